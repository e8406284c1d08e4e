"""Our forward against Hugging Face transformers: logits allclose in fp32, greedy tokens identical."""

from __future__ import annotations

import pytest
import torch

from vericache.kv.full import FullKVCache
from vericache.model.loader import load_model

transformers = pytest.importorskip("transformers")

PROMPT_LEN, DECODE_STEPS = 300, 20


def _small_config(arch: str):
    common = dict(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    if arch == "llama":
        return transformers.LlamaConfig(**common, rope_theta=50000.0, tie_word_embeddings=False,
                                        rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                                      "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": 128})
    if arch == "llama-linear":
        return transformers.LlamaConfig(**common, rope_scaling={"rope_type": "linear", "factor": 2.0},
                                        tie_word_embeddings=True)
    if arch == "mistral":
        return transformers.MistralConfig(**common, sliding_window=None)
    if arch == "qwen2":
        return transformers.Qwen2Config(**common, tie_word_embeddings=True)
    raise AssertionError(arch)


def _hf_model(arch: str):
    torch.manual_seed(0)
    cfg = _small_config(arch)
    cls = {"llama": transformers.LlamaForCausalLM, "llama-linear": transformers.LlamaForCausalLM,
           "mistral": transformers.MistralForCausalLM, "qwen2": transformers.Qwen2ForCausalLM}[arch]
    model = cls(cfg).eval()
    if arch == "qwen2":  # random init leaves biases at zero; make them count
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    return model


def _write_dir(model, tmp_path, tokenizer_src):
    model.save_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_text(tokenizer_src.read_text())
    return tmp_path


def _compare(hf, ours, vocab: int) -> None:
    torch.manual_seed(1)
    prompt = torch.randint(0, vocab, (PROMPT_LEN,))
    # HF: prefill then greedy decode with its own cache
    with torch.no_grad():
        hf_out = hf(prompt[None], use_cache=True)
        hf_logits = [hf_out.logits[0]]
        past = hf_out.past_key_values
        tok = hf_logits[-1][-1].argmax()
        hf_tokens = [int(tok)]
        for _ in range(DECODE_STEPS):
            o = hf(tok.view(1, 1), past_key_values=past, use_cache=True)
            past = o.past_key_values
            hf_logits.append(o.logits[0])
            tok = o.logits[0, -1].argmax()
            hf_tokens.append(int(tok))
    cache = FullKVCache(ours.config, "cpu", torch.float32)
    with torch.no_grad():
        logits = ours(prompt, [0], [PROMPT_LEN], [cache])
        torch.testing.assert_close(logits, hf_logits[0], atol=1e-4, rtol=1e-4)
        tok = int(logits[-1].argmax())
        tokens = [tok]
        for i in range(DECODE_STEPS):
            logits = ours(torch.tensor([tok]), [PROMPT_LEN + i], [1], [cache])
            torch.testing.assert_close(logits, hf_logits[i + 1][-1:], atol=1e-4, rtol=1e-4)
            tok = int(logits[-1].argmax())
            tokens.append(tok)
    assert tokens == hf_tokens


@pytest.mark.parametrize("arch", ["llama", "llama-linear", "mistral", "qwen2"])
def test_random_small_models_match_transformers(arch, tmp_path, llm):
    hf = _hf_model(arch)
    path = _write_dir(hf, tmp_path, llm.loaded.path / "tokenizer.json")
    ours = load_model(path, device="cpu", dtype="float32").model
    _compare(hf, ours, hf.config.vocab_size)


def test_bundled_model_matches_transformers(llm):
    hf = transformers.AutoModelForCausalLM.from_pretrained(llm.loaded.path, dtype=torch.float32).eval()
    _compare(hf, llm.loaded.model, llm.loaded.config.vocab_size)


def test_chunked_prefill_equals_one_shot(llm):
    """A prefill in chunks, a decode step and a k-token chunk all see the same cache."""
    model = llm.loaded.model
    ids = torch.randint(0, 4000, (257,))
    one = FullKVCache(model.config, "cpu", torch.float32)
    chunked = FullKVCache(model.config, "cpu", torch.float32, capacity=8)  # forces growth too
    with torch.no_grad():
        full_logits = model(ids, [0], [257], [one])
        parts = [model(ids[s:e], [s], [e - s], [chunked]) for s, e in ((0, 100), (100, 101), (101, 257))]
    torch.testing.assert_close(torch.cat(parts), full_logits, atol=1e-4, rtol=1e-4)


def test_packed_batch_equals_separate(llm):
    model = llm.loaded.model
    a, b = torch.randint(0, 4000, (37,)), torch.randint(0, 4000, (11,))
    with torch.no_grad():
        ca, cb = FullKVCache(model.config, "cpu", torch.float32), FullKVCache(model.config, "cpu", torch.float32)
        packed = model(torch.cat([a, b]), [0, 0], [37, 11], [ca, cb])
        sa = model(a, [0], [37], [FullKVCache(model.config, "cpu", torch.float32)])
        sb = model(b, [0], [11], [FullKVCache(model.config, "cpu", torch.float32)])
    torch.testing.assert_close(packed, torch.cat([sa, sb]), atol=1e-5, rtol=1e-5)


def test_rollback_overwrites_rejected_positions(llm):
    model = llm.loaded.model
    ids = torch.randint(0, 4000, (50,))
    cache = FullKVCache(model.config, "cpu", torch.float32)
    with torch.no_grad():
        model(ids[:40], [0], [40], [cache])
        model(torch.randint(0, 4000, (8,)), [40], [8], [cache])  # a draft that gets rejected
        cache.truncate(40)
        after = model(ids[40:], [40], [10], [cache])
        ref = model(ids, [0], [50], [FullKVCache(model.config, "cpu", torch.float32)])[40:]
    torch.testing.assert_close(after, ref, atol=1e-4, rtol=1e-4)
