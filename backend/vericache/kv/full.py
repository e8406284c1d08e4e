"""The full (uncompressed) KV cache of one sequence.

Position-indexed, like gpt-fast's static cache: the K/V of position p lives in
slot p. Rolling back after a rejected draft is just ``begin`` at an earlier
position: the stale slots beyond it are never attended to and are overwritten
by the next write. Capacity grows by doubling, so a request pays for what it
uses rather than for max_tokens up front.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vericache.config import ModelConfig


def attend_dense(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
                 key_positions: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of a query chunk over dense keys.

    q: [Hq, T, D] at positions start..start+T-1; keys, values: [Hkv, S, D].
    Key j sits at position ``key_positions[j]`` (default: j). Returns [Hq, T, D].
    """
    t, s = q.shape[1], keys.shape[1]
    if key_positions is None and t == 1:
        mask = None  # one query at the newest position sees every key
    else:
        kpos = key_positions if key_positions is not None else torch.arange(s, device=q.device)
        qpos = torch.arange(start, start + t, device=q.device)
        mask = kpos[None, :] <= qpos[:, None]                                  # [T, S]
    # 4-D inputs reach the fused CPU/GPU kernels (3-D ones fall back to the slow math path, ~10x
    # slower here); enable_gqa shares each KV head across its query group without copying K/V.
    out = F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=mask,
                                         enable_gqa=q.shape[0] != keys.shape[0])
    return out[0]


class FullKVCache:
    """Dense K/V of one sequence: k, v: [L, Hkv, capacity, D]; ``layers`` < L holds only that many
    (a device-resident slice, or a buffer for the layers that cross the link)."""

    def __init__(self, cfg: ModelConfig, device: torch.device | str, dtype: torch.dtype,
                 capacity: int = 256, layers: int | None = None) -> None:
        self.cfg = cfg
        n_layers = cfg.num_hidden_layers if layers is None else layers
        if not 0 <= n_layers <= cfg.num_hidden_layers:
            raise ValueError(f"layers must be in [0, {cfg.num_hidden_layers}], got {layers}")
        shape = (n_layers, cfg.num_key_value_heads, max(capacity, 1), cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.length = 0   # valid positions: 0..length-1
        self._start = 0   # where the current forward writes

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def nbytes_per_position(self) -> int:
        layers, heads, _, dim = self.k.shape
        return 2 * layers * heads * dim * self.k.element_size()  # K and V

    def nbytes(self) -> int:
        """Bytes held for valid positions (what a transfer of this KV would move)."""
        return self.length * self.nbytes_per_position()

    def _grow(self, needed: int) -> None:
        new_cap = max(needed, 2 * self.capacity)
        for name in ("k", "v"):
            old = getattr(self, name)
            new = old.new_zeros(old.shape[0], old.shape[1], new_cap, old.shape[3])
            new[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, new)

    def begin(self, start: int, count: int) -> None:
        if start > self.length:
            raise ValueError(f"cannot write at position {start}: cache holds only {self.length} positions")
        if start + count > self.capacity:
            self._grow(start + count)
        self._start = start
        self.length = start + count

    def truncate(self, length: int) -> None:
        """Drop positions >= length (rollback past rejected draft tokens)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate to {length}: cache holds {self.length} positions")
        self.length = length

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [Hq, T, D]; k, v: [Hkv, T, D]
        s, t = self._start, q.shape[1]
        self.k[layer, :, s : s + t] = k
        self.v[layer, :, s : s + t] = v
        return attend_dense(q, self.k[layer, :, : s + t], self.v[layer, :, : s + t], s)
