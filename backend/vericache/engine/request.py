"""A request inside the engine: its sequence, options, caches, state and counters.

States (``State``) and their transitions (``ALLOWED``), each exercised by the tests; the request
table (``engine.requests``) is the only place that moves them:
  waiting -> prefill -> decoding (full, lossy) | drafting (vericache)
  drafting -> transferring -> drafting          (a round whose full KV crosses the link to this device)
  drafting -> awaiting_verifier -> drafting     (a round out at the remote verifier, ``--role drafter``)
  any running state -> waiting                  (preempted: KV freed, recomputed on re-admission)
  any state -> finished | aborted | failed      (KV freed at once; failed: a step raised for it)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import StrEnum

from vericache.drafting.round import RoundState
from vericache.engine.options import ResolvedOptions
from vericache.engine.sequence import Sequence
from vericache.kv.compressed import CompressedKVCache
from vericache.kv.full import FullKVCache
from vericache.kv.link import Transfer

class State(StrEnum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODING = "decoding"
    DRAFTING = "drafting"
    TRANSFERRING = "transferring"            # the round's full KV on the link to this device
    AWAITING_VERIFIER = "awaiting_verifier"  # the round out at the remote verifier
    FINISHED = "finished"
    ABORTED = "aborted"
    FAILED = "failed"


DONE = frozenset({State.FINISHED, State.ABORTED, State.FAILED})
ALLOWED = {
    State.WAITING: {State.PREFILL} | DONE,
    State.PREFILL: {State.DECODING, State.DRAFTING, State.WAITING} | DONE,
    State.DECODING: {State.WAITING} | DONE,
    State.DRAFTING: {State.TRANSFERRING, State.AWAITING_VERIFIER, State.WAITING} | DONE,
    State.TRANSFERRING: {State.DRAFTING, State.WAITING} | DONE,
    State.AWAITING_VERIFIER: {State.DRAFTING, State.WAITING} | DONE,
}


@dataclass
class Request:
    id: int
    seq: Sequence
    opts: ResolvedOptions
    policy_state: object = None
    prefill: object = None                     # a SharedPrefill to load instead of prefilling
    state: State = State.WAITING
    full: FullKVCache | None = None            # device tier (full mode, or vericache without tiers) or host
    draft: CompressedKVCache | None = None     # device tier
    resident: FullKVCache | None = None        # device tier: the resident layers of the full KV
    prefill_buf: FullKVCache | None = None     # device tier: a host-tier full KV being prefilled on the device
    done_ids: int = 0                          # tokens already in the caches (prefill progress)
    round: RoundState = field(default_factory=RoundState)
    group: int = 0                             # grouped schedule: the phase group of the current round
    transfer: Transfer | None = None
    fetch: object = None                       # a Future of the prefix fetch (engine.remote)
    session: object = None                     # the remote verifier session (drafter role)
    prefilled: bool = False                    # remote: prefill done, the verifier's first token awaited
    prefix_tokens: int = 0                     # prompt positions loaded from the prefix store
    verifier_hit_tokens: int = 0
    fetch_bytes: int = 0
    fetch_s: float = 0.0
    emitted: int = 0          # output tokens already returned by step()
    reported: bool = False    # the final StepOutput has been returned
    error: str | None = None  # why the request failed
    error_status: int = 500   # the HTTP status that failure maps to (503: a remote part is gone)
    draft_bytes_read: int = 0
    verify_bytes_read: int = 0
    added_at: float = field(default_factory=time.perf_counter)
    first_token_at: float = 0.0
    finished_at: float = 0.0

    @property
    def mode(self) -> str:
        return self.opts.mode

    @property
    def position(self) -> int:
        """Position of the last token (the one no cache holds yet)."""
        return len(self.seq.prompt_ids) + len(self.seq.output_ids) - 1

    @property
    def prefill_ids(self) -> list[int]:
        """What a prefill puts in the caches: the prompt, and a re-admitted request's output but its last."""
        return self.seq.prompt_ids + self.seq.output_ids[:-1]

    @property
    def last_token(self) -> int:
        return self.seq.output_ids[-1] if self.seq.output_ids else self.seq.prompt_ids[-1]

    @property
    def done(self) -> bool:
        return self.state in DONE


@dataclass
class StepOutput:
    request_id: int
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None   # "stop", "length", "abort" or "error"
    error: str | None = None
