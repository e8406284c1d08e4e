"""The forward's attention: every sequence of a step, all its parts, one call per layer.

Each cache describes what one sequence's queries attend as ``KeyPart``s (``cache.parts``): a full
cache is one causal part (its prefix and the chunk's own keys), a compressed cache a store part (dense
kept tokens, or quantized codes) and a causal residual part. ``attend_packed`` attends every
sequence over its parts and merges them by log-sum-exp: on CPU in fp32 through one native call
(``kernels/packed_attention.cpp``: batch-invariant, GQA folded); elsewhere through the per-part
torch functions of ``kv.attention`` (CUDA keeps PyTorch's kernels).

Shapes: Hq query heads, Hkv KV heads, N packed query rows, T a sequence's rows, D head dim.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from vericache.kernels import packed_kernels
from vericache.kernels.layouts import CHANNEL_GROUPS, DENSE, PART_INTS, PART_TENSORS
from vericache.kv.attention import Part, attend_all, attend_causal, merge, merged_lse
from vericache.kv.quantized import Layout, StoredFields


@dataclass
class KeyCodes:
    """A dense part's keys and values as the q8qk numerics' codes (``kernels/int_scores.h``: per key and
    head, int8 codes and a scale), kept by its cache from step to step so a key is coded once: ``codes``
    [Hkv, C * D] int8 (for each group of 16 keys, D/4 lines of 64 bytes holding 4 channels of each),
    ``dk`` [Hkv, C] fp32 scales, ``csum`` [Hkv, C] int32 code sums; ``vcodes`` [Hkv, C * D] int8 (for each
    block of 64 keys and group of 16 channels, 16 lines of 64 bytes holding 4 keys of each channel) and
    ``dv`` [Hkv, C] fp32; C a multiple of 64 (whole blocks);
    ``coded`` (int64, one element): keys 0 .. coded - 1 hold their codes; the op codes the others as it
    reads them, in place, and then advances ``coded`` (so a forward that fails part way leaves each layer's
    count true). The cache lowers it where it rewrites keys. A ``LayeredParts``' tensors carry a leading
    layer dim."""
    codes: torch.Tensor
    dk: torch.Tensor
    csum: torch.Tensor
    vcodes: torch.Tensor
    dv: torch.Tensor
    coded: torch.Tensor

    def layer(self, i: int) -> KeyCodes:
        """Layer i's codes (of a cache's codes with a leading layer dim)."""
        return KeyCodes(*(t[i] for t in (self.codes, self.dk, self.csum, self.vcodes, self.dv, self.coded)))

    def arrays(self) -> tuple[torch.Tensor, ...]:
        """The codes and scales (not the count), in one order."""
        return self.codes, self.dk, self.csum, self.vcodes, self.dv


CODE_BLOCK = 64   # the attention op's keys a block: key codes are kept for whole blocks


def key_codes_bytes(layers: int, heads: int, capacity: int, dim: int) -> int:
    """Bytes ``new_key_codes`` allocates for these sizes: per key and KV head its D key codes, D value codes
    and three 4-byte numbers (dk, csum, dv), in whole blocks; one count a layer. (fp16 K and V take 4 D
    bytes a key and head: the codes add (2 D + 12) / 4 D to them, 55% at D = 64.)"""
    cap = -(-capacity // CODE_BLOCK) * CODE_BLOCK
    return layers * heads * cap * (2 * dim + 12) + 8 * layers


def new_key_codes(layers: int, heads: int, capacity: int, dim: int, device: torch.device) -> KeyCodes:
    """Empty key codes (none coded) for ``capacity`` keys, in whole blocks, of ``heads`` KV heads in each of
    ``layers`` layers."""
    cap = -(-capacity // CODE_BLOCK) * CODE_BLOCK
    return KeyCodes(torch.zeros(layers, heads, cap * dim, dtype=torch.int8, device=device),
                    torch.zeros(layers, heads, cap, device=device),
                    torch.zeros(layers, heads, cap, dtype=torch.int32, device=device),
                    torch.zeros(layers, heads, cap * dim, dtype=torch.int8, device=device),
                    torch.zeros(layers, heads, cap, device=device), torch.zeros(layers, dtype=torch.int64, device=device))


@dataclass
class KeyPart:
    """n keys per KV head that a sequence's T queries attend.

    Dense: ``k``, ``v`` [Hkv, >= n, D] (fp32, or a half-size KV's fp16/bf16). Quantized: ``layouts``
    (K, V) and the store's per-layer fields ``k``, ``v`` = {"tok": {field: [Hkv, C, w]}, "grp": {field:
    [Hkv, NG, D]}}, ``pos`` [Hkv, C] int32.
    ``diag`` >= 0 makes the part causal: query i sees key j iff j <= i + diag (so a full cache written
    at start s has n = s + T, diag = s); None: every query sees every key.
    ``seen`` (optional, an output) [Hq, >= n] fp32: the op writes, per query head, a log softmax over keys
    j < n of the max over the head's rows that see j of the scaled score q.k / sqrt(D) (about -1e30 where
    no row sees j): in logs, how much the verified rows attended to j, for a guided drafter
    (``drafting.guide``); then the first query head of each KV head's group holds the max over the
    group's heads (what the drafter reads: one row a KV head). In a scores-only call (``attend_packed``'s
    ``row_lse``) it takes each key's largest log-probability instead (KVzip's scores): the max over the
    head's rows that see j of the scaled score less the row's log-sum-exp, not normalised over keys.
    ``codes`` (optional, dense parts): its keys' integer-score codes, kept by the cache (``KeyCodes``);
    without them the q8qk numerics code each block's keys in the call (the same bits).
    ``exact`` False: a part scored in fp32 whatever the numerics (a compressed cache's that keeps no codes:
    coding its keys and values in every call cost SmolLM2's draft step at 8K 6.5 ms of 22). A compressed
    cache that keeps codes (``CompressedKVCache(key_codes=True)``) scores in the verifier's numerics: under
    q8qk, fp32 drafts over integer verification kept 0.74 of SmolLM2's drafts at 8K against 0.98.
    """

    k: torch.Tensor | StoredFields
    v: torch.Tensor | StoredFields
    n: int
    diag: int | None = None
    layouts: tuple[Layout, Layout] | None = None
    pos: torch.Tensor | None = None
    seen: torch.Tensor | None = None
    codes: KeyCodes | None = None
    exact: bool = True

    def __post_init__(self) -> None:
        if self.n < 0 or (self.diag is not None and self.diag < 0):
            raise ValueError(f"a part needs n >= 0 and diag >= 0 or None, got n={self.n}, diag={self.diag}")

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [Hkv, >= n, D] of a dense part (ValueError for a quantized one)."""
        if self.layouts is not None or not isinstance(self.k, torch.Tensor) or not isinstance(self.v, torch.Tensor):
            raise ValueError("a quantized part has no dense K/V")
        return self.k, self.v

    def stored(self) -> tuple[StoredFields, StoredFields]:
        """K's and V's stored fields of a quantized part (ValueError for a dense one)."""
        if self.layouts is None or not isinstance(self.k, dict) or not isinstance(self.v, dict):
            raise ValueError("a dense part has no stored fields")
        return self.k, self.v


class QueryObserver(Protocol):
    """A cache told how many queries its observation window took in a step (a compressed cache's)."""
    def observed(self, t: int) -> None: ...


@dataclass
class LayeredParts:
    """One sequence's cache for a whole step, every layer at once: the chunk's K/V go to ``k``, ``v``
    [L, Hkv, cap, D] at positions ``slot``..; its queries attend ``parts`` (``KeyPart``s whose tensors
    carry a leading layer dim); ``queries`` [L, Hq, W, D] (or None) keeps the last W queries of each
    layer, and ``observer`` is told how many it got (``observed``)."""
    k: torch.Tensor
    v: torch.Tensor
    slot: int
    parts: list[KeyPart]
    queries: torch.Tensor | None = None
    observer: QueryObserver | None = None


class PartsAttention(Protocol):
    """A layer's ``attend_packed`` with its model's settings bound (kernels, score unit, key coding), for one
    sequence: q [Hq, T, D] over ``parts`` -> out [T, Hq, D]; ``lse`` an optional output [Hq, T] fp32,
    ``row_lse`` an input making the call scores-only (what a cache computing its own attention calls:
    ``KVCache.attend``)."""

    def __call__(self, q: torch.Tensor, parts: Sequence[KeyPart], lse: torch.Tensor | None = None,
                 row_lse: torch.Tensor | None = None) -> torch.Tensor: ...


def op_args(seq: int, p: KeyPart, d: int) -> tuple[list[int], list[torch.Tensor | None]]:
    """One part's ints and tensors for the native op, named and put in the op's order (``layouts``'
    PART_INTS and PART_TENSORS; unnamed tensors are None)."""
    ints = {"seq": seq, "n_keys": p.n, "diag": -1 if p.diag is None else p.diag, "exact": int(p.exact)}
    tensors: dict[str, torch.Tensor | None] = {"pos": p.pos, "seen": p.seen}
    if p.codes is not None:
        c = p.codes
        tensors |= {"k_codes": c.codes, "k_dk": c.dk, "k_csum": c.csum, "v_codes": c.vcodes, "v_dv": c.dv,
                    "k_coded": c.coded}
    if p.layouts is None:
        k, v = p.dense()
        ints |= {"k_kind": DENSE, "k_bits": 0, "k_group": 0, "v_kind": DENSE, "v_bits": 0, "v_group": 0}
        tensors |= {"k_rows": k, "v_rows": v, "pos": None}
    else:
        for side, layout, fields in zip("kv", p.layouts, p.stored()):
            table = fields["grp"] if layout.kind == CHANNEL_GROUPS else fields["tok"]
            ints |= {f"{side}_kind": layout.kind, f"{side}_bits": layout.bits, f"{side}_group": layout.group_size(d)}
            tensors |= {f"{side}_rows": fields["tok"]["codes"], f"{side}_scale": table["scale"],
                        f"{side}_zero": table.get("zero")}
    return [ints[name] for name in PART_INTS], [tensors.get(name) for name in PART_TENSORS]


def attend_packed(q: torch.Tensor, seq_lens: Sequence[int], parts: Sequence[Sequence[KeyPart]],
                  n_kv_heads: int, kernels: str = "auto", score_unit: int = 0,
                  key_coding: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                  row_lse: torch.Tensor | None = None) -> torch.Tensor:
    """q: [Hq, N, D] (sequence i owns the next seq_lens[i] rows); parts[i]: sequence i's parts.
    Returns out [N, Hq, D]; ``lse`` (optional, an output) [Hq, N] fp32 takes each row's log-sum-exp of its
    scaled scores over all its parts' keys (-1e30 for a row that sees none; with it "triton" runs PyTorch's
    kernels). ``row_lse`` (optional, an input) [Hq, N] fp32, the rows' ``lse`` from a call over the same
    parts, makes the call scores-only: the parts' ``seen`` take each key's largest log-probability
    (``KeyPart``), nothing else is computed, and out is zeros. ``kernels`` (``model.loader.parse_kernels``):
    "triton" runs the Triton twin (``kernels/triton_attention.py``, in fp32); "torch" PyTorch's per-part
    kernels; otherwise the native op for fp32 queries on the CPU, PyTorch's kernels elsewhere.
    ``score_unit`` (the native op only):
    0 fp32 scores, else the q8qk numerics' integer scores on that unit (``linear_op.score_unit``), keys
    and queries coded in ``key_coding`` [2, Hkv, D] (fp32 offsets and channel scales, ``kernels/int_scores.h``;
    None: offsets 0, scales 1)."""
    hq, n, d = q.shape
    if len(parts) != len(seq_lens) or sum(seq_lens) != n:
        raise ValueError(f"{len(parts)} part lists and seq_lens {list(seq_lens)} for {n} query rows")
    native = kernels != "torch" and kernels != "triton" and q.device.type == "cpu" and q.dtype == torch.float32
    if score_unit and not native:
        raise ValueError(f"integer scores (score_unit={score_unit}) run on the native CPU op with fp32 queries, "
                         f"not kernels={kernels!r} on {q.device} {q.dtype}")
    for name, given in (("lse", lse), ("row_lse", row_lse)):
        if given is not None and (given.dtype != torch.float32 or tuple(given.shape) != (hq, n)
                                  or not given.is_contiguous()):
            raise ValueError(f"{name} must be a contiguous fp32 [{hq}, {n}] tensor, got {given.dtype} "
                             f"{tuple(given.shape)}")
    if row_lse is not None and (lse is not None or not any(p.seen is not None for ps in parts for p in ps)):
        raise ValueError("a scores-only call (row_lse) writes its parts' seen: it takes no lse output and needs "
                         "a part with a seen tensor")
    if row_lse is not None and not native:
        record_seen_torch(q, seq_lens, parts, row_lse)
        return q.new_zeros(n, hq, d)
    if kernels == "triton" and lse is None:   # (the Triton twin has no lse output: PyTorch's kernels give it)
        from vericache.kernels.triton_attention import attend_packed as attend_triton

        record_seen_torch(q, seq_lens, parts)
        return attend_triton(q.float(), seq_lens, parts, n_kv_heads).to(q.dtype)
    if native:
        ints: list[int] = []
        tensors: list[torch.Tensor | None] = []
        for seq, seq_parts in enumerate(parts):
            for p in seq_parts:
                i, t = op_args(seq, p, d)
                ints += i
                tensors += t
        out: torch.Tensor = packed_kernels().attend_packed(q, n_kv_heads, list(seq_lens), ints, tensors, score_unit,
                                                           key_coding, lse, row_lse)
        return out
    record_seen_torch(q, seq_lens, parts)
    outs, start = [], 0
    for rows, seq_parts in zip(seq_lens, parts):
        qs = q[:, start : start + rows]
        each = [r for p in seq_parts for r in torch_part(qs, p)]
        outs.append(merge(each))
        if lse is not None:
            lse[:, start : start + rows] = merged_lse(each)
        start += rows
    return torch.cat(outs, dim=1).transpose(0, 1)


def record_seen_torch(q: torch.Tensor, seq_lens: Sequence[int], parts: Sequence[Sequence[KeyPart]],
                      row_lse: torch.Tensor | None = None) -> None:
    """The op's ``seen`` output for the paths without it (PyTorch's kernels, Triton): dense parts only."""
    start = 0
    for t, seq_parts in zip(seq_lens, parts):
        for p in seq_parts:
            if p.seen is not None:
                rows = None if row_lse is None else row_lse[:, start : start + t]
                p.seen[:, : p.n] = seen_scores(q[:, start : start + t], p, rows)
        start += t


def seen_scores(q: torch.Tensor, p: KeyPart, row_lse: torch.Tensor | None = None) -> torch.Tensor:
    """Reference of the op's ``seen`` for one dense part: q [Hq, T, D] -> [Hq, n]: per query head, a log
    softmax over keys of each key's max scaled score over the rows that see it (with ``row_lse`` [Hq, T]:
    each key's max over those rows of its log-probability, score less the row's lse, not normalised);
    each KV head's first query head then holds its group's max."""
    if p.layouts is not None:
        raise ValueError("seen scores are recorded over dense parts (a full cache) only")
    hq, t, d = q.shape
    k, _ = p.dense()
    keys = k[:, : p.n].float().repeat_interleave(hq // k.shape[0], dim=0)          # [Hq, n, D]
    scores = torch.matmul(q.float() * (1.0 / math.sqrt(d)), keys.transpose(1, 2))   # [Hq, T, n]
    if p.diag is not None:
        visible = torch.arange(p.n, device=q.device)[None] <= torch.arange(t, device=q.device)[:, None] + p.diag
        scores = scores.masked_fill(~visible, -1e30)
    if row_lse is not None:
        scores = (scores - row_lse[:, :, None]).masked_fill(scores <= -1e30, -1e30)
    top = scores.amax(dim=1)                                                        # [Hq, n]
    seen = top if row_lse is not None else top - torch.logsumexp(top, dim=-1, keepdim=True)
    group = hq // k.shape[0]
    seen[::group] = seen.view(k.shape[0], group, -1).amax(dim=1)                    # each group's max, first row
    return seen


def torch_part(q: torch.Tensor, p: KeyPart) -> list[Part]:
    """One part with PyTorch's kernels (CUDA, or a dtype the op does not take): q [Hq, T, D]."""
    if p.layouts is not None:
        from vericache.kv.quantized import attend_quantized

        return [attend_quantized(q, p.layouts, *p.stored(), p.n, p.pos)] if p.n else []
    k, v = p.dense()
    if k.dtype != q.dtype:   # a half-size full KV: widened here (the CPU op widens block by block)
        k, v = k[:, : p.n].to(q.dtype), v[:, : p.n].to(q.dtype)
    if p.diag is None:
        return [attend_all(q, k[:, : p.n], v[:, : p.n])] if p.n else []
    t, s = q.shape[1], p.diag
    if p.n != s + t:
        raise ValueError(f"a causal part over {p.n} keys for {t} queries at {s}: only n = diag + T is supported here")
    if t == 1:
        return [attend_all(q, k[:, : p.n], v[:, : p.n])]
    own = attend_causal(q, k[:, s : s + t], v[:, s : s + t])
    return [attend_all(q, k[:, :s], v[:, :s]), own] if s else [own]
