"""The FastAPI app: OpenAI-shaped routes over a backend (the embedded ``BackgroundService``, or Triton).

The routes are plain module-level functions; ``create_app`` wires them to one app and puts what they
read (backend, metrics, model name, key) on ``app.state.gateway``."""

from __future__ import annotations

import hmac
import json
import time
import uuid
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from vericache.engine.options import InvalidOption, RequestOptions
from vericache.model.registry import DEFAULT_MODEL
from vericache.sampling import SamplingParams
from vericache.serving.metrics import Metrics, metrics_sink, refresh_gauges
from vericache.serving.service import BackgroundService, QueueFull, ServiceStopped
from vericache.serving.trace import TraceFile, tee
from vericache_gateway.backends import BackendUnavailable, EmbeddedBackend, TritonBackend
from vericache_gateway.protocol import (
    ChatRequest,
    ChatResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    chat_prompt,
    documented,
    error_body,
)


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.headers = status, message, type_, param, headers


@dataclass
class Gateway:
    """What the routes read, on ``app.state.gateway``: one app, one backend."""
    backend: EmbeddedBackend | TritonBackend
    metrics: Metrics
    model_name: str
    api_key: str | None
    max_body_bytes: int
    max_per_key: int = 0                               # concurrent generations per API key; 0: no limit
    in_flight: dict[str, int] = field(default_factory=dict)


def _key_of(request: Request) -> str:
    """Whose request this is: its bearer key ("" without one)."""
    given = request.headers.get("authorization", "")
    return given[7:] if given.lower().startswith("bearer ") else ""


def create_app(backend: BackgroundService | EmbeddedBackend | TritonBackend, model_name: str = DEFAULT_MODEL,
               api_key: str | None = None, max_body_bytes: int = 1 << 20, trace: str | None = None,
               max_per_key: int = 0) -> FastAPI:
    """The routes below on one app; ``trace``: also write the engine's events to this JSON-lines file
    (``serving.trace``); ``max_per_key``: generations one API key may have running at once (more get a
    429 with Retry-After; 0: no limit)."""
    if not isinstance(max_per_key, int) or max_per_key < 0:
        raise ValueError(f"max_per_key must be an integer >= 0, got {max_per_key!r}")
    if isinstance(backend, BackgroundService):
        backend = EmbeddedBackend(backend)
    metrics = Metrics(model_name, backend.mode, backend.compressor)
    backend.set_metrics_sink(tee(metrics_sink(metrics), TraceFile(trace) if trace else None))
    app = FastAPI(title="VeriCache", version="0.1.0")
    app.state.gateway = Gateway(backend, metrics, model_name, api_key, max_body_bytes, max_per_key)
    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.middleware("http")(guard)
    app.add_middleware(BodyLimit, gateway=app.state.gateway)   # outermost: runs before the guard
    app.add_api_route("/health", health, methods=["GET"],
                      responses={503: {"model": ErrorResponse, "description": "the backend is not ready"}})
    app.add_api_route("/v1/models", models, methods=["GET"], responses={401: {"model": ErrorResponse}})
    app.add_api_route("/metrics", prometheus, methods=["GET"],
                      responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}})
    app.add_api_route("/v1/completions", completions, methods=["POST"], responses=documented(CompletionResponse))
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"], responses=documented(ChatResponse))
    spec = app.openapi()   # generated once and kept: the served model is the one ``model`` accepts
    for name in ("CompletionRequest", "ChatRequest"):
        spec["components"]["schemas"][name]["properties"]["model"]["enum"] = [model_name]
    return app


def gateway_of(request: Request) -> Gateway:
    return request.app.state.gateway


def fail(gw: Gateway, status: int, message: str, type_: str, param=None, headers=None) -> JSONResponse:
    """An OpenAI-shaped error response, counted."""
    gw.metrics.lab(gw.metrics.errors, status=str(status)).inc()
    return JSONResponse(error_body(message, type_, param), status_code=status, headers=headers)


# ---------------------------------------------------------------------- errors and the guard
async def api_error(request: Request, exc: APIError) -> JSONResponse:
    return fail(gateway_of(request), exc.status, exc.message, exc.type, exc.param, exc.headers)


async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    err = exc.errors()[0]
    param = ".".join(str(p) for p in err.get("loc", [])[1:]) or None
    return fail(gateway_of(request), 400, f"{param}: {err.get('msg')}" if param else str(err.get("msg")),
                "invalid_request_error", param)


async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return fail(gateway_of(request), exc.status_code, str(exc.detail),
                "invalid_request_error" if exc.status_code < 500 else "server_error")


class BodyLimit:
    """Request bodies over ``max_body_bytes`` get a 413, whether or not they say their length: a declared
    length over it is refused unread; otherwise the body is read (never more than the limit plus one
    chunk) before any route runs, and handed on as one message. An ASGI middleware, so a chunked upload
    cannot reach the JSON parser whole."""

    def __init__(self, app, gateway: Gateway) -> None:
        self.app, self.gw = app, gateway

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.gw.max_body_bytes
        declared = dict(scope.get("headers") or []).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > limit:
            return await self._refuse(f"request body of {int(declared)} bytes exceeds the limit of {limit}",
                                      scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":        # the client left before its body was in
                return await self.app(scope, _replay(message, receive), send)
            size += len(message.get("body", b""))
            if size > limit:
                return await self._refuse(f"request body exceeds the limit of {limit} bytes (sent without a "
                                          f"length, cut off at {size})", scope, receive, send)
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay({"type": "http.request", "body": b"".join(chunks), "more_body": False}, receive),
                       send)

    async def _refuse(self, message: str, scope, receive, send) -> None:
        await fail(self.gw, 413, message, "invalid_request_error")(scope, receive, send)


def _replay(first: dict, receive):
    """An ASGI receive that gives ``first`` once, then whatever ``receive`` gives (a disconnect)."""
    pending = [first]

    async def receive_again() -> dict:
        return pending.pop() if pending else await receive()
    return receive_again


async def guard(request: Request, call_next):
    """The bearer key, before any route runs (``BodyLimit`` has checked the body's size)."""
    gw = gateway_of(request)
    if gw.api_key and request.url.path.startswith("/v1/"):
        if not hmac.compare_digest(_key_of(request).encode(), gw.api_key.encode()):  # constant-time comparison
            return fail(gw, 401, "missing or invalid API key", "authentication_error")
    return await call_next(request)


# ---------------------------------------------------------------------- routes
async def health(request: Request):
    gw = gateway_of(request)
    if not await gw.backend.ready():
        return fail(gw, 503, "backend is not ready", "server_error")
    return {"status": "ok"}


async def models(request: Request):
    gw = gateway_of(request)   # "vericache": what the engine computes with (numerics, kernels' build)
    return {"object": "list", "data": [{"id": gw.model_name, "object": "model", "created": 0,
                                        "owned_by": "vericache", "vericache": gw.backend.describe()}]}


async def prometheus(request: Request):
    gw = gateway_of(request)
    refresh_gauges(gw.backend.gauges(), gw.metrics)
    return PlainTextResponse(generate_latest(gw.metrics.registry).decode(), media_type="text/plain; version=0.0.4")


async def completions(body: CompletionRequest, request: Request):
    prompt = body.prompt if isinstance(body.prompt, str) else (body.prompt[0] if len(body.prompt) == 1 else None)
    if prompt is None:
        raise APIError(400, "prompt must be a string or a list with exactly one string", param="prompt")
    return await serve_request(gateway_of(request), request, body, prompt, body.max_tokens, chat=False)


async def chat_completions(body: ChatRequest, request: Request):
    gw = gateway_of(request)
    try:
        prompt = chat_prompt(body.messages, gw.backend.tokenizer)
    except Exception as exc:  # noqa: BLE001 - a template that fails to render is the request's problem
        raise APIError(400, f"chat template failed: {exc}", param="messages") from None
    return await serve_request(gw, request, body, prompt, body.max_completion_tokens or body.max_tokens, chat=True)


# ---------------------------------------------------------------------- one generation
async def serve_request(gw: Gateway, request: Request, body, prompt: str, max_tokens: int | None, chat: bool):
    """Validate, generate, and answer as one JSON body or a stream of server-sent events."""
    backend = gw.backend
    if body.model != gw.model_name:
        raise APIError(400, f"model {body.model!r} does not exist; this server serves {gw.model_name!r}",
                       param="model", type_="invalid_request_error")
    options = _request_options(body)
    if not prompt:
        raise APIError(400, "prompt is empty", param="prompt")
    ids = backend.tokenizer.encode(prompt)
    try:
        params = SamplingParams(max_tokens=max_tokens or 16, temperature=body.temperature, top_p=body.top_p,
                                top_k=body.top_k, seed=body.seed, stop=body.stop, ignore_eos=body.ignore_eos)
        intake = backend.intake(ids, params, options)
    except InvalidOption as exc:
        raise APIError(400, str(exc), param=f"vericache.{exc.field}") from None
    except (ValueError, TypeError) as exc:
        raise APIError(400, str(exc)) from None
    labels = {"mode": intake.options.mode, "compressor": intake.options.compressor_label}
    if not await backend.ready():
        raise APIError(503, "backend is not ready", "server_error")
    deltas = _deltas(gw, _key_of(request), backend.generate(intake, request.is_disconnected), labels)
    try:
        first = await deltas.__anext__()  # surfaces queue-full, shutdown and backend errors as HTTP codes
    except StopAsyncIteration:
        raise APIError(499, "client closed the request") from None
    gw.metrics.lab(gw.metrics.prompt_tokens, **labels).inc(len(ids))
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        continuous = bool(include_usage and body.stream_options.continuous_usage_stats)
        return StreamingResponse(_sse(gw.model_name, _chain(first, deltas), rid, chat, include_usage, len(ids),
                                      continuous),
                                 media_type="text/event-stream")
    text, reason, stats, n_out = "", None, {}, 0
    async for delta in _chain(first, deltas):
        text += delta.text
        n_out += len(delta.token_ids)
        if delta.finished:
            reason, stats = delta.finish_reason, delta.stats
    return _response(gw.model_name, rid, chat, text, reason, {"completion_tokens": n_out, **stats}, len(ids))


async def _deltas(gw: Gateway, key: str, source, labels: dict):
    """Deltas with latency metrics (labelled with the request's mode and compressor); backend
    errors become HTTP errors. The request counts against its key's running generations from its
    first delta asked for until this generator ends (finished, failed, or closed by a disconnect)."""
    metrics, t0, last = gw.metrics, time.perf_counter(), None
    if gw.max_per_key and gw.in_flight.get(key, 0) >= gw.max_per_key:
        await source.aclose()
        raise APIError(429, f"this API key already has {gw.max_per_key} generations running (the limit)",
                       "rate_limit_error", headers={"Retry-After": "1"})
    gw.in_flight[key] = gw.in_flight.get(key, 0) + 1
    try:
        async for delta in source:
            now = time.perf_counter()
            if delta.token_ids:
                if last is None:
                    metrics.lab(metrics.ttft, **labels).observe(now - t0)
                else:
                    metrics.lab(metrics.itl, **labels).observe((now - last) / len(delta.token_ids))
                last = now
                metrics.lab(metrics.generation_tokens, **labels).inc(len(delta.token_ids))
            if delta.finished and delta.finish_reason == "error":
                raise APIError(delta.stats.get("status", 500),
                               f"generation failed: {delta.stats.get('error', 'engine error')}", "server_error")
            yield delta
    except QueueFull as exc:
        raise APIError(429, str(exc), "rate_limit_error", headers={"Retry-After": "1"}) from None
    except (ServiceStopped, BackendUnavailable) as exc:
        raise APIError(503, str(exc), "server_error") from None
    except ValueError as exc:
        raise APIError(400, str(exc)) from None
    finally:
        gw.in_flight[key] -= 1
        if not gw.in_flight[key]:
            del gw.in_flight[key]
        await source.aclose()  # leaving early aborts the request in the backend


async def _sse(model_name: str, deltas, rid: str, chat: bool, include_usage: bool, n_prompt: int,
               continuous_usage: bool = False):
    head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": model_name}
    first, n_out = True, 0
    try:
        async for delta in deltas:
            n_out += len(delta.token_ids)
            if chat:
                d = {"content": delta.text} if not first else {"role": "assistant", "content": delta.text}
                choice = {"index": 0, "delta": d, "finish_reason": delta.finish_reason}
            else:
                choice = {"index": 0, "text": delta.text, "finish_reason": delta.finish_reason, "logprobs": None}
            first = False
            chunk = {**head, "choices": [choice]}
            if continuous_usage:   # a delta may carry several tokens (a VeriCache round): the count so far
                chunk["usage"] = _usage({"completion_tokens": n_out}, n_prompt)
            if delta.finished:
                chunk["vericache"] = delta.stats
            yield f"data: {json.dumps(chunk)}\n\n"
            if delta.finished and include_usage:
                usage = _usage({"completion_tokens": n_out, **delta.stats}, n_prompt)
                yield f"data: {json.dumps({**head, 'choices': [], 'usage': usage})}\n\n"
    except APIError as exc:  # the headers are sent: the error goes in the stream, OpenAI-shaped
        yield f"data: {json.dumps(error_body(exc.message, exc.type, exc.param))}\n\n"
    yield "data: [DONE]\n\n"


def _response(model_name: str, rid, chat, text, reason, stats, n_prompt):
    created = int(time.time())
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason}
    else:
        choice = {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model_name, "choices": [choice], "usage": _usage(stats, n_prompt), "vericache": stats}


async def _chain(first, rest):
    yield first
    async for item in rest:
        yield item


def _usage(stats: dict, n_prompt: int | None = None) -> dict:
    p, c = stats.get("prompt_tokens", n_prompt or 0), stats.get("completion_tokens", 0)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _request_options(body) -> RequestOptions | None:
    """The request's ``vericache`` options as asked (the backend's intake validates and resolves them)."""
    opts = body.vericache
    return None if opts is None else RequestOptions(opts.mode, opts.compressor, opts.draft_len, opts.lookup)
