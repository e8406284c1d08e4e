"""The scheduler of the step loop: which requests run (admission against the device budget,
preemption when one's growth does not fit) and which rows each step carries (planning).

- admit: waiting requests enter, first come first served, while their KV fits beside the running
  ones (``engine.memory``); a request alone always fits.
- plan: a verification chunk per request whose full KV is in place (or has landed over the link),
  prefill chunks within ``prefill_chunk`` tokens, a decode row per full/lossy request, a draft row per
  VeriCache request still drafting, and a local verification per complete draft; a request is in at
  most one row. A new round's draft length comes from the request's policy, then the link schedule
  (offloaded KV) or the fitted step costs (``drafting.cost``, full KV here).
- make room: newer requests are preempted, newest first, until a request's KV fits.
"""

from __future__ import annotations

import time

from vericache.engine import postprocess, remote_rounds, transfers
from vericache.engine.batch import RowKind, StepBatch
from vericache.engine.request import DONE, Request, State
from vericache.kv.link import StreamedKV
from vericache.kv.tee import TeeCache


class Scheduler:
    def __init__(self, loop) -> None:
        self.loop = loop   # the step loop (``engine.step_loop.StepLoop``): its requests and memory

    # ------------------------------------------------------------------ admit
    def admit(self) -> None:
        loop = self.loop
        running = [r for r in loop.requests if r.state not in (State.WAITING, *DONE)]
        reserved = sum(loop.memory.needed(r) for r in running)
        transient = max((loop.memory.transient(r) for r in running), default=0)
        for req in loop.requests.in_state(State.WAITING):
            need = loop.memory.needed(req)
            buf = max(transient, loop.memory.transient(req))  # room for one transient at a time
            fits = reserved + need + buf <= loop.device.capacity_bytes or not running  # alone it always fits
            if len(running) >= loop.max_running or not fits:
                break  # FIFO: later requests wait behind the first that does not fit
            loop.requests.set_state(req, State.PREFILL)
            running.append(req)
            reserved, transient = reserved + need, buf

    # ------------------------------------------------------------------ plan
    def plan(self) -> StepBatch:
        loop, batch = self.loop, StepBatch()
        for r in loop.requests.in_state(State.TRANSFERRING):
            if r.transfer.error:
                loop.requests.fail(r, f"transfer failed: {r.transfer.error}")
            elif transfers.can_verify(loop, r):
                batch.add(r, RowKind.VERIFY, [r.last_token] + r.round.drafts, r.position,
                          StreamedKV(r.transfer, r.resident), "all")
        budget = loop.prefill_chunk
        for r in loop.requests.in_state(State.PREFILL):
            if budget > 0 and not r.prefilled:
                budget -= self._plan_prefill(r, batch, budget)
        for r in loop.requests.in_state(State.DECODING):
            batch.add(r, RowKind.DECODE, [r.last_token], r.position, r.full if r.mode == "full" else r.draft)
        for r in loop.requests.in_state(State.DRAFTING):
            rs = r.round
            if not rs.started:  # a new round
                k = r.opts.policy.next_len(r.policy_state, r.seq.remaining)
                if loop.memory.is_offloaded(r):
                    k = loop.schedule.new_round(loop, r, k)
                elif k > 0 and r.opts.policy.fixed is None and r.full is not None and r.session is None:
                    k = self._cost_len(r, k, r.seq.remaining)   # full KV here: the local step costs decide
                rs.start(k)
            remote_verified = r.session is not None  # a complete round goes out in remote_rounds.send_verifies
            if not rs.complete and (remote_verified or loop.schedule.may_draft(loop, r)):
                tok = rs.drafts[-1] if rs.drafts else r.last_token
                batch.add(r, RowKind.DRAFT, [tok], r.position + len(rs.drafts), r.draft)
            elif rs.complete and not remote_verified and not loop.memory.is_offloaded(r):  # full KV here: verify
                batch.add(r, RowKind.VERIFY, [r.last_token] + rs.drafts, r.position, r.full, "all")
        return batch

    def _cost_len(self, r: Request, k: int, remaining: int) -> int:
        """The draft length the fitted step costs call for (``drafting/cost.py``); ``k`` until fitted."""
        pos, k_max = r.position, min(r.opts.policy.max_len, remaining - 1)
        n = len(self.loop.requests.in_state(State.DRAFTING, State.DECODING))
        choice = self.loop.draft_cost.choose(r.policy_state.acceptance(), n, r.draft.attention_cost(pos, 1),
                                            lambda j: r.full.attention_cost(pos, j + 1), k_max)
        return k if choice is None else choice

    def _plan_prefill(self, req: Request, batch: StepBatch, budget: int) -> int:
        """Add the request's next prefill chunk; returns the tokens planned."""
        loop = self.loop
        if req.done_ids == 0 and req.full is None and req.draft is None:
            loop.memory.allocate(req)
            if req.prefill is not None:  # an exact prefill made elsewhere: load it
                self._load_shared_prefill(req)
                if req.state != State.PREFILL:
                    return 0
            remote_rounds.start(loop, req)
        if remote_rounds.fetch_pending(loop, req):
            return 0
        ids = req.prefill_ids
        n = min(budget, len(ids) - req.done_ids)
        full = req.prefill_buf or req.full
        if req.mode == "full":
            cache = full
        elif req.mode == "lossy" or loop.memory.is_remote(req):
            cache = req.draft
        else:
            cache = TeeCache(full, req.draft)
        chunk = ids[req.done_ids : req.done_ids + n]
        last = req.done_ids + n == len(ids)
        batch.add(req, RowKind.PREFILL, chunk, req.done_ids, cache, "last" if last else "none")
        return n

    def _load_shared_prefill(self, req: Request) -> None:
        """Take the prompt's exact prefill (made once, elsewhere) and compress it: prefill work, so it
        is recorded as a "load" interval, which benches leave out of decode time."""
        t0, shared = time.perf_counter(), req.prefill
        if req.draft is not None:
            req.draft.load_prefill(shared.reset(req.seq), shared.queries)
        req.done_ids = shared.prompt_len
        if req.done_ids == len(req.seq.prompt_ids) + max(len(req.seq.output_ids) - 1, 0):
            postprocess.finish_prefill(self.loop, req, shared.logits, shared.full)
        self.loop.instruments.note_interval(t0, time.perf_counter(), "load")

    # ------------------------------------------------------------------ preemption
    def make_room(self, nbytes: int, key: tuple, req: Request) -> None:
        """Preempt newer requests (newest first) until ``nbytes`` fit; if none is newer, ``req`` itself
        goes back to waiting (its growth does not fit beside the older ones)."""
        loop = self.loop
        while not loop.device.can_fit(nbytes, key):
            victims = [r for r in loop.requests
                       if r.state in (State.PREFILL, State.DECODING, State.DRAFTING) and r is not req and r.id > req.id]
            if not victims:
                if key[0] == "kv" and req.state in (State.DECODING, State.DRAFTING):
                    self.preempt(req)
                return
            self.preempt(max(victims, key=lambda r: r.id))

    def preempt(self, req: Request) -> None:
        """Back to waiting with nothing held: it is prefilled again when admitted."""
        loop = self.loop
        loop.instruments.preemptions += 1
        loop.requests.drop_kv(req)
        req.done_ids = 0
        req.round.reset()
        loop.requests.set_state(req, State.WAITING)
