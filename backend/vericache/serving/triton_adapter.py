"""What the Triton Python model does, without Triton: tensors in, service calls, tensors out.

``model_repository/vericache/1/model.py`` only moves ``pb_utils`` objects to and from the dicts
of numpy arrays used here (the split of Triton's TensorRT-LLM BLS model), so this logic is
unit-tested without a server. Tensor names follow the TensorRT-LLM ensemble: ``text_input``,
``max_tokens``, ``stream``, ``temperature``, ``top_p``, ``top_k``, ``random_seed``,
``stop_words`` in; ``text_output`` out, plus ``output_ids``, ``finish_reason`` (set on the last
response) and VeriCache's round statistics.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from vericache.engine.config import EngineConfig
from vericache.engine.options import Intake, RequestOptions, draft_len_from_wire
from vericache.sampling import SamplingParams
from vericache.serving.service import BackgroundService, RequestStream

# how long a response thread waits for a delta before it looks at its cancelled flag (a cancelled request
# is aborted by the watcher, and its final delta wakes the thread anyway: no need to wake often)
CANCEL_CHECK_S = 0.5
CANCEL_SWEEP_S = 1.0    # how often the watcher asks Triton about each open stream (an IPC round trip per stream)


class GenerationFailed(RuntimeError):
    """The engine failed this request (a step raised for it): Triton answers with an error response."""


class InvalidInput(ValueError):
    """Maps to Triton's INVALID_ARG."""


def _scalar(inputs: dict, name: str, default=None):
    arr = inputs.get(name)
    if arr is None:
        return default
    flat = np.asarray(arr).reshape(-1)
    if flat.size == 0:
        return default
    v = flat[0]
    return v.decode("utf-8") if isinstance(v, (bytes, np.bytes_)) else v.item() if hasattr(v, "item") else v


def _strings(inputs: dict, name: str) -> list[str]:
    arr = inputs.get(name)
    if arr is None:
        return []
    return [v.decode("utf-8") if isinstance(v, (bytes, np.bytes_)) else str(v) for v in np.asarray(arr).reshape(-1)]


@dataclass
class Job:
    stream: RequestStream
    streaming: bool


class CancelWatcher:
    """Asks whether each open stream's client is gone, for every stream from one thread, off the
    response path: a response thread only reads its job's flag (``watch``), and sends.

    In Triton each ask (``response_sender.is_cancelled()``) is an IPC round trip to tritonserver under
    the model's one lock; asked before every response of 32 streams the asks cost the Triton model
    0.83x the embedded engine's tokens/s (issue 43). Here each stream is asked once every ``every_s``, a
    cancelled one is aborted at once (its KV freed even while its thread waits) and its flag set."""

    def __init__(self, service: BackgroundService, every_s: float = CANCEL_SWEEP_S) -> None:
        self.service, self.every_s = service, every_s
        self._jobs: dict[int, tuple[Callable[[], bool], threading.Event]] = {}   # stream id -> (ask, flag)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, job: Job, ask: Callable[[], bool]) -> threading.Event:
        """Start asking ``ask`` about ``job``; the returned flag is set once it said yes."""
        flag = threading.Event()
        with self._lock:
            self._jobs[job.stream.id] = (ask, flag)
        return flag

    def forget(self, job: Job) -> None:
        with self._lock:
            self._jobs.pop(job.stream.id, None)

    def sweep(self) -> int:
        """Ask about every watched job once; abort the cancelled ones. Returns how many were asked.

        Each ask is made under the watcher's lock with the job still watched, so once ``forget`` returns
        the job's sender is never asked again (Triton may release it after its final response)."""
        with self._lock:
            rids = list(self._jobs)
        asked = 0
        for rid in rids:
            with self._lock:
                if rid not in self._jobs:
                    continue
                ask, flag = self._jobs[rid]
                try:
                    gone = ask()
                except Exception:   # noqa: BLE001 - a sender that cannot answer has no client left
                    gone = True
                asked += 1
                if gone:
                    del self._jobs[rid]
            if gone:
                self.service.abort(rid)
                flag.set()
        return asked

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="vericache-cancel-watcher", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sweep()


class TritonAdapter:
    def __init__(self, service: BackgroundService) -> None:
        self.service = service
        self.engine = service.engine

    @classmethod
    def from_parameters(cls, params: dict[str, str]) -> TritonAdapter:
        """Build from config.pbtxt parameters: ``EngineConfig``'s fields by name, "" for its default."""
        from vericache.serving.build import build_service

        return cls(build_service(EngineConfig.from_parameters(params)))

    @staticmethod
    def _options(inputs: dict) -> RequestOptions:
        """The per-request ``mode``, ``compressor``, ``draft_len`` and ``lookup`` inputs (0 or absent: the
        default; draft_len's forms: ``options.draft_len_from_wire``)."""
        mode, comp, k = _scalar(inputs, "mode"), _scalar(inputs, "compressor"), _scalar(inputs, "draft_len")
        lookup = _scalar(inputs, "lookup")
        return RequestOptions(mode=mode or None, compressor=comp or None,
                              draft_len=draft_len_from_wire(k),
                              lookup=None if lookup is None else bool(lookup))

    def parse(self, inputs: dict) -> tuple[Intake, bool]:
        """The request's ``Engine.intake`` (``InvalidInput`` naming what is wrong) and whether it streams."""
        text = _scalar(inputs, "text_input")
        if not isinstance(text, str) or not text:
            raise InvalidInput("text_input must be a non-empty string")
        options = self._options(inputs)
        seed = _scalar(inputs, "random_seed")
        try:
            params = SamplingParams(max_tokens=int(_scalar(inputs, "max_tokens", 16)),
                                    temperature=float(_scalar(inputs, "temperature", 0.0)),
                                    top_p=float(_scalar(inputs, "top_p", 1.0)), top_k=int(_scalar(inputs, "top_k", 0)),
                                    seed=None if seed is None else int(seed), stop=_strings(inputs, "stop_words") or None)
        except (ValueError, TypeError) as exc:
            raise InvalidInput(str(exc)) from None
        ids = self.engine.tokenizer.encode(text)
        try:
            intake = self.engine.intake(ids, params, options)
        except ValueError as exc:
            raise InvalidInput(str(exc)) from None
        return intake, bool(_scalar(inputs, "stream", False))

    def start(self, inputs: dict) -> Job:
        intake, streaming = self.parse(inputs)
        return Job(self.service.enqueue(intake), streaming)

    def responses(self, job: Job, cancelled: Callable[[], bool],
                  check_every_s: float = CANCEL_CHECK_S) -> Iterator[dict[str, np.ndarray]]:
        """Streaming: one response per batch of deltas (those queued while the last was sent go out
        together). Otherwise one response with the whole text. A cancelled request is aborted (its KV
        freed) and the iterator ends.

        ``cancelled`` must be cheap: it is looked at before every response and every ``check_every_s``
        of silence. In Triton it is the flag a ``CancelWatcher`` sets, never an IPC ask of its own."""
        text, ids, pending_ids = "", [], []
        while True:
            try:
                deltas = [job.stream.get(timeout=check_every_s)]
            except queue.Empty:
                deltas = []
            while deltas and not deltas[-1].finished:   # what else is queued: one response for all
                try:
                    deltas.append(job.stream.get_nowait())
                except queue.Empty:
                    break
            if cancelled():
                self.service.abort(job.stream.id)
                return
            if not deltas:
                continue
            last = deltas[-1]
            if last.finished and last.finish_reason == "error":
                raise GenerationFailed(f"generation failed: {last.stats.get('error', 'engine error')}")
            new_text = "".join(d.text for d in deltas)
            pending_ids += [t for d in deltas for t in d.token_ids]   # ids of text not yet complete wait for it
            text += new_text
            ids += [t for d in deltas for t in d.token_ids]
            if job.streaming and (new_text or last.finished):
                yield self._tensors(new_text, pending_ids, last.stats if last.finished else {}, last.finish_reason)
                pending_ids = []
            if last.finished:
                if not job.streaming:
                    yield self._tensors(text, ids, last.stats, last.finish_reason)
                return

    @staticmethod
    def _tensors(text: str, ids: list[int], stats: dict, finish_reason: str | None = None) -> dict[str, np.ndarray]:
        return {"text_output": np.array([text.encode("utf-8")], dtype=np.object_),
                "finish_reason": np.array([(finish_reason or "").encode()], dtype=np.object_),
                "output_ids": np.array(ids, dtype=np.int32),
                "accepted_tokens": np.array([stats.get("accepted_tokens", 0)], dtype=np.int32),
                "drafted_tokens": np.array([stats.get("drafted_tokens", 0)], dtype=np.int32)}
