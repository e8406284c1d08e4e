"""KVzip's reconstruction pass: the packed attention (with its rows' log-sum-exp) plus its scores-only call
equal the explicit probabilities, whatever the chunks."""

from __future__ import annotations

import math

import pytest
import torch

from vericache.compress.kvzip_scoring import ReconstructionScoringCache
from vericache.config import ModelConfig
from vericache.kv.full import FullKVCache
from vericache.kv.packed import attend_packed

HQ, HKV, D, P = 6, 2, 16, 40
CFG = ModelConfig(vocab_size=32, hidden_size=HQ * D, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=HQ, num_key_value_heads=HKV)


def explicit_pass(ctx_k, ctx_v, chunks):
    """The reference: softmax over [context, own keys so far] with a causal mask, written out.
    chunks: (q [Hq, T, D], k, v [Hkv, T, D]) in order -> (outputs, [Hkv, P] max probabilities)."""
    keys, vals, outs, best = ctx_k, ctx_v, [], torch.zeros(HKV, P)
    for q, k, v in chunks:
        start = keys.shape[1]
        keys, vals = torch.cat([keys, k], dim=1), torch.cat([vals, v], dim=1)
        t = q.shape[1]
        qg = q.view(HKV, HQ // HKV, t, D)
        logits = torch.einsum("hgtd,hsd->hgts", qg, keys) / math.sqrt(D)
        later = torch.arange(keys.shape[1])[None, :] > torch.arange(start, start + t)[:, None]
        probs = torch.softmax(logits.masked_fill(later, float("-inf")), dim=-1)
        best = torch.maximum(best, probs[..., :P].amax(dim=(1, 2)))
        outs.append(torch.einsum("hgts,hsd->hgtd", probs, vals).reshape(HQ, t, D))
    return outs, best


def fp32_op(q, parts, lse=None, row_lse=None):
    """A layer's op with fp32 scores (``PartsAttention``; the model binds its own numerics)."""
    return attend_packed(q, [q.shape[1]], [parts], HKV, lse=lse, row_lse=row_lse)


def scored(chunks, seed=0, op=fp32_op):
    g = torch.Generator().manual_seed(seed)
    ctx = FullKVCache(CFG, "cpu", torch.float32, capacity=P)
    ctx.append(torch.randn(1, HKV, P, D, generator=g), torch.randn(1, HKV, P, D, generator=g))
    scorer = ReconstructionScoringCache(ctx, n_layers=1, own=sum(q.shape[1] for q, _, _ in chunks))
    outs, start = [], P
    for q, k, v in chunks:
        scorer.begin(start, q.shape[1])
        start += q.shape[1]
        outs.append(scorer.attend(0, q, k, v, op))
    reference = explicit_pass(*ctx.layer_views(0, P), chunks)
    return outs, scorer.scores[0], reference


def random_chunks(sizes, seed=1):
    g = torch.Generator().manual_seed(seed)
    # scaled queries give peaked rows: some probabilities near 1, most near 0, as in a real model
    return [(3 * torch.randn(HQ, t, D, generator=g), torch.randn(HKV, t, D, generator=g),
             torch.randn(HKV, t, D, generator=g)) for t in sizes]


@pytest.mark.parametrize("sizes", [[8], [8, 5, 1], [1, 1, 3]])
def test_the_fused_pass_equals_the_explicit_probabilities(sizes):
    outs, scores, (ref_outs, ref_scores) = scored(random_chunks(sizes))
    for out, ref in zip(outs, ref_outs):
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(scores, ref_scores, rtol=1e-4, atol=1e-7)
    assert scores.shape == (HKV, P) and float(scores.max()) > 0.1   # peaked rows: a real maximum to match


def q8qk_op(q, parts, lse=None, row_lse=None):
    """The op in the q8qk numerics (integer scores on this build's own vector code), as a q8qk model binds it."""
    return attend_packed(q, [q.shape[1]], [parts], HKV, score_unit=1, lse=lse, row_lse=row_lse)


def test_the_pass_on_integer_scores_is_within_int8s_reach_of_the_explicit_one():
    """Under q8qk the pass attends on the integer op and scores on its integer scores less its rows'
    log-sum-exp: int8 queries and keys move a logit by ~1% of its size, so outputs and probabilities stay
    near the explicit fp32 ones (peaked rows: some near 1), and no probability passes 1 (the scores the
    normaliser summed)."""
    chunks = random_chunks([8, 5, 1])
    outs, scores, (ref_outs, ref_scores) = scored(chunks, op=q8qk_op)
    for out, ref in zip(outs, ref_outs):
        torch.testing.assert_close(out, ref, atol=0.1, rtol=0.05)
    torch.testing.assert_close(scores, ref_scores, atol=0.1, rtol=0.1)
    assert float(ref_scores.max()) > 0.5 and float(scores.max()) <= 1.0


def torch_op(q, parts, lse=None, row_lse=None):
    """The same on PyTorch's kernels (a GPU's path)."""
    return attend_packed(q, [q.shape[1]], [parts], HKV, "torch", lse=lse, row_lse=row_lse)


@pytest.mark.parametrize("op, invariant", [(fp32_op, True), (q8qk_op, True), (torch_op, False)])
def test_the_scores_do_not_depend_on_the_chunks(op, invariant):
    """Each row's scores and log-sum-exp are its own (the op's rows do not depend on their chunk) and a max
    is exact, so scoring 14 tokens whole, in chunks of 8, 5 and 1, or one by one gives the same bits; on
    PyTorch's kernels (the negative control: a GEMM's bits follow its row count) they differ."""
    whole = random_chunks([14])
    q, k, v = whole[0]
    bits = []
    for sizes in ([14], [8, 5, 1], [1] * 14):
        cuts = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
        chunks = [(q[:, a:b], k[:, a:b], v[:, a:b]) for a, b in zip(cuts, cuts[1:])]
        bits.append(scored(chunks, op=op)[1])
    assert (torch.equal(bits[0], bits[1]) and torch.equal(bits[0], bits[2])) == invariant


def test_a_score_pass_without_the_row_normaliser_fails_the_comparison():
    def broken(q, parts, lse=None, row_lse=None):   # every row's log-sum-exp taken as 0: the raw exp(q.k)
        return fp32_op(q, parts, lse, None if row_lse is None else row_lse * 0)

    _, scores, (_, ref_scores) = scored(random_chunks([8, 5]), op=broken)
    assert not torch.allclose(scores, ref_scores, rtol=1e-4, atol=1e-7)


def test_chunks_out_of_order_or_past_the_pass_are_refused():
    ctx = FullKVCache(CFG, "cpu", torch.float32, capacity=P)
    ctx.append(torch.zeros(1, HKV, P, D), torch.zeros(1, HKV, P, D))
    scorer = ReconstructionScoringCache(ctx, n_layers=1, own=4)
    with pytest.raises(ValueError, match=f"expected position {P}, got {P + 3}"):
        scorer.begin(P + 3, 2)
    with pytest.raises(ValueError, match=f"positions {P}..{P + 4} exceed the 4 this pass holds"):
        scorer.begin(P, 5)
    scorer.begin(P, 4)   # the refusals changed nothing
