"""Memory and admission: what each request's caches hold, in which tier, charged to which budget.

Tiers (``BlockPool``: byte budgets in fixed-size blocks, each owner holding blocks for the bytes it
really holds, re-sized as it grows; exact accounting, every block back when its owner is freed): the *device* tier holds what the accelerator must hold: compressed KV
(vericache, lossy) or full KV (full mode), plus a transient buffer while a request's full KV is
brought in for verification. With ``offload`` the *host* tier holds every vericache request's full
KV (the paper's long-context scenario); without it (``ModelRunner.generate``, ``bench batch``) the full
KV stays on the device too and verification reads it in place.
"""

from __future__ import annotations

import math
import threading

import torch

from vericache.config import ModelConfig
from vericache.engine.requests import Request
from vericache.kv.compressed import CompressedKVCache, planned_bytes
from vericache.kv.full import FullKVCache
from vericache.kv.packed import key_codes_bytes

UNLIMITED = 1 << 62


class OutOfBlocks(RuntimeError):
    """The pool cannot hold what was asked; the caller waits, preempts or refuses."""


Owner = tuple[str, int]   # what holds blocks: (its kind: "kv", "full", "verify", request id)


class BlockPool:
    def __init__(self, name: str, capacity_bytes: int, block_bytes: int = 64 * 1024) -> None:
        if capacity_bytes < block_bytes:
            raise ValueError(f"{name} tier: capacity {capacity_bytes} B is smaller than one block ({block_bytes} B)")
        self.name = name
        self.block_bytes = block_bytes
        self.total_blocks = capacity_bytes // block_bytes
        self._owned: dict[Owner, int] = {}
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

    def can_fit(self, nbytes: int, owner: Owner | None = None) -> bool:
        have = self._owned.get(owner, 0) if owner is not None else 0
        return self.blocks_for(nbytes) - have <= self.free_blocks

    def resize(self, owner: Owner, nbytes: int) -> None:
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

    def free(self, owner: Owner) -> None:
        with self._lock:
            self._owned.pop(owner, None)

    def owners(self) -> list[Owner]:
        return list(self._owned)



class KVMemory:
    def __init__(self, cfg: ModelConfig, device: torch.device, kv_dtype: torch.dtype, device_budget: int | None,
                 host_budget: int | None = None, offload: bool = True, resident_layers: int = 0,
                 remote: bool = False, key_codes: bool = False) -> None:
        self.cfg, self.dev, self.dtype = cfg, device, kv_dtype
        self.key_codes = key_codes   # full caches keep their keys' integer-score codes (the q8qk numerics)
        self.device = BlockPool("device", device_budget or UNLIMITED)
        self.host = BlockPool("host", host_budget or UNLIMITED)
        # what ``placement.place`` decides each request's home by: vericache's full KV in the host tier
        # (``offload``) or at a remote verifier (``remote``: the drafter role)
        self.offload, self.resident_layers = offload, resident_layers
        self.remote = remote
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

    def full_bytes(self, positions: int) -> int:
        """A full cache's bytes at ``positions``: K and V, and their keys' codes where caches keep them (q8qk:
        at D = 64 they add 55%; ``FullKVCache.held_bytes``)."""
        cfg = self.cfg
        codes = key_codes_bytes(cfg.num_hidden_layers, cfg.num_key_value_heads, positions, cfg.head_dim) \
            if self.key_codes else 0
        return positions * self.per_pos + codes

    def needed(self, req: Request) -> int:
        """Device bytes a request holds at its longest (admission control)."""
        full = self.full_bytes(self.capacity(req))
        draft = planned_bytes(req.opts.compressor, self.cfg, self.dtype, self.capacity(req), self.key_codes) \
            if req.placement.draft_here else 0
        return req.placement.device_bytes_needed(full, draft, resident=full - self.streamed(full)) + self.seen_bytes(req)

    def seen_bytes(self, req: Request) -> int:
        """Device bytes of its verifications' record of what they attend to (``RequestKV.seen``): a guided
        drafter verifying its own rounds (in place or over the link) keeps one, fp32 a layer, query head and
        position; 0 otherwise."""
        where, cfg = req.placement, self.cfg
        if not (where.drafts and where.full_here and req.opts.compressor.guided):
            return 0
        return cfg.num_hidden_layers * cfg.num_attention_heads * self.capacity(req) * 4

    def transient(self, req: Request) -> int:
        """Device bytes held only for a while: the uncompressed prompt in a lossy draft cache's
        residual until the prefill is compressed, or a verification buffer (offloaded vericache: K and V
        only, the op codes its keys in the call)."""
        return req.placement.transient_bytes(prompt=self.full_bytes(len(req.prefill_ids)),
                                             streamed=self.streamed(self.capacity(req) * self.per_pos)) \
            + self.scoring_bytes(req)

    def scoring_bytes(self, req: Request) -> int:
        """Bytes its compressor's scoring pass holds while it runs (KVzip: per layer K and V over the
        prompt and the pass's own tokens, the repeat prompt and the prompt again, in the attention's dtype:
        fp32 at most); 0 for a compressor with no pass, and once the pass is over. Before its caches are
        made the pass's length is not known: the prompt plus 64 (KVzip's repeat prompt is ~10 tokens)."""
        pf = req.prefill
        if not req.placement.draft_here or not req.opts.compressor.needs_whole_prompt \
                or (pf.scoring_ids and pf.scored == len(pf.scoring_ids)):
            return 0
        prompt = len(req.prefill_ids)
        own = len(pf.scoring_ids) or prompt + 64
        cfg = self.cfg
        return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (prompt + own) * cfg.head_dim * 4

    def verify_buffer_bytes(self, req: Request) -> int:
        """Device bytes of the buffer a verification of ``req`` needs now: its streamed layers plus the draft."""
        return self.streamed((req.kv.full_kv().length + req.drafting.round.k + 1) * self.per_pos)

    # ------------------------------------------------------------------ caches
    def allocate(self, req: Request) -> None:
        """Make the caches its placement holds (empty, or holding its shared prefill)."""
        cap, where = self.capacity(req), req.placement
        if where.full_here:
            home = torch.device("cpu") if where.offloaded else self.dev
            if req.prefill.shared is not None and req.prefill.shared.full.device == home:
                req.kv.full = req.prefill.shared.reset(req.seq)
            else:
                req.kv.full = FullKVCache(self.cfg, home, self.dtype, capacity=cap, key_codes=self.key_codes)
                if home.type == "cpu" and self.dev.type == "cuda":  # pinned: the link copies asynchronously
                    req.kv.full.pin()
                if req.prefill.shared is not None:
                    src = req.prefill.shared.reset(req.seq)
                    req.kv.full.load(src, src.length)
            if req.kv.full.device != self.dev and req.prefill.shared is None:
                # prefill attends on the device: into a device buffer, copied home when done
                req.kv.prefill_buf = FullKVCache(self.cfg, self.dev, self.dtype, capacity=cap, key_codes=self.key_codes)
        if where.draft_here:
            req.kv.draft = CompressedKVCache(req.opts.compressor, self.cfg, self.dev, self.dtype, capacity=cap,
                                             key_codes=self.key_codes)
        if where.offloaded and self.resident_layers:
            req.kv.resident = FullKVCache(self.cfg, self.dev, self.dtype, capacity=cap, layers=self.resident_layers,
                                          key_codes=self.key_codes)
        if self.seen_bytes(req):   # not touched until its first verification writes it
            req.kv.seen = torch.empty(self.cfg.num_hidden_layers, self.cfg.num_attention_heads, cap, device=self.dev)

    def device_bytes(self, req: Request) -> int:
        """Device bytes the request's caches hold now (what it is charged)."""
        total = 0
        if req.kv.full is not None and not req.placement.offloaded:
            total += req.kv.full.held_bytes()
        if req.kv.draft is not None:  # everything it allocated (its store is allocated up front)
            total += req.kv.draft.resident_bytes()
        for cache in (req.kv.resident, req.kv.prefill_buf):
            if cache is not None:
                total += cache.held_bytes()
        return total + (req.kv.seen.nbytes if req.kv.seen is not None else 0)

    def charge(self, req: Request, device_bytes: int | None = None) -> None:
        """Charge both tiers for what the request holds now (OutOfBlocks where it does not fit: ask
        ``BlockPool.can_fit`` first); ``device_bytes``: its ``device_bytes``, where the caller just counted them."""
        self.device.resize(("kv", req.id), self.device_bytes(req) if device_bytes is None else device_bytes)
        if req.placement.offloaded and req.kv.full is not None:
            self.host.resize(("full", req.id), req.kv.full.held_bytes())

    def free(self, req: Request) -> None:
        for pool, key in ((self.device, ("kv", req.id)), (self.device, ("verify", req.id)),
                          (self.host, ("full", req.id))):
            pool.free(key)
        req.kv.full = req.kv.draft = req.kv.resident = req.kv.prefill_buf = req.kv.seen = None

