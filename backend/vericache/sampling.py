"""What a request asks for and what it has generated: sampling parameters, the ``Sequence`` of its
tokens (finish logic), token sampling and the speculative accept/resample rule."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

import torch

from vericache.model.tokenizer import Tokenizer
from vericache.noise import gumbel, uniforms


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False  # benchmarks: always generate max_tokens
    stop_list: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise TypeError(f"max_tokens must be an int, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool):
            raise TypeError(f"temperature must be a number, got {self.temperature!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 disables it), got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise TypeError(f"seed must be an int or None, got {self.seed!r}")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        for s in stops:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        self.stop_list = stops

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


# How a sampled draft is accepted (``EngineConfig.acceptance``):
#   coupled    the draft and the verifier sample with the same Gumbel noise g(seed, position): a draft
#              is accepted while it equals the verifier's own sample, exactly as greedy rounds accept
#              argmax matches, so a seeded request's text is the same bits as seeded full decoding's
#              whatever the rounds, the compressor or the batch (docs/DESIGN.md, "Sampling");
#   rejection  Leviathan et al.'s rule: accept with min(1, p/q), else resample from max(p - q, 0);
#              exact in distribution, and the text of a seed follows the request's round lengths.
ACCEPTANCE_RULES = ("coupled", "rejection")
# independent noise streams of one request (``noise.uniforms``' ``stream``)
SAMPLE_STREAM, ACCEPT_STREAM, RESIDUAL_STREAM = 0, 1, 2


def tempered_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits: [T, V] -> float64 [T, V]: (logits - max) / temperature, -inf outside top-k and top-p.
    softmax of it is the distribution a request samples from."""
    # shifted by the max before dividing: a temperature near 0 (1e-300, below fp32's range) sends the
    # others to -inf instead of every logit to +-inf or 0/0 (NaN); softmax ignores the shift
    logits = logits.double()
    scores = (logits - logits.max(dim=-1, keepdim=True).values) / params.temperature
    if params.top_k and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_p, idx = torch.softmax(scores, dim=-1).sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        drop[..., 0] = False
        scores = scores.masked_fill(torch.zeros_like(drop).scatter(-1, idx, drop), float("-inf"))
    return scores


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits: [T, V] -> probabilities [T, V] after temperature, top-k and top-p (fp32)."""
    return torch.softmax(tempered_logits(logits, params), dim=-1).float()


def choose_tokens(logits: torch.Tensor, params: SamplingParams, seed: int, first_position: int) -> list[int]:
    """logits: [T, V] for positions first_position .. +T-1 -> their tokens: the argmax when greedy,
    else argmax(tempered logits + g(seed, position)), the Gumbel-max trick: an exact sample of the
    truncated, tempered distribution whose noise depends on (seed, position) only."""
    if params.greedy:
        return logits.argmax(dim=-1).tolist()
    positions = torch.arange(first_position, first_position + logits.shape[0])
    noise = gumbel(seed, SAMPLE_STREAM, positions, logits.shape[-1])
    return (tempered_logits(logits.detach().cpu(), params) + noise).argmax(dim=-1).tolist()


def choose_token(logits: torch.Tensor, params: SamplingParams, seed: int, position: int) -> int:
    """logits: [V] -> the token at ``position`` (``choose_tokens`` for one row)."""
    return choose_tokens(logits[None], params, seed, position)[0]


def speculative_accept(p: torch.Tensor, q: torch.Tensor, token: int, seed: int,
                       position: int) -> tuple[bool, int | None]:
    """Leviathan et al.: accept a draft token x ~ q with prob min(1, p[x]/q[x]).

    p, q: [V] target and draft probabilities at ``position``. Returns (accepted, replacement): on
    rejection the replacement is drawn from normalise(max(p - q, 0)), which makes the output
    distributed exactly as p. The uniform and the replacement's noise are the request's own streams
    at this position (independent of the draft's)."""
    at = torch.tensor([position])
    ratio = (p[token] / q[token].clamp_min(1e-20)).item()
    if uniforms(seed, ACCEPT_STREAM, at, 1).item() < min(1.0, ratio):
        return True, None
    residual = (p - q).clamp_min(0.0)
    residual = p if residual.sum().item() <= 0 else residual
    noise = gumbel(seed, RESIDUAL_STREAM, at, p.shape[-1])[0]
    return False, int((residual.double().log() + noise).argmax())


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
        # an unseeded request draws a seed: from here on its randomness is g(seed, position) only
        self.seed: int = params.seed if params.seed is not None else secrets.randbits(63)
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
    def next_position(self) -> int:
        """The sequence position of the next token (prompt and output so far)."""
        return len(self.prompt_ids) + len(self.output_ids)

    def choose(self, logits: torch.Tensor, ahead: int = 0) -> int:
        """The token at ``next_position + ahead`` from logits [V] (argmax, or this request's coupled
        sample: the same for a draft, a verification and full decoding)."""
        return choose_token(logits, self.params, self.seed, self.next_position + ahead)

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
