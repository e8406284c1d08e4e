"""``EngineConfig``: every default written once, and the three ways in (keywords, CLI flags, Triton
parameters) giving the same config; bad settings are refused with the value named (issue 39)."""

from __future__ import annotations

import argparse
import inspect
import re
from pathlib import Path

import pytest

from vericache import LLM
from vericache.engine.config import DEFAULTS, EngineConfig, add_engine_args

ROOT = Path(__file__).resolve().parent.parent


def parsed(*argv: str) -> EngineConfig:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return EngineConfig.from_args(p.parse_args(list(argv)))


def test_the_three_ways_in_give_the_same_config():
    assert parsed() == EngineConfig() == EngineConfig.from_parameters({}) == DEFAULTS
    assert EngineConfig.from_parameters({k: "" for k in ("model", "mode", "compressor", "draft_len")}) == DEFAULTS
    want = EngineConfig(model="tiny", mode="full", compressor="kivi:bits=2", draft_len=16, device_budget_gb=None,
                        tiered=True, prefill_chunk=64)
    assert parsed("--model", "tiny", "--mode", "full", "--compressor", "kivi:bits=2", "--draft-len", "16",
                  "--device-budget-gb", "0", "--tiered", "--prefill-chunk", "64") == want
    assert EngineConfig.from_parameters({"model": "tiny", "mode": "full", "compressor": "kivi:bits=2", "draft_len": "16",
                                         "device_budget_gb": "none", "tiered": "true", "prefill_chunk": "64",
                                         "EXECUTION_ENV_PATH": "/venv"}) == want
    assert EngineConfig.from_parameters({"draft_len": "0"}).draft_len == "auto"   # the Triton input's convention
    assert EngineConfig.from_parameters({"numerics": "q8qk"}) == DEFAULTS.replace(numerics="q8qk") == \
        parsed("--numerics", "q8qk")                                      # Triton's parameter and serve's flag


@pytest.mark.parametrize("bad, named", [({"mode": "fast"}, "'fast'"), ({"draft_len": 0}, "0"),
                                        ({"draft_weights": "int3"}, "'int3'"), ({"prefill_chunk": 0}, "0"),
                                        ({"device_budget_gb": -1}, "-1"), ({"scheduler": "fifo"}, "'fifo'"),
                                        ({"tiered": "yes"}, "'yes'"), ({"kv_dtype": "int8"}, "'int8'"),
                                        ({"numerics": "q4"}, "'q4'")])
def test_bad_settings_are_refused_with_the_value(bad, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        EngineConfig(**bad)


def test_unknown_settings_are_named():
    with pytest.raises(TypeError, match="colour"):
        DEFAULTS.replace(colour="blue")
    with pytest.raises(ValueError, match="colour"):
        EngineConfig.from_parameters({"colour": "blue"})


def test_tiered_only_where_the_device_is_not_the_host():
    assert not DEFAULTS.is_tiered("cpu") and DEFAULTS.is_tiered("cuda")
    assert EngineConfig(tiered=True).is_tiered("cpu") and not EngineConfig(tiered=False).is_tiered("cuda")


def test_the_front_ends_read_their_defaults_from_the_config():
    """``LLM``'s keyword defaults, the Triton model's parameters and the README's list are the config's."""
    sig = inspect.signature(LLM.__init__).parameters
    for name in ("model", "mode", "compressor", "draft_len", "draft_weights", "device", "dtype", "kv_dtype", "kernels",
                 "numerics"):
        assert sig[name].default == getattr(DEFAULTS, name), name
    pbtxt = (ROOT / "model_repository" / "vericache" / "config.pbtxt").read_text()
    params = dict(re.findall(r'parameters: \{ key: "(\w+)", value: \{ string_value: "([^"]*)" \} \}', pbtxt))
    assert params and set(params) <= set(DEFAULTS.__dataclass_fields__) and set(params.values()) == {""}
    readme = (ROOT / "README.md").read_text()
    stated = re.search(r"mode `(\w+)`,\s+compressor `([^`]+)`, draft length `(\w+)`, draft weights `(\w+)`, "
                       r"prefill chunk (\d+),\s+device KV budget ([\d.]+) GiB", readme)
    assert stated is not None
    assert stated.groups() == (DEFAULTS.mode, DEFAULTS.compressor, str(DEFAULTS.draft_len), DEFAULTS.draft_weights,
                               str(DEFAULTS.prefill_chunk), f"{DEFAULTS.device_budget_gb:g}")


def test_draft_len_has_one_wire_form_both_sides_share():
    """The Triton model's INT32 ``draft_len``: the gateway writes it and the model reads it with one pair
    of helpers ("auto" is 0 on the wire), so every form survives the trip."""
    from vericache.engine.options import AUTO_ON_THE_WIRE, draft_len_from_wire, draft_len_to_wire

    for form in ("auto", 1, 16, 48):
        assert draft_len_from_wire(draft_len_to_wire(form)) == form
    assert draft_len_to_wire("auto") == AUTO_ON_THE_WIRE == 0 and draft_len_from_wire(None) is None
