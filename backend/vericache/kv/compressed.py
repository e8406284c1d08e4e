"""The compressed KV cache of one sequence: what the drafter (and lossy mode) attends over.

Layout per layer:
- a *store* of compressed tokens: dequantised K/V [Hkv, K, D] (what attention reads), their
  positions [Hkv, K] (each KV head keeps its own token set under eviction), and the rows the
  compressor produced (codes, scales: what ``nbytes`` counts);
- a *residual* of the most recent tokens in full precision, positions res_start.. (shared by heads).

Tokens move from the residual to the store in batches, and only once they are *committed*
(verified by the full model, or accepted as-is in lossy mode), so speculative draft tokens can
always be rolled back. Eviction re-scores at every move, so the kept budget tracks
``ratio`` x tokens seen as the sequence grows.
"""

from __future__ import annotations

import torch

from vericache.compress.base import Compressor, ScoreInputs
from vericache.config import ModelConfig
from vericache.kv.attention import attend_all, chunk_parts, merge
from vericache.kv.full import FullKVCache


class CompressedKVCache:
    def __init__(self, compressor: Compressor, cfg: ModelConfig, device: torch.device | str,
                 dtype: torch.dtype, capacity: int = 256) -> None:
        self.compressor = compressor
        self.cfg = cfg
        n_layers, hkv, d = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
        self.window = compressor.window
        empty = torch.zeros(hkv, 0, d, device=device, dtype=dtype)
        self.store_k = [empty] * n_layers
        self.store_v = [empty] * n_layers
        self.store_pos = [torch.zeros(hkv, 0, dtype=torch.long, device=device)] * n_layers
        self.store_rows: list[dict[str, torch.Tensor]] = [{} for _ in range(n_layers)]
        self.state: list[dict] = [{} for _ in range(n_layers)]
        self.queries: list[torch.Tensor | None] = [None] * n_layers      # [Hq, <=window, D]
        # the residual is a FullKVCache whose slot i holds position res_start + i
        self.residual = FullKVCache(cfg, device, dtype, capacity=max(capacity, 2 * self.window + 64))
        self.res_start = 0
        self.committed = 0
        self.prompt_len = 0
        self._start = 0
        self._store_bytes = 0  # recomputed when the store changes, not on every step

    # ------------------------------------------------------------------ the forward's interface
    @property
    def length(self) -> int:
        return self.res_start + self.residual.length

    def begin(self, start: int, count: int) -> None:
        if start < self.res_start:
            raise ValueError(f"cannot write at position {start}: positions < {self.res_start} are compressed")
        self.residual.begin(start - self.res_start, count)
        self._start = start

    def observe(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V and remember the queries without attending (prefill alongside a full cache)."""
        s, t = self._start - self.res_start, q.shape[1]
        self.residual.k[layer, :, s : s + t] = k
        self.residual.v[layer, :, s : s + t] = v
        prev = self.queries[layer]
        recent = q if prev is None else torch.cat([prev, q], dim=1)
        self.queries[layer] = recent[:, -self.window :].clone()

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [Hq, T, D]; k, v: [Hkv, T, D] at positions start..start+T-1
        self.observe(layer, q, k, v)
        # the stored tokens precede every query (unmasked); the residual is read where it lies
        parts = chunk_parts(q, self.residual.k[layer], self.residual.v[layer], self._start - self.res_start)
        if self.store_k[layer].shape[1]:
            parts.insert(0, attend_all(q, self.store_k[layer], self.store_v[layer]))
        return merge(parts)

    # ------------------------------------------------------------------ commits and compression
    def load_prefill(self, full: FullKVCache, queries: list[torch.Tensor]) -> None:
        """Take an exact prefill made elsewhere: the K/V of ``full``'s positions and each layer's last
        queries [Hq, >=window, D] (what ``observe`` would have kept during that prefill)."""
        n = full.length
        if self.length or n > self.residual.capacity:
            raise ValueError(f"load_prefill needs an empty cache with room for {n} positions")
        self.residual.begin(0, n)
        self.residual.k[:, :, :n] = full.k[:, :, :n]
        self.residual.v[:, :, :n] = full.v[:, :, :n]
        self.queries = [q[:, -self.window :].clone() for q in queries]

    def set_prefill_scores(self, scores: dict[int, torch.Tensor] | None, prompt_len: int) -> None:
        self.prompt_len = prompt_len
        for layer, s in (scores or {}).items():
            self.state[layer]["prefill_scores"] = s

    def commit(self, upto: int, source: FullKVCache | None = None) -> None:
        """Positions < upto are final; later (speculative) positions are dropped.

        With ``source``, the K/V of newly committed positions are copied from the full cache,
        so the drafter keeps tracking the full model rather than its own approximation.
        """
        if upto < self.committed:
            raise ValueError(f"cannot commit up to {upto}: already committed {self.committed}")
        lo, hi = self.committed - self.res_start, upto - self.res_start
        if source is not None:
            self.residual.begin(lo, hi - lo)
            self.residual.k[:, :, lo:hi] = source.k[:, :, self.committed : upto]
            self.residual.v[:, :, lo:hi] = source.v[:, :, self.committed : upto]
        elif hi > self.residual.length:
            raise ValueError(f"cannot commit up to {upto}: only {self.length} positions written")
        self.residual.truncate(hi)
        self.committed = upto
        self._maybe_compress()

    def _maybe_compress(self) -> None:
        movable = self.committed - self.window - self.res_start
        if movable < self.window:  # move in batches of at least `window` tokens
            return
        n, res_len = movable, self.residual.length
        for layer in range(self.cfg.num_hidden_layers):
            k = self.residual.k[layer, :, :n]
            v = self.residual.v[layer, :, :n]
            rows, k_hat, v_hat = self.compressor.encode(k.clone(), v.clone())
            pos = torch.arange(self.res_start, self.res_start + n, device=k.device).expand(k.shape[0], n)
            self.store_k[layer] = torch.cat([self.store_k[layer], k_hat], dim=1)
            self.store_v[layer] = torch.cat([self.store_v[layer], v_hat], dim=1)
            self.store_pos[layer] = torch.cat([self.store_pos[layer], pos], dim=1)
            old = self.store_rows[layer]
            self.store_rows[layer] = {name: torch.cat([old[name], r], dim=1) if name in old else r
                                      for name, r in rows.items()}
        # shift the residual left by n (clone: source and destination overlap)
        self.residual.k[:, :, : res_len - n] = self.residual.k[:, :, n:res_len].clone()
        self.residual.v[:, :, : res_len - n] = self.residual.v[:, :, n:res_len].clone()
        self.residual.truncate(res_len - n)
        self.res_start += n
        if self.compressor.evicts:
            self._evict()
        self._store_bytes = self._count_store_bytes()

    def _evict(self) -> None:
        in_residual = self.committed - self.res_start
        budget = max(self.compressor.keep_budget(self.committed) - in_residual, 0)
        for layer in range(self.cfg.num_hidden_layers):
            queries = self.queries[layer]
            scores = self.compressor.score(ScoreInputs(layer, self.store_k[layer], self.store_pos[layer],
                                                       queries, self.state[layer], self.prompt_len))
            if self.store_k[layer].shape[1] <= budget:
                continue
            keep = scores.topk(budget, dim=1).indices.sort(dim=1).values                  # [Hkv, budget]
            self._gather(layer, keep)

    def _gather(self, layer: int, keep: torch.Tensor) -> None:
        def g(x: torch.Tensor) -> torch.Tensor:
            idx = keep.view(*keep.shape, *([1] * (x.dim() - 2))).expand(*keep.shape, *x.shape[2:])
            return x.gather(1, idx)

        self.store_k[layer], self.store_v[layer] = g(self.store_k[layer]), g(self.store_v[layer])
        self.store_pos[layer] = self.store_pos[layer].gather(1, keep)
        self.store_rows[layer] = {name: g(r) for name, r in self.store_rows[layer].items()}
        st = self.state[layer]
        for name in [n for n in st if n.startswith("row:")]:
            st[name] = st[name].gather(1, keep)

    # ------------------------------------------------------------------ accounting
    def _count_store_bytes(self) -> int:
        total = 0.0
        for rows in self.store_rows:
            for name, r in rows.items():
                total += r.sum().item() if name.endswith("_bytes") else r.numel() * r.element_size()
        return int(total)

    def nbytes(self) -> int:
        """Bytes held: the compressor's rows (codes, scales) plus the full-precision residual."""
        return self._store_bytes + self.residual.nbytes()

    def full_nbytes(self) -> int:
        """What a full cache of the same positions would hold, in the same dtype."""
        return self.length * self.residual.nbytes_per_position()

    def kept_tokens(self) -> int:
        """Tokens visible to the first KV head of layer 0 (store + residual)."""
        return self.store_k[0].shape[1] + self.residual.length
