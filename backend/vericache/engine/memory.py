"""Memory and admission: what each request's caches hold, in which tier, charged to which budget.

Tiers (``kv.blocks``): the *device* tier holds what the accelerator must hold: compressed KV
(vericache, lossy) or full KV (full mode), plus a transient buffer while a request's full KV is
brought in for verification. With ``offload`` the *host* tier holds every vericache request's full
KV (the paper's long-context scenario); without it (``ModelRunner.generate``, ``bench batch``) the full
KV stays on the device too and verification reads it in place.
"""

from __future__ import annotations

import torch

from vericache.config import ModelConfig
from vericache.engine.request import Request
from vericache.kv.blocks import BlockPool, storage_bytes
from vericache.kv.compressed import CompressedKVCache, planned_bytes
from vericache.kv.full import FullKVCache

UNLIMITED = 1 << 62


class KVMemory:
    def __init__(self, cfg: ModelConfig, device: torch.device, kv_dtype: torch.dtype, device_budget: int | None,
                 host_budget: int | None = None, offload: bool = True, resident_layers: int = 0,
                 remote: bool = False) -> None:
        self.cfg, self.dev, self.dtype = cfg, device, kv_dtype
        self.device = BlockPool("device", device_budget or UNLIMITED)
        self.host = BlockPool("host", host_budget or UNLIMITED)
        self.offload, self.resident_layers = offload, resident_layers
        self.remote = remote  # vericache requests are verified elsewhere: no full KV here
        self.per_pos = cfg.kv_bytes_per_position(kv_dtype.itemsize)

    # ------------------------------------------------------------------ what a request needs
    @staticmethod
    def capacity(req: Request) -> int:
        """Positions a request can ever hold (``Sequence.capacity``)."""
        return req.seq.capacity

    def streamed(self, full_bytes: int) -> int:
        """The part of ``full_bytes`` (all layers) that crosses the link: the non-resident layers."""
        n_layers = self.cfg.num_hidden_layers
        return full_bytes * (n_layers - self.resident_layers) // n_layers

    def needed(self, req: Request) -> int:
        """Device bytes a request holds at its longest (admission control)."""
        full = self.capacity(req) * self.per_pos
        if req.mode == "full":
            return full
        draft = planned_bytes(req.opts.compressor, self.cfg, self.dtype, self.capacity(req))
        if req.mode == "lossy" or self.is_remote(req):
            return draft
        return draft + (full - self.streamed(full) if self.offload else full)

    def transient(self, req: Request) -> int:
        """Device bytes held only for a while: the uncompressed prompt in a lossy draft cache's
        residual until the prefill is compressed, or a verification buffer (offloaded vericache)."""
        if req.mode == "lossy" or self.is_remote(req):
            return len(req.prefill_ids) * self.per_pos
        return self.streamed(self.capacity(req) * self.per_pos) if self.is_offloaded(req) else 0

    def is_offloaded(self, req: Request) -> bool:
        return self.offload and not self.remote and req.mode == "vericache"

    def is_remote(self, req: Request) -> bool:
        return self.remote and req.mode == "vericache"

    def verify_buffer_bytes(self, req: Request) -> int:
        """Device bytes of the buffer a verification of ``req`` needs now: its streamed layers plus the draft."""
        return self.streamed((req.full.length + req.round.k + 1) * self.per_pos)

    # ------------------------------------------------------------------ caches
    def allocate(self, req: Request) -> None:
        """Make the request's caches (empty, or holding its shared prefill)."""
        cap, mode = self.capacity(req), req.mode
        host = torch.device("cpu")
        if mode == "full" or (mode == "vericache" and not self.remote):
            home = host if self.is_offloaded(req) else self.dev
            if req.prefill is not None and req.prefill.full.device == home:
                req.full = req.prefill.reset(req.seq)
            else:
                req.full = FullKVCache(self.cfg, home, self.dtype, capacity=cap)
                if home.type == "cpu" and self.dev.type == "cuda":  # pinned: the link copies asynchronously
                    req.full.pin()
                if req.prefill is not None:
                    src = req.prefill.reset(req.seq)
                    req.full.load(src, src.length)
            if req.full.device != self.dev and req.prefill is None:
                # prefill attends on the device: into a device buffer, copied home when done
                req.prefill_buf = FullKVCache(self.cfg, self.dev, self.dtype, capacity=cap)
        if mode in ("lossy", "vericache"):
            req.draft = CompressedKVCache(req.opts.compressor, self.cfg, self.dev, self.dtype, capacity=cap)
        if self.is_offloaded(req) and self.resident_layers:
            req.resident = FullKVCache(self.cfg, self.dev, self.dtype, capacity=cap, layers=self.resident_layers)

    def device_bytes(self, req: Request) -> int:
        """Device bytes the request's caches hold now (what it is charged)."""
        total = 0
        if req.full is not None and not self.is_offloaded(req):
            total += req.full.nbytes()
        if req.draft is not None:  # everything it allocated (its store is allocated up front)
            total += req.draft.resident_bytes()
        for cache in (req.resident, req.prefill_buf):
            if cache is not None:
                total += cache.nbytes()
        return total

    @staticmethod
    def resident_bytes(req: Request) -> int:
        """Bytes of every storage the request's caches hold (allocated capacity, not only valid
        positions), each storage counted once."""
        return storage_bytes(_tensors(req.full, req.draft, req.resident, req.prefill_buf))

    def fits(self, req: Request) -> bool:
        return self.device.can_fit(self.device_bytes(req), ("kv", req.id))

    def charge(self, req: Request) -> None:
        """Charge both tiers for what the request holds now (``fits`` first: raises OutOfBlocks otherwise)."""
        self.device.resize(("kv", req.id), self.device_bytes(req))
        if self.is_offloaded(req) and req.full is not None:
            self.host.resize(("full", req.id), req.full.nbytes())

    def free(self, req: Request) -> None:
        for pool, key in ((self.device, ("kv", req.id)), (self.device, ("verify", req.id)),
                          (self.host, ("full", req.id))):
            pool.free(key)
        req.full = req.draft = req.resident = req.prefill_buf = None


def _tensors(*caches) -> list[torch.Tensor]:
    out = []
    for c in caches:
        if isinstance(c, FullKVCache):
            out += [c.k, c.v]
        elif isinstance(c, CompressedKVCache):
            out += c.tensors()
    return out
