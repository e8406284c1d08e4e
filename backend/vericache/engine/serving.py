"""Continuous batching over tiered KV memory, with naive, staggered or grouped (P1) VeriCache schedules.

Each ``step()`` has three phases: schedule (admit waiting requests into the device budget, pick
prefill chunks, start link transfers), run (one batched forward per kind of work: prefill chunks,
a draft/decode step, a verification), postprocess (accept, finish, free, account).

Memory tiers (``kv.blocks``): the *device* tier holds what the accelerator must hold: compressed KV
(vericache, lossy) or full KV (full mode), plus a transient buffer while a request's full KV is
brought in for verification. The *host* tier holds every vericache request's full KV.

Request states and their transitions (``ALLOWED``), each exercised by the tests:
  waiting -> prefill -> decoding (full, lossy) | drafting (vericache)
  drafting -> transferring -> drafting          (a verification round; the link moves the full KV)
  any running state -> waiting                  (preempted: KV freed, recomputed on re-admission)
  any state -> finished | aborted               (KV freed at once)

Every request carries its own options (``engine.options``): mode, compressor and draft length
default to the engine's, and requests of different modes run side by side in one step (full and
lossy requests in the decode batch, vericache requests in the draft/verify phase).

Schedules (P1), all lossless:
- ``naive``: everyone drafts, then each request in turn is transferred and verified (the control;
  its verification still reads layer i while layer i+1 is in flight).
- ``staggered``: a request whose draft is complete queues its transfer at once and the others keep
  drafting; with ``draft_len="auto"`` a new draft is stretched to cover the link's measured backlog
  (``_draft_to_cover_link``), so requests fall into phase-shifted groups of one.
- ``grouped``: explicit phase groups, ``G`` planned from the measured link rate and draft-step time
  (``engine.stagger.group_count``, re-planned every round); one group at a time is on the link and
  its members start their transfers together, so each group is verified in one batch; a member
  waiting for its group's turn drafts on while its drafts are mostly accepted (P2).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import torch

from vericache.engine.options import RequestOptions, ResolvedOptions
from vericache.engine.sequence import Sequence
from vericache.engine.stagger import group_count
from vericache.kv.blocks import BlockPool
from vericache.kv.compressed import CompressedKVCache
from vericache.kv.full import FullKVCache
from vericache.kv.link import CudaLink, EmulatedLink, StreamedKV, Transfer
from vericache.kv.tee import TeeCache
from vericache.sampling import SamplingParams, choose_token
from vericache.spec.decoding import accept_draft, draft_token

SCHEDULERS = ("naive", "staggered", "grouped")
WAITING, PREFILL, DECODING, DRAFTING, TRANSFERRING, FINISHED, ABORTED = (
    "waiting", "prefill", "decoding", "drafting", "transferring", "finished", "aborted")
ALLOWED = {
    WAITING: {PREFILL, ABORTED},
    PREFILL: {DECODING, DRAFTING, WAITING, FINISHED, ABORTED},
    DECODING: {WAITING, FINISHED, ABORTED},
    DRAFTING: {TRANSFERRING, WAITING, FINISHED, ABORTED},
    TRANSFERRING: {DRAFTING, WAITING, FINISHED, ABORTED},
}


@dataclass
class Request:
    id: int
    seq: Sequence
    opts: ResolvedOptions
    state: str = WAITING
    full: FullKVCache | None = None            # device tier (full mode) or host tier (vericache)
    draft: CompressedKVCache | None = None     # device tier
    resident: FullKVCache | None = None        # device tier: the resident layers of the full KV
    done_ids: int = 0                          # tokens already in the caches (prefill progress)
    k: int = 0
    group: int = 0                             # grouped: the phase group of the current round
    drafts: list[int] = field(default_factory=list)
    qs: list = field(default_factory=list)
    transfer: Transfer | None = None
    policy_state: object = None
    emitted: int = 0          # output tokens already returned by step()
    reported: bool = False    # the final StepOutput has been returned
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def position(self) -> int:
        return len(self.seq.all_ids) - 1


@dataclass
class StepOutput:
    request_id: int
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None


@dataclass
class Activity:
    """Busy intervals of the compute (forwards) for utilisation and timelines."""
    intervals: list[tuple[float, float, str]] = field(default_factory=list)

    def busy_s(self) -> float:
        return sum(e - s for s, e, _ in self.intervals)


class ServingEngine:
    def __init__(self, engine, device_budget: int, host_budget: int | None = None, scheduler: str = "staggered",
                 link=None, prefill_chunk: int = 512, max_running: int = 64, resident_layers: int = 0) -> None:
        if scheduler not in SCHEDULERS:
            raise ValueError(f"scheduler must be one of {', '.join(SCHEDULERS)}, got {scheduler!r}")
        n_layers = engine.cfg.num_hidden_layers
        if isinstance(resident_layers, bool) or not isinstance(resident_layers, int) or not (
                0 <= resident_layers <= n_layers):
            raise ValueError(f"resident_layers must be an integer in [0, {n_layers}], got {resident_layers!r}")
        self.eng, self.mode, self.scheduler = engine, engine.mode, scheduler
        # vericache: the first ``resident_layers`` layers of every request's full KV stay on the
        # device, so each verification moves only the rest over the link (fewer bytes, smaller batch)
        self.resident_layers = resident_layers
        self.device = BlockPool("device", device_budget)
        self.host = BlockPool("host", host_budget or 1 << 62)
        self.link = link  # made on first use when None: the first vericache request needs it
        self.prefill_chunk, self.max_running = prefill_chunk, max_running
        self.requests: dict[int, Request] = {}
        self.activity = Activity()
        self.preemptions = 0  # requests sent back to waiting (their KV recomputed on re-admission)
        self.groups, self._turn = 2, 0    # grouped: current group count, next group on the link
        self._verify_layer_s = 0.0        # measured forward time per layer of a verification (EMA)
        self.early_verifies = 0           # verifications started while their last layers were in flight
        self._group_plans = [0, 0]        # (sum of planned group counts, plans): for the mean
        self.round_log: list[tuple[int, int, int]] = []  # (request id, drafted, accepted) per verification
        self._ids = itertools.count()

    # ------------------------------------------------------------------ public API
    def add_request(self, prompt_ids: list[int], params: SamplingParams,
                    options: RequestOptions | ResolvedOptions | None = None) -> int:
        """Queue a request; ``options`` override the engine's mode, compressor and draft length."""
        opts = options if isinstance(options, ResolvedOptions) else self.eng.resolve(options)
        seq = self.eng.new_sequence(-1, prompt_ids, params)
        req = Request(-1, seq, opts, policy_state=opts.policy.new_state())
        need = self._device_bytes_needed(req) + self._verify_buffer_bytes(req)
        if self.device.blocks_for(need) > self.device.total_blocks:
            raise ValueError(f"request needs {need} bytes of device KV (prompt {len(prompt_ids)} + max_tokens "
                             f"{params.max_tokens}) but the whole device budget is {self.device.capacity_bytes} bytes")
        req.id = seq.request_id = next(self._ids)  # ids only for accepted requests
        if opts.mode == "vericache" and self.link is None:
            dev = self.eng.loaded.device
            self.link = CudaLink(dev) if dev.type == "cuda" else EmulatedLink(gbps=32)
        self.requests[req.id] = req
        return req.id

    def abort(self, rid: int) -> None:
        req = self.requests.get(rid)
        if req is not None and req.state not in (FINISHED, ABORTED):
            self._release(req, ABORTED)

    def has_unfinished(self) -> bool:
        return any(r.state not in (FINISHED, ABORTED) for r in self.requests.values())

    def step(self) -> list[StepOutput]:
        self._schedule()
        self._run()
        return self._postprocess()

    # ------------------------------------------------------------------ schedule
    def _device_bytes_needed(self, req: Request) -> int:
        """Device bytes a request will need at its longest (admission control)."""
        seq, comp = req.seq, req.opts.compressor
        n = len(seq.prompt_ids) + seq.params.max_tokens
        per_pos = self.eng.cfg.kv_bytes_per_position(self.eng.loaded.dtype.itemsize)
        full = n * per_pos
        if req.opts.mode == "full":
            return full
        window = 2 * comp.window * per_pos
        chunk = min(self.prefill_chunk, len(seq.prompt_ids)) * per_pos
        resident = full - self._streamed(full) if req.opts.mode == "vericache" else 0
        return int(full * comp.nominal_ratio(self.eng.loaded.dtype.itemsize)) + window + chunk + resident

    def _streamed(self, full_bytes: int) -> int:
        """The part of ``full_bytes`` (all layers) that crosses the link: the non-resident layers."""
        n_layers = self.eng.cfg.num_hidden_layers
        return full_bytes * (n_layers - self.resident_layers) // n_layers

    def _verify_buffer_bytes(self, req: Request) -> int:
        """Device bytes of the transient full-KV buffer a verification of ``req`` needs (vericache)."""
        if req.opts.mode != "vericache":
            return 0
        per_pos = self.eng.cfg.kv_bytes_per_position(self.eng.loaded.dtype.itemsize)
        return self._streamed((len(req.seq.prompt_ids) + req.seq.params.max_tokens + 1) * per_pos)

    def _schedule(self) -> None:
        running = [r for r in self.requests.values() if r.state not in (WAITING, FINISHED, ABORTED)]
        reserved = sum(self._device_bytes_needed(r) for r in running)
        buffer = max((self._verify_buffer_bytes(r) for r in running), default=0)
        for req in [r for r in self.requests.values() if r.state == WAITING]:
            need = self._device_bytes_needed(req)
            buf = max(buffer, self._verify_buffer_bytes(req))  # room for one verification at a time
            fits = reserved + need + buf <= self.device.capacity_bytes or not running  # alone it always fits
            if len(running) >= self.max_running or not fits:
                break  # FIFO: later requests wait behind the first that does not fit
            self._set(req, PREFILL)
            running.append(req)
            reserved, buffer = reserved + need, buf

    # ------------------------------------------------------------------ run
    def _run(self) -> None:
        budget = self.prefill_chunk
        for req in [r for r in self.requests.values() if r.state == PREFILL]:
            if budget <= 0:
                break
            budget -= self._prefill_chunk(req, budget)
        self._decode_phase()     # full and lossy requests
        self._vericache_phase()  # vericache requests

    def _timed(self, kind: str, fn):
        start = time.perf_counter()
        out = fn()
        self.activity.intervals.append((start, time.perf_counter(), kind))
        return out

    @torch.inference_mode()
    def _prefill_chunk(self, req: Request, budget: int) -> int:
        eng, seq = self.eng, req.seq
        ids = seq.all_ids[:-1] if seq.output_ids else seq.prompt_ids  # re-admitted: recompute its tokens too
        if req.done_ids == 0:
            self._allocate(req, len(seq.prompt_ids) + seq.params.max_tokens + 1)
        mode, comp = req.opts.mode, req.opts.compressor
        whole = mode != "full" and comp.needs_whole_prompt
        n = len(ids) - req.done_ids if whole else min(budget, len(ids) - req.done_ids)
        chunk = ids[req.done_ids : req.done_ids + n]
        cache = {"full": req.full, "lossy": req.draft}.get(mode) or TeeCache(req.full, req.draft)
        dev = eng.loaded.device
        logits = self._timed("prefill", lambda: eng.model(torch.tensor(chunk, device=dev), [req.done_ids], [n],
                                                          [cache], logits_index=torch.tensor([n - 1], device=dev)))
        req.done_ids += n
        if req.draft is not None:
            if req.done_ids == len(ids) and whole:
                scores = comp.on_prefill(eng.model, req.full or req.draft.residual, ids, eng.tokenizer)
                req.draft.set_prefill_scores(scores, len(ids))
            if req.done_ids == len(ids) or not whole:
                req.draft.commit(req.done_ids)
        if req.resident is not None and req.done_ids == len(ids):  # the resident layers go up once
            req.resident.begin(0, len(ids))
            req.resident.k[:, :, : len(ids)] = req.full.k[: self.resident_layers, :, : len(ids)]
            req.resident.v[:, :, : len(ids)] = req.full.v[: self.resident_layers, :, : len(ids)]
        self._account(req)
        if req.done_ids == len(ids):
            if not seq.output_ids:
                seq.append(choose_token(logits[0], seq.params, seq.generator))
            self._set(req, DRAFTING if mode == "vericache" else DECODING)
            if seq.finished:
                self._release(req, FINISHED)
        return n

    @torch.inference_mode()
    def _decode_phase(self) -> None:
        rows = [r for r in self.requests.values() if r.state == DECODING]
        if not rows:
            return
        caches = [r.full if r.opts.mode == "full" else r.draft for r in rows]
        logits = self._timed("decode", lambda: self.eng.decode_step([r.seq.all_ids[-1] for r in rows],
                                                                   [r.position for r in rows], caches))
        for row, r in zip(logits, rows):
            if r.state != DECODING:
                continue  # preempted by a batch-mate's growth in this very loop
            if r.draft is not None:
                r.draft.commit(r.position + 1)
            r.seq.append(choose_token(row, r.seq.params, r.seq.generator))
            self._account(r)

    def _vericache_phase(self) -> None:
        ready = [r for r in self.requests.values() if r.state == TRANSFERRING and self._can_verify(r)]
        if ready:
            self._verify(ready)
        drafting = [r for r in self.requests.values() if r.state == DRAFTING]
        for r in drafting:
            remaining = r.seq.params.max_tokens - len(r.seq.output_ids)
            policy = r.opts.policy
            if r.k == 0 and not r.drafts:  # a new round
                r.k = policy.next_len(r.policy_state, remaining)
                if self.scheduler != "naive" and r.k and policy.fixed is None:
                    r.k = max(r.k, min(self._draft_to_cover_link(), policy.max_len, remaining - 1))
                if self.scheduler == "grouped":
                    r.group = r.id % self._plan_groups(r.k)
            elif (self.scheduler == "grouped" and r.k and len(r.drafts) >= r.k and policy.fixed is None
                  and r.policy_state.ema_accepted >= 0.75 * r.k):
                # waiting for its group's turn, and its drafts are mostly accepted: draft on (P2)
                r.k = min(r.k + 1, policy.max_len, max(remaining - 1, r.k))
        rows = [r for r in drafting if len(r.drafts) < r.k]
        if rows:
            self._draft_step(rows)
        complete = [r for r in drafting if len(r.drafts) >= r.k]
        self._make_room_for_a_verification(complete)
        if self.scheduler == "naive":
            # all draft, then all verify, each verification waiting for its transfer
            if complete and len(complete) == len(drafting) and not any(
                    r.state == TRANSFERRING for r in self.requests.values()):
                for r in complete:
                    if self._start_transfer(r):
                        self._verify([r])  # layer by layer: layer i is verified while i+1 is in flight
        elif self.scheduler == "staggered":
            for r in complete:  # the link works (and queues) while the others keep drafting
                self._start_transfer(r)
        else:
            self._start_next_group(drafting)
        in_flight = [r for r in self.requests.values() if r.state == TRANSFERRING]
        if in_flight and not ready and not rows:
            in_flight[0].transfer.wait_all()  # nothing to compute until a transfer lands: block, don't spin

    @torch.inference_mode()
    def _draft_step(self, rows: list[Request]) -> None:
        tokens = [r.drafts[-1] if r.drafts else r.seq.all_ids[-1] for r in rows]
        starts = [r.position + len(r.drafts) for r in rows]
        logits = self._timed("draft", lambda: self.eng.decode_step(tokens, starts, [r.draft for r in rows]))
        for row, r in zip(logits, rows):
            token, q = draft_token(r.seq, row)
            r.drafts.append(token)
            r.qs.append(q)

    def _can_verify(self, req: Request) -> bool:
        """Start verifying before the last layers land when, at the measured rates, they will land
        before the forward reaches them: r layers still in flight take r * t_link_layer, the forward
        spends (L - r) * t_verify_layer on the layers already there."""
        streamed = req.transfer.dst.k.shape[0]
        done = req.transfer.layers_done()
        if done == streamed:
            return True
        ahead = self.resident_layers + done  # layers the forward can do without waiting
        rates = self._measured_rates()
        if rates is None or self._verify_layer_s <= 0 or ahead == 0:
            return False
        link_layer_s = req.full.nbytes() / self.eng.cfg.num_hidden_layers / rates[0]
        return (streamed - done) * link_layer_s <= ahead * self._verify_layer_s

    def _start_next_group(self, drafting: list[Request]) -> None:
        """Grouped: put the next group whose drafts are all complete on the link, unless another
        group's transfers are still in flight (one group on the link while the others draft)."""
        on_link = {r.group for r in self.requests.values() if r.state == TRANSFERRING and not r.transfer.ready()}
        groups: dict[int, list[Request]] = {}
        for r in drafting:
            groups.setdefault(r.group, []).append(r)
        order = sorted(groups, key=lambda g: (g - self._turn) % max(self.groups, g + 1))  # round robin
        for g in order:
            if on_link - {g}:
                return
            members = groups[g]
            if all(len(r.drafts) >= r.k for r in members):
                for r in members:
                    self._start_transfer(r)
                self._turn = g + 1
                on_link.add(g)

    def _plan_groups(self, draft_len: int) -> int:
        """Re-plan the group count from the measured link rate and draft-step time."""
        rates = self._measured_rates()
        vc = [r for r in self.requests.values() if r.state in (DRAFTING, TRANSFERRING)]
        if rates is not None and vc:
            rate, step_s = rates
            per_request_s = sum(self._streamed(r.full.nbytes()) for r in vc) / len(vc) / rate
            self.groups = group_count(len(vc), per_request_s, step_s, draft_len)
        self._group_plans[0] += self.groups
        self._group_plans[1] += 1
        return self.groups

    @property
    def mean_groups(self) -> float:
        """The mean planned group count (grouped), for reports."""
        total, plans = self._group_plans
        return total / plans if plans else 0.0

    def _measured_rates(self) -> tuple[float, float] | None:
        """(link bytes per second, seconds per draft step), measured so far; None before both exist."""
        stats = self.link.stats
        draft_spans = [e - s for s, e, k in self.activity.intervals[-32:] if k == "draft"]
        if stats.busy_s <= 0 or not draft_spans:
            return None
        return stats.bytes_moved / stats.busy_s, sum(draft_spans) / len(draft_spans)

    def _draft_to_cover_link(self) -> int:
        """Draft steps that fit in the link's current backlog (P1 adapting to measured rates): a request
        that would only wait for the link drafts meanwhile, so its next transfer buys more tokens."""
        rates = self._measured_rates()
        if rates is None:
            return 0
        rate, step_s = rates
        queued = sum(self._transfer_bytes(r) for r in self.requests.values()
                     if r.state == TRANSFERRING and not r.transfer.ready())
        return int(queued / rate / step_s)

    def _make_room_for_a_verification(self, complete: list[Request]) -> None:
        """If no verification is in flight and none can start, preempt the newest other request."""
        if not complete or any(r.state == TRANSFERRING for r in self.requests.values()):
            return
        first = min(complete, key=lambda r: r.id)
        while not self.device.can_fit(self._transfer_bytes(first), ("verify", first.id)):
            victims = [r for r in self.requests.values() if r.state in (DRAFTING, PREFILL) and r is not first]
            if not victims:
                return
            self._preempt(max(victims, key=lambda r: r.id))

    def _transfer_bytes(self, req: Request) -> int:
        """Device bytes of the request's verification buffer: its streamed layers, with room for the draft."""
        return self._streamed(req.full.nbytes() + (req.k + 1) * req.full.nbytes_per_position())

    def _start_transfer(self, req: Request) -> bool:
        """Reserve a device buffer for the request's full KV and queue it on the link."""
        nbytes = self._transfer_bytes(req)
        key = ("verify", req.id)
        if not self.device.can_fit(nbytes, key):
            return False  # no room for the buffer now; retry next step
        self.device.resize(key, nbytes)
        n_layers, resident = self.eng.cfg.num_hidden_layers, self.resident_layers
        buf = FullKVCache(self.eng.cfg, self.eng.loaded.device, self.eng.loaded.dtype,
                          capacity=req.full.length + req.k + 1, layers=n_layers - resident)
        req.transfer = self.link.submit(req.full, req.full.length, buf, first_layer=resident)
        self._set(req, TRANSFERRING)
        return True

    @torch.inference_mode()
    def _verify(self, reqs: list[Request]) -> None:
        chunks = [[r.seq.all_ids[-1]] + r.drafts for r in reqs]
        dev = self.eng.loaded.device
        tokens = torch.tensor([t for c in chunks for t in c], device=dev)
        views = [StreamedKV(r.transfer, r.resident) for r in reqs]
        landed = all(r.transfer.ready() for r in reqs)
        t0 = time.perf_counter()
        logits = self._timed("verify", lambda: self.eng.model(tokens, [r.position for r in reqs],
                                                              [len(c) for c in chunks], views))
        self.early_verifies += not landed
        if landed:  # a clean measurement: no waiting on the link inside the forward
            per_layer = (time.perf_counter() - t0) / self.eng.cfg.num_hidden_layers
            self._verify_layer_s = per_layer if self._verify_layer_s <= 0 else (
                0.7 * self._verify_layer_s + 0.3 * per_layer)
        offset = 0
        for r, chunk, view in zip(reqs, chunks, views):
            if r.state != TRANSFERRING:
                offset += len(chunk)
                continue  # preempted while this batch was being verified
            start = r.position
            m = accept_draft(r.seq, logits[offset : offset + len(chunk)], r.drafts, r.qs)
            offset += len(chunk)
            keep = start + 1 + m
            # write the verified positions back to the host tier, then commit them to the drafter
            r.full.begin(start, keep - start)
            res = self.resident_layers
            r.full.k[res:, :, start:keep] = view.buf.k[:, :, start:keep]
            r.full.v[res:, :, start:keep] = view.buf.v[:, :, start:keep]
            if r.resident is not None:  # the resident layers were written on the device
                r.full.k[:res, :, start:keep] = r.resident.k[:, :, start:keep]
                r.full.v[:res, :, start:keep] = r.resident.v[:, :, start:keep]
                r.resident.truncate(keep)
            r.draft.commit(keep, source=r.full)
            self.device.free(("verify", r.id))
            r.rounds, r.drafted, r.accepted = r.rounds + 1, r.drafted + len(r.drafts), r.accepted + m
            self.round_log.append((r.id, len(r.drafts), m))
            r.opts.policy.update(r.policy_state, len(r.drafts), m)
            r.transfer, r.drafts, r.qs, r.k = None, [], [], 0
            self._set(r, DRAFTING)
            self._account(r)

    # ------------------------------------------------------------------ memory
    def _allocate(self, req: Request, capacity: int) -> None:
        eng = self.eng
        dev, dt = eng.loaded.device, eng.loaded.dtype
        mode = req.opts.mode
        if mode in ("full", "vericache"):
            req.full = FullKVCache(eng.cfg, dev if mode == "full" else "cpu", dt, capacity=capacity)
            if mode == "vericache" and dev.type == "cuda":
                req.full.k, req.full.v = req.full.k.pin_memory(), req.full.v.pin_memory()
        if mode in ("lossy", "vericache"):
            req.draft = CompressedKVCache(req.opts.compressor, eng.cfg, dev, dt, capacity=capacity)
        if mode == "vericache" and self.resident_layers:
            req.resident = FullKVCache(eng.cfg, dev, dt, capacity=capacity, layers=self.resident_layers)

    def _account(self, req: Request) -> None:
        """Charge the tiers for what the request holds now; preempt the newest request if the device is full."""
        dev_bytes = req.full.nbytes() if req.opts.mode == "full" else req.draft.nbytes()
        if req.resident is not None:
            dev_bytes += req.resident.nbytes()
        if req.opts.mode == "vericache":
            self.host.resize(("full", req.id), req.full.nbytes())
        while not self.device.can_fit(dev_bytes, ("kv", req.id)):
            victims = [r for r in self.requests.values() if r.state in (DECODING, DRAFTING) and r is not req]
            if not victims:
                break
            self._preempt(max(victims, key=lambda r: r.id))
        if self.device.can_fit(dev_bytes, ("kv", req.id)):
            self.device.resize(("kv", req.id), dev_bytes)

    def _preempt(self, req: Request) -> None:
        self.preemptions += 1
        if req.state == PREFILL and req.done_ids == 0:
            self._set(req, WAITING)  # admitted but holds nothing yet
            return
        self._free(req)
        req.done_ids, req.drafts, req.qs, req.k = 0, [], [], 0
        self._set(req, WAITING)

    def _free(self, req: Request) -> None:
        for pool, key in ((self.device, ("kv", req.id)), (self.device, ("verify", req.id)),
                          (self.host, ("full", req.id))):
            pool.free(key)
        if req.transfer is not None and req.transfer.cuda_events is None:
            req.transfer.done.wait()  # the copier may still be writing into the buffer
        req.full = req.draft = req.resident = req.transfer = None

    def _release(self, req: Request, state: str) -> None:
        self._free(req)
        self._set(req, state)

    def _set(self, req: Request, state: str) -> None:
        if state not in ALLOWED.get(req.state, set()):
            raise RuntimeError(f"request {req.id}: illegal transition {req.state} -> {state}")
        req.state = state

    # ------------------------------------------------------------------ postprocess
    def collect_outputs(self) -> list[StepOutput]:
        """Outputs not yet reported (an abort between steps, say)."""
        return self._postprocess()

    def _postprocess(self) -> list[StepOutput]:
        outs = []
        for req in self.requests.values():
            if req.seq.finished and req.state not in (FINISHED, ABORTED):
                self._release(req, FINISHED)
            if req.reported:
                continue
            new = req.seq.output_ids[req.emitted :]
            done = req.state in (FINISHED, ABORTED)
            if new or done:
                reason = req.seq.finish_reason if req.state == FINISHED else ("abort" if done else None)
                outs.append(StepOutput(req.id, list(new), done, reason))
                req.emitted, req.reported = len(req.seq.output_ids), done
        return outs
