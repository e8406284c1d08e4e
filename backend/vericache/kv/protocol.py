"""What the forward needs from a KV cache: one base every cache a forward attends through is declared
against (kvpress's way: one base, a small class per kind), so no caller asks a cache what it can do.

A step gives each sequence one cache. The forward calls ``begin`` once, then per layer either ``parts``
(store the chunk's K/V, say which key parts its queries attend: ``attend_packed`` computes every
sequence's attention in one call) or, for a cache that computes its own attention (KVzip's scoring
pass, which records attention probabilities), ``attend``, handed the layer's op to run its parts on. The
native step asks ``layered_parts`` (every layer at once) and runs the module's path where a cache answers
None; the roofline and the cost model ask ``attention_cost``.

Shapes: q [Hq, T, D]; k, v [Hkv, T, D] (rotated) for the positions given to ``begin``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from vericache.kv.packed import KeyPart, LayeredParts, PartsAttention


class KVCache(ABC):
    """One sequence's cache as a forward sees it."""

    computes_attention: ClassVar[bool] = False   # True: the forward calls ``attend``, never ``parts``

    @abstractmethod
    def begin(self, start: int, count: int) -> None:
        """A forward will write positions start..start+count-1; later positions are dropped (rollback)."""

    def parts(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> list[KeyPart]:
        """Store k, v for the positions given to ``begin``; return the key parts the queries attend."""
        raise NotImplementedError(f"{type(self).__name__} computes its own attention (attend)")

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               attention: PartsAttention) -> torch.Tensor:
        """Store k, v and return the attention output [Hq, T, D] (``computes_attention`` caches only), on
        the layer's own op (``attention``: the model's kernels and numerics)."""
        raise NotImplementedError(f"{type(self).__name__} hands its key parts to the packed attention (parts)")

    def layered_parts(self, t: int) -> LayeredParts | None:
        """``parts`` for every layer at once, for a chunk of ``t`` at the forward's start (the native
        step); None: this cache cannot describe itself so, and the module runs the step."""
        return None

    def attention_cost(self, start: int, t: int) -> tuple[int, int]:
        """(K/V bytes read over all layers, query-key pairs per query head and layer) of ``t`` queries
        written at ``start``; (0, 0) for a cache whose work no one prices (a scoring pass)."""
        return 0, 0
