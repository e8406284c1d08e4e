"""Prefill once, fill two caches: attention runs over the full cache (exact), and the
compressed cache receives the same K/V and queries."""

from __future__ import annotations

import torch

from vericache.kv.compressed import CompressedKVCache
from vericache.kv.full import FullKVCache


class TeeCache:
    def __init__(self, full: FullKVCache, draft: CompressedKVCache) -> None:
        self.full, self.draft = full, draft

    def begin(self, start: int, count: int) -> None:
        self.full.begin(start, count)
        self.draft.begin(start, count)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.draft.observe(layer, q, k, v)
        return self.full.attend(layer, q, k, v)
