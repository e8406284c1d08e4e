"""Verification-guided selection: the drafter's store keeps what the verifier attends to.

An eviction method chooses the kept tokens from the queries it saw when they entered the store. A
verification attends k+1 new queries over *every* key of the full cache: exactly what the next drafts
will need (Vegas, arXiv 2602.07223; SparseSpec, arXiv 2512.01278). The attention op records it as it
goes, at the cost of a max per score (``KeyPart.seen``: per layer and query head, a log softmax over
the keys of each key's max scaled score over the verified rows: an estimate, in logs, of how much the
rows attended to it, [L, Hq, n]; measured better than normalising by the rows' own log-sum-exp). The
op leaves the max over each KV head's query heads in the group's first row, so the selection reads
one row a KV head ([L, Hkv, n], a strided view).

After the round, per layer and KV head: att[j] = the max of those over the group's query heads; each
kept token's *memory* becomes max(memory - MEMORY_DECAY, att) (what a recent round attended still
counts); and the store trades its least remembered tokens for the most attended ones it lacks: the
t-th most attended missing token replaces the t-th least remembered kept one while its attention beats
that memory and a uniform share (1/n), at most ``swaps`` a KV head and round
(``kernels/guide_select.cpp``: O(keys) a head; its torch twin ``select_trades_torch`` runs elsewhere; for a
plain store the native op also makes the trades, ~30 small torch ops fewer a round).
The incoming token's exact K/V come from the full cache, stored as the store holds tokens (quantized
for a ``+quant`` composition); it carries the larger of its slot's old score and the head's median, so
the method's own moves do not evict it at once. The store keeps its size, and tokens that must stay
(attention sinks, a stored prefix: score inf) are never traded.

Drafts stay drafts: the full verification decides every token, so the output is unchanged.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

from vericache.kv.compressed import CompressedKVCache, KeptTokens
from vericache.kv.full import FullKVCache
from vericache.kv.packed import KeyPart, LayeredParts
from vericache.kv.protocol import KVCache

# log units a round: a kept token's verifier attention fades by ~10% a round in its memory, so what a
# recent round attended stays (measured: trading on one round's attention alone evicted tokens the next
# rounds needed; 8K decode acceptance 0.88 -> 0.63, with the memory 0.88)
MEMORY_DECAY = 0.1


class SeenRecorder(KVCache):
    """A verification's cache (the full cache, or the link's streamed view of it) whose full causal
    part records what the verified rows attend to into ``seen`` [L, Hq, >= start + T] fp32."""

    def __init__(self, cache: KVCache, seen: torch.Tensor) -> None:
        self.cache, self.seen = cache, seen

    def begin(self, start: int, count: int) -> None:
        self.cache.begin(start, count)

    def attention_cost(self, start: int, t: int) -> tuple[int, int]:
        return self.cache.attention_cost(start, t)

    def parts(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> list[KeyPart]:
        parts = self.cache.parts(layer, q, k, v)
        parts[-1].seen = self.seen[layer]        # the full cache: one causal part over every position
        return parts

    def layered_parts(self, t: int) -> LayeredParts | None:
        lp = self.cache.layered_parts(t)
        if lp is not None:
            lp.parts[-1].seen = self.seen
        return lp


def select_trades_torch(seen: torch.Tensor, n: int, kept: KeptTokens, swaps: int, decay: float) -> torch.Tensor:
    """``guide_select.cpp`` in torch (devices without it; the tests' reference): updates ``kept.memory``
    and returns int64 [T, 4] rows (layer, head, slot, position), heads in order. seen [L, Hq, >= n]."""
    pos, scores, memory, count, limit = kept.pos, kept.scores, kept.memory, kept.count, kept.res_start
    n_layers, hkv = pos.shape[:2]
    att = seen[:, :, :limit].reshape(n_layers, hkv, -1, limit).amax(dim=2)           # [L, Hkv, limit]
    kept_pos = pos[:, :, :count].long()
    mem = memory[:, :, :count]
    mem.copy_(torch.maximum(mem - decay, att.gather(2, kept_pos)))
    m = min(swaps, count, limit - count)
    if m <= 0:
        return torch.zeros(0, 4, dtype=torch.long)
    victims = mem.masked_fill(scores[:, :, :count].isinf(), float("inf"))
    missing = att.scatter(2, kept_pos, -float("inf"))
    cand_att, cand_pos = missing.topk(m, dim=2)                                       # most attended first
    victim_mem, victim_slot = victims.topk(m, dim=2, largest=False)                   # least remembered first
    trade = (cand_att > victim_mem) & (cand_att > -math.log(n))                       # a prefix of each head's m
    li, hi, ji = trade.nonzero(as_tuple=True)
    slot = victim_slot[li, hi, ji]
    mem[li, hi, slot] = cand_att[li, hi, ji]
    return torch.stack([li, hi, slot, cand_pos[li, hi, ji]], dim=1).cpu()


class GuideKernels(Protocol):
    """``guide_select.cpp``'s ops (the packed kernels' module): the choice of trades, [T, 4] (layer, head,
    slot, position), and the same choice made and applied to a plain store's K/V rows."""
    def guide_select(self, seen: torch.Tensor, n: int, pos: torch.Tensor, scores: torch.Tensor,
                     memory: torch.Tensor, count: int, limit: int, swaps: int, decay: float) -> torch.Tensor: ...

    def guide_trade(self, seen: torch.Tensor, n: int, pos: torch.Tensor, scores: torch.Tensor,
                    memory: torch.Tensor, count: int, limit: int, swaps: int, decay: float, full_k: torch.Tensor,
                    full_v: torch.Tensor, store_k: torch.Tensor, store_v: torch.Tensor) -> torch.Tensor: ...


def guide_store(draft: CompressedKVCache, full: FullKVCache, seen: torch.Tensor, n: int, swaps: int,
                kernels: GuideKernels | None = None) -> int:
    """Trade the store's least remembered tokens for the most attended missing ones (the module doc), after
    a verification over positions 0..n-1 recorded ``seen``; ``full`` holds every committed position.
    ``kernels``: ``guide_select.cpp``'s ops (CPU tensors), else the torch twin runs. Returns the
    tokens traded (all layers and heads)."""
    kept = draft.kept()   # positions >= res_start are in the residual, held whole
    if kept is None or not kept.count or kept.res_start <= kept.count:
        return 0
    seen = seen[:, :: seen.shape[1] // kept.pos.shape[1]]   # [L, Hkv, n]: each group's max, its first row
    if kernels is not None and seen.device.type == "cpu":
        args = (seen, n, kept.pos, kept.scores, kept.memory, kept.count, kept.res_start, swaps, MEMORY_DECAY)
        traded = draft.trade_in_one_call(kernels.guide_trade, args, full)   # a plain store: chosen and made at once
        if traded is not None:
            return traded
        trades = kernels.guide_select(*args)
    else:
        trades = select_trades_torch(seen, n, kept, swaps, MEMORY_DECAY)
    if len(trades):
        draft.trade(trades, full)
    return len(trades)
