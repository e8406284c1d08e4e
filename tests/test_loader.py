"""Model directories that cannot be used give errors naming the file or field."""

from __future__ import annotations

import json
import shutil

import pytest

from vericache import LLM, resolve_model
from vericache.config import ModelConfigError


@pytest.fixture()
def model_copy(tmp_path):
    dst = tmp_path / "m"
    shutil.copytree(resolve_model("tiny"), dst)
    return dst


def test_missing_directory():
    with pytest.raises(ModelConfigError, match="/no/such/model"):
        LLM("/no/such/model", device="cpu")


def test_corrupt_config(model_copy):
    (model_copy / "config.json").write_text("{not json")
    with pytest.raises(ModelConfigError, match="config.json"):
        LLM(str(model_copy), device="cpu")


def test_unsupported_architecture(model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (model_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelConfigError, match="GPT2LMHeadModel"):
        LLM(str(model_copy), device="cpu")


def test_missing_field(model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    del cfg["hidden_size"]
    (model_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelConfigError, match="hidden_size"):
        LLM(str(model_copy), device="cpu")


def test_missing_and_corrupt_weights(model_copy):
    (model_copy / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ModelConfigError, match="model.safetensors"):
        LLM(str(model_copy), device="cpu")
    (model_copy / "model.safetensors").unlink()
    with pytest.raises(ModelConfigError, match="model.safetensors"):
        LLM(str(model_copy), device="cpu")


def test_sharded_weights_load(model_copy, llm):
    from safetensors.torch import load_file, save_file

    state = load_file(str(model_copy / "model.safetensors"))
    keys = sorted(state)
    half = len(keys) // 2
    shards = {"model-00001-of-00002.safetensors": keys[:half], "model-00002-of-00002.safetensors": keys[half:]}
    for name, ks in shards.items():
        save_file({k: state[k] for k in ks}, str(model_copy / name))
    (model_copy / "model.safetensors").unlink()
    index = {"weight_map": {k: n for n, ks in shards.items() for k in ks}}
    (model_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    sharded = LLM(str(model_copy), device="cpu", dtype="float32")
    assert sharded.generate("def f():", None)[0].token_ids == llm.generate("def f():", None)[0].token_ids


def test_bad_dtype():
    with pytest.raises(ValueError, match="float64"):
        LLM("tiny", device="cpu", dtype="float64")


def test_numerics_are_chosen_once_and_bad_ones_refused(monkeypatch):
    """q8qk for integer blocks on the native kernels, fp32 elsewhere; $VERICACHE_NUMERICS only where q8
    can run; an explicit q8 where it cannot, or an unknown name, is a ValueError naming it."""
    import torch

    from vericache.kernels.linear_op import StoredWeight
    from vericache.model.loader import parse_numerics

    monkeypatch.delenv("VERICACHE_NUMERICS", raising=False)
    q4 = {"w": StoredWeight("Q4_1", torch.zeros(2, 20, dtype=torch.uint8), 2, 32)}
    f32 = {"w": StoredWeight.from_tensor(torch.zeros(2, 32))}
    assert parse_numerics(None, "native", torch.float32, q4) == "q8qk"   # integer blocks: the integer numerics
    assert parse_numerics(None, "native", torch.float32, f32) == parse_numerics(None, "native", torch.float32, {}) == "fp32"
    assert parse_numerics(None, "triton", torch.float32, q4) == "fp32"
    assert parse_numerics("fp32", "native", torch.float32, q4) == "fp32"
    assert parse_numerics("q8", "native", torch.float32, {}) == "q8"
    monkeypatch.setenv("VERICACHE_NUMERICS", "q8")
    assert parse_numerics(None, "native", torch.float32, {}) == "q8"
    assert parse_numerics(None, "torch", torch.bfloat16, {}) == "fp32"   # the variable asks only where q8 runs
    with pytest.raises(ValueError, match="numerics='q8' runs on the native CPU kernels.*kernels='torch'"):
        parse_numerics("q8", "torch", torch.float32, {})
    with pytest.raises(ValueError, match="got 'int3'"):
        parse_numerics("int3", "native", torch.float32, {})


def test_an_engine_refuses_numerics_its_model_was_not_loaded_in(llm):
    from vericache.engine.engine import Engine

    assert llm.loaded.numerics == "fp32"
    with pytest.raises(ValueError, match="numerics 'q8' asked of a model loaded in 'fp32' numerics"):
        Engine(llm.loaded, numerics="q8")
