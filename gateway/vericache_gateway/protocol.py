"""Request and response bodies of the OpenAI-compatible API (the subset we serve), with the bounds
the server enforces, so the OpenAPI document says what is accepted (a generator can fuzz from it)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_TEXT = 1 << 20            # characters: no prompt or message of the 1 MB body limit is longer
MAX_TOKENS = 1 << 20          # a bound for the schema; each model's context limit is checked (400) as well
MAX_SEED = (1 << 63) - 1      # the generator's seed range


# Requests are validated strictly: a JSON value of the schema's type only (lax pydantic took 0.0 for false
# and 2.0 for an integer, which the published schema forbids; the fuzz test found it)
STRICT = ConfigDict(strict=True)


class VeriCacheOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    mode: Literal["full", "lossy", "vericache"] | None = None
    compressor: str | None = Field(default=None, max_length=256)
    draft_len: int | Literal["auto"] | None = Field(default=None)
    lookup: bool | None = None    # prompt-lookup proposals checked by the drafter


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False
    continuous_usage_stats: bool = False   # vLLM's extension: every chunk carries the usage so far


class SamplingFields(BaseModel):
    model_config = STRICT
    model: str = Field(max_length=256)
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(default=0, ge=0, le=MAX_TOKENS)
    seed: int | None = Field(default=None, ge=-MAX_SEED, le=MAX_SEED)
    stop: str | list[str] | None = Field(default=None, max_length=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=1)
    ignore_eos: bool = False      # vLLM's extension: decode max_tokens whatever the model ends with (benchmarks)
    user: str | None = Field(default=None, max_length=256)
    vericache: VeriCacheOptions | None = None


class CompletionRequest(SamplingFields):
    prompt: (Annotated[str, Field(min_length=1, max_length=MAX_TEXT)]
             | Annotated[list[Annotated[str, Field(min_length=1, max_length=MAX_TEXT)]], Field(min_length=1, max_length=1)])


class ChatMessage(BaseModel):
    model_config = STRICT
    role: Literal["system", "user", "assistant", "tool"]
    content: str = Field(max_length=MAX_TEXT)


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=256)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS)


# ---------------------------------------------------------------------- responses (documented for clients)
class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every 4xx and 5xx: OpenAI's error shape."""
    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None
    logprobs: None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    vericache: dict = Field(description="the request's engine figures: mode, acceptance, timings, KV bytes")


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: str | None


class ChatResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    vericache: dict = Field(description="the request's engine figures: mode, acceptance, timings, KV bytes")


ERRORS = {400: "invalid request (OpenAI-shaped, naming the field)", 401: "missing or invalid API key",
          413: "request body over the limit", 422: "unprocessable request", 429: "queue full or the key's limit "
          "reached (Retry-After)", 499: "the client closed the request", 500: "the generation failed",
          503: "the backend is not ready"}


def documented(success: type[BaseModel]) -> dict:
    """The ``responses`` of a generation route: ``success`` as JSON or a server-sent event stream
    (``stream: true``), and every error status it answers, OpenAI-shaped."""
    event = {"type": "object", "required": ["data"], "properties": {
        "data": {"type": "string", "description": "a JSON chunk (OpenAI's completion or chat chunk; the last one "
                                                  "carries the request's `vericache` figures) or `[DONE]`"},
        "event": {"type": "string"}}}
    return {200: {"model": success, "content": {"text/event-stream": {"schema": event}}},
            **{status: {"model": ErrorResponse, "description": why} for status, why in ERRORS.items()}}


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def chat_prompt(messages: list[ChatMessage], tokenizer=None) -> str:
    """The prompt text for chat ``messages``: the model's own template (see ``vericache.chat``)."""
    from vericache.chat import render_chat

    return render_chat(tokenizer, [m.model_dump() for m in messages])
