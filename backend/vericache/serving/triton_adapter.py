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
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from vericache.engine.config import EngineConfig
from vericache.engine.options import RequestOptions
from vericache.sampling import SamplingParams
from vericache.serving.service import BackgroundService, RequestStream


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


class TritonAdapter:
    def __init__(self, service: BackgroundService) -> None:
        self.service = service
        self.engine = service.engine

    @classmethod
    def from_parameters(cls, params: dict[str, str]) -> "TritonAdapter":
        """Build from config.pbtxt parameters: ``EngineConfig``'s fields by name, "" for its default."""
        from vericache.serving.build import build_service

        return cls(build_service(EngineConfig.from_parameters(params)))

    @staticmethod
    def _options(inputs: dict) -> RequestOptions:
        """The per-request ``mode``, ``compressor``, ``draft_len`` and ``lookup`` inputs (0 or absent: the
        default; draft_len 0 means "auto")."""
        mode, comp, k = _scalar(inputs, "mode"), _scalar(inputs, "compressor"), _scalar(inputs, "draft_len")
        lookup = _scalar(inputs, "lookup")
        return RequestOptions(mode=mode or None, compressor=comp or None,
                              draft_len=None if k is None else "auto" if k == 0 else int(k),
                              lookup=None if lookup is None else bool(lookup))

    def parse(self, inputs: dict) -> tuple[list[int], SamplingParams, RequestOptions, bool]:
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
            self.engine.check_request(ids, params)
            self.engine.resolve(options)
        except ValueError as exc:
            raise InvalidInput(str(exc)) from None
        return ids, params, options, bool(_scalar(inputs, "stream", False))

    def start(self, inputs: dict) -> Job:
        ids, params, options, streaming = self.parse(inputs)
        return Job(self.service.submit(ids, params, options, checked=True), streaming)   # parse checked them

    def responses(self, job: Job, cancelled: Callable[[], bool]) -> Iterator[dict[str, np.ndarray]]:
        """Streaming: one response per delta. Otherwise one response with the whole text.
        A cancelled request is aborted (its KV freed) and the iterator ends."""
        text, ids = "", []
        while True:
            try:
                d = job.stream.get(timeout=0.05)
            except queue.Empty:
                d = None
            if cancelled():   # checked before every response too: nothing is sent to a gone client
                self.service.abort(job.stream.id)
                return
            if d is None:
                continue
            if d.finished and d.finish_reason == "error":
                raise GenerationFailed(f"generation failed: {d.stats.get('error', 'engine error')}")
            text += d.text
            ids += d.token_ids
            if job.streaming and (d.text or d.finished):
                yield self._tensors(d.text, d.token_ids, d.stats if d.finished else {}, d.finish_reason)
            if d.finished:
                if not job.streaming:
                    yield self._tensors(text, ids, d.stats, d.finish_reason)
                return

    @staticmethod
    def _tensors(text: str, ids: list[int], stats: dict, finish_reason: str | None = None) -> dict[str, np.ndarray]:
        return {"text_output": np.array([text.encode("utf-8")], dtype=np.object_),
                "finish_reason": np.array([(finish_reason or "").encode()], dtype=np.object_),
                "output_ids": np.array(ids, dtype=np.int32),
                "accepted_tokens": np.array([stats.get("accepted_tokens", 0)], dtype=np.int32),
                "drafted_tokens": np.array([stats.get("drafted_tokens", 0)], dtype=np.int32)}
