"""Where the gateway's requests go: the in-process engine, or a Triton server over gRPC.

Both give the app the same small surface: ``tokenizer``, ``mode``/``compressor`` (the server's
defaults, for labels), ``defaults`` (resolved options that per-request ``RequestOptions`` are
filled from), ``intake`` (the request checked and its options resolved, once, before accepting:
``vericache.engine.options.make_intake``), ``generate`` (an async iterator of ``EngineOutput``, the engine's one output type, for an intake;
leaving it early aborts the request), ``ready`` and ``gauges``.
"""

from __future__ import annotations

import asyncio
import queue
from collections.abc import AsyncIterator, Awaitable, Callable

import numpy as np

from vericache.engine.config import DEFAULTS, EngineConfig
from vericache.engine.engine import EngineOutput
from vericache.engine.options import Intake, RequestOptions, ResolvedOptions, draft_len_to_wire, make_intake
from vericache.grpc_channel import RECONNECT_BACKOFF
from vericache.sampling import SamplingParams
from vericache.serving.service import BackgroundService, QueueFull, ServiceStopped  # noqa: F401 - re-exported

DISCONNECT_CHECK_S = 0.25   # a stream with no new delta this long asks whether its client left


class BackendUnavailable(RuntimeError):
    """The backend is down or not ready (HTTP 503)."""


class EmbeddedBackend:
    def __init__(self, service: BackgroundService) -> None:
        self.service = service
        engine = service.engine
        self.tokenizer, self.defaults, self.max_context = engine.tokenizer, engine.defaults, engine.max_context
        self.mode = self.defaults.mode
        self.compressor = self.defaults.compressor_label

    def intake(self, ids: list[int], params: SamplingParams, options: RequestOptions | None) -> Intake:
        return self.service.engine.intake(ids, params, options)

    async def generate(self, intake: Intake, disconnected: Callable[[], Awaitable[bool]]) -> AsyncIterator[EngineOutput]:
        """Stream the request's deltas (``intake``: made by ``intake``, where the gateway's 400s come from).
        The engine thread wakes this coroutine when a delta lands (no thread waits per stream: threads
        polling queues took the CPU from the engine's forward on a 2-core machine); every
        ``DISCONNECT_CHECK_S`` without one it asks whether the client is still there."""
        stream = await asyncio.to_thread(self.service.enqueue, intake)
        loop, landed = asyncio.get_running_loop(), asyncio.Event()
        stream.on_put = lambda: loop.call_soon_threadsafe(landed.set)
        finished = False
        try:
            while True:
                landed.clear()   # before the look: a delta put after it sets it again
                try:
                    delta = stream.get_nowait()
                except queue.Empty:
                    try:
                        await asyncio.wait_for(landed.wait(), DISCONNECT_CHECK_S)
                    except TimeoutError:
                        if await disconnected():
                            return
                    continue
                finished = delta.finished
                yield delta
                if finished:
                    return
        finally:  # the client went away, or the response was cancelled: free the request's KV now
            if not finished:
                self.service.abort(stream.id)

    async def ready(self) -> bool:
        return self.service.healthy()

    def gauges(self) -> dict:
        return self.service.gauges()

    def describe(self) -> dict:
        return self.service.describe()

    def set_metrics_sink(self, sink) -> None:
        self.service.metrics = sink

    async def close(self) -> None:
        await asyncio.to_thread(self.service.shutdown, 30)


def triton_channel_args(grpc_client) -> list[tuple[str, int]]:
    """tritonclient's own channel options (message sizes, keepalive: passing any replaces them all) and
    the capped reconnect backoff (``vericache.grpc_channel``)."""
    keep = grpc_client.KeepAliveOptions()
    size = grpc_client.MAX_GRPC_MESSAGE_SIZE
    return [("grpc.max_send_message_length", size), ("grpc.max_receive_message_length", size),
            ("grpc.keepalive_time_ms", keep.keepalive_time_ms), ("grpc.keepalive_timeout_ms", keep.keepalive_timeout_ms),
            ("grpc.keepalive_permit_without_calls", keep.keepalive_permit_without_calls),
            ("grpc.http2.max_pings_without_data", keep.http2_max_pings_without_data), *RECONNECT_BACKOFF]


class TritonBackend:
    """Streams from the ``vericache`` model of a Triton server with ``tritonclient.grpc.aio``."""

    def __init__(self, url: str, config: EngineConfig = DEFAULTS, triton_model: str = "vericache") -> None:
        """``config``: what the Triton model runs (its config.pbtxt parameters; labels and the defaults
        per-request options are filled from)."""
        import tritonclient.grpc.aio as grpcclient

        from vericache.compress.registry import parse_compressor
        from vericache.drafting.round import DraftLengthPolicy
        from vericache.model.loader import load_tokenizer

        self._grpc = grpcclient
        self.url = url
        self._client = None  # made inside the serving event loop (gRPC aio channels belong to one loop)
        self.triton_model = triton_model
        # the tokenizer and limits are read locally (no weights): validation and token counts need no round trip
        self.tokenizer, model_config = load_tokenizer(config.model)
        self.max_context, self.vocab_size = model_config.context_limit, model_config.vocab_size
        self.defaults = ResolvedOptions(config.mode, parse_compressor(config.compressor),
                                        DraftLengthPolicy.from_arg(config.draft_len))
        self.mode, self.compressor = config.mode, self.defaults.compressor_label

    def intake(self, ids: list[int], params: SamplingParams, options: RequestOptions | None) -> Intake:
        """Checked here against the model's limits and resolved against the Triton model's defaults, so
        the gateway answers bad input with its 400s; what the client asked is what goes on the wire."""
        return make_intake(ids, params, options, self.defaults, self.max_context, self.vocab_size)

    def _inputs(self, text: str, params: SamplingParams, options: RequestOptions | None) -> list:
        g = self._grpc

        def t(name, arr, dt):
            x = g.InferInput(name, list(arr.shape), dt)
            x.set_data_from_numpy(arr)
            return x

        ins = [t("text_input", np.array([text.encode()], dtype=np.object_), "BYTES"),
               t("max_tokens", np.array([params.max_tokens], dtype=np.int32), "INT32"),
               t("stream", np.array([True]), "BOOL"),
               t("temperature", np.array([params.temperature], dtype=np.float32), "FP32"),
               t("top_p", np.array([params.top_p], dtype=np.float32), "FP32"),
               t("top_k", np.array([params.top_k], dtype=np.int32), "INT32")]
        if params.seed is not None:
            ins.append(t("random_seed", np.array([params.seed], dtype=np.uint64), "UINT64"))
        if params.stop_list:
            ins.append(t("stop_words", np.array([s.encode() for s in params.stop_list], dtype=np.object_), "BYTES"))
        options = options or RequestOptions()
        for name in ("mode", "compressor"):
            if getattr(options, name) is not None:
                ins.append(t(name, np.array([getattr(options, name).encode()], dtype=np.object_), "BYTES"))
        if options.draft_len is not None:
            ins.append(t("draft_len", np.array([draft_len_to_wire(options.draft_len)], dtype=np.int32), "INT32"))
        if options.lookup is not None:
            ins.append(t("lookup", np.array([options.lookup]), "BOOL"))
        return ins

    async def generate(self, intake: Intake, disconnected: Callable[[], Awaitable[bool]]) -> AsyncIterator[EngineOutput]:
        text = self.tokenizer.decode(intake.prompt_ids, skip_special_tokens=False)  # chat markup must reach the model

        async def requests():
            yield {"model_name": self.triton_model, "inputs": self._inputs(text, intake.params, intake.asked)}

        from tritonclient.utils import InferenceServerException

        responses = self.client().stream_infer(requests())
        try:
            async for result, error in responses:
                if error is not None:
                    raise ValueError(str(error))  # INVALID_ARG from the model: a 400
                # the model marks its last response with a finish reason (the aio client has no
                # empty-final-response option)
                reason = result.as_numpy("finish_reason")[0].decode() or None
                stats = {"accepted_tokens": int(result.as_numpy("accepted_tokens")[0]),
                         "drafted_tokens": int(result.as_numpy("drafted_tokens")[0])}
                # the engine's output as the Triton model sent it (its request id stays inside Triton)
                yield EngineOutput(-1, [int(i) for i in result.as_numpy("output_ids")],
                                   result.as_numpy("text_output")[0].decode(), reason is not None, reason,
                                   stats=stats if reason else {})
                if reason is not None:
                    return
        except InferenceServerException as exc:
            raise BackendUnavailable(f"triton: {exc}") from None
        finally:
            responses.cancel()  # a client that left cancels the Triton request, which frees its KV

    def client(self):
        if self._client is None:
            self._client = self._grpc.InferenceServerClient(self.url, channel_args=triton_channel_args(self._grpc))
        return self._client

    async def ready(self) -> bool:
        try:
            c = self.client()
            return await c.is_server_ready() and await c.is_model_ready(self.triton_model)
        except Exception:  # noqa: BLE001 - any transport failure means "not ready"
            return False

    def gauges(self) -> dict:
        return {}

    def describe(self) -> dict:
        """The engine runs inside Triton: its settings are the model repository's parameters."""
        return {"backend": "triton", "triton_model": self.triton_model}

    def set_metrics_sink(self, sink) -> None:
        pass

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
