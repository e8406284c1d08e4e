"""Byte budgets in fixed-size blocks: the device tier and the host tier.

Each owner (a request's compressed KV, its full KV, a transient verification buffer) holds
a number of blocks sized to the bytes it really holds, re-sized as it grows or shrinks.
Accounting is exact: ``used_blocks`` is the sum over owners, never negative, and every
block returns when its owner is freed.
"""

from __future__ import annotations

import math
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class OutOfBlocks(RuntimeError):
    """The pool cannot hold what was asked; the caller waits, preempts or refuses."""


class BlockPool:
    def __init__(self, name: str, capacity_bytes: int, block_bytes: int = 64 * 1024) -> None:
        if capacity_bytes < block_bytes:
            raise ValueError(f"{name} tier: capacity {capacity_bytes} B is smaller than one block ({block_bytes} B)")
        self.name = name
        self.block_bytes = block_bytes
        self.total_blocks = capacity_bytes // block_bytes
        self._owned: dict[object, int] = {}
        self._lock = threading.Lock()  # the link thread and the step loop both touch it

    def blocks_for(self, nbytes: int) -> int:
        return math.ceil(max(nbytes, 0) / self.block_bytes)

    @property
    def used_blocks(self) -> int:
        return sum(self._owned.values())

    @property
    def free_blocks(self) -> int:
        return self.total_blocks - self.used_blocks

    @property
    def used_bytes(self) -> int:
        return self.used_blocks * self.block_bytes

    @property
    def capacity_bytes(self) -> int:
        return self.total_blocks * self.block_bytes

    def usage(self) -> float:
        return self.used_blocks / self.total_blocks

    def can_fit(self, nbytes: int, owner: object | None = None) -> bool:
        have = self._owned.get(owner, 0) if owner is not None else 0
        return self.blocks_for(nbytes) - have <= self.free_blocks

    def resize(self, owner: object, nbytes: int) -> None:
        """Make ``owner`` hold exactly enough blocks for ``nbytes``; raises OutOfBlocks if they are not free."""
        with self._lock:
            need = self.blocks_for(nbytes)
            have = self._owned.get(owner, 0)
            if need - have > self.total_blocks - sum(self._owned.values()):
                raise OutOfBlocks(f"{self.name} tier: {owner} needs {need} blocks, "
                                  f"{self.total_blocks - sum(self._owned.values()) + have} available")
            if need:
                self._owned[owner] = need
            else:
                self._owned.pop(owner, None)

    def free(self, owner: object) -> None:
        with self._lock:
            self._owned.pop(owner, None)

    def owners(self) -> list[object]:
        return list(self._owned)


def storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one storage count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())
