"""Attention in parts merged by log-sum-exp equals one causal attention over everything."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vericache.kv.attention import attend_all, merge
from vericache.kv.packed import KeyPart, attend_packed


def _reference(q, keys, values, start):
    """Causal attention of q (positions start..) over keys 0..start+T-1, GQA expanded, in float64."""
    hq, t, _ = q.shape
    g = hq // keys.shape[0]
    k = keys[:, : start + t].repeat_interleave(g, 0).double()
    v = values[:, : start + t].repeat_interleave(g, 0).double()
    mask = torch.arange(start + t)[None, :] <= torch.arange(start, start + t)[:, None]
    return F.scaled_dot_product_attention(q.double(), k, v, attn_mask=mask)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])  # the native op / the torch parts
@pytest.mark.parametrize("start, t", [(0, 1), (0, 7), (37, 1), (37, 5), (130, 33), (1, 2)])
def test_chunk_equals_masked_attention(dtype, start, t):
    torch.manual_seed(start * 100 + t)
    hq, hkv, d = 9, 3, 64
    keys, values = torch.randn(hkv, start + t + 4, d, dtype=dtype), torch.randn(hkv, start + t + 4, d, dtype=dtype)
    q = torch.randn(hq, t, d, dtype=dtype)
    out = attend_packed(q, [t], [[KeyPart(keys, values, n=start + t, diag=start)]], 3).transpose(0, 1)
    assert out.shape == (hq, t, d) and out.dtype == dtype
    assert torch.allclose(out.double(), _reference(q, keys, values, start), atol=1e-5)


def test_merging_disjoint_key_sets_equals_attending_their_union():
    torch.manual_seed(0)
    q = torch.randn(4, 3, 32)
    k1, v1, k2, v2 = (torch.randn(2, n, 32) for n in (50, 50, 9, 9))
    merged = merge([attend_all(q, k1, v1), attend_all(q, k2, v2)])
    whole = attend_all(q, torch.cat([k1, k2], 1), torch.cat([v1, v2], 1))[0]
    assert torch.allclose(merged, whole, atol=1e-5)
    empty = attend_all(q, k1[:, :0], v1[:, :0])  # no keys: contributes nothing to a merge
    assert torch.allclose(merge([empty, attend_all(q, k1, v1)]), attend_all(q, k1, v1)[0], atol=1e-6)
