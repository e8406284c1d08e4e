"""One VeriCache round, in one place: draft, verify, accept, commit.

A round for a request whose last token x (at position n) is not yet in any cache:
  draft   x, d1 .. d(k-1) through the compressed cache -> d1 .. dk          (k cheap steps)
  verify  [x, d1 .. dk] at positions n .. n+k through the full cache -> p0 .. pk   (one forward)
  accept  d(i+1) while it equals p_i's choice; then append p_m's choice (a correction, or a
          bonus token when all k matched). Sampled requests do the same with choices that are
          coupled samples: the drafter and the verifier add the same Gumbel noise g(seed, position)
          to their logits, so the verifier's choices are full decoding's and the text is its text
          (``sampling.ACCEPTANCE_RULES``; the "rejection" rule accepts with min(1, p/q) instead).
  commit  the full cache keeps n .. n+m; the compressed cache drops its speculative tail and takes
          the full-KV K/V of the accepted positions, so the drafter tracks the full model.

The engine (``engine.step_loop``) decides *when* each step of a round runs (and packs the rows of
many requests into one forward); this module decides *what* a step does to one request, and what a
round's length adapts to (``DraftLengthPolicy``); ``engine.scheduler.DraftPlanner`` owns each length.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from vericache.drafting.cost import expected_tokens
from vericache.kv.compressed import CompressedKVCache
from vericache.kv.full import FullKVCache
from vericache.sampling import Sequence, probs_from_logits, speculative_accept


@dataclass
class RoundState:
    """A request's draft in progress and its acceptance record."""
    started: bool = False                        # k is chosen for the current round
    k: int = 0                                   # tokens to draft this round (0: a plain full-KV step)
    drafts: list[int] = field(default_factory=list)
    qs: list[torch.Tensor | None] = field(default_factory=list)   # the drafter's distributions (rejection rule)
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    full_steps: int = 0                          # rounds of k = 0: a token from a plain full-KV step
    swapped: int = 0                             # tokens guided selection traded into the store (drafting.guide)
    draft_steps: int = 0                         # draft rows run (a checked lookup proposal is one), all rounds
    proposed: int = 0                            # this round's lookup proposal tokens (drafting.lookup) ...
    kept: int = 0                                # ... and those the drafter agreed with
    accepted_per_pos: list[int] = field(default_factory=list)

    def start(self, k: int) -> None:
        self.started, self.k, self.drafts, self.qs, self.proposed, self.kept = True, k, [], [], 0, 0

    @property
    def complete(self) -> bool:
        """The round's draft is done: it can be verified."""
        return self.started and len(self.drafts) >= self.k

    def reset(self) -> None:
        self.started, self.k, self.drafts, self.qs = False, 0, [], []


def draft_token(seq: Sequence, logits: torch.Tensor, ahead: int, argmax: int | None = None,
                rule: str = "coupled") -> tuple[int, torch.Tensor | None]:
    """The drafter's choice from logits [V] for the token ``ahead`` past the committed ones: the
    argmax (``argmax`` if already known) or the request's coupled sample there; under the rejection
    rule also its distribution q."""
    if seq.params.greedy:
        return (int(logits.argmax()) if argmax is None else argmax), None
    q = probs_from_logits(logits[None], seq.params)[0] if rule == "rejection" else None
    return seq.choose(logits, ahead), q


def add_draft(seq: Sequence, rs: RoundState, logits: torch.Tensor, argmax: int | None = None,
              rule: str = "coupled") -> None:
    """One draft step's result for this request: logits [V] at its newest draft position."""
    token, q = draft_token(seq, logits, len(rs.drafts), argmax, rule)
    rs.drafts.append(token)
    rs.qs.append(q)


def add_checked_proposal(seq: Sequence, rs: RoundState, proposal: list[int], logits: torch.Tensor,
                         argmax: list[int], rule: str = "coupled") -> int:
    """A multi-row draft step over rows [t, p1 .. pL] (``drafting.lookup``): row i's own choice is a draft,
    and row i + 1 counts only while that choice was p(i+1). logits: [L+1, V], argmax: their greedy
    choices. Returns the proposal tokens kept (the drafts equal to them)."""
    kept = 0
    for i in range(len(proposal) + 1):
        add_draft(seq, rs, logits[i], argmax[i], rule)
        if i == len(proposal) or rs.drafts[-1] != proposal[i]:
            break
        kept += 1
    rs.proposed, rs.kept = rs.proposed + len(proposal), rs.kept + kept
    return kept


def greedy_accepted(targets: list[int], draft: list[int]) -> int:
    """How many leading draft tokens the verifier's greedy choices ``targets`` (one per verified
    row: the last token's, then each draft token's) agree with."""
    m = 0
    while m < len(draft) and targets[m] == draft[m]:
        m += 1
    return m


def accept_draft(seq: Sequence, target_logits: torch.Tensor | None, draft: list[int], q: list[torch.Tensor | None],
                 targets: list[int] | None = None, rule: str = "coupled") -> int:
    """Append accepted draft tokens and the verifier's token; returns m, the accepted count.

    target_logits: [k+1, V], the verifier's logits at the last token and at each draft token;
    ``targets``: their argmax, when already known. A row's choice is computed only when reached (a
    sampled row's noise and truncation cost ~1 ms): the rows after a rejection are never looked at.
    """
    params = seq.params
    if targets is None or not params.greedy:   # sampled rows (and greedy ones not yet chosen) need the logits
        if target_logits is None:
            raise ValueError("accepting drafts needs the verifier's logits (or, greedy, their argmax)")
        logits = target_logits
    if params.greedy and targets is None:  # one argmax over the chunk: no per-row device sync
        targets = logits.argmax(dim=-1).tolist()
    chosen: list[int] = targets or []

    def verifier_choice(i: int) -> int:   # row i decides the token at seq.next_position
        return chosen[i] if params.greedy else seq.choose(logits[i])

    for i, d in enumerate(draft):
        if params.greedy or rule == "coupled":
            replacement = verifier_choice(i)
            ok = replacement == d
        else:
            p, q_i = probs_from_logits(logits[i][None], params)[0], q[i]
            if q_i is None:
                raise ValueError("the rejection rule needs the drafter's distribution of every draft token")
            ok, rejected_for = speculative_accept(p, q_i, d, seq.seed, seq.next_position)
            replacement = d if rejected_for is None else rejected_for
        if not ok:
            seq.append(replacement)
            return i
        if seq.append(d):
            return i + 1
    seq.append(verifier_choice(len(draft)))  # the bonus token
    return len(draft)


def finish_round(seq: Sequence, rs: RoundState, start: int, draft: CompressedKVCache, *,
                 logits: torch.Tensor | None = None, targets: list[int] | None = None,
                 full: FullKVCache | None = None, write_back: Callable[[int, int], None] | None = None,
                 exact_kv: tuple[torch.Tensor, torch.Tensor] | None = None, rule: str = "coupled") -> int:
    """Accept, commit both caches, record: the one end of every round (local, offloaded, remote).

    Accepts against the verifier's logits [k+1, V] (or their greedy choices ``targets``) for the
    chunk at ``start``, then keeps positions up to ``start + 1 + m``:
    - a local verification (``full``): ``write_back(start, keep)``, when given, first copies the
      verified positions from the buffer it wrote (a device buffer) into ``full`` (their home tier);
      the full cache rolls back past them and the draft cache takes their exact K/V from it;
    - a remote one (``exact_kv``: K, V [L, Hkv, m+1, D] of start .. keep-1, sent by the verifier): the
      draft cache takes those instead of its own.
    A plain full step (no drafts) over a full cache in place leaves the draft cache behind: a stretch of
    them (a fallback) would pay its compression moves token by token for drafts nobody makes, so the
    drafter catches up once when it drafts again (``catch_up``). Returns m, the accepted count."""
    m = accept_draft(seq, logits, rs.drafts, rs.qs, targets, rule)
    keep = start + 1 + m
    if write_back is not None:
        write_back(start, keep)
    if full is not None:
        full.truncate(keep)
    if exact_kv is not None:
        draft.commit_exact(start, *exact_kv, keep)
    elif rs.drafts or write_back is not None:
        draft.commit(keep, source=full)
    record_round(rs, len(rs.drafts), m)
    return m


def catch_up(draft: CompressedKVCache, full: FullKVCache, position: int) -> None:
    """Before a drafted round: the draft cache takes the positions plain full steps left it behind on
    (``finish_round``), their exact K/V from ``full``, in one commit."""
    if draft.committed_length < position:
        draft.commit(position, source=full)


def draft_position(draft: CompressedKVCache, position: int) -> int:
    """Where a draft row is priced: at ``position``, or at the draft cache's last commit while plain full
    steps leave it behind (a residual counted up to ``position`` would price positions it never reads)."""
    return min(position, draft.committed_length)


def verify_for_drafter(full: FullKVCache, start: int, drafts: list[int],
                       targets: list[int]) -> tuple[int, int, torch.Tensor, torch.Tensor]:
    """The verifier's side of a remote round (greedy): ``targets`` are its choices at [x, d1 .. dk];
    keeps the accepted positions in ``full`` and returns (m, its token, K, V [L, Hkv, m+1, D] of
    start .. start+m) for ``finish_round(exact_kv=...)`` on the drafter."""
    m = greedy_accepted(targets, drafts)
    keep = start + 1 + m
    full.truncate(keep)
    return (m, targets[m], *full.copy_out(start, keep))


def end_round(rs: RoundState, policy: DraftLengthPolicy, state: DraftState, m: int) -> None:
    """After ``finish_round``: the draft-length policy learns the round, and a fresh round begins."""
    policy.update(state, len(rs.drafts), m)
    rs.reset()


def record_round(rs: RoundState, k: int, m: int) -> None:
    """Count a verified round of ``k`` drafted tokens with ``m`` accepted."""
    rs.rounds, rs.drafted, rs.accepted = rs.rounds + 1, rs.drafted + k, rs.accepted + m
    rs.full_steps += k == 0
    while len(rs.accepted_per_pos) < k:
        rs.accepted_per_pos.append(0)
    for i in range(m):
        rs.accepted_per_pos[i] += 1


MIN_YIELD_STEPS = 4   # draft steps before a request's measured yield prices its drafts
# proposal tokens checked or output tokens observed (``LookupIndex.evidence``) before a proposal on offer
# prices a draft step: at the prior alone (keep 1/2) a proposal step looked cheap enough for rounds that
# then failed (the code model, 8 x 8K on AMX: 31 lock-step steps against full's 30, 0.93x)
MIN_KEEP_EVIDENCE = 8


def draft_step_yield(rs: RoundState, proposed: int, proposal: int = 0, keep: float = 0.5) -> tuple[float, float]:
    """What one of a request's draft steps gives and carries, over its rounds so far: (drafts a step, rows
    a step); ``proposed``: the lookup proposal tokens its steps checked (``drafting.lookup``). A step
    checking a proposal is several rows and, where the drafter agrees, several drafts (SmolLM2 8 x 4K,
    3-draft rounds: 410 drafts from 279 steps), so a round of k drafts takes fewer than k steps. Until
    ``MIN_YIELD_STEPS`` steps ran: a step checking the ``proposal`` tokens the lookup offers now (0: none;
    the caller offers one only on ``MIN_KEEP_EVIDENCE``), each kept at the rate ``keep``
    (``LookupIndex.keep_rate``), else (1, 1)."""
    if rs.draft_steps < MIN_YIELD_STEPS:
        return (expected_tokens(keep, proposal), 1.0 + proposal) if proposal else (1.0, 1.0)
    return max(rs.drafted / rs.draft_steps, 1.0), 1.0 + proposed / rs.draft_steps


# ---------------------------------------------------------------------- the draft length (P2)
# Per-request draft length (the paper's P2: long verification periods).
#
# ``draft_len=int`` fixes it. ``draft_len="auto"`` follows each request's observed
# acceptance: a run that is fully accepted doubles the next draft (up to
# ``max_len``); otherwise the next draft is a little longer than the smoothed
# accepted length. When acceptance collapses (nothing accepted for ``patience``
# rounds) the request falls back to plain full-KV decoding for ``cooldown``
# tokens, then tries drafting again from a short draft.


@dataclass
class SharedAcceptance:
    """One engine's recent rounds with one compressor, pooled (``engine.scheduler.DraftPlanner`` keeps one
    per compressor): a request's acceptance starts from what its neighbours measured, not from a uniform
    prior, so a batch does not pay every request's failed first round to learn what the first verification
    showed (SmolLM2 8 x 2K, SnapKV 1/8: half the drafts accepted, eight 8-token probe rounds at once). The
    pool keeps about ``window`` observations (older ones fade in proportion) and counts as at most
    ``weight`` of them in one request's estimate, so a request's own rounds soon outweigh it (its own
    rounds are in the pool too: a small double count, bounded by ``weight``)."""
    accepted: float = 0.0        # drafted tokens accepted
    rejections: float = 0.0      # rounds that ended at a mismatch
    window: float = 64.0
    weight: float = 8.0

    def add(self, accepted: int, rejected: bool) -> None:
        self.accepted, self.rejections = self.accepted + accepted, self.rejections + rejected
        total = self.accepted + self.rejections
        if total > self.window:
            self.accepted, self.rejections = self.accepted * self.window / total, self.rejections * self.window / total

    def prior(self) -> tuple[float, float]:
        """(accepted, rejections) pseudo-counts for one request's estimate."""
        total = self.accepted + self.rejections
        scale = min(1.0, self.weight / total) if total else 0.0
        return self.accepted * scale, self.rejections * scale


@dataclass
class DraftState:
    k: int
    ema_accepted: float = 0.0
    failed_rounds: int = 0
    cooldown: int = 0
    fallbacks: int = 0
    cost_fallbacks: int = 0       # times the cost model found full steps faster than drafting
    probe: bool = False           # the next round is priced at the optimistic acceptance (to re-measure)
    probing: bool = False         # the round in flight was priced so: fully accepted, the next one is too
    backoff: int = 0              # full steps of the next such fallback: doubles while probes keep failing
    declined_rejections: int = 0  # ``rejections`` at the last such fallback (a decline with none since keeps it)
    declined_yield: float = 0.0   # in such a fallback: the drafts a step it priced (0: none in force)
    accepted_total: int = 0       # drafted tokens accepted, all rounds
    rejections: int = 0           # rounds that ended at a mismatch
    pool: SharedAcceptance | None = None   # the engine's pooled rounds with this compressor (the prior)

    def fall_back(self, cooldown: int, drafts_a_step: float) -> None:
        """The costs found no round paying (``engine.scheduler.DraftPlanner``): plain full steps for the
        backoff (``cooldown`` at first, doubling up to 16x only while rounds fail between fallbacks: a
        decline with no round since rests on the same evidence, and asking again costs only a price), then
        a probe. ``drafts_a_step``: what a draft step was priced at (a better lookup offer asks sooner)."""
        if not self.backoff:
            self.backoff = cooldown
        elif self.rejections > self.declined_rejections:   # a round failed since the last fallback
            self.backoff = min(2 * self.backoff, 16 * cooldown)
        self.cooldown, self.probe, self.declined_rejections = self.backoff, True, self.rejections
        self.cost_fallbacks, self.declined_yield = self.cost_fallbacks + 1, drafts_a_step

    def acceptance(self, optimistic: bool = False) -> float:
        """Per-token acceptance, a geometric model's estimate: the mean of its Beta posterior from a
        uniform prior (Laplace-smoothed) plus the pool's pseudo-counts, or with ``optimistic`` that mean
        plus one standard deviation (what a probe round prices: with no rounds anywhere yet 0.79,
        narrowing as rounds come in)."""
        a0, r0 = self.pool.prior() if self.pool is not None else (0.0, 0.0)
        accepted, n = self.accepted_total + a0, self.accepted_total + self.rejections + a0 + r0
        mean = (accepted + 1) / (n + 2)
        return min(mean + (mean * (1 - mean) / (n + 3)) ** 0.5, 1.0) if optimistic else mean

    def cautious_acceptance(self) -> float:
        """The acceptance less one standard deviation (the optimistic one's mirror): what a closed batch
        prices the steps a round may fall behind at (``DraftCost.choose``: its end is its latest request's,
        so an unlucky round costs the batch more than a lucky one saves)."""
        return max(2 * self.acceptance() - self.acceptance(optimistic=True), 0.0)

    @property
    def measured(self) -> bool:
        """Whether a drafted round has been verified, this request's or (pooled) a neighbour's: the
        acceptance rests on more than the uniform prior."""
        pooled = self.pool is not None and self.pool.accepted + self.pool.rejections > 0
        return self.accepted_total + self.rejections > 0 or pooled


@dataclass
class DraftLengthPolicy:
    fixed: int | None = None
    start: int = 8
    min_len: int = 2
    max_len: int = 48
    patience: int = 3
    cooldown: int = 16

    @classmethod
    def from_arg(cls, draft_len: int | str) -> DraftLengthPolicy:
        if draft_len == "auto":
            return cls()
        if isinstance(draft_len, bool) or not isinstance(draft_len, int) or draft_len < 1:
            raise ValueError(f"draft_len must be an integer >= 1 or 'auto', got {draft_len!r}")
        return cls(fixed=draft_len)

    def new_state(self) -> DraftState:
        return DraftState(k=self.fixed if self.fixed is not None else self.start)

    def next_len(self, st: DraftState, remaining: int) -> int:
        """Draft tokens for the next round; 0 means a plain full-KV step. A round emits at most k+1."""
        if st.cooldown > 0:
            return 0
        return max(min(st.k, remaining - 1), 0)

    def update(self, st: DraftState, drafted: int, accepted: int) -> None:
        if drafted == 0:
            st.cooldown = max(st.cooldown - 1, 0)
            if st.cooldown == 0 and self.fixed is None:
                st.k = max(self.min_len, 4)
            return
        st.accepted_total += accepted
        st.rejections += accepted < drafted
        if st.probing:   # a probe fully accepted is evidence the optimism held: price the next round so too
            st.probing, st.probe = False, accepted == drafted
            if st.probe:
                st.backoff = 0
        if st.pool is not None:
            st.pool.add(accepted, accepted < drafted)
        if self.fixed is not None:
            return
        st.ema_accepted = 0.6 * st.ema_accepted + 0.4 * accepted
        if accepted == drafted:
            st.k = min(max(st.k, 2 * drafted), self.max_len)
        else:
            st.k = min(max(int(1.5 * st.ema_accepted) + 2, self.min_len), self.max_len)
        st.failed_rounds = st.failed_rounds + 1 if accepted == 0 else 0
        if st.failed_rounds >= self.patience:
            st.cooldown, st.failed_rounds = self.cooldown, 0
            st.fallbacks += 1
