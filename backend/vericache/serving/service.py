"""The engine as a service: a background step loop, a bounded queue, per-request delta streams.

No Triton or HTTP imports: the gateway's embedded backend and the Triton model both drive this.
Threading model: one thread owns the ``Engine`` and runs ``step()``; other threads only
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

from vericache.engine.engine import Engine, EngineOutput
from vericache.engine.options import RequestOptions
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
    """Deltas of one request, in order. ``get`` blocks (a timeout raises queue.Empty); an event loop
    instead sets ``on_put`` (called from the engine thread after each delta is queued: hand it to the
    loop with ``call_soon_threadsafe``) and takes them with ``get_nowait``, holding no thread."""

    def __init__(self, rid: int, prompt_tokens: int) -> None:
        self.id = rid
        self.prompt_tokens = prompt_tokens
        self._q: queue.Queue[Delta] = queue.Queue()
        self.on_put: Callable[[], None] | None = None

    def put(self, d: Delta) -> None:
        self._q.put(d)
        if self.on_put is not None:
            self.on_put()

    def get(self, timeout: float | None = None) -> Delta:
        return self._q.get(timeout=timeout)

    def get_nowait(self) -> Delta:
        return self._q.get_nowait()


MetricsSink = Callable[[str, dict], None]  # (event, fields): "request_done", "step", ...


class BackgroundService:
    def __init__(self, engine: Engine, max_queue: int | None = None, metrics: MetricsSink | None = None) -> None:
        """``max_queue``: waiting requests accepted before ``QueueFull`` (default: the engine config's)."""
        from vericache.model.exact_linear import resident_weight_bytes

        self.engine = engine
        self.weight_bytes = resident_weight_bytes(engine.loaded.model)   # for the weight-bytes gauge
        self.tokenizer = engine.tokenizer
        self.max_queue = engine.config.max_queue if max_queue is None else max_queue
        self.metrics = metrics or (lambda event, fields: None)
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[int, RequestStream] = {}
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
            self.engine.check_request(prompt_ids, params)  # bad input fails here, before queueing
        opts = self.engine.resolve(options)
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
        return self.engine.counts()[0]

    def num_waiting(self) -> int:
        return self.engine.counts()[1]

    def describe(self) -> dict:
        """The engine's model, numerics, kernels and build (``Engine.describe``)."""
        return self.engine.describe()

    def gauges(self) -> dict:
        """The engine's gauges and the resident weights."""
        return {**self.engine.stats(), "weight_bytes": self.weight_bytes}

    def healthy(self) -> bool:
        """False only when the engine cannot go on (its thread is gone or its steps keep failing)."""
        return self._thread.is_alive() and not self._stop.is_set() and not self._broken

    def shutdown(self, drain_timeout: float = 30.0) -> None:
        """Stop accepting, let in-flight requests finish (up to ``drain_timeout``), then stop."""
        self._draining = True
        deadline = time.time() + drain_timeout
        while self.engine.has_unfinished() and time.time() < deadline:
            time.sleep(0.02)
        self._stop.set()
        self._thread.join(timeout=5)
        self.engine.close()

    # ------------------------------------------------------------------ the engine thread
    def _run(self) -> None:
        while not self._stop.is_set():
            self._drain_commands()
            if not self.engine.has_unfinished():
                try:  # idle: sleep until a command arrives
                    self._handle(self._commands.get(timeout=0.05))
                except queue.Empty:
                    pass
                continue
            try:
                outs = self.engine.step()
                self._step_errors = 0
            except Exception:  # noqa: BLE001 - the engine's own bookkeeping broke: fail what runs, go on
                log.exception("engine step failed")
                self._step_errors += 1
                outs = self.engine.fail_unfinished("the engine step failed; see the server log")
                if self._step_errors >= 3:  # it keeps failing: the engine cannot go on (/health: 503)
                    self._broken = True
                    self._stop.set()
            self._emit(self.engine.take_events())
            for o in outs:
                self._deliver(o)

    def _emit(self, events: dict) -> None:
        """The step's events as metrics: phases, rounds, verifier round trips, prefix fetches."""
        now, wall = time.perf_counter(), time.time()
        for start, end, kind in events["phases"]:   # ``end``: wall-clock, so traces of several processes line up
            self.metrics("phase", {"kind": kind, "seconds": end - start, "end": wall - (now - end)})
        for labels, drafted, accepted, swapped, proposed, kept in events["rounds"]:
            self.metrics("round", {"drafted": drafted, "accepted": accepted, "swapped": swapped,
                                   "proposed": proposed, "kept": kept, **labels})
        for rtt in events["rtts"]:
            self.metrics("verifier_rtt", {"seconds": rtt})
        for event, fields in events["prefix"]:   # fetches and store outages (``remote.fetch``)
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
                rid = self.engine.add_request(prompt_ids, params, opts, checked=True)  # submit checked it
                holder["stream"] = self._streams[rid] = RequestStream(rid, len(prompt_ids))
                self._arrival[rid] = time.perf_counter()
            except ValueError as exc:
                holder["error"] = exc
            done.set()
        elif cmd[0] == "abort":
            self.engine.abort(cmd[1])
            for o in self.engine.collect():  # report the abort at once, even when idle
                self._deliver(o)

    def _deliver(self, o: EngineOutput) -> None:
        stream = self._streams.get(o.request_id)
        if stream is None:
            return
        stats = o.stats
        if o.finished:
            stats["e2e_s"] = time.perf_counter() - self._arrival.pop(o.request_id, time.perf_counter())
            self.metrics("request_done", {"finish_reason": o.finish_reason, **stats})
            del self._streams[o.request_id]
        stream.put(Delta(o.token_ids, o.text, o.finished, o.finish_reason, stats))
