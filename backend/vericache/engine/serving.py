"""The engine loop: continuous batching of full, lossy and VeriCache requests, one forward per step.

``step()`` = admit -> plan -> run -> postprocess:
- admit: waiting requests enter while their KV fits the device budget (``engine.memory``);
- plan: pick this step's rows (``engine.batch``): prefill chunks (within ``prefill_chunk`` tokens),
  a decode row per full/lossy request, a draft row per VeriCache request still drafting, and a
  verification chunk per request whose draft is complete (its full KV in place, or landed over
  the link); a request is in at most one row;
- run: one forward over every row, so the weights are read once a step;
- postprocess: each row's result through ``drafting.round`` (accept, commit), finish, free, charge;
  with ``offload``, the link schedule (``engine.schedules``, P1) puts complete drafts on the link.

This is the only generation loop: ``Engine.generate`` (the library), the server and every bench
drive it. An exception in a step fails only the requests it concerns (their KV is freed, their
final output says "error"); the loop goes on.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time

import torch

from vericache.drafting.cost import DraftCost
from vericache.drafting.round import add_draft, finish_round
from vericache.engine import remote
from vericache.engine.batch import DECODE, DRAFT, VERIFY, StepBatch
from vericache.engine.batch import PREFILL as PREFILL_ROW
from vericache.engine.instruments import Instruments, StepRecord, request_stats
from vericache.engine.memory import KVMemory
from vericache.engine.options import RequestOptions, ResolvedOptions
from vericache.engine.request import (
    ABORTED,
    ALLOWED,
    DECODING,
    DONE,
    DRAFTING,
    FAILED,
    FINISHED,
    PREFILL,
    TRANSFERRING,
    WAITING,
    Request,
    StepOutput,
)
from vericache.engine.schedules import SCHEDULERS, make_schedule
from vericache.engine.sequence import Sequence
from vericache.kv.full import FullKVCache
from vericache.kv.link import CudaLink, EmulatedLink, StreamedKV
from vericache.kv.tee import TeeCache
from vericache.sampling import SamplingParams, choose_token

__all__ = ["SCHEDULERS", "ServingEngine", "StepOutput", "WAITING", "PREFILL", "DECODING", "DRAFTING",
           "TRANSFERRING", "FINISHED", "ABORTED", "FAILED", "ALLOWED"]
log = logging.getLogger("vericache.engine")


class ServingEngine:
    def __init__(self, engine, device_budget: int | None = None, host_budget: int | None = None,
                 scheduler: str = "staggered", link=None, prefill_chunk: int = 512, max_running: int = 64,
                 resident_layers: int = 0, offload: bool = True, prefix=None, verifier=None) -> None:
        n_layers = engine.cfg.num_hidden_layers
        if isinstance(resident_layers, bool) or not isinstance(resident_layers, int) or not (
                0 <= resident_layers <= n_layers):
            raise ValueError(f"resident_layers must be an integer in [0, {n_layers}], got {resident_layers!r}")
        if not isinstance(prefill_chunk, int) or prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be an integer >= 1, got {prefill_chunk!r}")
        self.eng = engine
        self.draft_cost = DraftCost()  # draft lengths from this engine's fitted step costs
        self.schedule = make_schedule(scheduler)   # P1: when complete drafts' full KV goes on the link
        # offload: vericache full KV in the host tier, brought over ``link`` for each verification;
        # the first ``resident_layers`` layers of it stay on the device (fewer bytes cross)
        self.memory = KVMemory(engine.cfg, engine.loaded.device, engine.loaded.kv_dtype, device_budget,
                               host_budget, offload, resident_layers, remote=verifier is not None)
        # the remote scenario (engine.remote): a prefix store's fetcher, a verifier elsewhere
        self.prefix, self.verifier = prefix, verifier
        self.wake = threading.Event()  # set when a fetch or a verifier reply lands
        for part in (prefix, verifier):
            if part is not None:
                part.wake = self.wake
        self.device, self.host = self.memory.device, self.memory.host
        self.link = link  # made on first use when None: the first offloaded vericache request needs it
        self.prefill_chunk, self.max_running = prefill_chunk, max_running
        self.requests: dict[int, Request] = {}
        self.instruments = Instruments()
        self._ids = itertools.count()

    # ------------------------------------------------------------------ public API
    def add_request(self, prompt_ids: list[int], params: SamplingParams,
                    options: RequestOptions | ResolvedOptions | None = None, prefill=None, checked: bool = False) -> int:
        """Queue a request; ``options`` override the engine's mode, compressor and draft length;
        ``prefill`` (an ``Engine.shared_prefill`` of this prompt) is loaded instead of recomputed;
        ``checked``: the caller validated the input (``Engine.check_request``) already."""
        return self._add(self.eng.new_sequence(-1, prompt_ids, params, checked), options, prefill)

    def add_sequence(self, seq: Sequence, options: RequestOptions | ResolvedOptions | None = None,
                     prefill=None) -> int:
        """``add_request`` for a ``Sequence`` made by the caller (who reads its output from it)."""
        self.eng.check_request(seq.prompt_ids, seq.params)
        return self._add(seq, options, prefill)

    def _add(self, seq: Sequence, options, prefill) -> int:
        opts = options if isinstance(options, ResolvedOptions) else self.eng.resolve(options)
        req = Request(-1, seq, opts, policy_state=opts.policy.new_state(), prefill=prefill)
        prompt_ids, params = seq.prompt_ids, seq.params
        if prefill is not None:
            prefill.check(seq)
        if self.memory.is_remote(req) and not seq.params.greedy:
            raise ValueError(f"a remote verifier verifies greedy drafts only: temperature must be 0, "
                             f"got {seq.params.temperature}")
        need = self.memory.needed(req) + self.memory.transient(req)
        if self.device.blocks_for(need) > self.device.total_blocks:
            raise ValueError(f"request needs {need} bytes of device KV (prompt {len(prompt_ids)} + max_tokens "
                             f"{params.max_tokens}) but the whole device budget is {self.device.capacity_bytes} bytes")
        req.id = seq.request_id = next(self._ids)  # ids only for accepted requests
        if self.memory.is_offloaded(req) and self.link is None:
            dev = self.eng.loaded.device
            self.link = CudaLink(dev) if dev.type == "cuda" else EmulatedLink(gbps=32)
        self.requests[req.id] = req
        return req.id

    def abort(self, rid: int) -> None:
        req = self.requests.get(rid)
        if req is not None and not req.done:
            self.release(req, ABORTED)

    def has_unfinished(self) -> bool:
        return any(not r.done for r in self.requests.values())

    def forget(self, rid: int) -> None:
        """Drop a finished request's record (a long-running server keeps none); refused while it runs."""
        req = self.requests.get(rid)
        if req is not None and not req.done:
            raise ValueError(f"request {rid} is still {req.state}: abort it first")
        self.requests.pop(rid, None)

    def counts(self) -> tuple[int, int]:
        """(running, waiting) requests: admitted and not done, and not yet admitted."""
        reqs = list(self.requests.values())   # the server's threads read while the engine steps
        waiting = sum(1 for r in reqs if r.state == WAITING)
        return sum(1 for r in reqs if not r.done) - waiting, waiting

    def in_state(self, *states: str) -> list[Request]:
        return [r for r in self.requests.values() if r.state in states]

    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        self._admit()
        remote.poll(self)
        batch = self._plan()
        if batch.rows and self._run(batch):
            t0 = time.perf_counter()
            self._postprocess(batch)
            self.instruments.steps[-1].post = time.perf_counter() - t0
        remote.send_verifies(self)
        if self.link is not None:
            self.schedule.start_transfers(self, self.in_state(DRAFTING))
        if self.link is not None or self.prefix is not None or self.verifier is not None:
            self._wait_if_idle(batch)
        return self.collect_outputs()

    # ------------------------------------------------------------------ admit
    def _admit(self) -> None:
        running = [r for r in self.requests.values() if r.state not in (WAITING, *DONE)]
        reserved = sum(self.memory.needed(r) for r in running)
        transient = max((self.memory.transient(r) for r in running), default=0)
        for req in self.in_state(WAITING):
            need = self.memory.needed(req)
            buf = max(transient, self.memory.transient(req))  # room for one transient at a time
            fits = reserved + need + buf <= self.device.capacity_bytes or not running  # alone it always fits
            if len(running) >= self.max_running or not fits:
                break  # FIFO: later requests wait behind the first that does not fit
            self.set_state(req, PREFILL)
            running.append(req)
            reserved, transient = reserved + need, buf

    # ------------------------------------------------------------------ plan
    def _plan(self) -> StepBatch:
        batch = StepBatch()
        for r in self.in_state(TRANSFERRING):
            if r.session is not None:
                continue  # verified remotely: the reply is applied by remote.poll
            if r.transfer.error:
                self.fail(r, f"transfer failed: {r.transfer.error}")
            elif self._can_verify(r):
                batch.add(r, VERIFY, [r.last_token] + r.round.drafts, r.position,
                          StreamedKV(r.transfer, r.resident), "all")
        budget = self.prefill_chunk
        for r in self.in_state(PREFILL):
            if budget > 0 and not r.prefilled:
                budget -= self._plan_prefill(r, batch, budget)
        for r in self.in_state(DECODING):
            batch.add(r, DECODE, [r.last_token], r.position, r.full if r.mode == "full" else r.draft)
        for r in self.in_state(DRAFTING):
            rs = r.round
            if not rs.started:  # a new round
                k = r.opts.policy.next_len(r.policy_state, r.seq.remaining)
                if self.memory.is_offloaded(r):
                    k = self.schedule.new_round(self, r, k)
                elif k > 0 and r.opts.policy.fixed is None and r.full is not None and r.session is None:
                    k = self._cost_len(r, k, r.seq.remaining)   # full KV here: the local step costs decide
                rs.start(k)
            remote_verified = r.session is not None  # a complete round goes out in remote.send_verifies
            if not rs.complete and (remote_verified or self.schedule.may_draft(self, r)):
                tok = rs.drafts[-1] if rs.drafts else r.last_token
                batch.add(r, DRAFT, [tok], r.position + len(rs.drafts), r.draft)
            elif rs.complete and not remote_verified and not self.memory.is_offloaded(r):  # full KV here: verify
                batch.add(r, VERIFY, [r.last_token] + rs.drafts, r.position, r.full, "all")
        return batch

    def _cost_len(self, r: Request, k: int, remaining: int) -> int:
        """The draft length the fitted step costs call for (``drafting/cost.py``); ``k`` until fitted."""
        pos, k_max = r.position, min(r.opts.policy.max_len, remaining - 1)
        n = len(self.in_state(DRAFTING, DECODING))
        choice = self.draft_cost.choose(r.policy_state.acceptance(), n, r.draft.attention_cost(pos, 1),
                                        lambda j: r.full.attention_cost(pos, j + 1), k_max)
        return k if choice is None else choice

    def _plan_prefill(self, req: Request, batch: StepBatch, budget: int) -> int:
        """Add the request's next prefill chunk; returns the tokens planned."""
        if req.done_ids == 0 and req.full is None and req.draft is None:
            self.memory.allocate(req)
            if req.prefill is not None:  # an exact prefill made elsewhere: load it
                self._load_shared_prefill(req)
                if req.state != PREFILL:
                    return 0
            remote.start(self, req)
        if remote.fetch_pending(self, req):
            return 0
        ids = req.prefill_ids
        n = min(budget, len(ids) - req.done_ids)
        full = req.prefill_buf or req.full
        if req.mode == "full":
            cache = full
        elif req.mode == "lossy" or self.memory.is_remote(req):
            cache = req.draft
        else:
            cache = TeeCache(full, req.draft)
        chunk = ids[req.done_ids : req.done_ids + n]
        last = req.done_ids + n == len(ids)
        batch.add(req, PREFILL_ROW, chunk, req.done_ids, cache, "last" if last else "none")
        return n

    def _load_shared_prefill(self, req: Request) -> None:
        """Take the prompt's exact prefill (made once, elsewhere) and compress it: prefill work, so it
        is recorded as a "load" interval, which benches leave out of decode time."""
        t0, shared = time.perf_counter(), req.prefill
        if req.draft is not None:
            req.draft.load_prefill(shared.reset(req.seq), shared.queries)
        req.done_ids = shared.prompt_len
        if req.done_ids == len(req.seq.prompt_ids) + max(len(req.seq.output_ids) - 1, 0):
            self._finish_prefill(req, shared.logits, shared.full)
        self.instruments.note_interval(t0, time.perf_counter(), "load")

    # ------------------------------------------------------------------ run
    def _run(self, batch: StepBatch) -> bool:
        """One forward; on an exception every request in the batch fails (and the loop goes on)."""
        for row in batch.of(VERIFY):
            if isinstance(row.cache, StreamedKV) and not row.req.transfer.ready():
                self.instruments.early_verifies += 1
        work = batch.attention_work()
        t0 = time.perf_counter()
        try:
            n_draft = sum(len(r.tokens) for r in batch.of(DRAFT))
            batch.run(self.eng.model, self.eng.loaded.device, draft_weights=self.eng.draft_kind(n_draft))
        except Exception as exc:  # noqa: BLE001 - whatever broke, the other requests go on
            log.exception("step forward failed for requests %s", [r.req.id for r in batch.rows])
            for row in batch.rows:
                self.fail(row.req, f"{type(exc).__name__}: {exc}")
            return False
        t1 = time.perf_counter()
        self.instruments.note_interval(t0, t1, batch.kinds)
        self.instruments.steps.append(StepRecord(t0, t1, batch.kinds, len(batch.rows), *work))
        self.draft_cost.tick(self.instruments.steps)
        if batch.of(VERIFY) and batch.kinds == VERIFY:  # a clean measurement of the verification
            self.instruments.note_verify(t1 - t0, self.eng.cfg.num_hidden_layers)
        return True

    # ------------------------------------------------------------------ postprocess
    def _postprocess(self, batch: StepBatch) -> None:
        handlers = {PREFILL_ROW: self._after_prefill, DECODE: self._after_decode,
                    DRAFT: self._after_draft, VERIFY: self._after_verify}
        for row in batch.rows:
            req = row.req
            if req.done or req.state == WAITING:
                continue  # aborted, or preempted by an earlier row's growth in this step
            try:
                handlers[row.kind](req, row)
                if req.seq.finished:
                    self.release(req, FINISHED)
                elif req.state not in (WAITING, *DONE):
                    self.charge(req)
            except Exception as exc:  # noqa: BLE001 - this request fails; the others go on
                log.exception("request %s failed in %s", req.id, row.kind)
                self.fail(req, f"{type(exc).__name__}: {exc}")

    def _after_prefill(self, req: Request, row) -> None:
        req.done_ids += len(row.tokens)
        if row.logits is not None:
            self._finish_prefill(req, row.logits[0], req.prefill_buf or req.full)

    def _finish_prefill(self, req: Request, logits: torch.Tensor, context: FullKVCache | None) -> None:
        """The prompt (and any recomputed output) is in the caches: compress, pick the first token."""
        eng, seq, n = self.eng, req.seq, req.done_ids
        if req.prefill_buf is not None:  # home to the host tier
            req.full.load(req.prefill_buf, n)
        if req.draft is not None:
            comp = req.opts.compressor
            ids = req.prefill_ids
            # a prompt partly loaded from the prefix store has no whole-prompt context here
            scores = None if req.draft.res_start else comp.on_prefill(
                eng.model, context or req.draft.residual, ids, eng.tokenizer)
            req.draft.set_prefill_scores(scores, n)
            # compression starts once the whole prompt is in (an exact prefill); beside a full
            # cache the draft cache takes the prompt's K/V from it
            req.draft.commit(n, source=context)
        if req.resident is not None:  # the resident layers go up once
            req.resident.load(req.prefill_buf or req.full, n)
        req.prefill_buf = None
        if self.memory.is_remote(req):  # the first token is the verifier's (exact), not the drafter's
            req.prefilled = True
            if seq.output_ids:
                self.set_state(req, DRAFTING)
            return
        if not seq.output_ids:
            seq.append(choose_token(logits, seq.params, seq.generator))
            req.first_token_at = time.perf_counter()
        self.set_state(req, DRAFTING if req.mode == "vericache" else DECODING)

    def _after_decode(self, req: Request, row) -> None:
        if req.draft is not None:  # lossy: the drafter's own K/V are final
            req.draft_bytes_read += req.draft.nbytes()
            req.draft.commit(req.position + 1)
        params = req.seq.params
        req.seq.append(row.argmax[0] if params.greedy else choose_token(row.logits[0], params, req.seq.generator))

    def _after_draft(self, req: Request, row) -> None:
        req.draft_bytes_read += req.draft.nbytes()
        add_draft(req.seq, req.round, row.logits[0], row.argmax[0])

    def _after_verify(self, req: Request, row) -> None:
        rs, start = req.round, req.position
        write_back = None
        if isinstance(row.cache, StreamedKV):
            write_back = lambda s, e: self._write_back(req, row.cache, s, e)  # noqa: E731
        req.verify_bytes_read += req.full.nbytes()
        m = finish_round(req.seq, rs, row.logits, start, req.full, req.draft, write_back, row.argmax)
        self.round_done(req, m)
        if req.state == TRANSFERRING:
            self.device.free(("verify", req.id))
            req.transfer = None
            self.set_state(req, DRAFTING)

    def _write_back(self, req: Request, view: StreamedKV, start: int, keep: int) -> None:
        """The verified positions, written on the device, back to the host tier."""
        res = self.memory.resident_layers
        req.full.begin(start, keep - start)
        req.full.k[res:, :, start:keep] = view.buf.k[:, :, start:keep]
        req.full.v[res:, :, start:keep] = view.buf.v[:, :, start:keep]
        if req.resident is not None:  # the resident layers were written on the device
            req.full.k[:res, :, start:keep] = req.resident.k[:, :, start:keep]
            req.full.v[:res, :, start:keep] = req.resident.v[:, :, start:keep]
            req.resident.truncate(keep)

    # ------------------------------------------------------------------ the link (offloaded vericache)
    def start_transfer(self, req: Request) -> bool:
        """Reserve a device buffer for the request's full KV and queue it on the link."""
        if req.state != DRAFTING or not req.round.complete:
            return False
        nbytes = self.memory.verify_buffer_bytes(req)
        key = ("verify", req.id)
        if not self.device.can_fit(nbytes, key):
            if not self.in_state(TRANSFERRING):  # no buffer will come back by itself
                self._make_room(nbytes, key, req)
            if not self.device.can_fit(nbytes, key):
                return False  # no room for the buffer now; retry next step
        self.device.resize(key, nbytes)
        n_layers = self.eng.cfg.num_hidden_layers
        buf = FullKVCache(self.eng.cfg, self.eng.loaded.device, self.eng.loaded.kv_dtype,
                          capacity=req.full.length + req.round.k + 1, layers=n_layers - self.memory.resident_layers)
        req.transfer = self.link.submit(req.full, req.full.length, buf, first_layer=self.memory.resident_layers)
        self.set_state(req, TRANSFERRING)
        return True

    def _can_verify(self, req: Request) -> bool:
        """Start verifying before the last layers land when, at the measured rates, they will land
        before the forward reaches them: r layers still in flight take r * t_link_layer, the forward
        spends (L - r) * t_verify_layer on the layers already there."""
        streamed = req.transfer.dst.k.shape[0]
        done = req.transfer.layers_done()
        if done == streamed:
            return True
        if self.schedule.verifies_in_turn:
            return req is min(self.in_state(TRANSFERRING), key=lambda r: r.id)
        ahead = self.memory.resident_layers + done  # layers the forward can do without waiting
        rates = self.measured_rates()
        if rates is None or self.instruments.verify_layer_s <= 0 or ahead == 0:
            return False
        link_layer_s = req.full.nbytes() / self.eng.cfg.num_hidden_layers / rates[0]
        return (streamed - done) * link_layer_s <= ahead * self.instruments.verify_layer_s

    def measured_rates(self) -> tuple[float, float] | None:
        """(link bytes per second, seconds per draft step), measured so far; None before both exist."""
        stats = self.link.stats if self.link is not None else None
        step_s = self.instruments.draft_step_s()
        if stats is None or stats.busy_s <= 0 or step_s is None:
            return None
        return stats.bytes_moved / stats.busy_s, step_s

    def _wait_if_idle(self, batch: StepBatch) -> None:
        """Nothing to compute until a transfer lands: block on it rather than spin."""
        if not batch.rows and remote.waiting_on_remote(self):
            self.wake.wait(0.05)  # a fetch or a verifier reply wakes it
            self.wake.clear()
            return
        in_flight = self.in_state(TRANSFERRING)
        if in_flight and not batch.rows and not self.in_state(PREFILL, DECODING) and not any(
                not r.round.complete for r in self.in_state(DRAFTING)):
            min(in_flight, key=lambda r: r.id).transfer.wait_all()

    # ------------------------------------------------------------------ memory
    def charge(self, req: Request) -> None:
        """Charge the tiers for what the request holds now; preempt newer requests if the device is full."""
        self._make_room(self.memory.device_bytes(req), ("kv", req.id), req)
        if req.state not in (WAITING, *DONE) and self.memory.fits(req):
            self.memory.charge(req)

    def _make_room(self, nbytes: int, key: tuple, req: Request) -> None:
        """Preempt newer requests (newest first) until ``nbytes`` fit; if none is newer, ``req`` itself
        goes back to waiting (its growth does not fit beside the older ones)."""
        while not self.device.can_fit(nbytes, key):
            victims = [r for r in self.requests.values()
                       if r.state in (PREFILL, DECODING, DRAFTING) and r is not req and r.id > req.id]
            if not victims:
                if key[0] == "kv" and req.state in (DECODING, DRAFTING):
                    self._preempt(req)
                return
            self._preempt(max(victims, key=lambda r: r.id))

    def _preempt(self, req: Request) -> None:
        self.instruments.preemptions += 1
        self._free(req)
        req.done_ids = 0
        req.round.reset()
        self.set_state(req, WAITING)

    def _free(self, req: Request) -> None:
        if req.session is not None:  # cancels the stream: the verifier frees its KV
            req.session.close()
            req.session = None
        if req.fetch is not None:
            req.fetch.cancel()
            req.fetch = None
        req.prefilled = False
        if req.transfer is not None:
            req.transfer.cancel()  # the copier skips what it has not started; the buffer dies with it
            req.transfer = None
        self.memory.free(req)

    # ------------------------------------------------------------------ the request lifecycle
    # (public: engine.remote drives remote rounds through them)
    def release(self, req: Request, state: str) -> None:
        """End a request in ``state`` (finished, aborted, failed): its stats, then its memory."""
        req.finished_at = time.perf_counter()
        req.seq.stats.update(request_stats(req))  # before the caches go
        self._free(req)
        self.set_state(req, state)

    def fail(self, req: Request, error: str, status: int = 500) -> None:
        """End a request with an error (``status``: the HTTP status its caller answers)."""
        if req.done:
            return
        self.instruments.failures += 1
        req.error, req.error_status = error, status
        self.release(req, FAILED)

    def round_done(self, req: Request, m: int) -> None:
        """A verified round with ``m`` of its drafts accepted (already appended and committed):
        the round log (metrics), the draft-length policy, and a fresh round."""
        rs = req.round
        self.instruments.round_log.append((req.id, len(rs.drafts), m))
        req.opts.policy.update(req.policy_state, len(rs.drafts), m)
        rs.reset()

    def fail_unfinished(self, error: str) -> list[StepOutput]:
        """Fail every request not yet done (the step loop itself broke) and report them."""
        for req in list(self.requests.values()):
            if not req.done:
                try:
                    self.fail(req, error)
                except Exception:  # noqa: BLE001 - its state is broken too: end it regardless
                    req.state, req.error = FAILED, error
                    self.memory.free(req)
        return self.collect_outputs()

    def set_state(self, req: Request, state: str) -> None:
        """Move a request along ``request.ALLOWED`` (RuntimeError on any other transition)."""
        if state not in ALLOWED.get(req.state, set()):
            raise RuntimeError(f"request {req.id}: illegal transition {req.state} -> {state}")
        req.state = state

    # ------------------------------------------------------------------ outputs
    def collect_outputs(self) -> list[StepOutput]:
        """Tokens not yet reported, and each request's end (once)."""
        outs = []
        for req in self.requests.values():
            if req.reported:
                continue
            new = req.seq.output_ids[req.emitted :]
            if new or req.done:
                reason = {FINISHED: req.seq.finish_reason, ABORTED: "abort", FAILED: "error"}.get(req.state)
                outs.append(StepOutput(req.id, list(new), req.done, reason, req.error))
                req.emitted, req.reported = len(req.seq.output_ids), req.done
        return outs
