"""The engine as a service: a background step loop, a bounded queue, per-request delta streams.

No Triton or HTTP imports: the gateway's embedded backend and the Triton model both drive this.
Threading model: one thread owns the ``StepLoop`` and runs ``step()``; other threads only
put commands (submit, abort) on a queue that the loop drains between steps, and read deltas from
each request's own queue. Aborting frees the request's KV at the next loop turn (milliseconds).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from vericache.engine.requests import State
from vericache.engine.options import RequestOptions
from vericache.engine.step_loop import StepLoop
from vericache.sampling import SamplingParams

log = logging.getLogger("vericache.service")


class QueueFull(RuntimeError):
    """The bounded request queue is full: the caller should retry later (HTTP 429)."""


class ServiceStopped(RuntimeError):
    """The service is shutting down or has stopped (HTTP 503)."""


@dataclass
class Delta:
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None = None
    stats: dict = field(default_factory=dict)


class RequestStream:
    """Deltas of one request, in order; ``get`` blocks, ``None`` timeouts raise queue.Empty."""

    def __init__(self, rid: int, prompt_tokens: int) -> None:
        self.id = rid
        self.prompt_tokens = prompt_tokens
        self._q: queue.Queue[Delta] = queue.Queue()

    def put(self, d: Delta) -> None:
        self._q.put(d)

    def get(self, timeout: float | None = None) -> Delta:
        return self._q.get(timeout=timeout)


MetricsSink = Callable[[str, dict], None]  # (event, fields): "request_done", "step", ...


class BackgroundService:
    def __init__(self, loop: StepLoop, max_queue: int = 64, metrics: MetricsSink | None = None) -> None:
        from vericache.model.exact_linear import resident_weight_bytes

        self.loop = loop
        self.weight_bytes = resident_weight_bytes(loop.runner.model)   # for the weight-bytes gauge
        self.tokenizer = loop.runner.tokenizer
        self.max_queue = max_queue
        self.metrics = metrics or (lambda event, fields: None)
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[int, RequestStream] = {}
        self._texts: dict[int, str] = {}
        self._arrival: dict[int, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._draining = False
        self._broken = False
        self._step_errors = 0
        self._thread = threading.Thread(target=self._run, name="vericache-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ callers' side
    def submit(self, prompt_ids: list[int], params: SamplingParams,
               options: RequestOptions | None = None, checked: bool = False) -> RequestStream:
        """Validate (unless ``checked``: the caller ran ``ModelRunner.check_request``), enqueue, and return
        the request's stream. ``options`` override the server's mode, compressor and draft length for
        this request. Raises ValueError, TypeError, QueueFull, ServiceStopped."""
        if self._stop.is_set() or self._draining:
            raise ServiceStopped("the engine is shutting down")
        if not checked:
            self.loop.runner.check_request(prompt_ids, params)  # bad input fails here, before queueing
        opts = self.loop.runner.resolve(options)
        with self._lock:
            if self.num_waiting() + self._commands.qsize() >= self.max_queue:
                raise QueueFull(f"request queue is full ({self.max_queue} waiting)")
            done = threading.Event()
            holder: dict = {}
            self._commands.put(("submit", prompt_ids, params, opts, holder, done))
        if not done.wait(timeout=30):
            raise ServiceStopped("the engine loop did not accept the request")
        if "error" in holder:
            raise holder["error"]
        return holder["stream"]

    def abort(self, rid: int) -> None:
        self._commands.put(("abort", rid))

    def num_running(self) -> int:
        return self.loop.requests.counts()[0]

    def num_waiting(self) -> int:
        return self.loop.requests.counts()[1]

    def healthy(self) -> bool:
        """False only when the engine cannot go on (its thread is gone or its steps keep failing)."""
        return self._thread.is_alive() and not self._stop.is_set() and not self._broken

    def shutdown(self, drain_timeout: float = 30.0) -> None:
        """Stop accepting, let in-flight requests finish (up to ``drain_timeout``), then stop."""
        self._draining = True
        deadline = time.time() + drain_timeout
        while self.loop.has_unfinished() and time.time() < deadline:
            time.sleep(0.02)
        self._stop.set()
        self._thread.join(timeout=5)
        if self.loop.link is not None:
            self.loop.link.close()

    # ------------------------------------------------------------------ the engine thread
    def _run(self) -> None:
        while not self._stop.is_set():
            self._drain_commands()
            if not self.loop.has_unfinished():
                try:  # idle: sleep until a command arrives
                    self._handle(self._commands.get(timeout=0.05))
                except queue.Empty:
                    pass
                continue
            try:
                outs = self.loop.step()
                self._step_errors = 0
            except Exception:  # noqa: BLE001 - the engine's own bookkeeping broke: fail what runs, go on
                log.exception("engine step failed")
                self._step_errors += 1
                outs = self.loop.fail_unfinished("the engine step failed; see the server log")
                if self._step_errors >= 3:  # it keeps failing: the engine cannot go on (/health: 503)
                    self._broken = True
                    self._stop.set()
            phases, rounds, rtts = self.loop.instruments.take_events()
            now, wall = time.perf_counter(), time.time()
            for start, end, kind in phases:   # ``end``: wall-clock, so traces of several processes line up
                self.metrics("phase", {"kind": kind, "seconds": end - start, "end": wall - (now - end)})
            for rid, drafted, accepted in rounds:
                self.metrics("round", {"drafted": drafted, "accepted": accepted, **self._labels(rid)})
            for rtt in rtts:
                self.metrics("verifier_rtt", {"seconds": rtt})
            self._drain_remote_events()
            for o in outs:
                self._deliver(o)

    def _drain_remote_events(self) -> None:
        """Prefix fetches and store outages (``remote.fetch``) as metrics events."""
        prefix = self.loop.prefix
        while prefix is not None and prefix.events:
            event, fields = prefix.events.pop(0)
            self.metrics(event, fields)

    def _drain_commands(self) -> None:
        while True:
            try:
                self._handle(self._commands.get_nowait())
            except queue.Empty:
                return

    def _handle(self, cmd) -> None:
        if cmd[0] == "submit":
            _, prompt_ids, params, opts, holder, done = cmd
            try:
                rid = self.loop.add_request(prompt_ids, params, opts, checked=True)  # submit checked it
                holder["stream"] = self._streams[rid] = RequestStream(rid, len(prompt_ids))
                self._texts[rid] = ""
                self._arrival[rid] = time.perf_counter()
            except ValueError as exc:
                holder["error"] = exc
            done.set()
        elif cmd[0] == "abort":
            self.loop.abort(cmd[1])
            for o in self.loop.collect_outputs():  # report the abort at once, even when idle
                self._deliver(o)

    def _labels(self, rid: int) -> dict:
        """The request's mode and compressor (metric labels and response stats)."""
        req = self.loop.requests.get(rid)
        if req is None:
            return {}
        return {"mode": req.opts.mode, "compressor": req.opts.compressor_label}

    def _deliver(self, o) -> None:
        stream = self._streams.get(o.request_id)
        if stream is None:
            return
        req = self.loop.requests[o.request_id]
        prev = self._texts[o.request_id]
        if o.finished:
            text_delta = req.seq.text()[len(prev):] if req.state == State.FINISHED else ""
        else:
            text = self.tokenizer.decode(req.seq.output_ids)
            # hold back what could still become a stop string (it is cut from the final text) and a
            # trailing partial UTF-8 character, so streamed text is always a prefix of the final text
            hold = max((len(s) - 1 for s in req.seq.params.stop_list), default=0)
            safe = len(text) - hold
            while safe > 0 and text[safe - 1] == "\ufffd":
                safe -= 1
            text_delta = text[len(prev):max(safe, len(prev))]
        self._texts[o.request_id] = prev + text_delta
        stats = {}
        if o.finished:
            rs = req.round   # the engine's own stats (``request_stats``, made when it ended) and the server's
            stats = {**req.seq.stats, **self._labels(o.request_id), "rounds": rs.rounds, "drafted_tokens": rs.drafted,
                     "accepted_tokens": rs.accepted, "prompt_tokens": len(req.seq.prompt_ids),
                     "completion_tokens": len(req.seq.output_ids),
                     "e2e_s": time.perf_counter() - self._arrival.pop(o.request_id, time.perf_counter())}
            if o.error:
                stats["error"], stats["status"] = o.error, req.error_status
            self.metrics("request_done", {"finish_reason": o.finish_reason, **stats})
            del self._streams[o.request_id], self._texts[o.request_id]
            self.loop.requests.forget(o.request_id)  # finished requests are not kept forever
        stream.put(Delta(o.new_token_ids, text_delta, o.finished, o.finish_reason, stats))
