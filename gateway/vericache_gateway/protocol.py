"""Request and response bodies of the OpenAI-compatible API (the subset we serve)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class VeriCacheOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mode: Literal["full", "lossy", "vericache"] | None = None
    compressor: str | None = None
    draft_len: int | Literal["auto"] | None = None


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=1)
    user: str | None = None
    vericache: VeriCacheOptions | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str]


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: str


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def chat_prompt(messages: list[ChatMessage], tokenizer=None) -> str:
    """The prompt text for chat ``messages``: the model's own template (see ``vericache.chat``)."""
    from vericache.chat import render_chat

    return render_chat(tokenizer, [m.model_dump() for m in messages])
