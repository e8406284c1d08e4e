"""Attention over KV caches in parts, merged by log-sum-exp, with PyTorch's kernels: the path
``kv.packed.attend_packed`` takes off the CPU fp32 op (CUDA, other dtypes).

A query chunk at positions s..s+T-1 sees every cached key before s (no mask needed) and, among
its own keys, only the earlier ones (a T x T causal triangle). Attending the two parts separately
and merging them (as FlashAttention merges its blocks) keeps the long part on the fast unmasked
kernel: a masked SDPA over prefix + chunk cannot use it, and on this CPU it runs compute-bound
(a 14-token verification chunk cost 3.5x a one-token step). The same merge lets a compressed
cache attend its store and its residual where they lie, with no per-step concatenation.

GQA: the G query heads that share a KV head are folded into query rows ([Hkv, G*T, D]), so each
K/V head is read once for its whole group and never expanded.

Shapes: Hq query heads, Hkv KV heads, G = Hq / Hkv, T queries, S keys, D head dim. ``lse`` is the
natural-log sum of exp of the scaled scores per query row, in fp32.
"""

from __future__ import annotations

import math
from typing import cast

import torch

Part = tuple[torch.Tensor, torch.Tensor]  # (out [Hq, T, D], lse [Hq, T])


def attend_all(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Part:
    """Every query sees every key. q: [Hq, T, D]; k, v: [Hkv, S, D] -> (out [Hq, T, D], lse [Hq, T])."""
    hq, t, d = q.shape
    hkv, s = k.shape[0], k.shape[1]
    if s == 0:
        return q.new_zeros(hq, t, d), q.new_full((hq, t), -math.inf, dtype=torch.float32)
    qf = q.reshape(hkv, (hq // hkv) * t, d)                               # [Hkv, G*T, D]
    if q.device.type == "cpu" and q.dtype == torch.float32:
        # the fused CPU flash kernel, which also returns the log-sum-exp
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qf[None], k[None], v[None])
        return out[0].reshape(hq, t, d), lse[0].reshape(hq, t)
    scores = torch.matmul(qf.float(), k.float().transpose(-1, -2)) / math.sqrt(d)   # [Hkv, G*T, S]
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse[..., None]), v.float()).to(q.dtype)
    return out.reshape(hq, t, d), lse.reshape(hq, t)


def attend_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Part:
    """Query i sees keys 0..i (the chunk over its own keys). q: [Hq, T, D]; k, v: [Hkv, T, D]."""
    hq, t, d = q.shape
    hkv = k.shape[0]
    if t == 1:
        return attend_all(q, k, v)
    kk, vv = k.repeat_interleave(hq // hkv, dim=0), v.repeat_interleave(hq // hkv, dim=0)  # [Hq, T, D]: T is small
    if q.device.type == "cpu" and q.dtype == torch.float32:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q[None], kk[None], vv[None],
                                                                               is_causal=True)
        return out[0], lse[0]
    scores = torch.matmul(q.float(), kk.float().transpose(-1, -2)) / math.sqrt(d)      # [Hq, T, T]
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~causal, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse[..., None]), vv.float()).to(q.dtype), lse


def merge(parts: list[Part]) -> torch.Tensor:
    """Combine attention over disjoint key sets into attention over their union: out [Hq, T, D]."""
    if len(parts) == 1:
        return parts[0][0]
    lse = torch.logsumexp(torch.stack([p[1] for p in parts]), dim=0)                   # [Hq, T]
    out = cast(torch.Tensor, sum(o.float() * torch.exp(l - lse)[..., None] for o, l in parts))
    return out.to(parts[0][0].dtype)


def merged_lse(parts: list[Part]) -> torch.Tensor:
    """The log-sum-exp [Hq, T] over the union of the parts' key sets (-1e30 for a row that sees no key,
    as the CPU op writes it)."""
    return torch.logsumexp(torch.stack([p[1].float() for p in parts]), dim=0).clamp_(min=-1e30)
