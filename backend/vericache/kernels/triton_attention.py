"""The packed attention's GPU twin in Triton (issue 33): every sequence of a step over its dense parts
(``kv.packed.KeyPart``: a full cache's causal part, a compressed cache's kept tokens and its causal
residual; K/V fp32, fp16 or bf16, widened in registers), GQA folded (one program reads a KV head's keys
once for its G query heads).

Batch-invariant by construction, the rule SGLang and vLLM use for deterministic attention: a part's
keys are split at fixed key indices (``SPLIT`` keys a split, whatever the sequence, its length or
its batch), each split gives a partial softmax (max, sum, weighted values) for one query row, and a
row's partials (all its parts' splits, in part order) are merged in that fixed order by a second
kernel. Nothing a row computes depends on another row, so a row alone, inside a batch and inside a
chunk gives the same bits. Quantized parts are not here yet (``kv.quantized``'s layouts).

Shapes: Hq query heads, Hkv KV heads (G = Hq / Hkv), N packed query rows, T a sequence's rows, D head dim.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import triton
import triton.language as tl

SPLIT = 64   # keys per split: fixed, so where a split starts never depends on the batch


@triton.jit
def _split_kernel(q_ptr, k_ptr, v_ptr, part_ptr, n, diag, row0, n_splits, slot0, s_total, G, scale,
                  q_sh, q_st, k_sh, k_sn, v_sh, v_sn,
                  CAUSAL: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, SPLIT: tl.constexpr):
    """One (query row, KV head, split): the partial softmax of the G query heads over SPLIT keys."""
    i, kvh, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    g, d = tl.arange(0, GP), tl.arange(0, D)
    j = s * SPLIT + tl.arange(0, SPLIT)
    heads = kvh * G + g
    h_ok = g < G
    q = tl.load(q_ptr + heads[:, None] * q_sh + (row0 + i) * q_st + d[None, :], mask=h_ok[:, None], other=0.0)
    k_ok = j < n
    if CAUSAL:
        k_ok = k_ok & (j <= i + diag)
    k = tl.load(k_ptr + kvh * k_sh + j[:, None] * k_sn + d[None, :], mask=k_ok[:, None], other=0.0).to(tl.float32)
    v = tl.load(v_ptr + kvh * v_sh + j[:, None] * v_sn + d[None, :], mask=k_ok[:, None], other=0.0).to(tl.float32)
    scores = tl.sum(q.to(tl.float32)[:, None, :] * k[None, :, :], axis=2) * scale        # [GP, SPLIT]
    scores = tl.where(k_ok[None, :], scores, float("-inf"))
    m = tl.max(scores, axis=1)                                                             # [GP]
    p = tl.where(k_ok[None, :], tl.exp(scores - tl.where(m == float("-inf"), 0.0, m)[:, None]), 0.0)
    l = tl.sum(p, axis=1)
    acc = tl.sum(p[:, :, None] * v[None, :, :], axis=1)                                   # [GP, D]
    # partials [T, Hq, s_total, D + 2]: the weighted values, then the max and the sum
    base = part_ptr + ((i * (G * tl.num_programs(1)) + heads) * s_total + slot0 + s) * (D + 2)
    tl.store(base[:, None] + d[None, :], acc, mask=h_ok[:, None])
    tl.store(base + D, m, mask=h_ok)
    tl.store(base + D + 1, l, mask=h_ok)


@triton.jit
def _merge_kernel(part_ptr, out_ptr, s_total, row0, Hq, D: tl.constexpr):
    """One (query row, query head): its partials merged in split order; out [N, Hq, D]."""
    i, h = tl.program_id(0), tl.program_id(1)
    d = tl.arange(0, D)
    base = part_ptr + (i * Hq + h) * s_total * (D + 2)
    big_m = tl.full((), float("-inf"), tl.float32)
    big_l = tl.zeros((), tl.float32)
    acc = tl.zeros((D,), dtype=tl.float32)
    for s in range(s_total):
        m_s = tl.load(base + s * (D + 2) + D)
        l_s = tl.load(base + s * (D + 2) + D + 1)
        a_s = tl.load(base + s * (D + 2) + d)
        new_m = tl.maximum(big_m, m_s)
        keep = tl.where(big_m == float("-inf"), 0.0, tl.exp(big_m - new_m))
        take = tl.where(m_s == float("-inf"), 0.0, tl.exp(m_s - new_m))
        big_l = big_l * keep + l_s * take
        acc = acc * keep + a_s * take
        big_m = new_m
    tl.store(out_ptr + ((row0 + i) * Hq + h) * D + d, acc / big_l)


def attend_packed(q: torch.Tensor, seq_lens: Sequence[int], parts: Sequence[Sequence], n_kv_heads: int) -> torch.Tensor:
    """``kv.packed.attend_packed`` on Triton: q [Hq, N, D] fp32 (sequence i owns the next seq_lens[i]
    rows), parts[i] its dense ``KeyPart``s; returns out [N, Hq, D] fp32."""
    hq, n_rows, d = q.shape
    if q.dtype != torch.float32 or d & (d - 1) or hq % n_kv_heads:
        raise ValueError(f"q must be fp32 [Hq, N, D] with D a power of two and Hq a multiple of {n_kv_heads} "
                         f"KV heads, got {q.dtype} {list(q.shape)}")
    if len(parts) != len(seq_lens) or sum(seq_lens) != n_rows:
        raise ValueError(f"{len(parts)} part lists and seq_lens {list(seq_lens)} for {n_rows} query rows")
    g = hq // n_kv_heads
    out = torch.empty(n_rows, hq, d, dtype=torch.float32, device=q.device)
    row0 = 0
    for t, seq_parts in zip(seq_lens, parts):
        for p in seq_parts:
            _check_part(p, n_kv_heads, d, q.device)
        splits = [triton.cdiv(p.n, SPLIT) for p in seq_parts]
        s_total = sum(splits)
        if t and not s_total:
            raise ValueError(f"a sequence's {t} query rows attend no key")
        partial = torch.empty(t, hq, max(s_total, 1), d + 2, dtype=torch.float32, device=q.device)
        slot = 0
        for p, n_splits in zip(seq_parts, splits):
            if n_splits and t:
                k, v = p.k, p.v
                _split_kernel[(t, n_kv_heads, n_splits)](
                    q, k, v, partial, p.n, -1 if p.diag is None else p.diag, row0, n_splits, slot, s_total, g,
                    1.0 / math.sqrt(d), q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                    CAUSAL=p.diag is not None, GP=triton.next_power_of_2(g), D=d, SPLIT=SPLIT)
            slot += n_splits
        if t:
            _merge_kernel[(t, hq)](partial, out, s_total, row0, hq, D=d)
        row0 += t
    return out


def _check_part(p, n_kv_heads: int, d: int, device: torch.device) -> None:
    if p.layouts is not None:
        raise ValueError("quantized parts are not in the Triton attention yet: dense parts only")
    for name, x in (("k", p.k), ("v", p.v)):
        if (x.dtype not in (torch.float32, torch.float16, torch.bfloat16) or x.dim() != 3 or x.shape[0] != n_kv_heads
                or x.shape[1] < p.n or x.shape[2] != d or x.stride(2) != 1 or x.device != device):
            raise ValueError(f"dense part {name}: fp32, fp16 or bf16 [{n_kv_heads}, >= {p.n}, {d}] with a contiguous "
                             f"last dim on {device}, got {x.dtype} {list(x.shape)} on {x.device}")
