"""The requests of one step loop: each request's data and states, the table that moves them, and
what the engine measures about its steps and requests.

States (``State``) and their transitions (``ALLOWED``), each exercised by the tests:
  waiting -> prefill -> decoding (full, lossy) | drafting (vericache)
  drafting -> transferring -> drafting          (a round whose full KV crosses the link to this device)
  drafting -> awaiting_verifier -> drafting     (a round out at the remote verifier, ``--role drafter``)
  prefill -> serving                            (a verifier session, ``--role verifier``: it verifies the
                                                 drafts a remote drafter sends until the drafter closes it)
  any running state -> waiting                  (preempted: KV freed, recomputed on re-admission)
  any state -> finished | aborted | failed      (KV freed at once; failed: a step raised for it)
A request's state moves only through ``RequestTable.set_state`` (along ``ALLOWED``); it ends only
through ``release`` (finished, aborted) or ``fail``, which free everything it holds at once. The
scheduler, the offload policy, the remote half and the background service all go through these
calls; none of them writes a state or frees KV by itself.

``Instruments``: the rates feed the offload policy (how long a transfer takes, how long a draft step
takes) and the draft-length cost fit; the intervals feed timelines and utilisation;
``request_stats`` is what every caller reports (``LLM.generate`` outputs, the server's final chunk,
the benches).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

import torch

from vericache.compress.kvzip_scoring import ReconstructionScoringCache
from vericache.drafting.lookup import LookupIndex
from vericache.drafting.round import DraftState, RoundState, end_round
from vericache.engine.options import ResolvedOptions
from vericache.engine.placement import Placement
from vericache.engine.shared_prefill import SharedPrefill
from vericache.kv.compressed import CompressedKVCache
from vericache.kv.full import FullKVCache
from vericache.kv.link import Transfer
from vericache.kv.tee import QueryRecorder
from vericache.sampling import Sequence


class State(StrEnum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODING = "decoding"
    DRAFTING = "drafting"
    TRANSFERRING = "transferring"            # the round's full KV on the link to this device
    AWAITING_VERIFIER = "awaiting_verifier"  # the round out at the remote verifier
    SERVING = "serving"                      # a verifier session: verifying a remote drafter's rounds
    FINISHED = "finished"
    ABORTED = "aborted"
    FAILED = "failed"


DONE = frozenset({State.FINISHED, State.ABORTED, State.FAILED})
# admitted and still to make output tokens (a verifier session makes none of its own)
MAKING_OUTPUT = (State.PREFILL, State.DECODING, State.DRAFTING, State.TRANSFERRING, State.AWAITING_VERIFIER)
ALLOWED = {
    State.WAITING: {State.PREFILL} | DONE,
    State.PREFILL: {State.DECODING, State.DRAFTING, State.SERVING, State.WAITING} | DONE,
    State.DECODING: {State.WAITING} | DONE,
    State.DRAFTING: {State.TRANSFERRING, State.AWAITING_VERIFIER, State.WAITING} | DONE,
    State.TRANSFERRING: {State.DRAFTING, State.WAITING} | DONE,
    State.AWAITING_VERIFIER: {State.DRAFTING, State.WAITING} | DONE,
    State.SERVING: set(DONE),
}


# a verification's answer to a remote drafter: (m, the verifier's token, K, V) (``verify_for_drafter``)
VerifyReply = tuple[int, int, torch.Tensor, torch.Tensor]
Reply = Callable[[VerifyReply], None]
Interval = tuple[float, float, str]                 # (start, end, kinds) of a forward or a load
RoundEntry = tuple[int, int, int, int, int, int]    # (request, drafted, accepted, swapped, proposed, kept)


class Fetched(Protocol):
    """A prefix fetch's result (``remote.store.Fetched``): the blocks found as stored, their bytes, seconds."""
    blocks: list[dict[str, torch.Tensor]]
    nbytes: int
    seconds: float


class VerifierSession(Protocol):
    """A drafter's stream to its remote verifier (``remote.client``): rounds out, replies polled."""
    @property
    def in_flight(self) -> bool: ...   # a round (or the open) awaits its reply

    def verify(self, start: int, tokens: list[int]) -> None: ...
    def poll(self) -> tuple[dict[str, Any], dict[str, Any], float] | None: ...
    def close(self) -> None: ...


@dataclass
class Served:
    """A verifier session's side of a request (``remote.verifier``): its rounds come over the network.
    The scheduler plans the first queued verification (one per step), and on its result calls the
    verification's reply with ``drafting.round.verify_for_drafter``'s (m, token, K, V)."""
    opened: Callable[[int], None]       # called with the first token once the prompt is in (exact, greedy)
    chunk: int = 64                     # prompt tokens per forward: opens that land later join within a chunk
    recorder: QueryRecorder | None = None   # the prompt's last queries, for the store
    inbox: deque[tuple[int, list[int], Reply]] = field(default_factory=deque)   # (start, [x, d1 .. dk], reply) queued


@dataclass
class RequestKV:
    """The caches a request holds; which ones, on which tier, its ``Placement`` decides."""
    full: FullKVCache | None = None            # device tier (full mode, or vericache without tiers) or host
    draft: CompressedKVCache | None = None     # device tier
    resident: FullKVCache | None = None        # device tier: the resident layers of the full KV
    prefill_buf: FullKVCache | None = None     # device tier: a host-tier full KV being prefilled on the device
    # device tier: a guided drafter's record of what its verifications attend to, [L, Hq, capacity] fp32
    # (``drafting.guide``), made with the caches and reused by each: a fresh one a verification cost ~10,500
    # page faults at 32K (43 MB for the 0.5B code model), 8-12 ms
    seen: torch.Tensor | None = None

    def full_kv(self) -> FullKVCache:
        """The full KV, which a placement with one (``Placement.full_here`` or offloaded) allocates; a
        RuntimeError otherwise, which would be a bug in who asks."""
        if self.full is None:
            raise RuntimeError("this request holds no full KV (its placement has none)")
        return self.full

    def draft_kv(self) -> CompressedKVCache:
        """The compressed cache, which a placement that drafts here allocates (RuntimeError otherwise)."""
        if self.draft is None:
            raise RuntimeError("this request holds no compressed cache (its placement drafts elsewhere)")
        return self.draft

    def resident_bytes(self) -> int:
        """Bytes of every storage the caches hold (allocated capacity, not only valid positions), each
        storage counted once (no two of a request's caches share one)."""
        caches = sum(c.resident_bytes() for c in (self.full, self.draft, self.resident, self.prefill_buf) if c is not None)
        return caches + (self.seen.nbytes if self.seen is not None else 0)


@dataclass
class ScoringPass:
    """Its compressor's pass over the prompt once prefilled (KVzip's reconstruction: a second forward
    over it), run a chunk a step (``RowKind.PREFILL_SCORE``) so the other requests' steps go on
    meanwhile; the prefill completes when it ends, with what it left for then."""
    cache: ReconstructionScoringCache   # the prompt's K/V read-only, the pass's own after them; the scores
    logits: torch.Tensor                # [V]: the prompt's last logits (the first token, after the pass)
    context: FullKVCache | None         # the full cache the prompt is in (None: a lossy request)
    shared: SharedPrefill | None        # a shared prefill keeps the scores for the next request over it


@dataclass
class PrefillProgress:
    """How far its prompt is in the caches, and its compressor's scoring pass over it (KVzip)."""
    shared: SharedPrefill | None = None   # an exact prefill made elsewhere, loaded instead of computed
    done_ids: int = 0                     # tokens already in the caches
    complete: bool = False                # remote drafter: prefill done, the verifier's first token awaited
    scoring_ids: list[int] = field(default_factory=list)   # the pass's tokens (``Compressor.scoring_ids``)
    scored: int = 0                       # of them run (all of them once the pass ends or is not needed)
    scoring: ScoringPass | None = None    # the pass under way

    def restart(self) -> None:
        """Nothing in the caches (a preempted request is prefilled again on re-admission)."""
        self.done_ids = self.scored = 0
        self.scoring_ids, self.scoring = [], None

    def shared_prefill(self) -> SharedPrefill:
        """The exact prefill this request loads (RuntimeError where it computes its own)."""
        if self.shared is None:
            raise RuntimeError("this request has no shared prefill to load")
        return self.shared


@dataclass
class Drafting:
    """Its rounds (vericache): the round in progress, its draft-length policy's state, its proposals."""
    policy_state: DraftState
    round: RoundState = field(default_factory=RoundState)
    lookup: LookupIndex | None = None          # with lookup proposals: its n-gram index
    vocab: torch.Tensor | None = None          # its prompt's and output's tokens past the draft vocabulary
    vocab_seen: int = 0                        # output tokens ``vocab`` has taken in (``take_output_rare_tokens``)
    group: int = 0                             # grouped schedule: the phase group of the current round
    transfer: Transfer | None = None           # offloaded: its full KV on the link for this round

    def take_rare_tokens(self, ids: list[int], n: int | None) -> None:
        """Its prompt's ``ids`` (or its output's since the last call) past a draft vocabulary of the first ``n``
        tokens into ``vocab`` (int64, ascending, unique; None: none, or no draft vocabulary). Its drafts take
        logits for these too (``ModelRunner.execute``), so a draft can copy its prompt's and output's rare
        tokens (an identifier, a path): 187 of the 1,247 distinct tokens of an 8K code prompt were past
        32,768, and of the 6 of 64 tokens full decoding wrote past it all but one were in the prompt."""
        if n is None:
            return
        past = [i for i in ids if i >= n]   # a plain list: most calls take one output token (no tensor per step)
        if past:
            t = torch.tensor(past, dtype=torch.int64)
            self.vocab = torch.unique(t if self.vocab is None else torch.cat([self.vocab, t]))

    def take_output_rare_tokens(self, output_ids: list[int], n: int | None) -> None:
        """``take_rare_tokens`` of the output tokens it has not taken in yet (at a round's start)."""
        self.take_rare_tokens(output_ids[self.vocab_seen :], n)
        self.vocab_seen = len(output_ids)

    def on_link(self) -> Transfer:
        """The transfer of this round's full KV (offloaded requests between putting it on the link and
        the verification): a RuntimeError where there is none, which would be a scheduling bug."""
        if self.transfer is None:
            raise RuntimeError("no transfer is in flight for this request")
        return self.transfer

    def lookup_index(self) -> LookupIndex:
        """Its n-gram index (requests with lookup proposals; RuntimeError otherwise)."""
        if self.lookup is None:
            raise RuntimeError("this request drafts without lookup proposals")
        return self.lookup


@dataclass
class RemoteParts:
    """What it holds of the remote scenario: a prefix fetch, a verifier stream (drafter role), a
    session's queued rounds (verifier role), and what they brought."""
    fetch: Future[Fetched] | None = None        # the prefix store's fetch (``remote.fetch``)
    session: VerifierSession | None = None      # drafter role: its stream to the verifier
    served: Served | None = None                # verifier role: rounds from a remote drafter
    prefix_tokens: int = 0                      # prompt positions loaded from the prefix store
    verifier_hit_tokens: int = 0                # prompt positions the verifier had stored
    fetch_bytes: int = 0
    fetch_s: float = 0.0

    def serving(self) -> Served:
        """The verifier role's side of it (a verifier session; RuntimeError for any other request)."""
        if self.served is None:
            raise RuntimeError("this request is not a verifier session")
        return self.served


@dataclass
class Measures:
    """What its stats report: when it arrived, got its first token and ended; KV bytes read."""
    added_at: float = field(default_factory=time.perf_counter)
    first_token_at: float = 0.0
    finished_at: float = 0.0
    draft_bytes_read: int = 0
    verify_bytes_read: int = 0


@dataclass
class Request:
    """One request in the step loop: the core record and its typed parts (its caches, its prefill's
    progress, its rounds, its remote parts, its measures)."""
    id: int
    seq: Sequence
    opts: ResolvedOptions
    placement: Placement                       # where it lives (``engine.placement``): decided when added
    drafting: Drafting
    state: State = State.WAITING
    kv: RequestKV = field(default_factory=RequestKV)
    prefill: PrefillProgress = field(default_factory=PrefillProgress)
    remote: RemoteParts = field(default_factory=RemoteParts)
    measured: Measures = field(default_factory=Measures)
    emitted: int = 0          # output tokens already returned by step()
    reported: bool = False    # the final StepOutput has been returned
    error: str | None = None  # why the request failed
    error_status: int = 500   # the HTTP status that failure maps to (503: a remote part is gone)

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


@dataclass
class StepRecord:
    """One forward: when, what kinds of rows, and the work the roofline charges for it."""
    start: float
    end: float
    kinds: str
    seqs: int
    rows: int
    kv_bytes: int     # K/V bytes its attention reads (all layers)
    pairs: int        # query-key pairs per query head and layer
    by_kind: dict[str, tuple[int, int]] = field(default_factory=dict)   # row kind -> (rows, tokens)
    post: float = 0.0  # seconds of the step's postprocess after the forward (commits, compression moves)
    round_post: float = 0.0  # of ``post``: the drafted rounds' own updates (``Instruments.note_round_update``)
    vocab_rows: int = 0      # draft rows whose logits took the draft vocabulary's head (``ModelRunner.execute``)


def _bounded() -> deque[Any]:
    return deque(maxlen=65536)   # a long-running server keeps a bounded history


@dataclass
class Instruments:
    """What the engine measured. ``intervals`` and ``steps`` are histories (bounded); the server
    takes what happened since its last look as events (``take_events``), leaving the histories
    for the rates that read them (``draft_step_s``)."""
    intervals: deque[Interval] = field(default_factory=_bounded)      # per forward or load
    round_log: deque[RoundEntry] = field(default_factory=_bounded)    # rounds not yet taken
    remote_rtts: deque[float] = field(default_factory=_bounded)       # verifier round trips not yet taken
    new_intervals: deque[Interval] = field(default_factory=_bounded)  # intervals not yet taken
    verify_layer_s: float = 0.0   # forward seconds per layer of a verification (EMA)
    early_verifies: int = 0       # verifications started while their last layers were in flight
    preemptions: int = 0          # requests sent back to waiting (their KV recomputed on re-admission)
    failures: int = 0             # requests failed by an exception in a step
    steps: deque[StepRecord] = field(default_factory=lambda: deque(maxlen=4096))   # per forward, the latest

    n_steps: int = 0              # forwards recorded, ever (``steps`` keeps the latest)
    round_updates: deque[float] = field(default_factory=lambda: deque(maxlen=64))   # seconds, the latest 64
    _step_round_post: float = 0.0  # this step's round updates so far (``take_round_post``)

    def note_round_update(self, seconds: float) -> None:
        """A drafted round's update after its verification ran (accept, both caches' commits, guided
        trades): what a round costs beyond its rows, priced per round (``DraftCost.round_s``)."""
        self.round_updates.append(seconds)
        self._step_round_post += seconds

    def take_round_post(self) -> float:
        """The round updates since the last call: the step's ``StepRecord.round_post``."""
        seconds, self._step_round_post = self._step_round_post, 0.0
        return seconds

    def record_step(self, rec: StepRecord, n_layers: int) -> None:
        """A forward ran: its interval, its record, and (a verification alone) the per-layer rate."""
        self.note_interval(rec.start, rec.end, rec.kinds)
        self.steps.append(rec)
        self.n_steps += 1
        if rec.kinds == "verify":  # a clean measurement of the verification
            self.note_verify(rec.end - rec.start, n_layers)

    def note_interval(self, start: float, end: float, kinds: str) -> None:
        self.intervals.append((start, end, kinds))
        self.new_intervals.append((start, end, kinds))

    def take_events(self) -> tuple[list[Interval], list[RoundEntry], list[float]]:
        """(intervals, rounds, verifier round trips) since the last call, for metrics; the
        histories the engine's own rates read stay."""
        out = list(self.new_intervals), list(self.round_log), list(self.remote_rtts)
        self.new_intervals.clear()
        self.round_log.clear()
        self.remote_rtts.clear()
        return out

    def busy_s(self) -> float:
        return float(sum(e - s for s, e, _ in self.intervals))

    def draft_step_s(self) -> float | None:
        """Mean seconds of a recent step that drafted (None before one ran)."""
        recent = [self.intervals[-i] for i in range(1, min(32, len(self.intervals)) + 1)]
        spans = [e - s for s, e, k in recent if "draft" in k]
        return sum(spans) / len(spans) if spans else None

    def note_verify(self, seconds: float, n_layers: int) -> None:
        per_layer = seconds / n_layers
        self.verify_layer_s = per_layer if self.verify_layer_s <= 0 else 0.7 * self.verify_layer_s + 0.3 * per_layer


class RequestTable:
    def __init__(self, free_kv: Callable[[Request], None], instruments: Instruments) -> None:
        """``free_kv``: gives back every block the request's caches hold (``KVMemory.free``)."""
        self.free_kv, self.instruments = free_kv, instruments
        self._by_id: dict[int, Request] = {}
        self._ids = itertools.count()

    # ------------------------------------------------------------------ the table
    def add(self, req: Request) -> int:
        """Give an accepted request its id (ids go only to accepted requests) and enter it. (The
        sequence keeps its own ``request_id``: it may be the caller's object.)"""
        req.id = next(self._ids)
        self._by_id[req.id] = req
        return req.id

    def get(self, rid: int) -> Request | None:
        return self._by_id.get(rid)

    def __getitem__(self, rid: int) -> Request:
        return self._by_id[rid]

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._by_id.values()))   # a copy: the server's threads read while the loop steps

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, rid: int) -> bool:
        return rid in self._by_id

    def in_state(self, *states: State) -> list[Request]:
        return [r for r in self if r.state in states]

    def has_unfinished(self) -> bool:
        return any(not r.done for r in self)

    def counts(self) -> tuple[int, int]:
        """(running, waiting) requests: admitted and not done, and not yet admitted."""
        reqs = list(self)
        waiting = sum(1 for r in reqs if r.state == State.WAITING)
        return sum(1 for r in reqs if not r.done) - waiting, waiting

    def forget(self, rid: int) -> None:
        """Drop a finished request's record (a long-running server keeps none); refused while it runs."""
        req = self._by_id.get(rid)
        if req is not None and not req.done:
            raise ValueError(f"request {rid} is still {req.state}: abort it first")
        self._by_id.pop(rid, None)

    # ------------------------------------------------------------------ the lifecycle
    def set_state(self, req: Request, state: State) -> None:
        """Move a request along ``request.ALLOWED`` (RuntimeError on any other transition)."""
        if state not in ALLOWED.get(req.state, set()):
            raise RuntimeError(f"request {req.id}: illegal transition {req.state} -> {state}")
        req.state = state

    def release(self, req: Request, state: State) -> None:
        """End a request in ``state`` (finished, aborted, failed): its stats, then its memory."""
        req.measured.finished_at = time.perf_counter()
        req.seq.stats.update(request_stats(req))  # before the caches go
        self.drop_kv(req)
        self.set_state(req, state)

    def fail(self, req: Request, error: str, status: int = 500) -> None:
        """End a request with an error (``status``: the HTTP status its caller answers)."""
        if req.done:
            return
        self.instruments.failures += 1
        req.error, req.error_status = error, status
        self.release(req, State.FAILED)

    def fail_unfinished(self, error: str) -> None:
        """Fail every request not yet done (the step loop itself broke)."""
        for req in self:
            if not req.done:
                try:
                    self.fail(req, error)
                except Exception:  # noqa: BLE001 - its state is broken too: end it regardless
                    req.state, req.error = State.FAILED, error
                    self.free_kv(req)

    def drop_kv(self, req: Request) -> None:
        """Let go of everything the request holds: its verifier session, fetch, transfer and KV."""
        if req.remote.session is not None:  # cancels the stream: the verifier frees its KV
            req.remote.session.close()
            req.remote.session = None
        if req.remote.fetch is not None:
            req.remote.fetch.cancel()
            req.remote.fetch = None
        req.prefill.complete = False
        req.prefill.scoring = None   # its pass's buffers go with it
        if req.drafting.transfer is not None:
            req.drafting.transfer.cancel()  # the copier skips what it has not started; the buffer dies with it
            req.drafting.transfer = None
        self.free_kv(req)

    def round_done(self, req: Request, m: int, swapped: int = 0) -> None:
        """A verified round with ``m`` of its drafts accepted (``finish_round`` done) and ``swapped``
        tokens traded into its drafter's store (``drafting.guide``): the round log (metrics), then
        ``end_round`` (the draft-length policy learns it; a fresh round)."""
        rs = req.drafting.round
        rs.swapped += swapped
        self.instruments.round_log.append((req.id, len(rs.drafts), m, swapped, rs.proposed, rs.kept))
        end_round(req.drafting.round, req.opts.policy, req.drafting.policy_state, m)

    # ------------------------------------------------------------------ outputs
    def collect_outputs(self) -> list[StepOutput]:
        """Tokens not yet reported, and each request's end (once)."""
        outs = []
        for req in self:
            if req.reported:
                continue
            new = req.seq.output_ids[req.emitted :]
            if new or req.done:
                reason = {State.FINISHED: req.seq.finish_reason, State.ABORTED: "abort",
                          State.FAILED: "error"}.get(req.state)
                outs.append(StepOutput(req.id, list(new), req.done, reason, req.error))
                req.emitted, req.reported = len(req.seq.output_ids), req.done
        return outs


def request_stats(req: Request) -> dict[str, Any]:
    """A request's timing, memory and (vericache) acceptance figures."""
    seq, rs = req.seq, req.drafting.round
    n_out = len(seq.output_ids)
    decoded = max(n_out - 1, 0)  # the first token comes from prefill
    end = req.measured.finished_at or time.perf_counter()
    prefill_s = (req.measured.first_token_at - req.measured.added_at) if req.measured.first_token_at else 0.0
    decode_s = end - req.measured.first_token_at if req.measured.first_token_at else 0.0
    st = {"mode": req.mode, "prompt_tokens": len(seq.prompt_ids), "completion_tokens": n_out,
          "prefill_s": round(prefill_s, 6), "decode_s": round(decode_s, 6),
          "decode_tokens_per_s": round(decoded / decode_s, 3) if decode_s > 0 else 0.0,
          "kv_resident_bytes": req.kv.resident_bytes()}  # every storage its caches hold, once
    if req.kv.draft is not None:
        full_bytes = req.kv.draft.full_nbytes()
        st.update({
            "compressor": req.opts.compressor.spec(),
            "compression_ratio": round(req.kv.draft.nbytes() / full_bytes, 4) if full_bytes else 1.0,
            "kv_bytes_read_per_token": {"draft": round(req.measured.draft_bytes_read / max(decoded, 1), 1),
                                        "verify": round(req.measured.verify_bytes_read / max(decoded, 1), 1)}})
    if req.placement.drafts:
        st.update({
            "rounds": rs.rounds, "drafted_tokens": rs.drafted, "accepted_tokens": rs.accepted,
            "acceptance_rate": round(rs.accepted / rs.drafted, 4) if rs.drafted else 0.0,
            # tokens emitted per verification round, bonus/correction included
            "mean_acceptance_length": round(decoded / rs.rounds, 3) if rs.rounds else 0.0,
            "accepted_per_position": list(rs.accepted_per_pos),
            # tokens each way: plain full-KV steps (cool-downs, or the costs found drafting slower)
            # and verified rounds of drafts
            "full_step_tokens": rs.full_steps, "round_tokens": decoded - rs.full_steps,
            "fallbacks": req.drafting.policy_state.fallbacks,
            "cost_fallbacks": req.drafting.policy_state.cost_fallbacks,
            # tokens verification-guided selection traded into the drafter's store (all layers, heads)
            "guided_swaps": rs.swapped,
            # lookup proposals (drafting.lookup): tokens the drafter checked, and those it agreed with
            "lookup_proposed_tokens": req.drafting.lookup.proposed if req.drafting.lookup else 0,
            "lookup_kept_tokens": req.drafting.lookup.kept if req.drafting.lookup else 0,
            "draft_steps": rs.draft_steps})   # drafter forwards this request took part in
    if req.remote.prefix_tokens or req.remote.fetch_bytes or req.remote.verifier_hit_tokens:
        st.update({"prefix_tokens": req.remote.prefix_tokens, "prefix_fetch_bytes": req.remote.fetch_bytes,
                   "prefix_fetch_s": round(req.remote.fetch_s, 6), "verifier_prefix_tokens": req.remote.verifier_hit_tokens})
    if req.error:
        st["error"] = req.error
    return st
