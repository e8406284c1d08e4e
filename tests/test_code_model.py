"""The real code model (issue 53): Qwen2.5-Coder-0.5B-Instruct's GGUF, as ``make models`` installs it
(``make test`` does), read by us and by transformers from the same file: its tokenizer (151,936 tokens,
the qwen2 pre-tokenizer), its own chat template, logits and greedy tokens in the fp32 numerics; and
VeriCache equal to full decoding. The logits beside transformers' are `make test-slow`'s (transformers
takes ~40 s to read the file; the qwen2 path against transformers on a small synthetic file is in
tests/test_gguf.py, which `make test` runs)."""

from __future__ import annotations

import pytest
import torch

from vericache.config import ModelConfigError
from vericache.kv.full import FullKVCache

transformers = pytest.importorskip("transformers")
NAME = "qwen2.5-coder-0.5b"
PROMPT = "<|im_start|>user\nWrite a Python function is_prime(n).<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def model_path():
    from vericache.model.registry import model_file

    try:
        return model_file(NAME)
    except ModelConfigError as exc:   # not a hardware gap: `make test` installs it (make models)
        pytest.fail(f"{exc} (make models)")


@pytest.fixture(scope="module")
def ours():
    """The model as users load it (its default numerics: q8 for a GGUF with integer blocks)."""
    import vericache

    return vericache.LLM(NAME, mode="full")


def test_the_tokenizer_and_chat_template_are_transformers(ours, model_path):
    from vericache.chat import render_chat

    hf = transformers.AutoTokenizer.from_pretrained(model_path.parent, gguf_file=model_path.name)
    tok = ours.tokenizer
    assert tok.vocab_size == 151_936 or tok.vocab_size == len(hf)
    for text in ["def f(x):\n    return x ** 2  # square\n", "Héllo 世界 😀 1234567 \t\n\n  x",
                 "<|im_start|>system\nYou are Qwen.<|im_end|>\n<|fim_prefix|>a<|fim_suffix|>b<|fim_middle|>"]:
        ids = tok.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False), text
        assert tok.decode(ids, skip_special_tokens=False) == text
    for messages in ([{"role": "user", "content": "Write quicksort."}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                      {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}]):
        ref = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ref = ref["input_ids"] if not isinstance(ref, list) else ref
        assert tok.encode(render_chat(tok, messages)) == list(ref)
    assert tok.eos_token_ids == [tok.token_to_id("<|im_end|>")]   # the chat turn's end stops generation


# transformers dequantizes the 0.5B file in ~40 s; tests/test_gguf.py checks the qwen2 path on a synthetic file
@pytest.mark.slow
def test_logits_and_greedy_tokens_are_transformers(model_path):
    import vericache
    from vericache import SamplingParams

    ours = vericache.LLM(NAME, mode="full", numerics="fp32")   # exact dequantization: transformers' arithmetic
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_path.parent, gguf_file=model_path.name,
                                                           dtype=torch.float32).eval()
    ids = ours.tokenizer.encode(PROMPT)
    with torch.no_grad():
        ref = hf(torch.tensor(ids)[None]).logits[0]
        ref_gen = hf.generate(torch.tensor(ids)[None], attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=12, do_sample=False)[0, len(ids):].tolist()
        got = ours.loaded.model(torch.tensor(ids), [0], [len(ids)], [FullKVCache(ours.loaded.config, "cpu", torch.float32)])
    assert (got - ref).abs().max().item() < 1e-3
    assert ours.generate(PROMPT, SamplingParams(max_tokens=12))[0].token_ids == ref_gen[:12]


def test_vericache_is_full_decoding_on_the_code_model(ours):
    from vericache import SamplingParams
    from vericache.engine.engine import Engine

    params = SamplingParams(max_tokens=24)
    full = ours.generate(PROMPT, params)[0]
    engine = Engine(ours.loaded, mode="vericache", compressor="snapkv:ratio=0.25")
    veri = engine.generate([engine.new_sequence(0, ours.tokenizer.encode(PROMPT), params)])[0]
    assert veri.token_ids == full.token_ids and veri.stats["rounds"] >= 1
    assert "def is_prime" in full.text


def test_the_repository_context_format_uses_the_models_file_headers(ours):
    """``eval humaneval --context-format repo``: held-out files as one repository in Qwen2.5-Coder's own
    layout (a repo name, then each file after a <|file_sep|> path header), cut at a line break within
    the context's length; the problem follows as a file of its own."""
    from vericache_lab.eval import humaneval as he

    tok = ours.tokenizer
    sep, repo = tok.token_to_id("<|file_sep|>"), tok.token_to_id("<|repo_name|>")
    ids = he.context_ids(tok, 3000, "repo")
    assert 2900 < len(ids) <= 3000 and ids[0] == repo and ids.count(sep) == 1
    assert he.context_ids(tok, 16000, "repo").count(sep) >= 2   # whole files, then the cut one
    assert tok.decode(ids[-1:]).endswith("\n") and "Lib/" in tok.decode(ids[:200])
    problem = he.load_problems(1)[0]
    tail = he.problem_ids(tok, problem, "repo", 3000)
    assert tail[0] == sep and tok.decode(tail).endswith(problem["prompt"])
    assert he.problem_ids(tok, problem, "repo", 0) == tok.encode(problem["prompt"])   # no context: the prompt alone
    assert he.context_ids(tok, 3000, "documents") != ids
