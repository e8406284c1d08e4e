"""One request in flight: its tokens, its sampling state and when it finishes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from vericache.model.tokenizer import Tokenizer
from vericache.sampling import SamplingParams


@dataclass
class RequestOutput:
    request_id: int
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    stats: dict[str, Any] = field(default_factory=dict)


def positions_needed(prompt_len: int, max_tokens: int) -> int:
    """Positions a request can ever hold in its KV: the prompt, every output token, and the one a
    verification writes beyond the last accepted token (the bonus position)."""
    return prompt_len + max_tokens + 1


class Sequence:
    """Tokens and finish logic of one request.

    ``append`` takes one token at a time, so EOS, stop strings and max_tokens
    are applied identically whether tokens arrive one per step (full mode) or
    as a run of accepted draft tokens (VeriCache mode).
    """

    def __init__(self, request_id: int, prompt_ids: list[int], params: SamplingParams,
                 tokenizer: Tokenizer, eos_ids: list[int]) -> None:
        self.request_id = request_id
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.output_ids: list[int] = []
        self.finish_reason: str | None = None
        self.generator: torch.Generator = params.make_generator()
        self._tokenizer = tokenizer
        self._eos = set() if params.ignore_eos else set(eos_ids)
        # a stop string of c characters spans at most 4c byte-level tokens
        self._stop_window = 4 * max((len(s) for s in params.stop_list), default=0) + 1
        self.stats: dict[str, Any] = {}

    @property
    def capacity(self) -> int:
        """``positions_needed`` for this request."""
        return positions_needed(len(self.prompt_ids), self.params.max_tokens)

    @property
    def remaining(self) -> int:
        """Tokens still allowed by ``max_tokens``."""
        return self.params.max_tokens - len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, token: int) -> bool:
        """Add one generated token; returns True when the request has just finished."""
        if self.finished:
            raise RuntimeError(f"request {self.request_id} is already finished")
        self.output_ids.append(token)
        if token in self._eos:
            self.finish_reason = "stop"
        elif self.params.stop_list and self._hits_stop():
            self.finish_reason = "stop"
        elif len(self.output_ids) >= self.params.max_tokens:
            self.finish_reason = "length"
        return self.finished

    def _hits_stop(self) -> bool:
        tail = self._tokenizer.decode(self.output_ids[-self._stop_window:])
        return any(s in tail for s in self.params.stop_list)

    def text(self) -> str:
        """Output text without EOS and cut before the first stop string."""
        text = self._tokenizer.decode(self.output_ids)
        cuts = [i for i in (text.find(s) for s in self.params.stop_list) if i >= 0]
        return text[: min(cuts)] if cuts else text

    def to_output(self) -> RequestOutput:
        return RequestOutput(self.request_id, self.text(), list(self.output_ids), list(self.prompt_ids),
                             self.finish_reason or "length", dict(self.stats))
