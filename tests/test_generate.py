"""Full-KV generation through the public API: batching, sampling, stopping, bad input."""

from __future__ import annotations

import pytest

import vericache
from vericache import SamplingParams


def test_public_api_shapes(llm):
    out = llm.generate("def add(a, b):", SamplingParams(max_tokens=5))
    assert len(out) == 1
    o = out[0]
    assert isinstance(o, vericache.RequestOutput)
    assert o.prompt_token_ids == llm.tokenizer.encode("def add(a, b):")
    assert 1 <= len(o.token_ids) <= 5
    assert o.finish_reason in ("stop", "length")
    for key in ("prefill_s", "decode_s", "decode_tokens_per_s"):
        assert key in o.stats
    assert llm.tokenizer.decode(llm.tokenizer.encode("x = 12345\n")) == "x = 12345\n"
    assert vericache.resolve_model("tiny").joinpath("config.json").exists()


def test_batch_of_mixed_lengths_equals_one_by_one(llm, code_prompts):
    prompts = [code_prompts["short"], code_prompts["long"], code_prompts["medium"]]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    batched = llm.generate(prompts, params)
    single = [llm.generate(p, params)[0] for p in prompts]
    assert [b.token_ids for b in batched] == [s.token_ids for s in single]


def test_max_tokens_gives_length(llm):
    o = llm.generate("import os\n", SamplingParams(max_tokens=7, ignore_eos=True))[0]
    assert len(o.token_ids) == 7 and o.finish_reason == "length"


def test_stop_string_cuts_text_and_finishes(llm):
    free = llm.generate("class A:\n    def f(self):\n", SamplingParams(max_tokens=24, ignore_eos=True))[0]
    assert len(free.text) > 3
    stop = free.text[2:4]  # a string that certainly occurs in the greedy continuation
    o = llm.generate("class A:\n    def f(self):\n", SamplingParams(max_tokens=24, stop=stop, ignore_eos=True))[0]
    assert o.finish_reason == "stop"
    assert stop not in o.text
    assert free.text.startswith(o.text)
    assert len(o.token_ids) <= len(free.token_ids)


def test_eos_stops(llm):
    eos = llm.tokenizer.eos_token_ids[0]
    seq = llm.engine.new_sequence(0, [5, 6, 7], SamplingParams(max_tokens=10))
    assert seq.append(eos) and seq.finish_reason == "stop"
    seq = llm.engine.new_sequence(1, [5, 6, 7], SamplingParams(max_tokens=10, ignore_eos=True))
    assert not seq.append(eos)


def test_seeded_sampling_is_reproducible_and_varies(llm):
    p = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=7, ignore_eos=True)
    a = llm.generate("def main():\n", p)[0]
    b = llm.generate("def main():\n", p)[0]
    assert a.token_ids == b.token_ids
    others = {tuple(llm.generate("def main():\n", SamplingParams(max_tokens=16, temperature=1.0, seed=s,
                                                                 ignore_eos=True))[0].token_ids) for s in range(4)}
    assert len(others) > 1


def test_seeded_request_unaffected_by_batch_mates(llm):
    p = SamplingParams(max_tokens=10, temperature=0.8, seed=3, ignore_eos=True)
    alone = llm.generate("x = ", p)[0]
    together = llm.generate(["x = ", "import re\n"], p)[0]
    assert alone.token_ids == together.token_ids


def test_top_k_one_is_greedy(llm):
    g = llm.generate("for i in range(", SamplingParams(max_tokens=10, ignore_eos=True))[0]
    k1 = llm.generate("for i in range(", SamplingParams(max_tokens=10, temperature=1.3, top_k=1, seed=1,
                                                         ignore_eos=True))[0]
    assert g.token_ids == k1.token_ids


@pytest.mark.parametrize("kwargs, needle", [
    ({"max_tokens": 0}, "max_tokens must be >= 1, got 0"),
    ({"temperature": -0.5}, "temperature must be >= 0, got -0.5"),
    ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
    ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
    ({"top_k": -1}, "top_k"),
    ({"stop": [""]}, "stop strings"),
])
def test_bad_sampling_params(kwargs, needle):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    assert needle in str(e.value)


def test_bad_prompts(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate("")
    with pytest.raises(ValueError, match="empty"):
        llm.generate([])
    with pytest.raises(TypeError):
        llm.generate("x", params={"max_tokens": 3})


def test_context_limit_names_values(llm):
    limit = llm.engine.max_context
    with pytest.raises(ValueError) as e:
        llm.generate("x = 1\n", SamplingParams(max_tokens=limit))
    msg = str(e.value)
    assert str(limit) in msg and f"max_tokens ({limit})" in msg
