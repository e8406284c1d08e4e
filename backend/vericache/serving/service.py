"""The engine as a service: a background step loop, a bounded queue, per-request delta streams.

No Triton or HTTP imports: the gateway's embedded backend and the Triton model both drive this.
Threading model: one thread owns the ``Engine`` (``engine.owner.EngineOwner``) and runs ``step()``;
other threads only hand it commands (add, abort), run between steps, and read deltas from each
request's own queue. Aborting frees the request's KV at the next loop turn (milliseconds).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

from vericache.engine.engine import Engine, EngineOutput
from vericache.engine.options import Intake, RequestOptions
from vericache.engine.owner import EngineOwner
from vericache.sampling import SamplingParams


class QueueFull(RuntimeError):
    """The bounded request queue is full: the caller should retry later (HTTP 429)."""


class ServiceStopped(RuntimeError):
    """The service is shutting down or has stopped (HTTP 503)."""


class RequestStream:
    """A request's outputs (``EngineOutput``: new tokens, their text, at the end its stats), in order. ``get`` blocks (a timeout raises queue.Empty); an event loop
    instead sets ``on_put`` (called from the engine thread after each delta is queued: hand it to the
    loop with ``call_soon_threadsafe``) and takes them with ``get_nowait``, holding no thread."""

    def __init__(self, rid: int, prompt_tokens: int) -> None:
        self.id = rid
        self.prompt_tokens = prompt_tokens
        self._q: queue.Queue[EngineOutput] = queue.Queue()
        self.on_put: Callable[[], None] | None = None

    def put(self, d: EngineOutput) -> None:
        self._q.put(d)
        if self.on_put is not None:
            self.on_put()

    def get(self, timeout: float | None = None) -> EngineOutput:
        return self._q.get(timeout=timeout)

    def get_nowait(self) -> EngineOutput:
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
        self._streams: dict[int, RequestStream] = {}
        self._arrival: dict[int, float] = {}
        self._lock = threading.Lock()
        self._draining = False
        self._step_errors = 0
        self._owner = EngineOwner("vericache-engine", engine.has_unfinished, self._step, self._step_failed)

    # ------------------------------------------------------------------ callers' side
    def submit(self, prompt_ids: list[int], params: SamplingParams, options: RequestOptions | None = None) -> RequestStream:
        """``enqueue`` the request's ``Engine.intake`` (bad input fails here, before queueing): ``options``
        override the server's mode, compressor and draft length for this request. Raises ValueError,
        TypeError, QueueFull, ServiceStopped."""
        return self.enqueue(self.engine.intake(prompt_ids, params, options))

    def enqueue(self, intake: Intake) -> RequestStream:
        """Queue a request that came in through ``Engine.intake`` and return its stream. Raises QueueFull,
        ServiceStopped."""
        if self._owner.stopped or self._draining:
            raise ServiceStopped("the engine is shutting down")
        with self._lock:
            if self.num_waiting() + self._owner.pending() >= self.max_queue:
                raise QueueFull(f"request queue is full ({self.max_queue} waiting)")
            done = threading.Event()
            holder: dict = {}
            self._owner.call(lambda: self._add(intake, holder, done))
        if not done.wait(timeout=30):
            raise ServiceStopped("the engine loop did not accept the request")
        if "error" in holder:
            raise holder["error"]
        return holder["stream"]

    def abort(self, rid: int) -> None:
        self._owner.call(lambda: self._abort(rid))

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
        return self._owner.running

    def shutdown(self, drain_timeout: float = 30.0) -> None:
        """Stop accepting, let in-flight requests finish (up to ``drain_timeout``), then stop."""
        self._draining = True
        deadline = time.time() + drain_timeout
        while self.engine.has_unfinished() and time.time() < deadline and self._owner.running:
            time.sleep(0.02)
        self._owner.stop()
        self.engine.close()

    # ------------------------------------------------------------------ on the engine's thread
    def _step(self) -> None:
        outs = self.engine.step()
        self._step_errors = 0
        self._emit(self.engine.take_events())
        for o in outs:
            self._deliver(o)

    def _step_failed(self, exc: Exception) -> bool:
        """The engine's own bookkeeping broke: fail what runs and go on, unless it keeps failing (then the
        engine cannot go on: /health says 503)."""
        self._step_errors += 1
        for o in self.engine.fail_unfinished("the engine step failed; see the server log"):
            self._deliver(o)
        return self._step_errors < 3

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
        for event, fields in events["prefix"]:   # fetches, store outages, verifier failovers (``remote``)
            self.metrics(event, fields)

    def _add(self, intake: Intake, holder: dict, done: threading.Event) -> None:
        try:
            rid = self.engine.add(intake)
            holder["stream"] = self._streams[rid] = RequestStream(rid, len(intake.prompt_ids))
            self._arrival[rid] = time.perf_counter()
        except ValueError as exc:
            holder["error"] = exc
        done.set()

    def _abort(self, rid: int) -> None:
        self.engine.abort(rid)
        for o in self.engine.collect():  # report the abort at once, even when idle
            self._deliver(o)

    def _deliver(self, o: EngineOutput) -> None:
        stream = self._streams.get(o.request_id)
        if stream is None:
            return
        if o.finished:
            o.stats["e2e_s"] = time.perf_counter() - self._arrival.pop(o.request_id, time.perf_counter())
            self.metrics("request_done", {"finish_reason": o.finish_reason, **o.stats})
            del self._streams[o.request_id]
        stream.put(o)
