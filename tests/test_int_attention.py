"""The q8qk numerics' attention (``kernels/int_scores.h``): queries, keys, values and each row's weights as
int8 codes in exact integer dot products. The same bits in every build and on every unit (the build's own
vector code, VNNI, AMX), a row's bits independent of its chunk, batch and threads, the cache's kept codes
giving the bits of codes made in the call, the contract as written (a torch twin), close to fp32
attention, and bad input refused."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from vericache.config import ModelConfig
from vericache.kernels import packed_kernels
from vericache.kernels.cpu import supported_isas
from vericache.kernels.linear_op import score_unit
from vericache.kv.full import FullKVCache
from vericache.kv.packed import KeyPart, attend_packed, op_args

HQ, HKV, D = 6, 2, 64
BLOCK = 64


def _units() -> list[tuple[str, int]]:
    """(build, unit) pairs this CPU runs: each build's own integer dots, and VNNI / AMX where present."""
    pairs = [(isa, 1) for isa in supported_isas()]
    pairs += [(isa, score_unit("q8qk", isa)) for isa in supported_isas() if score_unit("q8qk", isa) > 1]
    return pairs


def _call(isa: str, unit: int, q: torch.Tensor, part: KeyPart, seq_lens=None, lse=None) -> torch.Tensor:
    ints, tensors = op_args(0, part, q.shape[2])
    return packed_kernels(isa).attend_packed(q, HKV, seq_lens or [q.shape[1]], ints, tensors, unit, None, lse)


def _code(x: torch.Tensor, top: float = 127.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The contract's coding of each row of x (last dim): codes (as float) and the fp32 scale."""
    d = x.abs().amax(-1, keepdim=True) / top
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return torch.round(x * inv), d


def _twin(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, row_scale: bool = True,
          coding: torch.Tensor | None = None) -> torch.Tensor:
    """The contract in torch for one sequence's causal part (n = start + T <= 512 keys: one work item a
    head): integer scores, the online softmax block by block, weights coded with the values' scales
    folded in, integer value sums; in the key coding [2, Hkv, D] (offsets mu, channel scales s): keys coded
    as (k - mu) / s, queries as q * s, each row given q . mu back. q [Hq, T, D] -> [T, Hq, D].
    ``row_scale=False``: a broken variant that codes each head's queries with one scale for the whole chunk."""
    hq, t, d = q.shape
    n, g = start + t, hq // HKV
    mu, sc = (torch.zeros(HKV, d), torch.ones(HKV, d)) if coding is None else coding
    qs = q.float() * (1.0 / math.sqrt(d)) * sc.repeat_interleave(g, 0)[:, None]
    qc, dq = _code(qs)
    if not row_scale:
        dq = dq.amax(dim=1, keepdim=True).expand_as(dq)
        qc = torch.round(qs / dq)
    kc, dk = _code((k[:, :n].float() - mu[:, None]) / sc[:, None])
    vc, dv = _code(v[:, :n].float())
    out = torch.zeros(t, hq, d)
    for h in range(hq):
        kv = h // g
        for i in range(t):
            m, l, acc = -1e30, 0.0, torch.zeros(d, dtype=torch.float64)
            for t0 in range(0, n, BLOCK):
                vis = min(BLOCK, n - t0, start + i + 1 - t0)
                if vis <= 0:
                    break
                dots = (kc[kv, t0 : t0 + vis] @ qc[h, i]).float()                  # exact integers
                s = dots * (dq[h, i] * dk[kv, t0 : t0 + vis, 0]) + float(q[h, i].float() / math.sqrt(d) @ mu[kv])
                m_new = max(m, float(s.max()))
                alpha = math.exp(m - m_new)
                p = torch.exp(s - m_new)
                l = l * alpha + float(p.sum())
                u, dw = _code(p * dv[kv, t0 : t0 + vis, 0], 255.0)
                acc = acc * alpha + (u.double() @ vc[kv, t0 : t0 + vis].double()) * float(dw)
                m = m_new
            out[i, h] = (acc / l).float()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_every_build_and_unit_gives_the_same_bits(dtype):
    """AVX-512 and AVX2 `maddubs`, VNNI `dpbusd`, AMX tiles and the portable build's scalars sum the same
    integers: for head sizes 64, 80 and 128, a decode row and a 17-row chunk, every (build, unit) this CPU
    runs gives the portable build's bits, its rows' log-sum-exp output too; fp32 scores (unit 0) differ, so
    equal bits are the integer path's own."""
    gen, n = torch.Generator().manual_seed(3), 300
    for d in (64, 80, 128):
        k, v = (torch.randn(HKV, n, d, generator=gen).to(dtype) for _ in range(2))
        for t in (1, 17):
            q = torch.randn(HQ, t, d, generator=gen)
            part = KeyPart(k, v, n=n, diag=n - t)
            ref_lse = torch.empty(HQ, t)
            ref = _call("portable", 1, q, part, lse=ref_lse)
            for isa, unit in _units():
                lse = torch.empty(HQ, t)   # the rows' log-sum-exp (KVzip's scoring pass reads it) too
                assert torch.equal(_call(isa, unit, q, part, lse=lse), ref) and torch.equal(lse, ref_lse), (isa, unit, d, t)
            assert not torch.equal(_call("portable", 0, q, part), ref)


def test_the_op_is_the_contract():
    """Against the torch twin of the contract (its own exp and summation order: close, not equal), and
    within int8's reach of fp32 attention."""
    gen = torch.Generator().manual_seed(11)
    for start, t in ((0, 1), (37, 5), (190, 9), (400, 3)):
        k, v = (torch.randn(HKV, start + t, D, generator=gen) for _ in range(2))
        q = torch.randn(HQ, t, D, generator=gen) * 3
        got = attend_packed(q, [t], [[KeyPart(k, v, n=start + t, diag=start)]], HKV, score_unit=1)
        torch.testing.assert_close(got, _twin(q, k, v, start), atol=2e-5, rtol=1e-4)
        kx, vx = (x.repeat_interleave(HQ // HKV, 0) for x in (k, v))
        mask = torch.arange(start + t)[None, :] <= torch.arange(start, start + t)[:, None]
        fp32 = F.scaled_dot_product_attention(q, kx, vx, attn_mask=mask).transpose(0, 1)
        assert (got - fp32).abs().max() < 0.05


def test_the_key_coding_takes_off_offsets_and_balances_channels():
    """A biased key channel (as Qwen2's) and a key channel ranging 32x its queries': coded less the offset
    and with the channel scale (a power of two), the scores keep their precision (each closer to fp32
    attention than the coding before it), the op is the twin's contract in that coding, every unit gives
    the same bits in it, offsets 0 with scales 1 give the bits of none, and a scale that is not positive
    is refused."""
    gen = torch.Generator().manual_seed(13)
    start, t = 180, 9
    k, v = (torch.randn(HKV, start + t, D, generator=gen) for _ in range(2))
    q = torch.randn(HQ, t, D, generator=gen)
    k[:, :, 5] += 80.0                                           # one channel far from zero in every key
    biased = k.clone()
    k[:, :, 9] *= 32.0                                           # and one ranging 32x the others
    scales = torch.ones(HKV, D)
    scales[:, 9] = 8.0                                           # sqrt(32 / 1), rounded to a power of two
    mask = torch.arange(start + t)[None, :] <= torch.arange(start, start + t)[:, None]

    def error(keys: torch.Tensor, coding: torch.Tensor | None) -> float:   # the op's, against fp32 attention
        out = attend_packed(q, [t], [[KeyPart(keys, v, n=start + t, diag=start)]], HKV, score_unit=1, key_coding=coding)
        kx, vx = (x.repeat_interleave(HQ // HKV, 0) for x in (keys, v))
        return float((out - F.scaled_dot_product_attention(q, kx, vx, attn_mask=mask).transpose(0, 1)).abs().max())

    offset = torch.stack([biased.mean(dim=1), torch.ones(HKV, D)])
    assert error(biased, offset) < 0.5 * error(biased, None)
    coding = torch.stack([k.mean(dim=1), scales])
    assert error(k, coding) < 0.5 * error(k, torch.stack([k.mean(dim=1), torch.ones(HKV, D)]))
    part = KeyPart(k, v, n=start + t, diag=start)
    got = attend_packed(q, [t], [[part]], HKV, score_unit=1, key_coding=coding)
    torch.testing.assert_close(got, _twin(q, k, v, start, coding=coding), atol=2e-5, rtol=1e-4)
    ints, tensors = op_args(0, part, D)
    for isa, unit in _units():
        assert torch.equal(packed_kernels(isa).attend_packed(q, HKV, [t], ints, tensors, unit, coding), got), (isa, unit)
    plain = torch.stack([torch.zeros(HKV, D), torch.ones(HKV, D)])
    assert torch.equal(attend_packed(q, [t], [[part]], HKV, score_unit=1, key_coding=plain),
                       attend_packed(q, [t], [[part]], HKV, score_unit=1))
    with pytest.raises(RuntimeError, match="positive"):
        attend_packed(q, [t], [[part]], HKV, score_unit=1, key_coding=torch.stack([coding[0], torch.zeros(HKV, D)]))


def test_the_lse_output_is_each_rows_log_sum_exp_and_bad_ones_are_refused():
    """``lse`` [Hq, N]: each row's log-sum-exp of its scaled scores over all its parts (what KVzip's scoring
    pass normalises with): fp32 scores give the explicit one, PyTorch's kernels too; integer scores are
    within int8's reach of it; a row's value is the same alone and beside another sequence; with "triton"
    kernels (no lse there) PyTorch's run; a wrong output is refused before anything runs."""
    gen = torch.Generator().manual_seed(5)
    k, v = (torch.randn(HKV, 120, D, generator=gen) for _ in range(2))
    q = torch.randn(HQ, 9, D, generator=gen) * 3
    parts = [[KeyPart(k, v, n=107, diag=100)], [KeyPart(k, v, n=50)]]        # a causal chunk of 7, a 2-row sequence
    logits = torch.einsum("htd,hsd->hts", q, k.repeat_interleave(HQ // HKV, 0)) / math.sqrt(D)   # [Hq, 9, 120]
    seen = torch.cat([torch.arange(120)[None] <= torch.arange(7)[:, None] + 100,
                      (torch.arange(120) < 50)[None].expand(2, 120)])                     # [9, 120]
    explicit = torch.logsumexp(logits.masked_fill(~seen, -math.inf), dim=-1)               # [Hq, 9]
    outs = {}
    for unit, kernels, tol in ((0, "auto", 1e-5), (0, "torch", 1e-5), (1, "auto", 0.05)):
        lse = torch.full((HQ, 9), 7.0)
        outs[unit, kernels] = attend_packed(q, [7, 2], parts, HKV, kernels, score_unit=unit, lse=lse)
        torch.testing.assert_close(lse, explicit, atol=tol, rtol=tol)
        if (unit, kernels) == (1, "auto"):
            alone = torch.empty(HQ, 7)
            attend_packed(q[:, :7].contiguous(), [7], parts[:1], HKV, score_unit=1, lse=alone)
            assert torch.equal(alone, lse[:, :7])
    out = outs[1, "auto"].clone()
    for bad in (torch.empty(HQ, 8), torch.empty(HQ, 9, dtype=torch.float64), torch.empty(9, HQ).t()):
        with pytest.raises(ValueError, match="lse must be a contiguous fp32"):
            attend_packed(q, [7, 2], parts, HKV, score_unit=1, lse=bad)
    lse = torch.empty(HQ, 9)   # the Triton twin has no lse output: asked for one, PyTorch's kernels run
    torch.testing.assert_close(attend_packed(q, [7, 2], parts, HKV, "triton", lse=lse), outs[0, "torch"])
    torch.testing.assert_close(lse, explicit, atol=1e-5, rtol=1e-5)
    assert torch.equal(attend_packed(q, [7, 2], parts, HKV, score_unit=1), out)   # refusals left nothing behind


def test_a_scores_only_call_gives_each_keys_largest_log_probability():
    """``row_lse`` (the rows' lse from a first call) makes a second call scores-only: each part's ``seen``
    takes, per query head and key, the max over the head's rows that see it of score - lse (KVzip's
    scores), the group's max in its first head. fp32 scores give the explicit values, PyTorch's kernels too;
    integer scores are near them, never above 0 (the normaliser summed the same scores), with the same
    bits in every build and unit; the output is zeros; bad calls are refused and write nothing."""
    gen = torch.Generator().manual_seed(6)
    k, v = (torch.randn(HKV, 120, D, generator=gen) for _ in range(2))
    q = torch.randn(HQ, 9, D, generator=gen) * 3
    shapes = [(107, 100), (50, None)]                                  # a causal chunk of 7, a 2-row sequence

    def parts(seen=None):
        return [[KeyPart(k, v, n=n, diag=d, seen=None if seen is None else seen[i])] for i, (n, d) in enumerate(shapes)]

    logits = torch.einsum("htd,hsd->hts", q, k.repeat_interleave(HQ // HKV, 0)) / math.sqrt(D)   # [Hq, 9, 120]
    sees = torch.cat([torch.arange(120)[None] <= torch.arange(7)[:, None] + 100,
                      (torch.arange(120) < 50)[None].expand(2, 120)])                     # [9, 120]
    logp = logits - torch.logsumexp(logits.masked_fill(~sees, -math.inf), dim=-1, keepdim=True)
    logp = logp.masked_fill(~sees, -1e30)
    explicit = []
    for rows, (n, _) in zip((slice(0, 7), slice(7, 9)), shapes):
        top = logp[:, rows, :n].amax(dim=1)                                               # [Hq, n]
        top[:: HQ // HKV] = top.view(HKV, HQ // HKV, n).amax(dim=1)                        # each group's max first
        explicit.append(top)
    got = {}
    for unit, kernels, tol in ((0, "auto", 1e-5), (0, "torch", 1e-5), (1, "auto", 0.05)):
        lse = torch.empty(HQ, 9)
        attend_packed(q, [7, 2], parts(), HKV, kernels, score_unit=unit, lse=lse)
        seen = [torch.full((HQ, 120), 7.0), torch.full((HQ, 50), 7.0)]
        out = attend_packed(q, [7, 2], parts(seen), HKV, kernels, score_unit=unit, row_lse=lse)
        assert not out.any()
        for s, ref in zip(seen, explicit):
            torch.testing.assert_close(s[:, : ref.shape[1]], ref, atol=tol, rtol=tol)
            assert float(s[:, : ref.shape[1]].max()) <= (0.0 if kernels == "auto" else 1e-6)
        got[unit, kernels] = seen, lse
    seen1, lse1 = got[1, "auto"]
    for isa, unit in _units():   # the integer path's bits in every build and on every unit
        seen = [torch.full_like(x, 7.0) for x in seen1]
        ints, tensors = [], []
        for i, ps in enumerate(parts(seen)):
            a, b = op_args(i, ps[0], D)
            ints, tensors = ints + a, tensors + b
        packed_kernels(isa).attend_packed(q, HKV, [7, 2], ints, tensors, unit, None, None, lse1)
        assert all(torch.equal(a, b) for a, b in zip(seen, seen1)), (isa, unit)
    seen = [torch.full((HQ, 120), 7.0), torch.full((HQ, 50), 7.0)]
    for call, match in ((dict(row_lse=torch.empty(HQ, 8)), "row_lse must be a contiguous fp32"),
                        (dict(row_lse=lse1, lse=torch.empty(HQ, 9)), "takes no lse output"),
                        (dict(row_lse=lse1, parts=parts()), "needs a part with a seen")):
        with pytest.raises(ValueError, match=match):
            attend_packed(q, [7, 2], call.pop("parts", parts(seen)), HKV, score_unit=1, **call)
    ints, tensors = op_args(0, KeyPart(k, v, n=107, diag=100, seen=seen[0]), D)
    with pytest.raises(RuntimeError, match="a call gives the rows' lse"):   # the op's own check, beneath
        packed_kernels().attend_packed(q[:, :7].contiguous(), HKV, [7], ints, tensors, 1, None, torch.empty(HQ, 7),
                                       lse1[:, :7].contiguous())
    assert all(bool((x == 7.0).all()) for x in seen)   # the refusals wrote nothing


def test_an_inexact_part_takes_fp32_scores_whatever_the_numerics():
    """A part marked inexact (a compressed cache's that keeps no codes: drafts need not be exact) is scored
    in fp32 under the q8qk numerics too, the fp32 path's bits, while the exact part beside it in the same
    call keeps the integer path's; a compressed cache without codes marks its parts so, one with codes
    (the engine's under q8qk) and a full cache do not."""
    from vericache.compress.registry import parse_compressor
    from vericache.kv.compressed import CompressedKVCache

    gen = torch.Generator().manual_seed(17)
    k, v = (torch.randn(HKV, 200, D, generator=gen) for _ in range(2))
    q = torch.randn(HQ, 2, D, generator=gen)
    exact, free = KeyPart(k, v, n=200, diag=198), KeyPart(k, v, n=200, diag=198, exact=False)
    both = attend_packed(torch.cat([q, q], 1), [2, 2], [[exact], [free]], HKV, score_unit=1)
    assert torch.equal(both[:2], attend_packed(q, [2], [[exact]], HKV, score_unit=1))
    assert torch.equal(both[2:], attend_packed(q, [2], [[exact]], HKV, score_unit=0))
    assert not torch.equal(both[:2], both[2:])
    draft = CompressedKVCache(parse_compressor("snapkv:ratio=0.25"), CFG, "cpu", torch.float32, capacity=64)
    draft.begin(0, 4)
    parts = draft.parts(0, q[:, :1].expand(HQ, 4, D).contiguous(), k[:, :4], v[:, :4])
    assert parts and not any(p.exact for p in parts)
    coded = CompressedKVCache(parse_compressor("snapkv:ratio=0.25"), CFG, "cpu", torch.float32, capacity=64,
                              key_codes=True)
    coded.begin(0, 4)
    assert all(p.exact for p in coded.parts(0, q[:, :1].expand(HQ, 4, D).contiguous(), k[:, :4], v[:, :4]))
    full = FullKVCache(CFG, "cpu", torch.float32, capacity=64, key_codes=True)
    full.begin(0, 4)
    assert all(p.exact for p in full.parts(0, q[:, :1].expand(HQ, 4, D).contiguous(), k[:, :4], v[:, :4]))


def _row_alone(q, k, v, pos, unit):
    return attend_packed(q[:, pos : pos + 1], [1], [[KeyPart(k, v, n=pos + 1, diag=pos)]], HKV, score_unit=unit)[0]


def test_a_row_is_the_same_alone_in_its_chunk_and_in_a_batch():
    """A query row's output under q8qk depends on its own query, keys and values only: alone, inside
    chunks of 2-70 rows (more than one scoring chunk of 64), inside steps of 1-9 sequences, 1 and 2
    threads, on each unit."""
    n = 1200
    gen = torch.Generator().manual_seed(7)
    k, v = (torch.randn(HKV, n + 80, D, generator=gen) for _ in range(2))
    qall = torch.randn(HQ, n + 80, D, generator=gen)
    probe = [0, 63, 64, 511, 600, 1100]
    threads = torch.get_num_threads()
    try:
        for unit in sorted({u for _, u in _units()}):
            alone = {p: _row_alone(qall, k, v, p, unit) for p in probe}
            for t in (2, 17, 70):
                for p in probe:
                    start = max(0, p - t // 2)
                    out = attend_packed(qall[:, start : start + t], [t], [[KeyPart(k, v, n=start + t, diag=start)]],
                                        HKV, score_unit=unit)
                    assert torch.equal(out[p - start], alone[p]), (unit, t, p)
            for n_threads in (1, 2):
                torch.set_num_threads(n_threads)
                seq_lens, parts, rows, qs, at = [], [], [], [], 0
                for j in range(9):
                    p, t = probe[j % len(probe)], 1 + j % 4
                    start = max(0, p - j % t)
                    qs.append(qall[:, start : start + t])
                    parts.append([KeyPart(k, v, n=start + t, diag=start)])
                    rows.append((at + p - start, p))
                    seq_lens.append(t)
                    at += t
                out = attend_packed(torch.cat(qs, dim=1), seq_lens, parts, HKV, score_unit=unit)
                for row, p in rows:
                    assert torch.equal(out[row], alone[p]), (unit, n_threads, p)
    finally:
        torch.set_num_threads(threads)


def test_a_chunk_wide_query_scale_would_fail_the_row_test():
    """The negative control for the test above: coding a chunk's queries with one scale (as a tile-wide
    quantizer would) changes a row's output with the rows beside it; the op's row-wise codes do not."""
    gen = torch.Generator().manual_seed(5)
    k, v = (torch.randn(HKV, 200, D, generator=gen) for _ in range(2))
    q = torch.randn(HQ, 9, D, generator=gen)
    q[:, 4] *= 10                                    # one loud row in the chunk
    start = 191
    alone = _twin(q[:, :1], k, v, start, row_scale=False)[0]
    assert not torch.allclose(alone, _twin(q, k, v, start, row_scale=False)[0], atol=1e-3)
    assert torch.allclose(_twin(q[:, :1], k, v, start)[0], _twin(q, k, v, start)[0], atol=1e-6)
    real = attend_packed(q, [9], [[KeyPart(k, v, n=start + 9, diag=start)]], HKV, score_unit=1)
    assert torch.equal(real[0], attend_packed(q[:, :1], [1], [[KeyPart(k, v, n=start + 1, diag=start)]], HKV,
                                              score_unit=1)[0])


CFG = ModelConfig(vocab_size=32, hidden_size=HQ * D, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=HQ, num_key_value_heads=HKV)


def _cache_step(cache: FullKVCache, layer: int, q, k, v, unit: int) -> torch.Tensor:
    parts = cache.parts(layer, q, k, v)
    return attend_packed(q, [q.shape[1]], [parts], HKV, score_unit=unit)


def test_the_cache_keeps_its_keys_codes_with_the_bits_of_codes_made_in_the_call():
    """A full cache with ``key_codes`` codes each key once (the op advances its count) and gives the bits of
    a cache without them, through decode steps, a verification chunk, a rollback (truncate and rewrite:
    the count comes back), growth (the codes move with the keys) and a copy (``load``)."""
    gen = torch.Generator().manual_seed(2)
    kept, plain = (FullKVCache(CFG, "cpu", torch.float16, capacity=100, key_codes=c) for c in (True, False))
    assert kept.codes is not None and plain.codes is None
    pos = 0

    def step(t: int) -> None:
        nonlocal pos
        q = torch.randn(HQ, t, D, generator=gen)
        k, v = (torch.randn(HKV, t, D, generator=gen).half() for _ in range(2))
        for cache in (kept, plain):
            cache.begin(pos, t)
        for layer in range(CFG.num_hidden_layers):
            a = _cache_step(kept, layer, q, k, v, 1)
            b = _cache_step(plain, layer, q, k, v, 1)
            assert torch.equal(a, b), (pos, t, layer)
        pos += t
        assert kept.codes.coded.tolist() == [pos] * CFG.num_hidden_layers

    step(90)          # a prefill chunk
    step(1)
    step(9)           # a verification chunk: grows the cache past 100 (codes move with it)
    assert kept.capacity >= 100 and kept.codes.dk.shape[2] % BLOCK == 0
    for cache in (kept, plain):
        cache.truncate(95)  # a rejected draft: the count comes back with the length
    pos = 95
    assert kept.codes.coded.tolist() == [95, 95]
    step(3)
    copy = FullKVCache(CFG, "cpu", torch.float16, capacity=8, key_codes=True)
    copy.load(kept, pos)
    assert copy.codes.coded.tolist() == [pos, pos]
    whole = pos // 16 * 16 * D                        # the bytes of the whole 16-key groups copied
    assert torch.equal(copy.codes.codes[:, :, :whole], kept.codes.codes[:, :, :whole])


def test_bad_integer_score_calls_are_refused():
    k, v = (torch.randn(HKV, 40, 72) for _ in range(2))
    q = torch.randn(HQ, 1, 72)
    with pytest.raises(RuntimeError, match="multiple of 16"):     # head dim 72: not whole 16-channel groups
        attend_packed(q, [1], [[KeyPart(k, v, n=40, diag=39)]], HKV, score_unit=1)
    with pytest.raises(RuntimeError, match="score_unit"):
        attend_packed(q, [1], [[KeyPart(k, v, n=40, diag=39)]], HKV, score_unit=7)
    with pytest.raises(ValueError, match="native CPU op"):
        attend_packed(q, [1], [[KeyPart(k, v, n=40, diag=39)]], HKV, kernels="torch", score_unit=1)


@pytest.mark.skipif("amx" not in supported_isas(), reason="this CPU or kernel gives no AMX tiles")
def test_the_op_asks_for_the_amx_tiles_itself():
    """A process that calls the op's AMX unit before anything else asked Linux for the tiles runs it (the
    op asks), where a tile instruction without the grant would kill the process (an illegal instruction)."""
    script = (
        "import torch\n"
        "from vericache.kernels import packed_kernels\n"
        "from vericache.kv.packed import KeyPart, op_args\n"
        "k, v, q = torch.randn(2, 300, 64), torch.randn(2, 300, 64), torch.randn(6, 9, 64)\n"
        "ints, tensors = op_args(0, KeyPart(k, v, n=300, diag=291), 64)\n"
        "out = packed_kernels('amx').attend_packed(q, 2, [9], ints, tensors, 3)\n"
        "print(bool(torch.isfinite(out).all()))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr[-2000:]


def test_a_q8qk_model_measures_its_key_coding_at_load_and_vericache_still_equals_full():
    """Loading with numerics="q8qk" measures each layer's key coding over the fixed text (offsets in bf16,
    channel scales powers of two, some not 1; the same on a second load; where the attention reads it: the
    module and the native step), and VeriCache's output is full decoding's."""
    from vericache.llm import LLM
    from vericache.model.loader import load_model
    from vericache.sampling import SamplingParams

    first, second = (load_model("tiny", device="cpu", dtype="float32", numerics="q8qk") for _ in range(2))
    codings = [b.self_attn.key_coding for b in first.model.model.blocks()]
    assert all(c is not None and c.shape == (2, b.self_attn.n_kv, b.self_attn.head_dim)
               for c, b in zip(codings, first.model.model.blocks()))
    assert all(c[0].abs().sum() > 0 and torch.equal(c[0], c[0].to(torch.bfloat16).float()) for c in codings)
    assert all(torch.equal(c[1], torch.exp2(torch.log2(c[1]).round())) for c in codings)
    assert any((c[1] != 1).any() for c in codings)
    assert all(torch.equal(a, b.self_attn.key_coding) for a, b in zip(codings, second.model.model.blocks()))
    ids = first.tokenizer.encode("def fibonacci(n):\n    " * 20)

    def native_logits() -> torch.Tensor:   # the whole step in the native call, the coding as it holds it
        assert first.model.native is not None
        cache = FullKVCache(first.config, "cpu", first.kv_dtype, capacity=len(ids), key_codes=True)
        cache.begin(0, len(ids))
        with torch.inference_mode():
            return first.model(torch.tensor(ids), [0], [len(ids)], [cache])

    measured = native_logits()
    for c in codings:   # set to none in place: the native step reads the same tensors
        c[0].zero_()
        c[1].fill_(1.0)
    assert not torch.equal(native_logits(), measured)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompt = "def fibonacci(n):\n    " * 12
    full = LLM("tiny", mode="full", numerics="q8qk").generate(prompt, params)[0].token_ids
    veri = LLM("tiny", mode="vericache", numerics="q8qk", compressor="snapkv:ratio=0.25").generate(prompt, params)[0]
    assert veri.token_ids == full


def _drafter_keeps_true_codes(monkeypatch, broken: bool) -> list[bool]:
    """A SnapKV drafter with kept codes through a prefill, decode steps whose commits compress (kept tokens
    fill evicted slots) and verification-guided trades: per check, whether its draft row's attention with
    the kept codes has the bits of codes made in the call. ``broken``: the store never drops stale codes."""
    import dataclasses

    from vericache.compress.registry import parse_compressor
    from vericache.kv.compressed import CompressedKVCache

    if broken:
        monkeypatch.setattr(CompressedKVCache, "_uncode_store", lambda self, slot: None)
        monkeypatch.setattr(CompressedKVCache, "_uncode_slots", lambda self, layers, slots: None)
    gen = torch.Generator().manual_seed(5)
    n = 400
    full = FullKVCache(CFG, "cpu", torch.float16, capacity=n, key_codes=True)
    full.begin(0, n)
    full.fill_random()
    draft = CompressedKVCache(parse_compressor("snapkv:ratio=0.25,window=16"), CFG, "cpu", torch.float16,
                              capacity=n, key_codes=True)
    prompt = FullKVCache(CFG, "cpu", torch.float16, capacity=n, key_codes=True)
    prompt.load(full, 256)
    draft.load_prefill(prompt, [torch.randn(HQ, 16, D, generator=gen).half()] * CFG.num_hidden_layers)
    draft.commit(256, source=full)
    same = []
    for pos in range(256, 330):
        draft.begin(pos, 1)
        for layer in range(CFG.num_hidden_layers):
            q = torch.randn(HQ, 1, D, generator=gen)
            parts = draft.parts(layer, q, full.k[layer, :, pos : pos + 1], full.v[layer, :, pos : pos + 1])
            made = attend_packed(q, [1], [[dataclasses.replace(p, codes=None) for p in parts]], HKV, score_unit=1)
            same.append(torch.equal(attend_packed(q, [1], [parts], HKV, score_unit=1), made))
        draft.commit(pos + 1, source=full)
        if pos % 9 == 0 and draft.count:   # a verification's trades: stored slots take other positions
            slots = torch.arange(3) * 5 % draft.count
            trades = torch.stack([torch.ones(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64), slots,
                                  torch.tensor([3, 40, 77])], 1)
            draft.trade(trades, full)
    assert draft.codes is not None and int(draft.codes.coded.max()) > 0
    return same


def test_a_trade_drops_only_its_layers_codes_from_its_first_slot():
    """A verification's trades rewrite a few store slots: each traded layer's codes hold below its first
    traded slot, an untraded layer's all (not the whole store coded again after every round)."""
    from vericache.compress.registry import parse_compressor
    from vericache.kv.compressed import CompressedKVCache

    full = FullKVCache(CFG, "cpu", torch.float16, capacity=300, key_codes=True)
    full.begin(0, 300)
    full.fill_random()
    draft = CompressedKVCache(parse_compressor("snapkv:ratio=0.25,window=16"), CFG, "cpu", torch.float16,
                              capacity=300, key_codes=True)
    prompt = FullKVCache(CFG, "cpu", torch.float16, capacity=300)
    prompt.load(full, 256)
    draft.load_prefill(prompt, [torch.randn(HQ, 16, D).half()] * CFG.num_hidden_layers)
    draft.commit(256, source=full)
    assert draft.count > 30
    draft.codes.coded.fill_(draft.count)                 # as if a draft step had coded the whole store
    draft.trade(torch.tensor([[1, 0, 30, 3], [1, 1, 12, 40]]), full)
    assert draft.codes.coded.tolist() == [draft.count, 12]


def test_a_drafters_kept_codes_have_the_bits_of_codes_made_in_the_call(monkeypatch):
    """Under q8qk a drafter scores as the verifier does, from codes its cache keeps (coded again only where
    a compression or a trade rewrote store slots): its draft rows get the bits of codes made in each call,
    through compressions and trades; a store that kept stale codes would not."""
    assert all(_drafter_keeps_true_codes(monkeypatch, broken=False))
    assert not all(_drafter_keeps_true_codes(monkeypatch, broken=True))
