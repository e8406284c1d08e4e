"""The request table: every request of one step loop, and its lifecycle in one place.

A request's state moves only through ``set_state`` (along ``request.ALLOWED``); it ends only through
``release`` (finished, aborted) or ``fail``, which free everything it holds at once. The step loop,
its scheduler, its remote half, the link schedules and the background service all go through these
calls; none of them writes a state or frees KV by itself.
"""

from __future__ import annotations

import itertools
import time
from typing import Callable, Iterator

from vericache.engine.instruments import Instruments, request_stats
from vericache.engine.memory import KVMemory
from vericache.engine.request import ALLOWED, DONE, Request, State, StepOutput

MakeRoom = Callable[[int, tuple, Request], None]   # (bytes, device key, for whom): preempts to fit


class RequestTable:
    def __init__(self, memory: KVMemory, instruments: Instruments, make_room: MakeRoom) -> None:
        self.memory, self.instruments, self.make_room = memory, instruments, make_room
        self._by_id: dict[int, Request] = {}
        self._ids = itertools.count()

    # ------------------------------------------------------------------ the table
    def add(self, req: Request) -> int:
        """Give an accepted request its id (ids go only to accepted requests) and enter it. (The
        sequence keeps its own ``request_id``: it may be the caller's object.)"""
        req.id = next(self._ids)
        self._by_id[req.id] = req
        return req.id

    def get(self, rid: int) -> Request | None:
        return self._by_id.get(rid)

    def __getitem__(self, rid: int) -> Request:
        return self._by_id[rid]

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._by_id.values()))   # a copy: the server's threads read while the loop steps

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, rid: int) -> bool:
        return rid in self._by_id

    def in_state(self, *states: State) -> list[Request]:
        return [r for r in self if r.state in states]

    def has_unfinished(self) -> bool:
        return any(not r.done for r in self)

    def counts(self) -> tuple[int, int]:
        """(running, waiting) requests: admitted and not done, and not yet admitted."""
        reqs = list(self)
        waiting = sum(1 for r in reqs if r.state == State.WAITING)
        return sum(1 for r in reqs if not r.done) - waiting, waiting

    def forget(self, rid: int) -> None:
        """Drop a finished request's record (a long-running server keeps none); refused while it runs."""
        req = self._by_id.get(rid)
        if req is not None and not req.done:
            raise ValueError(f"request {rid} is still {req.state}: abort it first")
        self._by_id.pop(rid, None)

    # ------------------------------------------------------------------ the lifecycle
    def set_state(self, req: Request, state: State) -> None:
        """Move a request along ``request.ALLOWED`` (RuntimeError on any other transition)."""
        if state not in ALLOWED.get(req.state, set()):
            raise RuntimeError(f"request {req.id}: illegal transition {req.state} -> {state}")
        req.state = state

    def release(self, req: Request, state: State) -> None:
        """End a request in ``state`` (finished, aborted, failed): its stats, then its memory."""
        req.finished_at = time.perf_counter()
        req.seq.stats.update(request_stats(req))  # before the caches go
        self.drop_kv(req)
        self.set_state(req, state)

    def fail(self, req: Request, error: str, status: int = 500) -> None:
        """End a request with an error (``status``: the HTTP status its caller answers)."""
        if req.done:
            return
        self.instruments.failures += 1
        req.error, req.error_status = error, status
        self.release(req, State.FAILED)

    def fail_unfinished(self, error: str) -> None:
        """Fail every request not yet done (the step loop itself broke)."""
        for req in self:
            if not req.done:
                try:
                    self.fail(req, error)
                except Exception:  # noqa: BLE001 - its state is broken too: end it regardless
                    req.state, req.error = State.FAILED, error
                    self.memory.free(req)

    def drop_kv(self, req: Request) -> None:
        """Let go of everything the request holds: its verifier session, fetch, transfer and KV."""
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

    def charge(self, req: Request) -> None:
        """Charge the tiers for what the request holds now; preempt newer requests if the device is full."""
        self.make_room(self.memory.device_bytes(req), ("kv", req.id), req)
        if req.state not in (State.WAITING, *DONE) and self.memory.fits(req):
            self.memory.charge(req)

    def round_done(self, req: Request, m: int) -> None:
        """A verified round with ``m`` of its drafts accepted (already appended and committed):
        the round log (metrics), the draft-length policy, and a fresh round."""
        rs = req.round
        self.instruments.round_log.append((req.id, len(rs.drafts), m))
        req.opts.policy.update(req.policy_state, len(rs.drafts), m)
        rs.reset()

    # ------------------------------------------------------------------ outputs
    def collect_outputs(self) -> list[StepOutput]:
        """Tokens not yet reported, and each request's end (once)."""
        outs = []
        for req in self:
            if req.reported:
                continue
            new = req.seq.output_ids[req.emitted :]
            if new or req.done:
                reason = {State.FINISHED: req.seq.finish_reason, State.ABORTED: "abort",
                          State.FAILED: "error"}.get(req.state)
                outs.append(StepOutput(req.id, list(new), req.done, reason, req.error))
                req.emitted, req.reported = len(req.seq.output_ids), req.done
        return outs
