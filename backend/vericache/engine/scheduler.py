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

from vericache.engine import postprocess, remote, transfers
from vericache.engine.batch import DECODE, DRAFT, VERIFY, StepBatch
from vericache.engine.batch import PREFILL as PREFILL_ROW
from vericache.engine.request import DECODING, DONE, DRAFTING, PREFILL, TRANSFERRING, WAITING, Request
from vericache.kv.link import StreamedKV
from vericache.kv.tee import TeeCache


class Scheduler:
    def __init__(self, srv) -> None:
        self.srv = srv   # the step loop (``engine.serving.ServingEngine``): its requests and memory

    # ------------------------------------------------------------------ admit
    def admit(self) -> None:
        srv = self.srv
        running = [r for r in srv.requests.values() if r.state not in (WAITING, *DONE)]
        reserved = sum(srv.memory.needed(r) for r in running)
        transient = max((srv.memory.transient(r) for r in running), default=0)
        for req in srv.in_state(WAITING):
            need = srv.memory.needed(req)
            buf = max(transient, srv.memory.transient(req))  # room for one transient at a time
            fits = reserved + need + buf <= srv.device.capacity_bytes or not running  # alone it always fits
            if len(running) >= srv.max_running or not fits:
                break  # FIFO: later requests wait behind the first that does not fit
            srv.set_state(req, PREFILL)
            running.append(req)
            reserved, transient = reserved + need, buf

    # ------------------------------------------------------------------ plan
    def plan(self) -> StepBatch:
        srv, batch = self.srv, StepBatch()
        for r in srv.in_state(TRANSFERRING):
            if r.session is not None:
                continue  # verified remotely: the reply is applied by remote.poll
            if r.transfer.error:
                srv.fail(r, f"transfer failed: {r.transfer.error}")
            elif transfers.can_verify(srv, r):
                batch.add(r, VERIFY, [r.last_token] + r.round.drafts, r.position,
                          StreamedKV(r.transfer, r.resident), "all")
        budget = srv.prefill_chunk
        for r in srv.in_state(PREFILL):
            if budget > 0 and not r.prefilled:
                budget -= self._plan_prefill(r, batch, budget)
        for r in srv.in_state(DECODING):
            batch.add(r, DECODE, [r.last_token], r.position, r.full if r.mode == "full" else r.draft)
        for r in srv.in_state(DRAFTING):
            rs = r.round
            if not rs.started:  # a new round
                k = r.opts.policy.next_len(r.policy_state, r.seq.remaining)
                if srv.memory.is_offloaded(r):
                    k = srv.schedule.new_round(srv, r, k)
                elif k > 0 and r.opts.policy.fixed is None and r.full is not None and r.session is None:
                    k = self._cost_len(r, k, r.seq.remaining)   # full KV here: the local step costs decide
                rs.start(k)
            remote_verified = r.session is not None  # a complete round goes out in remote.send_verifies
            if not rs.complete and (remote_verified or srv.schedule.may_draft(srv, r)):
                tok = rs.drafts[-1] if rs.drafts else r.last_token
                batch.add(r, DRAFT, [tok], r.position + len(rs.drafts), r.draft)
            elif rs.complete and not remote_verified and not srv.memory.is_offloaded(r):  # full KV here: verify
                batch.add(r, VERIFY, [r.last_token] + rs.drafts, r.position, r.full, "all")
        return batch

    def _cost_len(self, r: Request, k: int, remaining: int) -> int:
        """The draft length the fitted step costs call for (``drafting/cost.py``); ``k`` until fitted."""
        pos, k_max = r.position, min(r.opts.policy.max_len, remaining - 1)
        n = len(self.srv.in_state(DRAFTING, DECODING))
        choice = self.srv.draft_cost.choose(r.policy_state.acceptance(), n, r.draft.attention_cost(pos, 1),
                                            lambda j: r.full.attention_cost(pos, j + 1), k_max)
        return k if choice is None else choice

    def _plan_prefill(self, req: Request, batch: StepBatch, budget: int) -> int:
        """Add the request's next prefill chunk; returns the tokens planned."""
        srv = self.srv
        if req.done_ids == 0 and req.full is None and req.draft is None:
            srv.memory.allocate(req)
            if req.prefill is not None:  # an exact prefill made elsewhere: load it
                self._load_shared_prefill(req)
                if req.state != PREFILL:
                    return 0
            remote.start(srv, req)
        if remote.fetch_pending(srv, req):
            return 0
        ids = req.prefill_ids
        n = min(budget, len(ids) - req.done_ids)
        full = req.prefill_buf or req.full
        if req.mode == "full":
            cache = full
        elif req.mode == "lossy" or srv.memory.is_remote(req):
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
            postprocess.finish_prefill(self.srv, req, shared.logits, shared.full)
        self.srv.instruments.note_interval(t0, time.perf_counter(), "load")

    # ------------------------------------------------------------------ preemption
    def make_room(self, nbytes: int, key: tuple, req: Request) -> None:
        """Preempt newer requests (newest first) until ``nbytes`` fit; if none is newer, ``req`` itself
        goes back to waiting (its growth does not fit beside the older ones)."""
        srv = self.srv
        while not srv.device.can_fit(nbytes, key):
            victims = [r for r in srv.requests.values()
                       if r.state in (PREFILL, DECODING, DRAFTING) and r is not req and r.id > req.id]
            if not victims:
                if key[0] == "kv" and req.state in (DECODING, DRAFTING):
                    self.preempt(req)
                return
            self.preempt(max(victims, key=lambda r: r.id))

    def preempt(self, req: Request) -> None:
        """Back to waiting with nothing held: it is prefilled again when admitted."""
        srv = self.srv
        srv.instruments.preemptions += 1
        srv.drop_kv(req)
        req.done_ids = 0
        req.round.reset()
        srv.set_state(req, WAITING)
