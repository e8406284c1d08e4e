"""The compressed KV cache of one sequence: what the drafter (and lossy mode) attends over.

Layout, every tensor allocated once for the request (all layers in one tensor each):
- a *store* of compressed tokens, ``count`` per KV head: full-precision K/V for eviction methods,
  or the quantizer's codes and scales (``tok``: per token; ``grp``: per position group, KIVI keys).
  Under eviction each KV head keeps its own token set, with positions ``pos`` [L, Hkv, C] int32.
  The draft attention reads the store as it is (``parts``: quantized codes through the packed op).
- a *residual* of the most recent tokens in full precision, positions res_start.. (shared by heads),
  sized to the window plus a draft round. In lossy mode it also holds the prompt while the prompt
  is prefilled (then shrinks); beside a full cache (vericache) the prompt is read from there.
- the last ``window`` queries per layer (eviction scorers read them).

Tokens move from the residual to the store in batches (whole position groups, at least
``window``), only once they are *committed* (verified by the full model, or accepted as-is in
lossy mode), so speculative draft tokens can always be rolled back.

Eviction at a move costs work in proportion to the tokens moved, not to the tokens kept: only the
entering tokens are scored (all layers in one call; H2O, which accumulates, re-scores its kept
ones), kept tokens carry the score they entered with (``scores``), the top ``ratio`` x tokens seen
stay, and each entering token that stays is written into a slot an evicted one left. The store is
therefore not in position order (``pos`` says where each token lies; attention does not care).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from vericache.config import ModelConfig
from vericache.kv.full import FullKVCache, storage_bytes
from vericache.kv.packed import KeyCodes, KeyPart, LayeredParts, key_codes_bytes, new_key_codes
from vericache.kv.protocol import KVCache
from vericache.kv.quantized import Layout, StoredFields

Spec = dict[str, tuple[tuple[int, ...], torch.dtype]]


class Compressor(Protocol):
    """What the cache asks of its compressor (``compress.base.Compressor`` is one; kv does not import
    compress: the compressors build on the caches, not the reverse)."""
    window: int

    @property
    def align(self) -> int: ...
    @property
    def evicts(self) -> bool: ...
    @property
    def quantizes(self) -> bool: ...
    @property
    def needs_whole_prompt(self) -> bool: ...
    @property
    def rescores_kept(self) -> bool: ...

    def keep_budget(self, total_tokens: int) -> int | None: ...

    def layouts(self) -> tuple[Layout, Layout]: ...

    def score(self, inputs: ScoreInputs) -> torch.Tensor: ...


@dataclass
class ScoreInputs:
    """What an eviction scorer sees: every layer at once, layers folded into heads (H = L * Hkv).

    keys: [H, S, D] candidate keys (fp32 where dequantised, else as the cache holds them: a scorer widens
    what it reads), positions: [H, S];
    queries: [L * Hq, W, D] the most recent observed queries (rotated);
    state: a dict the scorer may keep across compression events (KVzip's prompt scores);
    carried: [H, c] the scores the first c candidates (kept tokens) carry, for methods that
    re-score them (``rescores_kept``); None when every candidate is entering.
    """
    keys: torch.Tensor
    positions: torch.Tensor
    queries: torch.Tensor
    state: dict[str, Any]
    prompt_len: int
    carried: torch.Tensor | None = None


NO_MEMORY = -1e30   # a kept token no verification has attended to yet


@dataclass
class EvictionSlots:
    """An evicting store's per-slot bookkeeping, each [L, Hkv, C]: the position a slot holds (int32), its
    score (the method's; inf: a token that must stay) and its memory (``drafting.guide``'s, log)."""
    pos: torch.Tensor
    scores: torch.Tensor
    memory: torch.Tensor

    def by_name(self) -> dict[str, torch.Tensor]:
        return {"pos": self.pos, "scores": self.scores, "memory": self.memory}


@dataclass
class KeptTokens:
    """An evicting store's bookkeeping, for verification-guided selection (``drafting.guide``): per layer,
    KV head and slot, ``pos`` [L, Hkv, C] int32 and ``scores`` [L, Hkv, C] (read only), ``memory``
    [L, Hkv, C] (the guide's own: each kept token's verifier attention, log; updated in place by it);
    slots < ``count`` in use, holding positions < ``res_start``."""
    pos: torch.Tensor
    scores: torch.Tensor
    memory: torch.Tensor
    count: int
    res_start: int


def store_capacity(comp: Compressor, capacity: int) -> int:
    """Tokens per KV head the store can ever hold for a sequence of ``capacity`` positions."""
    budget = comp.keep_budget(capacity) if comp.evicts else None
    return capacity if budget is None else budget


def residual_capacity(comp: Compressor) -> int:
    """Committed tokens not yet moved (< 2 * window + align) plus a draft round's speculative ones."""
    return 2 * comp.window + comp.align + 64


def store_spec(comp: Compressor, cfg: ModelConfig, dtype: torch.dtype, capacity: int) -> Spec:
    """Every store tensor's name -> (shape, dtype): what ``CompressedKVCache`` allocates."""
    n_layers, hkv, hq, d = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.num_attention_heads, cfg.head_dim
    c = store_capacity(comp, capacity)
    spec: Spec = {}
    if comp.quantizes:
        for p, layout in zip("kv", comp.layouts()):
            for f, (w, dt) in layout.token_fields(d).items():
                spec[f"{p}.tok.{f}"] = ((n_layers, hkv, c, w), dt)
            for f, (w, dt) in layout.group_fields(d).items():
                spec[f"{p}.grp.{f}"] = ((n_layers, hkv, -(-capacity // layout.group), w), dt)
    else:
        spec["k.tok.x"] = spec["v.tok.x"] = ((n_layers, hkv, c, d), dtype)
    if comp.evicts:
        spec["pos"] = ((n_layers, hkv, c), torch.int32)
        spec["scores"] = ((n_layers, hkv, c), torch.float32)
        spec["memory"] = ((n_layers, hkv, c), torch.float32)   # verification-guided selection's (drafting.guide)
    spec["queries"] = ((n_layers, hq, comp.window, d), dtype)
    return spec


def planned_bytes(comp: Compressor, cfg: ModelConfig, dtype: torch.dtype, capacity: int, key_codes: bool = False) -> int:
    """Bytes a compressed cache of ``capacity`` positions allocates (admission charges this); ``key_codes``:
    as ``CompressedKVCache(key_codes=True)`` allocates, its residual's and a plain store's codes too."""
    spec = store_spec(comp, cfg, dtype, capacity)
    store = sum(math.prod(shape) * dt.itemsize for shape, dt in spec.values())
    # KVzip keeps its prompt scores, fp32 [L * Hkv, prompt] (``set_prefill_scores``)
    scores = cfg.num_hidden_layers * cfg.num_key_value_heads * capacity * 4 if comp.needs_whole_prompt else 0
    residual = residual_capacity(comp)
    total = store + scores + residual * cfg.kv_bytes_per_position(dtype.itemsize)
    if key_codes:
        layers, heads, dim = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
        total += key_codes_bytes(layers, heads, residual, dim)
        if not comp.quantizes:   # a quantized store scores in fp32: no codes
            total += key_codes_bytes(layers, heads, store_capacity(comp, capacity), dim)
    return total


class CompressedKVCache(KVCache):
    """A drafter's cache: a store the compressor fills (kept or quantized tokens) and a residual of the
    latest positions. ``key_codes`` (the q8qk numerics): both keep their keys' integer-score codes, so its
    draft rows score as the verifier's rows do (a plain store's codes made again in the first call after
    it changes, not in every call)."""

    def __init__(self, compressor: Compressor, cfg: ModelConfig, device: torch.device | str,
                 dtype: torch.dtype, capacity: int = 256, key_codes: bool = False) -> None:
        self.compressor, self.cfg, self.dtype = compressor, cfg, dtype
        self.window = compressor.window
        self.layouts = compressor.layouts() if compressor.quantizes else None
        self.capacity = capacity
        spec = store_spec(compressor, cfg, dtype, capacity)
        t = {name: torch.zeros(shape, dtype=dt, device=device) for name, (shape, dt) in spec.items()}
        self.slots = EvictionSlots(t.pop("pos"), t.pop("scores"), t.pop("memory")) if compressor.evicts else None
        self.queries = t.pop("queries")                            # [L, Hq, W, D], the last W in order
        self.fields = t                                            # "k.tok.codes" -> [L, Hkv, C, w], ...
        self.count = 0                                             # tokens per KV head in the store
        self.q_seen = 0                                            # queries observed (by the last layer)
        self.state: dict[str, torch.Tensor] = {}                   # the scorer's (all layers)
        self._resident: tuple[tuple[int, ...], int] | None = None  # resident_bytes, and what it was counted over
        self.residual = FullKVCache(cfg, device, dtype, capacity=residual_capacity(compressor), key_codes=key_codes)
        # a plain store's codes, slot by slot as the store's (a quantized store scores in fp32)
        self.codes: KeyCodes | None = None
        if key_codes and self.layouts is None:
            x = self.fields["k.tok.x"]
            self.codes = new_key_codes(x.shape[0], x.shape[1], x.shape[2], x.shape[3], x.device)
        self.res_start = 0
        self.committed = 0
        self.prompt_len = 0
        self._start = 0
        self._parts = [self._layer_parts(layer) for layer in range(cfg.num_hidden_layers)]
        self._all_layers = self._layer_parts(None)
        n_l, hkv = cfg.num_hidden_layers, cfg.num_key_value_heads
        per_token = sum(x[0, 0, 0].numel() * x.element_size() for n, x in t.items() if ".tok." in n)
        self._token_bytes = n_l * hkv * (per_token + (4 if self.slots is not None else 0))
        self._group_bytes = {p: n_l * hkv * sum(x[0, 0, 0].numel() * x.element_size() for n, x in t.items()
                                                if n.startswith(f"{p}.grp.")) for p in "kv"}

    def _layer_parts(self, layer: int | None) -> tuple[StoredFields, StoredFields]:
        """Views of one layer's store, K and V: {"tok": {field: [Hkv, C, w]}, "grp": {field: [Hkv, NG, D]}}
        (layer None: every layer's, each with a leading layer dim)."""
        def part(p: str) -> StoredFields:
            out: StoredFields = {"tok": {}, "grp": {}}
            for name, x in self.fields.items():
                prefix, kind, field = name.split(".")
                if prefix == p:
                    out[kind][field] = x if layer is None else x[layer]
            return out
        return part("k"), part("v")

    # ------------------------------------------------------------------ the forward's interface
    @property
    def length(self) -> int:
        return self.res_start + self.residual.length

    @property
    def committed_length(self) -> int:
        """Positions committed so far (verified, or accepted as-is): a draft row attends to them."""
        return self.committed

    def begin(self, start: int, count: int) -> None:
        if start < self.res_start:
            raise ValueError(f"cannot write at position {start}: positions < {self.res_start} are compressed")
        self.residual.begin(start - self.res_start, count)
        self._start = start

    def observe(self, layer: int, q: torch.Tensor) -> None:
        """Remember the latest queries [Hq, T, D] of a layer (the eviction scorers' observation window)."""
        w, t = self.window, q.shape[1]
        buf = self.queries[layer]                                                      # [Hq, W, D]
        if t >= w:
            buf.copy_(q[:, -w:])
        else:
            buf[:, : w - t] = buf[:, t:].clone()
            buf[:, w - t :] = q
        if layer == self.cfg.num_hidden_layers - 1:
            self.q_seen += t

    def parts(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> list[KeyPart]:
        """Store the chunk's k, v [Hkv, T, D] (positions start..start+T-1) in the residual. The stored
        tokens precede every query (seen whole, in stored form); the residual is causal, read where it lies."""
        s, t = self._start - self.res_start, q.shape[1]
        self.residual.k[layer, :, s : s + t] = k
        self.residual.v[layer, :, s : s + t] = v
        self.observe(layer, q)
        res, codes = self.residual.codes, self.codes
        parts = [KeyPart(self.residual.k[layer], self.residual.v[layer], n=s + t, diag=s,
                         codes=None if res is None else res.layer(layer), exact=res is not None)]
        if self.count:
            kp, vp = self._parts[layer]
            if self.layouts is None:
                parts.insert(0, KeyPart(kp["tok"]["x"], vp["tok"]["x"], n=self.count,
                                        codes=None if codes is None else codes.layer(layer), exact=codes is not None))
            else:
                pos = None if self.slots is None else self.slots.pos[layer]
                parts.insert(0, KeyPart(kp, vp, n=self.count, layouts=self.layouts, pos=pos, exact=False))
        return parts

    def layered_parts(self, t: int) -> LayeredParts:
        """``parts`` for every layer at once (the native step, which also keeps the queries: ``observed``)."""
        s = self._start - self.res_start
        res = self.residual.codes
        parts = [KeyPart(self.residual.k, self.residual.v, n=s + t, diag=s, codes=res, exact=res is not None)]
        if self.count:
            kp, vp = self._all_layers
            if self.layouts is None:
                parts.insert(0, KeyPart(kp["tok"]["x"], vp["tok"]["x"], n=self.count, codes=self.codes,
                                        exact=self.codes is not None))
            else:
                pos = None if self.slots is None else self.slots.pos
                parts.insert(0, KeyPart(kp, vp, n=self.count, layouts=self.layouts, pos=pos, exact=False))
        return LayeredParts(self.residual.k, self.residual.v, s, parts, self.queries, observer=self)

    def observed(self, t: int) -> None:
        """The native step kept the last of t new queries in every layer's window (as ``observe``)."""
        self.q_seen += t

    # ------------------------------------------------------------------ commits and compression
    def load_prefill(self, full: FullKVCache, queries: list[torch.Tensor | None]) -> None:
        """Take an exact prefill made elsewhere: ``full``'s positions (into the residual, which grows
        for the while) and each layer's last queries [Hq, >=window, D] (what ``observe`` would have
        kept). ``commit`` then compresses them."""
        n = full.length
        if self.length or self.committed:
            raise ValueError("load_prefill needs an empty cache")
        held = [q for q in queries if q is not None]
        if len(held) < len(queries):
            missing = [layer for layer, q in enumerate(queries) if q is None]
            raise ValueError(f"the prefill holds no queries for layers {missing}")
        self.residual.load(full, n)
        for layer, q in enumerate(held):
            self.observe(layer, q)

    def load_stored(self, blocks: list[dict[str, torch.Tensor]], block_tokens: int) -> int:
        """Fill an empty cache's store with a prefix's leading stored blocks (``remote.forms``: each
        block's fields as this store holds them); returns the positions covered (they become committed;
        the next position written is the first after them)."""
        if self.length or self.committed:
            raise ValueError("load_stored needs an empty cache")
        if not blocks:
            return 0
        names = set(self.fields) | ({"pos"} if self.slots is not None else set())
        for b in blocks:
            if set(b) != names:
                raise ValueError(f"stored form has fields {sorted(b)}; this cache needs {sorted(names)}")
        tok = [name for name in self.fields if ".tok." in name] + (["pos"] if self.slots is not None else [])
        count = sum(b[tok[0]].shape[2] for b in blocks)
        n = len(blocks) * block_tokens
        if count > self.fields[tok[0]].shape[2] or n > self.capacity:
            raise ValueError(f"{len(blocks)} blocks ({count} stored tokens per head, {n} positions) do not fit "
                             f"this cache ({self.fields[tok[0]].shape[2]} per head, {self.capacity} positions)")
        for name in self.fields:
            x = torch.cat([b[name] for b in blocks], dim=2)
            dst = self.fields[name]
            if x.shape[:2] != dst.shape[:2] or x.shape[3:] != dst.shape[3:]:
                raise ValueError(f"stored {name} of shape {tuple(x.shape)} does not fit {tuple(dst.shape)}")
            dst[:, :, : x.shape[2]] = x.to(dst)
        if self.slots is not None:
            slots = self.slots
            slots.pos[:, :, :count] = torch.cat([b["pos"] for b in blocks], dim=2).to(slots.pos)
            slots.scores[:, :, :count] = float("inf")  # a stored form has no scores: its tokens stay
            slots.memory[:, :, :count] = NO_MEMORY
        self.count = count
        self._uncode_store(0)
        self.res_start = self.committed = self.prompt_len = n
        self.residual.truncate(0)
        return n

    def prefill_context(self) -> FullKVCache | None:
        """The exact K/V of every position so far while none is compressed yet (the residual holds them
        from position 0); None once a stored prefix was loaded (its positions are in the store only)."""
        return self.residual if self.res_start == 0 else None

    def set_prefill_scores(self, scores: dict[int, torch.Tensor] | None, prompt_len: int) -> None:
        """KVzip's per-layer [Hkv, P] prompt scores, kept as one [L * Hkv, P] tensor."""
        self.prompt_len = prompt_len
        if scores:
            self.state["prefill_scores"] = torch.cat([scores[i] for i in range(len(scores))])

    def commit(self, upto: int, source: FullKVCache | None = None) -> None:
        """Positions < upto are final; later (speculative) positions are dropped.

        With ``source`` (a full cache holding every position < upto), committed K/V come from
        there, so the drafter keeps tracking the full model rather than its own approximation.
        """
        if upto < self.committed:
            raise ValueError(f"cannot commit up to {upto}: already committed {self.committed}")
        if upto > self.capacity:
            raise ValueError(f"cannot commit up to {upto}: the cache is sized for {self.capacity} positions")
        rs, old = self.res_start, self.committed
        if source is None and upto - rs > self.residual.length:
            raise ValueError(f"cannot commit up to {upto}: only {self.length} positions written")
        self.committed = upto
        n = self._movable(upto)
        src_k, src_v = (source.k, source.v) if source is not None else (self.residual.k, self.residual.v)
        if n:  # positions rs..rs+n leave the residual
            off = rs if source is not None else 0
            self._move(src_k[:, :, off : off + n], src_v[:, :, off : off + n], upto)
        self.res_start = rs + n
        keep = upto - self.res_start
        if source is not None:  # committed positions not yet in the residual come from the source
            first = self.res_start if n else old
            self._place(source.k, source.v, first, first - self.res_start, upto - first)
        elif n:  # shift the residual left by n
            self._place(self.residual.k, self.residual.v, n, 0, keep)
        self.residual.truncate(keep)

    def commit_exact(self, start: int, k: torch.Tensor, v: torch.Tensor, upto: int) -> None:
        """Positions start..upto-1 get exact K/V made elsewhere (a remote verifier's: k, v [L, Hkv,
        >= upto - start, D]) in place of the drafter's own, then ``commit(upto)``."""
        n = upto - start
        self.begin(start, n)
        s = start - self.res_start
        self.residual.k[:, :, s : s + n] = k[:, :, :n].to(self.residual.k)
        self.residual.v[:, :, s : s + n] = v[:, :, :n].to(self.residual.v)
        self.commit(upto)

    def _movable(self, upto: int) -> int:
        """Tokens to move now: whole ``align`` groups, once at least ``window`` are past the window."""
        movable = upto - self.window - self.res_start
        n = movable // self.compressor.align * self.compressor.align
        return n if movable >= self.window else 0

    def _place(self, k: torch.Tensor, v: torch.Tensor, src: int, dst: int, n: int) -> None:
        """Residual slots dst..dst+n := k/v[:, :, src..src+n] (shrinking a prefill-sized residual)."""
        res, cap = self.residual, residual_capacity(self.compressor)
        if res.capacity > cap and dst + n <= cap:
            res = FullKVCache(self.cfg, res.k.device, self.dtype, capacity=cap, key_codes=res.codes is not None)
            res.begin(0, dst)
            res.k[:, :, :dst] = self.residual.k[:, :, :dst]
            res.v[:, :, :dst] = self.residual.v[:, :, :dst]
        res.begin(dst, n)
        res.k[:, :, dst : dst + n] = k[:, :, src : src + n].clone() if k is res.k else k[:, :, src : src + n]
        res.v[:, :, dst : dst + n] = v[:, :, src : src + n].clone() if v is res.v else v[:, :, src : src + n]
        self.residual = res

    def _move(self, k: torch.Tensor, v: torch.Tensor, committed: int) -> None:
        """Store positions res_start..res_start+n. k, v: [L, Hkv, n, D]."""
        comp, rs, c = self.compressor, self.res_start, self.count
        n = k.shape[2]
        new = {"k.tok.x": k, "v.tok.x": v}
        if self.layouts is not None:
            new = {}
            for p, layout, x in zip("kv", self.layouts, (k, v)):
                tok, grp = layout.encode(x)
                new |= {f"{p}.tok.{f}": y for f, y in tok.items()}
                for f, y in grp.items():  # whole position groups: rs and n are multiples of the group
                    self.fields[f"{p}.grp.{f}"][:, :, rs // layout.group : (rs + n) // layout.group] = y
        if self.slots is None:
            for name, y in new.items():
                self.fields[name][:, :, c : c + n] = y
            self.count = c + n
            self._uncode_store(c)
            return
        # eviction: the kept tokens (their carried scores) and the entering ones compete for the budget
        n_l, hkv = k.shape[:2]
        positions = torch.arange(rs, rs + n, device=k.device, dtype=torch.int32).expand(n_l, hkv, n)
        scores = self._candidate_scores(k, positions, self.slots)                       # [L*Hkv, c+n]
        budget = max(store_capacity(comp, committed) - (committed - rs - n), 0)
        entering = new | {"pos": positions, "scores": scores[:, c:].view(n_l, hkv, n),
                          "memory": torch.full((n_l, hkv, n), NO_MEMORY, device=k.device)}
        self._keep_top(scores, min(budget, c + n), entering, self.slots)

    def _candidate_scores(self, k: torch.Tensor, positions: torch.Tensor, slots: EvictionSlots) -> torch.Tensor:
        """[L*Hkv, count + n]: the kept tokens' scores, then the n entering ones' (k: [L, Hkv, n, D]).
        Only the entering tokens are scored, unless the method re-scores what it keeps (H2O)."""
        comp, c = self.compressor, self.count
        w = min(self.q_seen, self.window)
        queries = self.queries[:, :, self.window - w :].flatten(0, 1)                  # [L*Hq, w, D]
        carried = slots.scores[:, :, :c].flatten(0, 1)                                  # [L*Hkv, c]
        if comp.rescores_kept:
            keys = torch.cat([self._stored_keys(), k.float()], dim=2)                   # [L, Hkv, c+n, D]
            pos = torch.cat([slots.pos[:, :, :c], positions], dim=2)
            scores = comp.score(ScoreInputs(keys.flatten(0, 1), pos.flatten(0, 1).long(), queries,
                                            self.state, self.prompt_len, carried))
            carried.copy_(scores[:, :c])
            return scores
        # the entering keys as the cache holds them: the scorer widens a head at a time (fp32 copies of a
        # 32K prompt's keys at once were 0.4 GB for the 0.5B code model)
        new = comp.score(ScoreInputs(k.flatten(0, 1), positions.flatten(0, 1).long(), queries,
                                     self.state, self.prompt_len))
        return torch.cat([carried, new], dim=1)

    def _keep_top(self, scores: torch.Tensor, b: int, entering: dict[str, torch.Tensor], slots: EvictionSlots) -> None:
        """Keep the b best of the candidates ([H, c+n] scores: store slots 0..c-1, then the entering
        tokens) in slots 0..b-1. Tokens already in those slots stay put; every other kept one (an
        entering token, or a stored one beyond b when the budget shrinks) fills a hole left by an
        evicted one, so the writes are O(tokens moved). ``entering``: name -> [L, Hkv, n, ...]."""
        h, s = scores.shape
        c = self.count
        idx = torch.arange(s, device=scores.device)
        kept = torch.zeros(h, s, dtype=torch.bool, device=scores.device)
        kept.scatter_(1, scores.topk(b, dim=1).indices, True)
        stay = kept & (idx < min(b, c))
        # per head, as many movers as holes (b - stayers each); nonzero lists them head by head in order
        mover_h, mover_j = (kept & ~stay).nonzero(as_tuple=True)
        hole_h, hole_j = ((idx < b) & ~stay).nonzero(as_tuple=True)
        stored, slot_fields = mover_j < c, slots.by_name()
        for name, y in entering.items():
            store = (slot_fields[name] if name in slot_fields else self.fields[name]).flatten(0, 1)   # [H, C, ...]
            y = y.flatten(0, 1)                                                           # [H, n, ...]
            vals = torch.empty((len(mover_h), *store.shape[2:]), dtype=store.dtype, device=store.device)
            vals[stored] = store[mover_h[stored], mover_j[stored]]
            vals[~stored] = y[mover_h[~stored], mover_j[~stored] - c].to(store.dtype)
            store[hole_h, hole_j] = vals
        self._uncode_slots(hole_h // self.cfg.num_key_value_heads, hole_j)
        self.count = b

    def kept(self) -> KeptTokens | None:
        """An evicting store's bookkeeping (``KeptTokens``), for verification-guided selection; None for a
        store that keeps every token."""
        slots = self.slots
        return None if slots is None else KeptTokens(slots.pos, slots.scores, slots.memory, self.count, self.res_start)

    def trade_in_one_call(self, op: Callable[..., torch.Tensor], args: tuple[object, ...],
                          full: FullKVCache) -> int | None:
        """Trades chosen and made by one native call (``kernels/guide_select.cpp``'s ``guide_trade``: ``op``
        over ``args``, then the full cache's K, V and this store's K, V [L, Hkv, *, D]), each incoming
        token's rows copied from ``full`` as ``trade`` would store them: the trades made, or None where
        this store does not hold plain rows of the full cache's element type (quantized: ``trade``)."""
        if self.slots is None or self.layouts is not None:
            return None
        k, v = self.fields["k.tok.x"], self.fields["v.tok.x"]
        if not all(x.dtype == full.k.dtype and x.is_contiguous() for x in (k, v, full.k, full.v)):
            return None
        trades = op(*args, full.k, full.v, k, v)          # int64 [T, 4]: layer, head, slot, position
        self._uncode_slots(trades[:, 0], trades[:, 2])
        return len(trades)

    def _uncode_store(self, slot: int) -> None:
        """Store slots from ``slot`` on were rewritten: their codes no longer hold (the op codes them again)."""
        if self.codes is not None:
            self.codes.coded.clamp_(max=slot)

    def _uncode_slots(self, layers: torch.Tensor, slots: torch.Tensor) -> None:
        """Store slots ``slots`` of layers ``layers`` (int64 [T] each) were rewritten: each layer's codes hold
        below its first rewritten slot (a layer with none keeps them all; a verification's trades touch a
        few slots a layer, not the whole store)."""
        if self.codes is not None and len(slots):
            coded = self.codes.coded
            first = torch.full_like(coded, torch.iinfo(torch.int64).max)
            first.scatter_reduce_(0, layers.to(coded.device, torch.int64), slots.to(coded.device, torch.int64),
                                  reduce="amin")
            torch.minimum(coded, first, out=coded)

    def trade(self, trades: torch.Tensor, full: FullKVCache) -> None:
        """Store slots take other tokens: ``trades`` int64 [T, 4] rows (layer, head, slot < count, position <
        res_start); each incoming token's exact K/V come from ``full``, stored as the store holds tokens
        (quantized codes; KIVI keys with their position group's tables), and it carries the larger of its
        slot's old score and the head's median, so the method's own moves do not evict it at once. The
        count does not change (verification-guided selection, ``drafting.guide``)."""
        slots = self.slots
        if slots is None:
            raise ValueError("trades need an evicting store; this one keeps every token")
        li, hi, si, positions = trades.to(slots.pos.device).unbind(1)
        if len(si) and (int(si.max()) >= self.count or int(positions.max()) >= self.res_start):
            raise ValueError(f"a trade needs slots < {self.count} and positions < {self.res_start}, got slot "
                             f"{int(si.max())}, position {int(positions.max())}")
        k, v = full.rows(li, hi, positions)
        new = {"k.tok.x": k, "v.tok.x": v}
        if self.layouts is not None:
            new = {}
            for p, layout, x in zip("kv", self.layouts, (k, v)):
                grp = {name.split(".")[2]: t[li, hi, positions // layout.group]
                       for name, t in self.fields.items() if name.startswith(f"{p}.grp.")}
                new |= {f"{p}.tok.{f}": y for f, y in layout.encode_tokens(x, grp, positions).items()}
        kept_scores = slots.scores[:, :, : self.count]
        scores = torch.maximum(kept_scores[li, hi, si], kept_scores.median(dim=2).values[li, hi])
        for name, y in new.items():
            self.fields[name][li, hi, si] = y.to(self.fields[name].dtype)
        self._uncode_slots(li, si)
        slots.pos[li, hi, si] = positions.to(torch.int32)
        slots.scores[li, hi, si] = scores

    def _stored_keys(self) -> torch.Tensor:
        """The store's keys in fp32: [L, Hkv, count, D] (dequantized for scoring)."""
        c = self.count
        if self.layouts is None:
            return self.fields["k.tok.x"][:, :, :c].float()
        tok = {name.split(".")[2]: x[:, :, :c] for name, x in self.fields.items() if name.startswith("k.tok.")}
        grp = {name.split(".")[2]: x for name, x in self.fields.items() if name.startswith("k.grp.")}
        pos = None if self.slots is None else self.slots.pos[:, :, :c]
        return self.layouts[0].decode(tok, grp, self.cfg.head_dim, pos)

    def dequantized(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The store of one layer as fp32 K, V [Hkv, count, D] (tests, inspection)."""
        kp, vp = self._parts[layer]
        if self.layouts is None:
            return kp["tok"]["x"][:, : self.count].float(), vp["tok"]["x"][:, : self.count].float()
        pos = None if self.slots is None else self.slots.pos[layer, :, : self.count]
        k, v = (layout.decode({f: x[:, : self.count] for f, x in part["tok"].items()}, part["grp"], self.cfg.head_dim,
                              pos) for layout, part in zip(self.layouts, (kp, vp)))
        return k, v

    # ------------------------------------------------------------------ accounting
    def nbytes(self) -> int:
        """Bytes a draft step reads: the stored tokens' codes and scales, the position groups in use
        (KIVI keys) and the residual's valid positions."""
        total = self.count * self._token_bytes + self.residual.nbytes()
        for layout, p in zip(self.layouts or (), "kv"):  # group bytes are 0 for layouts without groups
            total += -(-self.res_start // layout.group) * self._group_bytes[p]
        return total

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the cache holds."""
        state = [x for x in self.state.values() if isinstance(x, torch.Tensor)]
        evict = [] if self.slots is None else list(self.slots.by_name().values())
        codes = [] if self.codes is None else list(self.codes.arrays())
        return [*self.fields.values(), self.queries, *self.residual.tensors(), *state, *evict, *codes]

    def resident_bytes(self) -> int:
        """Bytes of every storage the cache holds, each counted once (allocated, not only used). Its
        storages are allocated up front, so this is counted again only when the residual (or its
        storage) or the scorer's state is replaced (every step's charge asks: walking its ~25 storages
        took 0.1 ms a request a step)."""
        key = (id(self.residual), id(self.residual.k), *map(id, self.state.values()))
        if self._resident is None or self._resident[0] != key:
            self._resident = (key, storage_bytes(self.tensors()))
        return self._resident[1]

    def full_nbytes(self) -> int:
        """What a full cache of the same positions would hold, in the same dtype."""
        return self.length * self.residual.nbytes_per_position()

    def attention_cost(self, start: int, t: int) -> tuple[int, int]:
        """(bytes read, query-key pairs per query head and layer) of ``t`` queries at ``start``: the
        whole store for each, the residual causally (as ``FullKVCache.attention_cost``)."""
        res_bytes, res_pairs = self.residual.attention_cost(start - self.res_start, t)
        return self.nbytes() - self.residual.nbytes() + res_bytes, t * self.count + res_pairs

    def kept_tokens(self) -> int:
        """Tokens visible to each KV head (store + residual)."""
        return self.count + self.residual.length
