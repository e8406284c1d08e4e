"""The scheduler: which requests run, what each step carries (the plan), and what its results do.

The stages of a step are joined by plain data, as in vLLM v1: ``plan()`` returns a ``StepPlan``
(rows: their kind, tokens, positions, cache), ``ModelRunner.execute(plan)`` returns a ``StepResult``
(logits per sampled row), ``update(plan, result)`` applies it to the requests.
- admit: waiting requests enter, first come first served, while their KV fits beside the running
  ones (``engine.memory``); a request alone always fits.
- plan: a verification chunk per request whose full KV is in place (or has landed over the link),
  prefill chunks within ``prefill_chunk`` tokens, a decode row per full/lossy request, a draft row per
  VeriCache request still drafting, and a local verification per complete draft; a request is in at
  most one row. A new round's draft length is the draft planner's (``DraftPlanner``, below:
  the request's policy, then the link's backlog or the fitted step costs).
- update: prefill chunks advance and, at the prompt's end, compress it and pick the first token;
  decode rows append their token; draft rows add theirs to the round; verifications end the round
  (``drafting.round.finish_round``). Then each request finishes, or is charged for what it holds now.
- make room: newer requests are preempted, newest first, until a request's KV fits.
An exception while updating a row fails only its request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

import torch

from vericache.drafting.calibrate import model_calibration
from vericache.drafting.cost import Calibrated, DraftCost
from vericache.drafting.guide import SeenRecorder, guide_store
from vericache.drafting.lookup import Joined, LookupIndex
from vericache.drafting.round import (
    MIN_KEEP_EVIDENCE,
    DraftState,
    SharedAcceptance,
    add_checked_proposal,
    add_draft,
    catch_up,
    draft_position,
    draft_step_yield,
    finish_round,
    verify_for_drafter,
)
from vericache.engine.config import EngineConfig
from vericache.engine.memory import KVMemory
from vericache.engine.offload import Offload
from vericache.engine.options import ResolvedOptions
from vericache.engine.placement import drafts_in_rounds
from vericache.engine.remote_rounds import PrefixSource, RemoteRounds, VerifierSource
from vericache.engine.requests import DONE, MAKING_OUTPUT, Instruments, Request, RequestTable, ScoringPass, State
from vericache.engine.shared_prefill import SharedPrefill
from vericache.kv.full import FullKVCache
from vericache.kv.link import Link, StreamedKV
from vericache.kv.protocol import KVCache
from vericache.kv.tee import TeeCache
from vericache.model.draft_weights import draft_vocab_size
from vericache.model.loader import LoadedModel

log = logging.getLogger("vericache.engine")
MAX_POOLS = 64   # acceptance pools an engine keeps (one per compressor spec its requests name)
# drafts a step more than at a cost decline before its cool-down ends early (DraftPlanner._better_offer)
OFFER_GAIN = 1.0


class RowKind(StrEnum):
    # prefill work's values start with "prefill": the checks that leave it out of decode steps (the cost
    # fit, the roofline) match on that
    PREFILL = "prefill"   # a chunk of a prompt into the caches
    PREFILL_SCORE = "prefill_score"   # a chunk of a compressor's scoring pass over its prompt (KVzip)
    DECODE = "decode"     # one token of a full or lossy request
    DRAFT = "draft"       # one draft token over the compressed cache
    VERIFY = "verify"     # a round's chunk [x, d1 .. dk] over the full KV


@dataclass
class Row:
    req: Request              # the request the row is for (a verifier session is one too)
    kind: RowKind
    tokens: list[int]
    start: int                # position of tokens[0]
    cache: KVCache            # what it attends through
    logits_for: str           # "last", "all" or "none"


@dataclass
class StepPlan:
    """One step's rows: prefill chunks, decode, draft and verification rows of different requests,
    run in one forward so the weights are read once per step whatever the mix."""
    rows: list[Row] = field(default_factory=list)

    def add(self, req: Request, kind: RowKind, tokens: list[int], start: int, cache: KVCache,
            logits_for: str = "last") -> None:
        self.rows.append(Row(req, kind, tokens, start, cache, logits_for))

    def of(self, kind: RowKind) -> list[Row]:
        return [r for r in self.rows if r.kind == kind]

    @property
    def kinds(self) -> str:
        """The kinds of work in this step, for timelines ("draft+verify")."""
        return "+".join(k for k in RowKind if any(r.kind == k for r in self.rows))


@dataclass
class StepResult:
    """What one forward returned, row by row (aligned with ``StepPlan.rows``)."""
    logits: list[torch.Tensor | None]   # [1, V] ("last"), [len(tokens), V] ("all") or None
    argmax: list[list[int] | None]      # the greedy choice of each logits row (one device sync a step)


# ---------------------------------------------------------------------- the draft length
class DraftPlanner:
    """The one owner of a round's draft length. The scheduler asks it when a round starts
    (``new_round``) and, for the grouped link schedule, whether a complete draft waiting for its
    group's turn may draft on (``extend_waiting``); nothing else sets a length. In this order:
    1. the request's policy (``DraftLengthPolicy``): a fixed length, or "auto"'s length adapted to the
       request's acceptance (0 while it cools down after failed rounds: plain full steps);
    2. "auto" with the full KV here (in place): the fitted step costs (``drafting.cost``), the k that
       maximises tokens per second at this acceptance, this many requests and these caches;
    3. "auto" with the full KV behind a link (tiered): the link's backlog (``engine.offload``'s
       staggered and grouped schedules): a request that would only wait for the link drafts meanwhile,
       so its transfer buys more tokens; a grouped request whose complete draft waits for its group's
       turn drafts on while its drafts are mostly accepted (P2)."""

    def __init__(self, offload: Offload, n_active: Callable[[], int], queued: Callable[[], bool],
                 longest_other: Callable[[Request], int], instruments: Instruments,
                 calibrate: Callable[[], Calibrated] | None = None) -> None:
        """``offload``: the engine's ``Offload`` (for requests whose placement is offloaded: full KV behind the link);
        ``n_active()``: requests drafting or decoding now; ``queued()``: whether any waits for admission
        (what a request finishing sooner is worth: ``DraftCost``); ``longest_other(r)``: the most output
        tokens any other admitted request has still to make (where a closed batch ends); ``instruments``:
        the measured steps; ``calibrate``: the model's timed forwards (``drafting.calibrate.Calibration``),
        asked once at the first choice."""
        self.offload, self.n_active, self.queued, self.instruments = offload, n_active, queued, instruments
        self.longest_other = longest_other
        self.cost = DraftCost(calibrate=calibrate)   # draft lengths from this engine's step costs
        self.pools: dict[str, SharedAcceptance] = {}   # rounds pooled per compressor (a request's prior)

    def new_state(self, opts: ResolvedOptions) -> DraftState:
        """A new request's draft-length state: its policy's, its acceptance starting from the rounds of
        the engine's requests with the same compressor (``SharedAcceptance``; at admission, not in a step)."""
        st = opts.policy.new_state()
        if opts.compressor_label not in self.pools and len(self.pools) >= MAX_POOLS:
            del self.pools[next(iter(self.pools))]   # requests' own compressor specs: keep the latest few
        st.pool = self.pools.setdefault(opts.compressor_label, SharedAcceptance())
        return st

    def new_round(self, r: Request) -> int:
        """The draft length of ``r``'s next round (0: a plain full-KV step)."""
        policy, st = r.opts.policy, r.drafting.policy_state
        if st.cooldown and st.declined_yield and self.n_active() == 1 and self._better_offer(r):
            st.cooldown = 0   # the text copies now as it did not when rounds were declined: price one again
        k = policy.next_len(st, r.seq.remaining)
        if r.placement.offloaded:
            if k and policy.fixed is None and self.offload.stretches:
                k = max(k, min(self.offload.draft_to_cover_link(), policy.max_len, r.seq.remaining - 1))
            self.offload.on_new_round(r, k)
        elif k > 0 and policy.fixed is None and r.placement.verifies_in_place:
            k = self._cost_len(r, k)   # full KV here: the local step costs decide
        return k

    def proposal(self, r: Request) -> list[int]:
        """Lookup proposal tokens for ``r``'s next draft step (``drafting.lookup``), [] for a single row:
        where its committed tokens hold the last 3 (or 2) tokens earlier, what followed them, as many
        as the round has room for beyond the step's own draft and the fitted costs find worth checking."""
        if r.drafting.lookup is None:
            return []
        rs = r.drafting.round
        room = rs.k - len(rs.drafts) - 1
        if room < 1:
            return []
        tokens = self._indexed_tokens(r, r.drafting.lookup)
        proposal = r.drafting.lookup.propose(tokens, (tokens[-3:] + rs.drafts)[-3:], room)
        if not proposal:
            return []
        pos = r.position + len(rs.drafts)
        self.cost.refit(self.instruments.steps, self.instruments.n_steps, self.instruments.round_updates)
        n = self.cost.proposal_len(r.drafting.lookup.keep_rate(), self.n_active(),
                                   lambda rows: r.kv.draft_kv().attention_cost(pos, rows), len(proposal), self.queued())
        return proposal[:n]

    def extend_waiting(self, r: Request) -> None:
        """A complete draft waiting for its group's turn on the link: one more token while its drafts are
        mostly accepted (P2; "auto" only, within the policy's maximum and the request's budget)."""
        policy, rs = r.opts.policy, r.drafting.round
        if rs.k and rs.complete and policy.fixed is None and r.drafting.policy_state.ema_accepted >= 0.75 * rs.k:
            rs.k = min(rs.k + 1, policy.max_len, max(r.seq.remaining - 1, rs.k))

    def _cost_len(self, r: Request, k: int) -> int:
        """The draft length the step costs call for (``DraftCost``: calibrated on the model, then fitted
        to the engine's own forwards); the policy's ``k`` when no costs exist. Where they find plain full
        steps faster than any round at the request's acceptance, the request decodes full steps (the same
        tokens either way: ``cooldown`` of them, doubling up to 16x while rounds between keep failing), then
        asks again as a probe (sooner where the lookup now offers a better step: ``_better_offer``). A
        probe, and a request's first round, is priced at an optimistic acceptance (``DraftState.acceptance``,
        which starts from the rounds of the engine's other requests with the same compressor:
        ``SharedAcceptance``): where a round may pay at it, the request drafts the length
        the costs call for there, the policy's ``k`` at most (one request at 8K: a long first round measures
        a high acceptance at once; 8 x 2K of SmolLM2: 1-draft probes, where eight 8-draft probes failing
        together cost the batch 8 steps of 30). A probe fully accepted makes the next round a probe too
        (``DraftLengthPolicy.update``): from a uniform prior a few accepted drafts leave the mean acceptance
        low (1 of 1: 0.67), which at 32K of the code model declines every round (draft 41 ms, full 57, a
        verified row 10: rounds pay only above ~0.95), so a first probe's success used to end drafting with
        the backoff doubled, where 8-draft rounds were all accepted (1.18x full); where even then no round
        pays, it drafts nothing and decodes full steps as above, so a request whose rounds cannot pay runs
        as full mode does (8 x 8K of the 0.5B code model on AMX: a verified row's fp32 attention costs
        two thirds of a full row, and short probe rounds there cost 12%: "never slower than full"). Until
        the engine's own fit exists the calibration only vetoes rounds (timed on random K/V it prices
        attention above real steps' cost: ~60 vs ~42 ms a row at 8K on a Zen 2), so the policy sizes the
        rounds it lets through. The draft row is priced at the drafter's last commit (``draft_position``), a
        draft at its step's price over the drafts a step has given (lookup proposals: ``draft_step_yield``), and
        a drafted round's update after its verification as measured (``DraftCost.round_s``)."""
        st, policy = r.drafting.policy_state, r.opts.policy
        probing = st.probe or not st.measured
        pos, k_max, n = r.position, min(policy.max_len, r.seq.remaining - 1), self.n_active()
        self.cost.refit(self.instruments.steps, self.instruments.n_steps, self.instruments.round_updates)
        step_yield = self._step_yield(r, k_max)
        slack = max(self.longest_other(r) / max(r.seq.remaining, 1) - 1.0, 0.0)   # steps a token it may lose
        choice = self.cost.choose(st.acceptance(optimistic=probing), n,
                                  r.kv.draft_kv().attention_cost(draft_position(r.kv.draft_kv(), pos), 1),
                                  lambda j: r.kv.full_kv().attention_cost(pos, j + 1), k_max, step_yield, self.queued(),
                                  slack, st.cautious_acceptance())
        if choice is None:
            return k
        if choice == 0:   # no round pays (probing: not even at the optimistic acceptance): full steps a while
            st.fall_back(policy.cooldown, step_yield[0])
            return 0
        st.declined_yield = 0.0
        if probing:   # explore at the length that pays if the optimistic acceptance holds (the policy's at most)
            st.probe, st.probing = False, True   # (the backoff stays unless the probe is fully accepted)
            return min(k, choice)
        if self.cost.source != "fitted":
            return k   # the calibration may veto rounds; until the engine's own fit, the policy sizes them
        st.backoff = 0
        return choice

    def _better_offer(self, r: Request) -> bool:
        """Whether a draft step of ``r`` would now give ``OFFER_GAIN`` more drafts than the step its
        rounds were declined at (``DraftState.declined_yield``): the lookup offers a proposal, kept at the
        rate the output shows, where it offered none or a shorter one (the code model at 8K on a context that
        repeats: rounds declined before 8 output tokens showed the copying, then 16 full steps of cool-down
        before the next ask, 1.27x full where pricing at once gave 1.88x). Asked at each plain full step
        of the cool-down: one lookup probe and, with a proposal, its sizing. Asked for a
        request alone in its steps: in a batch a copying request's early rounds finished it early without
        ending the batch sooner, their verifications' attention added (8 x 8K, AMX: 0.95 -> 0.89-0.91x full),
        so there it waits out its cool-down."""
        k_max = min(r.opts.policy.max_len, r.seq.remaining - 1)
        need = r.drafting.policy_state.declined_yield + OFFER_GAIN
        return k_max >= 1 and self._step_yield(r, k_max)[0] >= need

    def index_prompt(self, r: Request) -> None:
        """With its prefill: ``r``'s prompt into its lookup index (where it has one), prompt work that at
        32K took ~20 ms of the first decode step."""
        if r.drafting.lookup is not None:
            self._indexed_tokens(r, r.drafting.lookup)

    @staticmethod
    def _indexed_tokens(r: Request, lookup: LookupIndex) -> Joined:
        """``r``'s committed tokens (prompt, then output; not copied), with ``lookup`` extended over them
        (its output tokens observed against the proposals: ``LookupIndex.extend``)."""
        seq = r.seq
        tokens = Joined(seq.prompt_ids, seq.output_ids)
        lookup.extend(tokens, observe_from=len(seq.prompt_ids))
        return tokens

    def _step_yield(self, r: Request, k_max: int) -> tuple[float, float]:
        """(drafts, rows) a draft step of ``r`` gives (``draft_step_yield``): as measured, or before that
        from the proposal the lookup offers now (as long as ``proposal`` would check), kept at the rate its
        checks and the committed output show, once they show it (``MIN_KEEP_EVIDENCE``)."""
        lookup = r.drafting.lookup
        if lookup is None:
            return draft_step_yield(r.drafting.round, 0)
        tokens = self._indexed_tokens(r, lookup)
        if lookup.evidence() < MIN_KEEP_EVIDENCE:
            return draft_step_yield(r.drafting.round, lookup.proposed)
        offered, keep = len(lookup.propose(tokens, tokens[-3:], k_max - 1)), lookup.keep_rate()
        if offered:
            draft, pos = r.kv.draft_kv(), draft_position(r.kv.draft_kv(), r.position)
            offered = self.cost.proposal_len(keep, self.n_active(), lambda rows: draft.attention_cost(pos, rows), offered,
                                             self.queued())
        return draft_step_yield(r.drafting.round, lookup.proposed, offered, keep)


class Scheduler:
    def __init__(self, loaded: LoadedModel, memory: KVMemory, requests: RequestTable, instruments: Instruments,
                 config: EngineConfig, link: Link | None = None, prefix: PrefixSource | None = None,
                 verifier: VerifierSource | None = None) -> None:
        """``loaded``: the model (compressors score prompts with it); ``config``: the engine's (its link
        schedule, prefill chunk and running limit); the rest: the loop's parts."""
        self.loaded, self.memory, self.requests, self.instruments = loaded, memory, requests, instruments
        self.prefill_chunk, self.max_running = config.prefill_chunk, config.max_running
        # this engine's draft vocabulary (its runner's: the model's may be another engine's at the moment)
        self.draft_vocab = draft_vocab_size(config.draft_vocab, loaded.config.vocab_size)
        self.offload = Offload(config.scheduler, loaded, memory, requests, instruments, self.make_room,
                               lambda r: self.planner.extend_waiting(r), link)
        self.planner = DraftPlanner(self.offload,   # every draft length
                                    lambda: len(requests.in_state(State.DRAFTING, State.DECODING)),
                                    lambda: bool(requests.in_state(State.WAITING)),
                                    lambda r: max((o.seq.remaining for o in requests.in_state(*MAKING_OUTPUT) if o is not r),
                                                  default=0),
                                    instruments,
                                    lambda: model_calibration(loaded))
        self.remote = RemoteRounds(prefix, verifier, requests, memory, instruments, loaded.device,
                                   self.charge) if prefix is not None or verifier is not None else None
        native = getattr(loaded.model, "native", None)   # guided selection's native ops, where the step is native
        self.guide_kernels = None if native is None else native.kernels

    # ------------------------------------------------------------------ admit
    def admit(self) -> None:
        waiting = self.requests.in_state(State.WAITING)
        if not waiting:
            return
        running = [r for r in self.requests if r.state not in (State.WAITING, *DONE)]
        reserved = sum(self.memory.needed(r) for r in running)
        transient = max((self.memory.transient(r) for r in running), default=0)
        for req in waiting:
            need = self.memory.needed(req)
            buf = max(transient, self.memory.transient(req))  # room for one transient at a time
            fits = reserved + need + buf <= self.memory.device.capacity_bytes or not running  # alone it always fits
            if len(running) >= self.max_running or not fits:
                break  # FIFO: later requests wait behind the first that does not fit
            self.requests.set_state(req, State.PREFILL)
            running.append(req)
            reserved, transient = reserved + need, buf

    # ------------------------------------------------------------------ plan
    def plan(self) -> StepPlan:
        plan = StepPlan()
        for r in self.requests.in_state(State.TRANSFERRING):
            transfer = r.drafting.on_link()
            if transfer.error:
                self.requests.fail(r, f"transfer failed: {transfer.error}")
            elif self.offload.can_verify(r):
                if not transfer.ready():
                    self.instruments.early_verifies += 1
                tokens = [r.last_token] + r.drafting.round.drafts
                plan.add(r, RowKind.VERIFY, tokens, r.position,
                         self._verify_cache(r, StreamedKV(transfer, r.kv.resident), len(tokens)), "all")
        budget = self.prefill_chunk
        for r in self.requests.in_state(State.PREFILL):
            if budget > 0 and not r.prefill.complete:
                budget -= self._plan_prefill(r, plan, budget)
        for r in self.requests.in_state(State.DECODING):
            plan.add(r, RowKind.DECODE, [r.last_token], r.position,
                     r.kv.draft_kv() if r.placement.draft_here else r.kv.full_kv())
        for r in self.requests.in_state(State.DRAFTING):
            self._plan_round(r, plan)
        for r in self.requests.in_state(State.SERVING):   # a verifier session: the drafter's next round
            if r.remote.serving().inbox:
                start, tokens, _ = r.remote.serving().inbox[0]
                plan.add(r, RowKind.VERIFY, tokens, start, r.kv.full_kv(), "all")
        return plan

    def _plan_round(self, r: Request, plan: StepPlan) -> None:
        """A drafting request's row: its next draft token, or its verification once the draft is complete."""
        rs, offloaded = r.drafting.round, r.placement.offloaded
        if not rs.started:  # a new round
            r.drafting.take_output_rare_tokens(r.seq.output_ids, self.draft_vocab)   # drafts may repeat them
            rs.start(self.planner.new_round(r))
            if rs.k and r.placement.verifies_in_place:
                catch_up(r.kv.draft_kv(), r.kv.full_kv(), r.position)   # plain full steps may have left the drafter behind
        if not rs.complete and (not offloaded or self.offload.may_draft(r)):
            tok = rs.drafts[-1] if rs.drafts else r.last_token
            proposal = self.planner.proposal(r)
            plan.add(r, RowKind.DRAFT, [tok] + proposal, r.position + len(rs.drafts), r.kv.draft_kv(),
                     "all" if proposal else "last")
        elif rs.complete and r.placement.verifies_in_place:  # else: the link (Offload) or the network (RemoteRounds)
            tokens = [r.last_token] + rs.drafts
            plan.add(r, RowKind.VERIFY, tokens, r.position, self._verify_cache(r, r.kv.full_kv(), len(tokens)), "all")

    def _verify_cache(self, r: Request, cache: KVCache, t: int) -> KVCache:
        """A local verification's cache; for a guided drafter (``drafting.guide``) one that records what
        the t verified rows attend to (into its ``RequestKV.seen``, [L, Hq, position + t] of it)."""
        if r.kv.seen is None or t == 1:   # t == 1: a plain full step, no drafts
            return cache
        return SeenRecorder(cache, r.kv.seen[:, :, : r.position + t])

    def _plan_prefill(self, req: Request, plan: StepPlan, budget: int) -> int:
        """Add the request's next prefill chunk (or its scoring pass's); returns the tokens planned."""
        if req.prefill.done_ids == 0 and req.kv.full is None and req.kv.draft is None:
            self.memory.allocate(req)
            if req.kv.draft is not None:   # its compressor's pass after the prompt (KVzip), if any
                req.prefill.scoring_ids = req.opts.compressor.scoring_ids(req.prefill_ids, self.loaded.tokenizer)
            if req.prefill.shared is not None:  # an exact prefill made elsewhere: load it
                self._load_shared_prefill(req)
                if req.state != State.PREFILL:
                    return 0
            if self.remote is not None:
                self.remote.start(req)
        if req.prefill.scoring is not None:
            return self._plan_scoring(req, plan)
        if self.remote is not None and self.remote.fetch_pending(req):
            return 0
        ids = req.prefill_ids
        n = min(budget, len(ids) - req.prefill.done_ids, req.remote.served.chunk if req.remote.served else budget)
        cache: KVCache
        if req.remote.served is not None and req.remote.served.recorder is not None:   # the store wants the last queries
            cache = TeeCache(self._prefill_full(req), req.remote.served.recorder)
        elif not req.placement.draft_here:
            cache = self._prefill_full(req)
        elif not req.placement.full_here:
            cache = req.kv.draft_kv()
        else:   # one prefill fills both
            cache = TeeCache(self._prefill_full(req), req.kv.draft_kv())
        chunk = ids[req.prefill.done_ids : req.prefill.done_ids + n]
        last = req.prefill.done_ids + n == len(ids)
        plan.add(req, RowKind.PREFILL, chunk, req.prefill.done_ids, cache, "last" if last else "none")
        return n

    @staticmethod
    def _plan_scoring(req: Request, plan: StepPlan) -> int:
        """The scoring pass's next chunk: its tokens after the prompt's positions, through its cache. The
        chunk is the pass's own (``chunk``), not what is left of the step's budget: its scores' bits do not
        depend on how an engine splits its prefill work."""
        pf, scoring = req.prefill, req.prefill.scoring
        assert scoring is not None
        chunk = pf.scoring_ids[pf.scored : pf.scored + scoring.cache.chunk]
        plan.add(req, RowKind.PREFILL_SCORE, chunk, scoring.cache.p + pf.scored, scoring.cache, "none")
        return len(chunk)

    @staticmethod
    def _prefill_full(req: Request) -> FullKVCache:
        """Where its prompt's full K/V are written: the device buffer of a host-tier request, else its full KV."""
        return req.kv.prefill_buf or req.kv.full_kv()

    def _load_shared_prefill(self, req: Request) -> None:
        """Take the prompt's exact prefill (made once, elsewhere) and compress it: prefill work, so it
        is recorded as a "load" interval, which benches leave out of decode time."""
        t0, shared = time.perf_counter(), req.prefill.shared_prefill()
        if req.kv.draft is not None:
            req.kv.draft.load_prefill(shared.reset(req.seq), shared.queries)
        req.prefill.done_ids = shared.prompt_len
        if req.prefill.done_ids == len(req.seq.prompt_ids) + max(len(req.seq.output_ids) - 1, 0):
            self._finish_prefill(req, shared.logits, shared.full, shared)
        self.instruments.note_interval(t0, time.perf_counter(), "load")

    # ------------------------------------------------------------------ update
    def update(self, plan: StepPlan, result: StepResult) -> None:
        """Each row's result applied to its request; then it finishes or is charged."""
        handlers = {RowKind.DECODE: self._after_decode, RowKind.DRAFT: self._after_draft,
                    RowKind.VERIFY: self._after_verify}
        for row, logits, argmax in zip(plan.rows, result.logits, result.argmax):
            req = row.req
            if req.done or req.state == State.WAITING:
                continue  # aborted, or preempted by an earlier row's growth in this step
            try:
                if row.kind == RowKind.PREFILL:   # logits only for a prompt's last chunk
                    self._after_prefill(req, row, logits)
                elif row.kind == RowKind.PREFILL_SCORE:
                    self._after_scoring(req, row)
                elif logits is None or argmax is None:
                    raise RuntimeError(f"the forward returned no logits for a {row.kind} row")
                else:
                    handlers[row.kind](req, row, logits, argmax)
                if req.seq.finished:
                    self.requests.release(req, State.FINISHED)
                elif req.state not in (State.WAITING, *DONE):
                    self.charge(req)
            except Exception as exc:  # noqa: BLE001 - this request fails; the others go on
                log.exception("request %s failed in %s", req.id, row.kind)
                self.requests.fail(req, f"{type(exc).__name__}: {exc}")

    def _finish_prefill(self, req: Request, logits: torch.Tensor, context: FullKVCache | None,
                        shared: SharedPrefill | None = None) -> None:
        """The prompt (and any recomputed output) is in the caches: its compressor's scoring pass starts
        (KVzip: a chunk a step from the next), or the prefill completes. ``shared``: the exact prefill
        made elsewhere that ``context`` is, which keeps its prompt's scores for every request over it."""
        if req.kv.prefill_buf is not None:  # home to the host tier
            req.kv.full_kv().load(req.kv.prefill_buf, req.prefill.done_ids)
        pf, comp = req.prefill, req.opts.compressor
        # a prompt partly loaded from the prefix store has no whole-prompt context here: no pass
        whole = req.kv.draft.prefill_context() if req.kv.draft is not None else None
        known = shared is not None and comp.spec() in shared.scores
        if pf.scoring_ids and whole is not None and not known:
            source = context or whole
            cache = comp.scoring_cache(source, self.loaded.config.num_hidden_layers, len(pf.scoring_ids))
            pf.scoring = ScoringPass(cache, logits, context, shared)
            return
        pf.scored = len(pf.scoring_ids)
        self._complete_prefill(req, logits, context, shared.scores.get(comp.spec()) if shared is not None else None)

    def _after_scoring(self, req: Request, row: Row) -> None:
        pf, scoring = req.prefill, req.prefill.scoring
        assert scoring is not None
        pf.scored += len(row.tokens)
        if pf.scored == len(pf.scoring_ids):   # the pass is over: the prefill completes with its scores
            pf.scoring, scores = None, scoring.cache.scores
            if scoring.shared is not None:
                scoring.shared.scores[req.opts.compressor.spec()] = scores
            self._complete_prefill(req, scoring.logits, scoring.context, scores)

    def _complete_prefill(self, req: Request, logits: torch.Tensor, context: FullKVCache | None,
                          scores: dict[int, torch.Tensor] | None) -> None:
        """Compress the prompt (``scores``: its scoring pass's, else None), pick the first token."""
        seq, n = req.seq, req.prefill.done_ids
        if req.kv.draft is not None:
            req.kv.draft.set_prefill_scores(scores, n)
            # compression starts once the whole prompt is in (an exact prefill); beside a full
            # cache the draft cache takes the prompt's K/V from it
            req.kv.draft.commit(n, source=context)
        self.planner.index_prompt(req)
        if drafts_in_rounds(req.mode):   # its drafts may propose (and check) the prompt's rare tokens too
            req.drafting.take_rare_tokens(seq.prompt_ids, self.draft_vocab)
        if req.kv.resident is not None:  # the resident layers go up once
            req.kv.resident.load(self._prefill_full(req), n)
        req.kv.prefill_buf = None
        if req.placement.session:  # a verifier session: the drafter appends the first token, not us
            self.requests.set_state(req, State.SERVING)
            req.remote.serving().opened(seq.choose(logits))
            return
        if req.placement.remote:  # the first token is the verifier's (exact), not the drafter's
            req.prefill.complete = True
            if seq.output_ids:
                self.requests.set_state(req, State.DRAFTING)
            return
        if not seq.output_ids:
            seq.append(seq.choose(logits))
            req.measured.first_token_at = time.perf_counter()
        self.requests.set_state(req, State(req.placement.state_after_prefill()))

    def _after_prefill(self, req: Request, row: Row, logits: torch.Tensor | None) -> None:
        req.prefill.done_ids += len(row.tokens)
        if logits is not None:
            self._finish_prefill(req, logits[0], req.kv.prefill_buf or req.kv.full)   # none: a lossy request

    def _after_decode(self, req: Request, row: Row, logits: torch.Tensor, argmax: list[int]) -> None:
        if req.kv.draft is not None:  # lossy: the drafter's own K/V are final
            req.measured.draft_bytes_read += req.kv.draft.nbytes()
            req.kv.draft.commit(req.position + 1)
        params = req.seq.params
        req.seq.append(argmax[0] if params.greedy else req.seq.choose(logits[0]))

    def _after_draft(self, req: Request, row: Row, logits: torch.Tensor, argmax: list[int]) -> None:
        req.measured.draft_bytes_read += req.kv.draft_kv().nbytes()
        req.drafting.round.draft_steps += 1
        if len(row.tokens) == 1:
            add_draft(req.seq, req.drafting.round, logits[0], argmax[0], req.opts.acceptance)
        else:   # a lookup proposal, checked by the drafter in one step
            kept = add_checked_proposal(req.seq, req.drafting.round, row.tokens[1:], logits, argmax, req.opts.acceptance)
            req.drafting.lookup_index().record(len(row.tokens) - 1, kept)

    def _after_verify(self, req: Request, row: Row, logits: torch.Tensor, argmax: list[int]) -> None:
        if req.remote.served is not None:   # the verifier role: the drafter's round, answered over the network
            _, _, reply = req.remote.served.inbox.popleft()
            reply(verify_for_drafter(req.kv.full_kv(), row.start, row.tokens[1:], argmax))
            return
        began, drafted = time.perf_counter(), bool(req.drafting.round.drafts)
        write_back, view = None, row.cache.cache if isinstance(row.cache, SeenRecorder) else row.cache
        if isinstance(view, StreamedKV):
            write_back = lambda s, e: self._write_back(req, view, s, e)  # noqa: E731
        full, draft = req.kv.full_kv(), req.kv.draft_kv()
        req.measured.verify_bytes_read += full.nbytes()
        m = finish_round(req.seq, req.drafting.round, req.position, draft, logits=logits, targets=argmax,
                         full=full, write_back=write_back, rule=req.opts.acceptance)
        swapped = 0
        if isinstance(row.cache, SeenRecorder):   # the drafter's store takes what the verifier attended to
            swapped = guide_store(draft, full, row.cache.seen, row.start + len(row.tokens),
                                  req.opts.compressor.swaps, self.guide_kernels)
        self.requests.round_done(req, m, swapped)
        if drafted:
            self.instruments.note_round_update(time.perf_counter() - began)
        if req.state == State.TRANSFERRING:
            self.memory.device.free(("verify", req.id))
            req.drafting.transfer = None
            self.requests.set_state(req, State.DRAFTING)

    def _write_back(self, req: Request, view: StreamedKV, start: int, keep: int) -> None:
        """The verified positions, written on the device, back to the host tier."""
        full = req.kv.full_kv()
        full.begin(start, keep - start)
        full.overwrite(view.buf, start, keep, first_layer=self.memory.resident_layers)
        if req.kv.resident is not None:  # the resident layers were written on the device
            full.overwrite(req.kv.resident, start, keep)
            req.kv.resident.truncate(keep)

    # ------------------------------------------------------------------ memory: charge, preempt
    def charge(self, req: Request) -> None:
        """Charge the tiers for what the request holds now; preempt newer requests if the device is full."""
        held = self.memory.device_bytes(req)
        self.make_room(held, ("kv", req.id), req)
        if req.state not in (State.WAITING, *DONE) and self.memory.device.can_fit(held, ("kv", req.id)):
            self.memory.charge(req, held)

    def make_room(self, nbytes: int, key: tuple[str, int], req: Request) -> None:
        """Preempt newer requests (newest first) until ``nbytes`` fit; if none is newer, ``req`` itself
        goes back to waiting (its growth does not fit beside the older ones)."""
        while not self.memory.device.can_fit(nbytes, key):
            victims = [r for r in self.requests
                       if r.state in (State.PREFILL, State.DECODING, State.DRAFTING) and r is not req and r.id > req.id]
            if not victims:
                if key[0] == "kv" and req.state in (State.DECODING, State.DRAFTING):
                    self.preempt(req)
                return
            self.preempt(max(victims, key=lambda r: r.id))

    def preempt(self, req: Request) -> None:
        """Back to waiting with nothing held: it is prefilled again when admitted."""
        self.instruments.preemptions += 1
        self.requests.drop_kv(req)
        req.prefill.restart()
        req.drafting.round.reset()
        self.requests.set_state(req, State.WAITING)
