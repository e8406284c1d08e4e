"""Per-request VeriCache options: mode, compressor, draft length and lookup, defaulting to the server's.

One server runs every mode side by side: each request carries its own resolved options, so a
``full`` request decodes over the full KV on the device while a ``vericache`` request next to it
drafts from its compressed KV. Validation happens here, before a request is queued, and raises
``InvalidOption`` (a ``ValueError``) naming the field and the offending value.
"""

from __future__ import annotations

from dataclasses import dataclass

from vericache.compress.base import Compressor
from vericache.compress.registry import parse_compressor
from vericache.drafting.round import DraftLengthPolicy
from vericache.sampling import SamplingParams

MODES = ("full", "lossy", "vericache")


class InvalidOption(ValueError):
    """A request option that cannot be served; ``field`` names it (``mode``, ``compressor``, ``draft_len``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class RequestOptions:
    """What a client may ask for; ``None`` means "the server's default"."""
    mode: str | None = None
    compressor: str | None = None
    draft_len: int | str | None = None
    lookup: bool | None = None      # prompt-lookup proposals checked by the drafter (drafting.lookup)


AUTO_ON_THE_WIRE = 0   # draft_len "auto" in a typed integer input (the Triton model's INT32 draft_len)


def draft_len_to_wire(draft_len: int | str) -> int:
    """A request's ``draft_len`` (an integer >= 1 or "auto") as the Triton model's INT32 input."""
    return AUTO_ON_THE_WIRE if draft_len == "auto" else int(draft_len)


def draft_len_from_wire(k: int | None) -> int | str | None:
    """The Triton model's ``draft_len`` input back as a request's option (None: absent, the default)."""
    return None if k is None else "auto" if k == AUTO_ON_THE_WIRE else int(k)


@dataclass
class ResolvedOptions:
    mode: str
    compressor: Compressor
    policy: DraftLengthPolicy
    lookup: bool = False
    acceptance: str = "coupled"     # how sampled drafts are accepted (sampling.ACCEPTANCE_RULES)

    @property
    def compressor_label(self) -> str:
        """The compressor as a metric label ("" for full mode, which compresses nothing)."""
        return "" if self.mode == "full" else self.compressor.spec()


def check_mode(mode: object) -> str:
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
    return mode


def resolve_options(options: RequestOptions | None, default: ResolvedOptions) -> ResolvedOptions:
    """Fill a request's options from the server's ``default``; parse and validate what was given."""
    if options is None:
        return default
    if not isinstance(options, RequestOptions):
        raise TypeError(f"options must be a RequestOptions, got {type(options).__name__}")
    try:
        mode = default.mode if options.mode is None else check_mode(options.mode)
    except ValueError as exc:
        raise InvalidOption("mode", str(exc)) from None
    if options.compressor is None:
        compressor = default.compressor
    elif not isinstance(options.compressor, str):
        raise InvalidOption("compressor", f"compressor must be a string such as 'snapkv:ratio=0.25', "
                                          f"got {options.compressor!r}")
    else:
        try:
            compressor = parse_compressor(options.compressor)
        except (ValueError, TypeError) as exc:
            raise InvalidOption("compressor", str(exc)) from None
    try:
        policy = default.policy if options.draft_len is None else DraftLengthPolicy.from_arg(options.draft_len)
    except ValueError as exc:
        raise InvalidOption("draft_len", str(exc)) from None
    if options.lookup is not None and not isinstance(options.lookup, bool):
        raise InvalidOption("lookup", f"lookup must be true or false, got {options.lookup!r}")
    lookup = default.lookup if options.lookup is None else options.lookup
    return ResolvedOptions(mode, compressor, policy, lookup, default.acceptance)


def check_prompt(prompt_ids: list[int], params: SamplingParams, max_context: int, vocab_size: int) -> None:
    """A request's prompt and budget against the model's limits: ValueError saying what is wrong."""
    if not prompt_ids:
        raise ValueError("prompt is empty: it encodes to 0 tokens")
    total = len(prompt_ids) + params.max_tokens
    if total > max_context:
        raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds "
                         f"the model's context limit of {max_context} tokens")
    bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")


@dataclass(frozen=True)
class Intake:
    """A request as an engine takes it: its prompt and sampling checked against the model's limits and
    its options resolved, once, by ``make_intake`` (``Engine.intake``). Every front end makes one where
    the request arrives (the gateway, the Triton model, the library, the verifier role), so bad input
    fails there, before anything is queued, and nothing after checks or resolves it again."""
    prompt_ids: list[int]
    params: SamplingParams
    options: ResolvedOptions
    asked: RequestOptions | None = None   # what the client set (a gateway forwards these, not the defaults)


def make_intake(prompt_ids: list[int], params: SamplingParams, options: RequestOptions | ResolvedOptions | None,
                default: ResolvedOptions, max_context: int, vocab_size: int) -> Intake:
    """The one intake: ``check_prompt`` and ``resolve_options`` (ValueError / ``InvalidOption`` / TypeError)."""
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
    check_prompt(prompt_ids, params, max_context, vocab_size)
    if isinstance(options, ResolvedOptions):
        return Intake(list(prompt_ids), params, options)
    return Intake(list(prompt_ids), params, resolve_options(options, default), options)
