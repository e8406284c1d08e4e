"""The full (uncompressed) KV cache of one sequence.

Position-indexed, like gpt-fast's static cache: the K/V of position p lives in
slot p. Rolling back after a rejected draft is just ``begin`` at an earlier
position: the stale slots beyond it are never attended to and are overwritten
by the next write. Capacity grows by doubling, so a request pays for what it
uses rather than for max_tokens up front.
"""

from __future__ import annotations

import torch

from vericache.config import ModelConfig
from vericache.kv.packed import KeyCodes, KeyPart, LayeredParts, key_codes_bytes, new_key_codes
from vericache.kv.protocol import KVCache


class FullKVCache(KVCache):
    """Dense K/V of one sequence: k, v: [L, Hkv, capacity, D]; ``layers`` < L holds only that many
    (a device-resident slice, or a buffer for the layers that cross the link). ``key_codes``: also keep
    its keys' integer-score codes for the q8qk numerics (``KeyCodes``: each key coded once, not every step;
    a dense copy of the codes' source stays the cache's K)."""

    codes: KeyCodes | None = None   # (a class default: a cache pickled before codes existed has none)

    def __init__(self, cfg: ModelConfig, device: torch.device | str, dtype: torch.dtype,
                 capacity: int = 256, layers: int | None = None, key_codes: bool = False) -> None:
        self.cfg = cfg
        n_layers = cfg.num_hidden_layers if layers is None else layers
        if not 0 <= n_layers <= cfg.num_hidden_layers:
            raise ValueError(f"layers must be in [0, {cfg.num_hidden_layers}], got {layers}")
        shape = (n_layers, cfg.num_key_value_heads, max(capacity, 1), cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.codes = self._new_codes(shape[2]) if key_codes else None
        self.length = 0   # valid positions: 0..length-1
        self._start = 0   # where the current forward writes

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    @property
    def layers(self) -> int:
        return self.k.shape[0]

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    def pin(self) -> None:
        """Move K/V to pinned host memory (a host-tier cache: the link then copies asynchronously)."""
        self.k, self.v = self.k.pin_memory(), self.v.pin_memory()

    def fill_random(self) -> None:
        """Every slot's K/V drawn from N(0, 1): scratch caches for timing (a forward's time does not
        depend on the values, but NaN-free inputs keep every kernel on its usual path)."""
        self.k.normal_()
        self.v.normal_()
        self._uncode_from(0)

    def tensors(self) -> list[torch.Tensor]:
        """Every storage it holds: K, V and any q8qk codes (``resident_bytes``)."""
        return [self.k, self.v, *(self.codes.arrays() if self.codes is not None else ())]

    def resident_bytes(self) -> int:
        """Bytes of every storage it holds, each counted once (allocated, not only valid positions)."""
        return storage_bytes(self.tensors())

    def nbytes_per_position(self) -> int:
        layers, heads, _, dim = self.k.shape
        return 2 * layers * heads * dim * self.k.element_size()  # K and V

    def nbytes(self) -> int:
        """Bytes held for valid positions (what a transfer of this KV would move)."""
        return self.length * self.nbytes_per_position()

    def held_bytes(self) -> int:
        """Bytes its valid positions hold (what a memory tier charges): K and V (``nbytes``) and, where it
        keeps them (q8qk), their keys' codes."""
        if self.codes is None:
            return self.nbytes()
        layers, heads, _, dim = self.k.shape
        return self.nbytes() + key_codes_bytes(layers, heads, self.length, dim)

    def attention_cost(self, start: int, t: int) -> tuple[int, int]:
        """What ``t`` queries written at ``start`` cost the attention: (K/V bytes read over all layers,
        query-key pairs per query head and layer). Query i sees positions 0..start+i."""
        return (start + t) * self.nbytes_per_position(), t * start + t * (t + 1) // 2

    def _new_codes(self, capacity: int) -> KeyCodes:
        """Empty key codes for ``capacity`` positions (whole blocks) of every layer held."""
        layers, heads, _, dim = self.k.shape
        return new_key_codes(layers, heads, capacity, dim, self.k.device)

    def _uncode_from(self, position: int) -> None:
        """Keys from ``position`` on are rewritten: their codes no longer hold (the op codes them again)."""
        if self.codes is not None:
            self.codes.coded.clamp_(max=position)

    def _grow(self, needed: int) -> None:
        new_cap = max(needed, 2 * self.capacity)
        for name in ("k", "v"):
            old = getattr(self, name)
            new = old.new_zeros(old.shape[0], old.shape[1], new_cap, old.shape[3])
            new[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, new)
        if self.codes is not None:   # a position's codes lie at the same offsets in any capacity
            old_codes, self.codes = self.codes, self._new_codes(new_cap)
            for new_t, old_t in zip(self.codes.arrays(), old_codes.arrays()):
                new_t[:, :, : old_t.shape[2]] = old_t
            self.codes.coded.copy_(old_codes.coded)

    def begin(self, start: int, count: int) -> None:
        if start > self.length:
            raise ValueError(f"cannot write at position {start}: cache holds only {self.length} positions")
        if start + count > self.capacity:
            self._grow(start + count)
        self._uncode_from(start)
        self._start = start
        self.length = start + count

    def load(self, src: FullKVCache, n: int) -> None:
        """Hold src's positions 0..n-1 (of as many layers as this cache has: its first ones) and
        nothing after them."""
        layers = self.k.shape[0]
        self.begin(0, n)
        self.k[:, :, :n].copy_(src.k[:layers, :, :n])
        self.v[:, :, :n].copy_(src.v[:layers, :, :n])
        if self.codes is not None and src.codes is not None:   # src's codes hold for its keys copied here
            for mine, theirs in zip(self.codes.arrays(), src.codes.arrays()):
                width = min(mine.shape[2], theirs.shape[2])
                mine[:, :, :width] = theirs[:layers, :, :width]
            self.codes.coded.copy_(src.codes.coded[:layers].clamp(max=n))

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k, v [L, Hkv, t, D] (a stored block: every layer) at positions length .. length+t-1."""
        if k.shape != v.shape or k.shape[:2] != self.k.shape[:2] or k.shape[3] != self.k.shape[3]:
            raise ValueError(f"K/V of shapes {tuple(k.shape)}, {tuple(v.shape)} do not fit a cache of "
                             f"(L, Hkv, D) = {(self.k.shape[0], self.k.shape[1], self.k.shape[3])}")
        s, t = self.length, k.shape[2]
        self.begin(s, t)
        self.k[:, :, s : s + t] = k
        self.v[:, :, s : s + t] = v

    def overwrite(self, src: FullKVCache, start: int, end: int, first_layer: int = 0) -> None:
        """Positions start .. end-1 of layers first_layer .. first_layer + (src's layers) - 1, from
        ``src``, which holds just those layers (a device buffer of the streamed layers, the resident ones)."""
        n = src.k.shape[0]
        if end > self.length or first_layer + n > self.k.shape[0]:
            raise ValueError(f"cannot overwrite positions {start}..{end - 1} of layers {first_layer}.."
                             f"{first_layer + n - 1}: the cache holds {self.length} positions, {self.k.shape[0]} layers")
        self.k[first_layer : first_layer + n, :, start:end] = src.k[:, :, start:end]
        self.v[first_layer : first_layer + n, :, start:end] = src.v[:, :, start:end]
        self._uncode_from(start)

    def views(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [L, Hkv, end - start, D] of positions start .. end-1, as views: for reading (encoders,
        stores); a write through them bypasses the cache."""
        if not 0 <= start <= end <= self.length:
            raise ValueError(f"cannot view positions {start}..{end - 1}: the cache holds {self.length}")
        return self.k[:, :, start:end], self.v[:, :, start:end]

    def rows(self, layers: torch.Tensor, heads: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [n, D] of n (layer, head, position) triples (three [n] index tensors), as new tensors."""
        if len(positions) and int(positions.max()) >= self.length:
            raise ValueError(f"position {int(positions.max())} is not held: the cache holds {self.length}")
        # one flat index into [L * Hkv * capacity, D] rows: index_select is ~5x faster than three-index gathers
        rows = (layers * self.k.shape[1] + heads) * self.k.shape[2] + positions
        return self.k.view(-1, self.k.shape[-1]).index_select(0, rows), self.v.view(-1, self.v.shape[-1]).index_select(0, rows)

    def layer_views(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [Hkv, end, D] of one layer's positions 0 .. end-1, as views (for reading)."""
        return self.k[layer, :, :end], self.v[layer, :, :end]

    def copy_out(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [L, Hkv, end - start, D] of positions start .. end-1, as new tensors."""
        return self.k[:, :, start:end].clone(), self.v[:, :, start:end].clone()

    def byte_views(self, start: int, t: int) -> list[memoryview]:
        """Writable views of positions start .. start+t-1 (already ``begin``-ed; a CPU cache) as
        K's rows then V's, each layer's heads in order: the byte order of a packed [L, Hkv, t, D]
        K then V, so a block can be received from a socket straight into place."""
        if self.k.device.type != "cpu" or start + t > self.length:
            raise ValueError(f"byte views need a CPU cache holding positions {start}..{start + t - 1}")
        return [x[layer, head, start : start + t].view(torch.uint8).numpy().data.cast("B")
                for x in (self.k, self.v) for layer in range(x.shape[0]) for head in range(x.shape[1])]

    def truncate(self, length: int) -> None:
        """Drop positions >= length (rollback past rejected draft tokens)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate to {length}: cache holds {self.length} positions")
        if length == self.length:   # nothing rejected (a plain full step): codes hold only positions < length
            return
        self.length = length
        self._uncode_from(length)

    def parts(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> list[KeyPart]:
        """Store the chunk's k, v [Hkv, T, D]; its queries see positions 0..start+i (one causal part)."""
        s, t = self._start, q.shape[1]
        self.k[layer, :, s : s + t] = k
        self.v[layer, :, s : s + t] = v
        codes = None if self.codes is None else self.codes.layer(layer)
        return [KeyPart(self.k[layer], self.v[layer], n=s + t, diag=s, codes=codes)]

    def load_blocks(self, blocks: list[dict[str, torch.Tensor]]) -> int:
        """Blocks of K/V ({"k", "v": [L, Hkv, t, D]}, a stored prefix's full form) written at positions 0..
        of this empty cache; returns the positions written."""
        if self.length:
            raise ValueError(f"load_blocks needs an empty cache; it holds {self.length} positions")
        for b in blocks:
            self.append(b["k"], b["v"])
        return self.length

    def layered_parts(self, t: int) -> LayeredParts:
        """``parts`` for every layer at once (the native step): the chunk of t at the forward's start."""
        s = self._start
        return LayeredParts(self.k, self.v, s, [KeyPart(self.k, self.v, n=s + t, diag=s, codes=self.codes)])


def storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one storage count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())
