"""The GGUF architectures people run (issue 52 item 3): qwen3 (per-head q/k RMS norms, head_dim 128 on a
256-wide model), Llama 3.x (RoPE scaling as llama.cpp stores it: a ``rope_freqs`` tensor) and Mistral (a
``llama`` file with a SentencePiece vocabulary). Each is a small random model written as llama.cpp's
converter writes it, its matrices in the real block formats (Q8_0, Q4_0, Q5_0, Q4_K, Q6_K, F16), with its
tokenizer and chat template in the metadata; transformers reading the same file is the reference."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from vericache.kv.full import FullKVCache
from vericache.model.loader import load_model

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
from gguf_synthetic import add_matrix, byte_vocab, permute_qk  # noqa: E402

HIDDEN, FFN, LAYERS = 256, 512, 2
BLOCK_TYPES = ["Q8_0", "Q4_0", "Q5_0", "Q4_K", "Q6_K", "F16"]   # each matrix the next one: all in every model
LLAMA3_ROPE = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 16}

QWEN3_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}")
# Meta-Llama-3-8B-Instruct's template as published
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
# Mistral-7B-Instruct's (v0.1) template as published
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == "
    "'assistant' %}{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant roles "
    "are supported!') }}{% endif %}{% endfor %}")

MODELS = {
    "qwen3": {"arch": "qwen3", "name": "Qwen3 tiny", "heads": 4, "kv_heads": 2, "head_dim": 128, "qk_norm": True,
              "tokenizer": "gpt2", "pre": "qwen2", "template": QWEN3_TEMPLATE, "bos": None, "eos": "<|im_end|>",
              "specials": {"<|endoftext|>": 3, "<|im_start|>": 3, "<|im_end|>": 3, "<think>": 4, "</think>": 4}},
    "llama3": {"arch": "llama", "name": "Llama 3.1 tiny", "heads": 4, "kv_heads": 2, "head_dim": 64, "rope": LLAMA3_ROPE,
               "tokenizer": "gpt2", "pre": "llama-bpe", "template": LLAMA3_TEMPLATE, "bos": "<|begin_of_text|>",
               "eos": "<|eot_id|>", "specials": {"<|begin_of_text|>": 3, "<|end_of_text|>": 3,
                                                 "<|start_header_id|>": 3, "<|end_header_id|>": 3, "<|eot_id|>": 3}},
    "mistral": {"arch": "llama", "name": "mistral tiny", "heads": 4, "kv_heads": 1, "head_dim": 64,
                "tokenizer": "llama", "template": MISTRAL_TEMPLATE, "bos": "<s>", "eos": "</s>"},
}
TEXTS = ["the cat sat in the hat", "  two leading spaces, then\nnew lines\n\nand tabs\tand digits 1234567",
         "Héllo wörld — 日本語 😀 ∑ x² ≤ 3.14", "<|im_start|>user\nhi<|im_end|> [INST] the cat [/INST]</s>"]
CHATS = [[{"role": "user", "content": "Write hello world in Python."}],
         [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
          {"role": "user", "content": " And 3+3? "}]]


def _byte_level_vocab(specials: dict[str, int]) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges): the byte alphabet, a few merged words, the model's special tokens."""
    merges = ["Ġ t", "Ġt h", "Ġth e", "i n", "Ġ in", "a t", "Ġ c", "Ġc at", "Ġ s", "Ġs at"]
    tokens = byte_vocab() + [m.replace(" ", "") for m in merges] + list(specials)
    return tokens, [1] * (len(tokens) - len(specials)) + list(specials.values()), merges


def _sentencepiece_vocab() -> tuple[list[str], list[int], list[float]]:
    """(tokens, types, scores) as a Llama-2/Mistral vocabulary: <unk>, <s>, </s>, the 256 byte tokens,
    single characters, then words scored best first; [INST] and [/INST] control tokens (Mistral v0.3)."""
    chars = list("▁abcdefghijklmnopqrstuvwxyzHABCDEFGIJKLMNOPQRSTUVWXYZ0123456789.,;:!?'\"()[]/-+=*#_")
    words = ["▁t", "th", "▁th", "he", "▁the", "▁a", "at", "▁c", "▁cat", "▁s", "▁sat", "in", "▁in", "▁h", "▁hat",
             "▁He", "ll", "llo", "▁w", "or", "ld", "▁Wr", "ite", "▁hello", "▁world", "▁P", "yth", "on", "▁An", "nd"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + chars + words + ["[INST]", "[/INST]"]
    types = [2, 3, 3] + [6] * 256 + [1] * (len(chars) + len(words)) + [3, 3]
    scores = [0.0] * 259 + [-1000.0 - i for i in range(len(chars))] + [-float(i) for i in range(len(words))] + [0.0] * 2
    return tokens, types, scores


def llama3_freq_factors(head_dim: int, theta: float, rope: dict) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf ``rope_freqs`` for Llama 3.x scaling (what the file holds)."""
    factors = []
    low_wavelen = rope["original_max_position_embeddings"] / rope["low_freq_factor"]
    high_wavelen = rope["original_max_position_embeddings"] / rope["high_freq_factor"]
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(rope["factor"])
        else:
            smooth = (rope["original_max_position_embeddings"] / wavelen - rope["low_freq_factor"]) / (
                rope["high_freq_factor"] - rope["low_freq_factor"])
            factors.append(1 / ((1 - smooth) / rope["factor"] + smooth))
    return np.array(factors, dtype=np.float32)


def write_gguf(path, spec: dict, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    arch, heads, kv_heads, d = spec["arch"], spec["heads"], spec["kv_heads"], spec["head_dim"]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(spec["name"])
    w.add_block_count(LAYERS)
    w.add_context_length(4096)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(d)
    w.add_value_length(d)
    w.add_rope_dimension_count(d)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    if spec["tokenizer"] == "gpt2":
        tokens, types, merges = _byte_level_vocab(spec["specials"])
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(spec["pre"])
        w.add_token_merges(merges)
    else:
        tokens, types, scores = _sentencepiece_vocab()
        w.add_tokenizer_model("llama")
        w.add_token_scores(scores)
        w.add_unk_token_id(0)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_vocab_size(len(tokens))
    if spec["bos"]:
        w.add_bos_token_id(tokens.index(spec["bos"]))
    w.add_eos_token_id(tokens.index(spec["eos"]))
    w.add_add_bos_token(spec["bos"] is not None)
    w.add_chat_template(spec["template"])
    w.add_tensor("token_embd.weight", (rng.standard_normal((len(tokens), HIDDEN)) * 0.5).astype(np.float32))
    w.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
    if "rope" in spec:
        w.add_tensor("rope_freqs.weight", llama3_freq_factors(d, 10000.0, spec["rope"]))
    shapes = {"attn_q": (heads * d, HIDDEN), "attn_k": (kv_heads * d, HIDDEN), "attn_v": (kv_heads * d, HIDDEN),
              "attn_output": (HIDDEN, heads * d), "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN),
              "ffn_down": (HIDDEN, FFN)}
    n = 0
    for layer in range(LAYERS):
        for norm in ("attn_norm", "ffn_norm") + (("attn_q_norm", "attn_k_norm") if spec.get("qk_norm") else ()):
            width = d if norm in ("attn_q_norm", "attn_k_norm") else HIDDEN
            w.add_tensor(f"blk.{layer}.{norm}.weight", (1 + 0.1 * rng.standard_normal(width)).astype(np.float32))
        for part, shape in shapes.items():
            value = (rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32)
            if part in ("attn_q", "attn_k") and arch == "llama":   # llama.cpp permutes Llama's rows only
                value = permute_qk(value, heads if part == "attn_q" else kv_heads)
            add_matrix(w, f"blk.{layer}.{part}.weight", value, BLOCK_TYPES[n % len(BLOCK_TYPES)], rng)
            n += 1
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module", params=list(MODELS))
def model_file(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"gguf-{request.param}") / f"{request.param}.gguf"
    write_gguf(path, MODELS[request.param])
    return request.param, path


def _hf_model(name: str, path):
    if name != "llama3":
        return transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                                 dtype=torch.float32).eval()
    # transformers does not read rope_freqs: give it the Llama-3 scaling the file was made from
    cfg = transformers.AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    cfg.rope_parameters = {"rope_type": "llama3", "rope_theta": 10000.0, **LLAMA3_ROPE}
    return transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, config=cfg,
                                                             dtype=torch.float32).eval()


def _logits(loaded, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return loaded.model(torch.tensor(ids), [0], [len(ids)], [FullKVCache(loaded.config, "cpu", torch.float32)])


def test_decodes_like_transformers_reading_the_same_file(model_file, tmp_path, monkeypatch):
    """fp32 numerics (exact dequantization): logits within 1e-4 of transformers' and its greedy tokens;
    the native step and the module give the same bits; in the q8 numerics VeriCache's tokens are full's."""
    from vericache import LLM, SamplingParams

    name, path = model_file
    monkeypatch.setenv("VERICACHE_CACHE_DIR", str(tmp_path))
    ours = load_model(path, device="cpu", dtype="float32", numerics="fp32")
    assert ours.config.architecture == {"qwen3": "Qwen3ForCausalLM"}.get(name, "LlamaForCausalLM")
    assert ours.config.head_dim == MODELS[name]["head_dim"] and ours.config.qk_norm == (name == "qwen3")
    assert ours.model.native is not None   # the fast path runs these models too
    assert {fmt for l in ours.model.model.layers for x in (l.self_attn.qkv_exact, l.self_attn.o_exact,
            l.mlp.gate_up_exact, l.mlp.down_exact) for fmt in x.formats} == set(BLOCK_TYPES)
    hf = _hf_model(name, path)
    ids = [int(i) for i in np.random.default_rng(1).integers(0, 256, 40)]
    with torch.no_grad():
        ref = hf(torch.tensor(ids)[None]).logits[0]
    got = _logits(ours, ids)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    native, ours.model.native = ours.model.native, None
    assert torch.equal(_logits(ours, ids), got)   # the module's ops are the native step's, bit for bit
    ours.model.native = native
    if name == "llama3":   # the scaling is what makes them agree: without it the logits part
        plain = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                                  dtype=torch.float32).eval()
        with torch.no_grad():
            assert (plain(torch.tensor(ids)[None]).logits[0] - ref).abs().max() > 1e-2

    prompt, params = "the cat sat in the hat", SamplingParams(max_tokens=12, ignore_eos=True)
    full = LLM(str(path), mode="full", numerics="fp32").generate(prompt, params)[0].token_ids
    prompt_ids = ours.tokenizer.encode(prompt)
    with torch.no_grad():
        ref_gen = hf.generate(torch.tensor(prompt_ids)[None], attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                              max_new_tokens=12, do_sample=False, eos_token_id=None)[0, len(prompt_ids):].tolist()
    assert full == ref_gen
    full = LLM(str(path), mode="full", numerics="q8").generate(prompt, params)[0].token_ids
    veri = LLM(str(path), mode="vericache", numerics="q8", compressor="snapkv:ratio=0.25").generate(prompt, params)[0]
    assert veri.token_ids == full and veri.stats["rounds"] >= 1


def test_tokenizer_and_chat_template_match_transformers(model_file, tmp_path, monkeypatch):
    """The tokenizer rebuilt from the metadata encodes and decodes as transformers' does (byte-level BPE
    with its pre-tokenizer; SentencePiece with byte fallback and control tokens); the chat template renders
    the tokens transformers' ``apply_chat_template`` gives."""
    from vericache.chat import render_chat

    name, path = model_file
    monkeypatch.setenv("VERICACHE_CACHE_DIR", str(tmp_path))
    ours = load_model(path, device="cpu", dtype="float32", numerics="fp32").tokenizer
    hf = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    bos = [ours.bos_token_id] if MODELS[name]["bos"] else []
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == bos + hf.encode(text, add_special_tokens=False), text
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True), text
    for messages in CHATS:
        ref = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ref = ref["input_ids"] if not isinstance(ref, list) else ref
        assert ours.encode(render_chat(ours, messages)) == list(ref)
    assert ours.eos_token_ids == [ours.token_to_id(MODELS[name]["eos"])]
    if name == "mistral":   # the template's own errors reach the caller, as transformers raises them
        from jinja2.exceptions import TemplateError

        with pytest.raises(TemplateError, match="alternate"):
            render_chat(ours, [{"role": "assistant", "content": "x"}])


def test_models_path_describes_a_file_without_converting_it(model_file, tmp_path, monkeypatch, capsys):
    import json

    from vericache.cli import main

    name, path = model_file
    monkeypatch.setenv("VERICACHE_CACHE_DIR", str(tmp_path))
    assert main(["models", "--path", str(path), "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    spec = MODELS[name]
    assert row["architecture"] == spec["arch"] and row["blocks"] == LAYERS and row["context_length"] == 4096
    assert row["size_bytes"] == path.stat().st_size and row["supported"] and row["name"] == spec["name"]
    assert row["tokenizer"] == spec["tokenizer"] and set(row["tensor_types"]) >= set(BLOCK_TYPES)
    assert not (tmp_path / "gguf").exists()   # read from the header: nothing converted
    assert main(["models", "--path", str(path)]) == 0
    assert spec["arch"] in capsys.readouterr().out
    # the file is a model name wherever one is taken (serve, generate: the engine's --model)
    assert main(["generate", "--model", str(path), "--prompt", "the cat", "--max-tokens", "3"]) == 0
    assert capsys.readouterr().out.strip()
