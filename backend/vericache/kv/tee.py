"""Prefill once, fill two caches: attention runs over the full cache (exact); the compressed
cache only records the queries (its scorers' observation window) and takes the prompt's K/V from
the full cache when the prefill is committed (``CompressedKVCache.commit(n, source=full)``)."""

from __future__ import annotations

import torch

from vericache.kv.compressed import CompressedKVCache
from vericache.kv.full import FullKVCache
from vericache.kv.packed import KeyPart, LayeredParts
from vericache.kv.protocol import KVCache


class TeeCache(KVCache):
    def __init__(self, full: FullKVCache, draft: CompressedKVCache | QueryRecorder) -> None:
        self.full, self.draft = full, draft

    def begin(self, start: int, count: int) -> None:
        self.full.begin(start, count)

    def attention_cost(self, start: int, t: int) -> tuple[int, int]:
        return self.full.attention_cost(start, t)

    def parts(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> list[KeyPart]:
        self.draft.observe(layer, q)
        return self.full.parts(layer, q, k, v)

    def layered_parts(self, t: int) -> LayeredParts | None:
        """The full cache's, keeping the queries in the compressed cache's window (a ``QueryRecorder``
        keeps lists, not one tensor: None, and the module runs the step)."""
        if not isinstance(self.draft, CompressedKVCache):
            return None
        lp = self.full.layered_parts(t)
        lp.queries, lp.observer = self.draft.queries, self.draft
        return lp


class QueryRecorder:
    """The draft side of a ``TeeCache`` when no compressor is chosen yet: it keeps each layer's last
    ``window`` queries, so one exact prefill can later seed a compressed cache of any method."""

    def __init__(self, n_layers: int, window: int = 64, queries: list[torch.Tensor | None] | None = None) -> None:
        """``queries``: a prefix's recorded window, which this prompt's rest slides on from."""
        self.window = window
        self.queries: list[torch.Tensor | None] = list(queries) if queries is not None else [None] * n_layers   # [Hq, <=window, D]

    def begin(self, start: int, count: int) -> None:
        pass

    def recorded(self) -> list[torch.Tensor]:
        """Every layer's window, once a prefill has passed through each (ValueError before)."""
        missing = [i for i, q in enumerate(self.queries) if q is None]
        if missing:
            raise ValueError(f"no queries recorded for layers {missing[:4]}: prefill through the recorder first")
        return [q for q in self.queries if q is not None]

    def observe(self, layer: int, q: torch.Tensor) -> None:
        prev = self.queries[layer]
        recent = q if prev is None else torch.cat([prev, q], dim=1)
        self.queries[layer] = recent[:, -self.window :].clone()
