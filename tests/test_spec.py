"""Draft/verify details: finishing inside an accepted run, statistics, the adaptive policy,
and losslessness in distribution under sampling."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from vericache import SamplingParams
from vericache.drafting.round import DraftLengthPolicy
from vericache.engine.engine import Engine
from vericache.sampling import Sequence

SPEC = "snapkv:ratio=0.1"


def _gen(llm, mode, prompt_ids, params, eos=None, draft_len=32, spec=SPEC):
    runner = Engine(llm.loaded, mode=mode, compressor=spec, draft_len=draft_len)
    seq = Sequence(0, prompt_ids, params, llm.tokenizer, eos if eos is not None else llm.tokenizer.eos_token_ids)
    return runner.generate([seq])[0]


@pytest.fixture(scope="session")
def long_ids(llm, code_prompts):
    return llm.tokenizer.encode(code_prompts["long"])


def test_stop_string_inside_accepted_run(llm, long_ids):
    free = _gen(llm, "full", long_ids, SamplingParams(max_tokens=30, ignore_eos=True))
    stop = free.text[len(free.text) // 2 : len(free.text) // 2 + 2]
    params = SamplingParams(max_tokens=30, stop=stop, ignore_eos=True)
    full = _gen(llm, "full", long_ids, params)
    veri = _gen(llm, "vericache", long_ids, params)
    assert full.finish_reason == veri.finish_reason == "stop"
    assert (full.text, full.token_ids) == (veri.text, veri.token_ids)
    assert veri.stats["drafted_tokens"] > len(veri.token_ids) - 1 or veri.stats["rounds"] >= 1


def test_eos_and_max_tokens_inside_accepted_run(llm, long_ids):
    free = _gen(llm, "full", long_ids, SamplingParams(max_tokens=20, ignore_eos=True))
    eos = [free.token_ids[6]]  # pretend this token is EOS: it lands inside a 32-token draft
    full = _gen(llm, "full", long_ids, SamplingParams(max_tokens=20), eos=eos)
    veri = _gen(llm, "vericache", long_ids, SamplingParams(max_tokens=20), eos=eos)
    assert full.token_ids == veri.token_ids and full.finish_reason == veri.finish_reason == "stop"
    assert veri.token_ids[-1] == eos[0]
    short = _gen(llm, "vericache", long_ids, SamplingParams(max_tokens=5, ignore_eos=True))
    assert short.token_ids == free.token_ids[:5] and short.finish_reason == "length"


def test_statistics_are_consistent(llm, long_ids):
    # a fixed length: with "auto" the cost model may find no round paying for tiny here (a machine's call)
    out = _gen(llm, "vericache", long_ids, SamplingParams(max_tokens=40, ignore_eos=True), draft_len=8)
    st = out.stats
    for key in ("mode", "compressor", "compression_ratio", "rounds", "drafted_tokens", "accepted_tokens",
                "acceptance_rate", "mean_acceptance_length", "decode_tokens_per_s", "kv_bytes_read_per_token"):
        assert key in st
    assert st["acceptance_rate"] == pytest.approx(st["accepted_tokens"] / st["drafted_tokens"], abs=1e-4)
    assert st["mean_acceptance_length"] == pytest.approx((len(out.token_ids) - 1) / st["rounds"], abs=1e-3)
    # every round emits its accepted drafts plus one verifier token
    assert st["accepted_tokens"] + st["rounds"] == len(out.token_ids) - 1
    assert 0 < st["compression_ratio"] < 0.3
    assert 0 < st["kv_bytes_read_per_token"]["draft"] < st["kv_bytes_read_per_token"]["verify"] * 40


def test_adaptive_policy_grows_and_falls_back():
    pol = DraftLengthPolicy()
    st = pol.new_state()
    k0 = pol.next_len(st, 1000)
    pol.update(st, k0, k0)
    assert pol.next_len(st, 1000) == 2 * k0  # a fully accepted draft doubles
    for _ in range(20):
        pol.update(st, pol.next_len(st, 1000), pol.next_len(st, 1000))
    assert pol.next_len(st, 1000) == pol.max_len
    assert pol.next_len(st, 5) == 4  # never drafts past max_tokens
    for _ in range(pol.patience):  # acceptance collapses
        pol.update(st, pol.next_len(st, 1000), 0)
    assert st.fallbacks == 1
    for _ in range(pol.cooldown):  # plain full-KV steps for a while
        assert pol.next_len(st, 1000) == 0
        pol.update(st, 0, 0)
    assert pol.next_len(st, 1000) > 0  # then drafting again
    with pytest.raises(ValueError, match="draft_len"):
        DraftLengthPolicy.from_arg(0)


def test_fallback_rounds_keep_identity(llm, long_ids):
    """A policy that always collapses (patience 1) mixes plain full-KV steps with drafting."""
    runner = Engine(llm.loaded, mode="vericache", compressor="streaming:ratio=0.05", draft_len="auto")
    runner.policy = DraftLengthPolicy(patience=1, cooldown=3, start=4)
    runner.loop.scheduler.planner.cost.calibrate = None   # no step costs: the policy alone sizes the rounds
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    veri = runner.generate([runner.new_sequence(0, long_ids, params)])[0]
    full = Engine(llm.loaded, mode="full").generate([runner.new_sequence(0, long_ids, params)])[0]
    assert veri.token_ids == full.token_ids and veri.stats["drafted_tokens"] > 0


def _exact_two_token_distribution(llm, prompt_ids, params) -> dict[tuple[int, int], float]:
    from vericache.kv.full import FullKVCache
    from vericache.sampling import probs_from_logits

    model = llm.loaded.model
    dist = {}
    with torch.no_grad():
        cache = FullKVCache(model.config, "cpu", torch.float32)
        p0 = probs_from_logits(model(torch.tensor(prompt_ids), [0], [len(prompt_ids)], [cache])[-1:], params)[0]
        n = len(prompt_ids)
        for t0 in torch.nonzero(p0).flatten().tolist():
            cache.truncate(n)
            p1 = probs_from_logits(model(torch.tensor([t0]), [n], [1], [cache]), params)[0]
            for t1 in torch.nonzero(p1).flatten().tolist():
                dist[(t0, t1)] = p0[t0].item() * p1[t1].item()
    return dist


@pytest.mark.parametrize("mode,acceptance", [("full", "coupled"), ("vericache", "coupled"), ("vericache", "rejection")])
def test_sampling_is_lossless_in_distribution(llm, code_prompts, mode, acceptance):
    """Samples of the first two tokens over 400 seeds fit the exact full-KV distribution (chi-square at
    p = 0.001) in full decoding and under either acceptance rule, while drafts were really rejected."""
    prompt = llm.tokenizer.encode(code_prompts["medium"])
    params = dict(max_tokens=3, temperature=1.0, top_k=4, ignore_eos=True)  # t0, one drafted t1, bonus
    exact = _exact_two_token_distribution(llm, prompt, SamplingParams(**{**params, "max_tokens": 2}))
    runner = Engine(llm.loaded, mode=mode, compressor="streaming:ratio=0.1,window=4", draft_len=1, acceptance=acceptance)
    shared = runner.shared_prefill(runner.new_sequence(0, prompt, SamplingParams(**params)))   # the prompt, once
    n, counts, drafted, accepted = 0, Counter(), 0, 0
    for chunk in range(4):
        seqs = [runner.new_sequence(i, prompt, SamplingParams(seed=1000 * chunk + i, **params)) for i in range(100)]
        for out in runner.generate(seqs, prefills=[shared] * len(seqs)):
            counts[tuple(out.token_ids[:2])] += 1
            drafted += out.stats.get("drafted_tokens", 0)
            accepted += out.stats.get("accepted_tokens", 0)
            n += 1
    assert mode == "full" or 0 < accepted < drafted  # some drafts were rejected
    # pool cells with small expectation into one, then Pearson's chi-square
    big = {k: p for k, p in exact.items() if p * n >= 5}
    obs = [counts[k] for k in big] + [n - sum(counts[k] for k in big)]
    exp = [p * n for p in big.values()] + [n * (1 - sum(big.values()))]
    cells = [(o, e) for o, e in zip(obs, exp) if e > 0]
    chi2 = sum((o - e) ** 2 / e for o, e in cells)
    df = len(cells) - 1
    critical = df + 3.09 * math.sqrt(2 * df) + 2  # ~ the 0.999 quantile (Wilson-Hilferty, conservative)
    assert set(counts) <= set(exact)
    assert chi2 < critical, (chi2, df)


def test_a_temperature_near_zero_samples_the_argmax_not_nan():
    """Found by the API fuzz: temperature 1e-300 divided the logits to +-inf (NaN probabilities, a 500).
    Shifted by the max first, the distribution is one-hot at the argmax; ordinary temperatures unchanged."""
    from vericache.sampling import probs_from_logits

    logits = torch.tensor([[1.0, 3.0, -2.0, 2.5]])
    p = probs_from_logits(logits, SamplingParams(temperature=1e-300))
    assert torch.equal(p, torch.tensor([[0.0, 1.0, 0.0, 0.0]]))
    # top_p 5e-324 (a float64 denormal) is 0 in fp32: the top token stays, alone
    assert torch.equal(probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=5e-324)), p)
    ordinary = probs_from_logits(logits, SamplingParams(temperature=0.7))
    assert torch.allclose(ordinary, torch.softmax(logits / 0.7, dim=-1), atol=1e-6)
