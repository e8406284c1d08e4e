"""The packed attention's GPU twin in Triton (issue 33): every sequence of a step over its dense parts
(``kv.packed.KeyPart``: a full cache's causal part, a compressed cache's store and its causal residual),
reading each as stored: dense K/V in fp32, fp16 or bf16, or quantized codes (``kv.quantized``: token
groups, channel groups found by position, fp8 e4m3) dequantized in registers; GQA folded (one program
reads a KV head's keys once for its G query heads).

Batch-invariant by construction, the rule SGLang and vLLM use for deterministic attention: a part's
keys are split at fixed key indices (``SPLIT`` keys a split, whatever the sequence, its length or
its batch), each split gives a partial softmax (max, sum, weighted values) for one query row, and a
row's partials (all its parts' splits, in part order) are merged in that fixed order by a second
kernel. Nothing a row computes depends on another row, so a row alone, inside a batch and inside a
chunk gives the same bits.

Shapes: Hq query heads, Hkv KV heads (G = Hq / Hkv), N packed query rows, T a sequence's rows, D head dim.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from vericache.kernels.layouts import CHANNEL_GROUPS, DENSE, FP8, TOKEN_GROUPS

SPLIT = 64   # keys per split: fixed, so where a split starts never depends on the batch


@triton.jit
def _e4m3(b):
    """fp8 e4m3fn bytes (int32) -> fp32, exactly: (8 + m) 2^(e - 10), subnormals m 2^-9, S.1111.111 NaN."""
    e, m = (b >> 3) & 15, b & 7
    pow2 = ((e + 117) << 23).to(tl.float32, bitcast=True)                     # 2^(e - 10)
    val = tl.where(e == 0, m.to(tl.float32) * 0.001953125, (8 + m).to(tl.float32) * pow2)
    val = tl.where((e == 15) & (m == 7), float("nan"), val)
    return tl.where((b & 128) != 0, -val, val)


@triton.jit
def _rows(x_ptr, sc_ptr, zr_ptr, pos_ptr, kvh, j, ok, x_sh, x_sn, sc_sh, sc_sn, zr_sh, zr_sn, pos_sh,
          KIND: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, HAS_POS: tl.constexpr, D: tl.constexpr):
    """Keys (or values) ``j`` of KV head ``kvh`` as fp32 [len(j), D], read as stored: KIND 3 dense, 0 token
    groups, 1 channel groups (the group of a token's position), 2 fp8 (``kv.quantized``)."""
    d = tl.arange(0, D)
    if KIND == 3:
        return tl.load(x_ptr + kvh * x_sh + j[:, None] * x_sn + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    if KIND == 2:
        b = tl.load(x_ptr + kvh * x_sh + j[:, None] * x_sn + d[None, :], mask=ok[:, None], other=0).to(tl.int32)
        scale = tl.load(sc_ptr + kvh * sc_sh + j * sc_sn, mask=ok, other=0.0).to(tl.float32)
        return _e4m3(b) * scale[:, None]
    width: tl.constexpr = D * BITS // 8        # planar bit packing: byte c % width, bits (c // width) * BITS
    byte = tl.load(x_ptr + kvh * x_sh + j[:, None] * x_sn + (d % width)[None, :], mask=ok[:, None], other=0)
    code = ((byte.to(tl.int32) >> ((d // width) * BITS)[None, :]) & ((1 << BITS) - 1)).to(tl.float32)
    if KIND == 0:    # per token: scale and zero per group of GROUP channels
        at = kvh * sc_sh + j[:, None] * sc_sn + (d // GROUP)[None, :]
        zat = kvh * zr_sh + j[:, None] * zr_sn + (d // GROUP)[None, :]
    else:            # per channel: scale and zero of the token's position group
        if HAS_POS:
            p = tl.load(pos_ptr + kvh * pos_sh + j, mask=ok, other=0)
        else:
            p = j
        at = kvh * sc_sh + (p // GROUP)[:, None] * sc_sn + d[None, :]
        zat = kvh * zr_sh + (p // GROUP)[:, None] * zr_sn + d[None, :]
    scale = tl.load(sc_ptr + at, mask=ok[:, None], other=0.0).to(tl.float32)
    zero = tl.load(zr_ptr + zat, mask=ok[:, None], other=0.0).to(tl.float32)
    return code * scale + zero


@triton.jit
def _split_kernel(q_ptr, part_ptr, n, diag, row0, slot0, s_total, G, scale, q_sh, q_st,
                  k_ptr, ksc_ptr, kzr_ptr, k_sh, k_sn, ksc_sh, ksc_sn, kzr_sh, kzr_sn,
                  v_ptr, vsc_ptr, vzr_ptr, v_sh, v_sn, vsc_sh, vsc_sn, vzr_sh, vzr_sn, pos_ptr, pos_sh,
                  CAUSAL: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, SPLIT: tl.constexpr,
                  K_KIND: tl.constexpr, K_BITS: tl.constexpr, K_GROUP: tl.constexpr,
                  V_KIND: tl.constexpr, V_BITS: tl.constexpr, V_GROUP: tl.constexpr, HAS_POS: tl.constexpr):
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
    k = _rows(k_ptr, ksc_ptr, kzr_ptr, pos_ptr, kvh, j, k_ok, k_sh, k_sn, ksc_sh, ksc_sn, kzr_sh, kzr_sn, pos_sh,
              K_KIND, K_BITS, K_GROUP, HAS_POS, D)
    v = _rows(v_ptr, vsc_ptr, vzr_ptr, pos_ptr, kvh, j, k_ok, v_sh, v_sn, vsc_sh, vsc_sn, vzr_sh, vzr_sn, pos_sh,
              V_KIND, V_BITS, V_GROUP, HAS_POS, D)
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
                _split_kernel[(t, n_kv_heads, n_splits)](
                    q, partial, p.n, -1 if p.diag is None else p.diag, row0, slot, s_total, g, 1.0 / math.sqrt(d),
                    q.stride(0), q.stride(1), *_side(p, 0, d), *_side(p, 1, d), *_positions(p),
                    CAUSAL=p.diag is not None, GP=triton.next_power_of_2(g), D=d, SPLIT=SPLIT,
                    **_kinds(p, 0, "K_", d), **_kinds(p, 1, "V_", d), HAS_POS=p.pos is not None)
            slot += n_splits
        if t:
            _merge_kernel[(t, hq)](partial, out, s_total, row0, hq, D=d)
        row0 += t
    return out


def _side(p, which: int, d: int) -> list:
    """K (0) or V (1) of a part as the kernel's 3 pointers and 6 strides: the rows (dense values or
    codes), then scale and zero (their stored tables; the rows again where a kind has none)."""
    if p.layouts is None:
        x = (p.k, p.v)[which]
        return [x, x, x, x.stride(0), x.stride(1), 0, 0, 0, 0]
    fields, layout = (p.k, p.v)[which], p.layouts[which]
    codes = fields["tok"]["codes"]
    table = fields["grp"] if layout.kind == CHANNEL_GROUPS else fields["tok"]
    scale, zero = table["scale"], table.get("zero", table["scale"])
    return [codes, scale, zero, codes.stride(0), codes.stride(1), scale.stride(0), scale.stride(1),
            zero.stride(0), zero.stride(1)]


def _kinds(p, which: int, prefix: str, d: int) -> dict:
    if p.layouts is None:
        return {prefix + "KIND": DENSE, prefix + "BITS": 8, prefix + "GROUP": 1}
    layout = p.layouts[which]
    group = layout.group if layout.kind == CHANNEL_GROUPS else layout.group_size(d)
    return {prefix + "KIND": layout.kind, prefix + "BITS": layout.bits, prefix + "GROUP": group}


def _positions(p) -> list:
    """The stored tokens' positions [Hkv, C] (channel groups under eviction), or a stand-in."""
    pos = p.pos if p.pos is not None else (p.k if p.layouts is None else p.k["tok"]["codes"])
    return [pos, pos.stride(0)]


def _check_part(p, n_kv_heads: int, d: int, device: torch.device) -> None:
    if p.layouts is not None:
        for fields, layout in zip((p.k, p.v), p.layouts):
            codes = fields["tok"]["codes"]
            if (codes.dim() != 3 or codes.shape[0] != n_kv_heads or codes.shape[1] < p.n or codes.device != device
                    or codes.stride(2) != 1 or layout.kind not in (TOKEN_GROUPS, CHANNEL_GROUPS, FP8)):
                raise ValueError(f"quantized part: codes [{n_kv_heads}, >= {p.n}, w] on {device}, a kv.quantized "
                                 f"layout, got {list(codes.shape)} on {codes.device}, {layout}")
        return
    for name, x in (("k", p.k), ("v", p.v)):
        if (x.dtype not in (torch.float32, torch.float16, torch.bfloat16) or x.dim() != 3 or x.shape[0] != n_kv_heads
                or x.shape[1] < p.n or x.shape[2] != d or x.stride(2) != 1 or x.device != device):
            raise ValueError(f"dense part {name}: fp32, fp16 or bf16 [{n_kv_heads}, >= {p.n}, {d}] with a contiguous "
                             f"last dim on {device}, got {x.dtype} {list(x.shape)} on {x.device}")
