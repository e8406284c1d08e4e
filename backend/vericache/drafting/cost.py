"""The cost model: what a forward costs and what a VeriCache round yields. One model for everything that
predicts a step or a round: the engine's draft-length choice (here), and the research harness's
predicted tokens/s (``vericache_lab.predict``: ``bench decode``, ``bench batch``, ``bench throughput``
through ``vericache sim --calibrate``) and remote prefix model (``vericache_lab.sim.remote_prefix``).

A forward's seconds (``StepCosts.seconds``):

    c0 + weights(rows) + seqs * t_seq + kv_bytes * t_byte + pairs * t_pair

c0: a step's fixed work; weights(rows): the weight matmuls at that many rows (``rows * t_row``, or a
measured curve: the exact weights', a draft copy's); t_seq: each sequence's own work (its cache
calls); t_byte: each K/V byte its attention reads (the read rate); t_pair: each query-key pair (all
layers and query heads: attention's compute, which bounds a long verification chunk on a CPU). What
a row reads and how many pairs come from the caches themselves (``attention_cost``), so the same
terms price a decode row over a full cache, a draft row over a compressed one and a verification
chunk, at any context (``CostsAt``: the terms at one geometry).

Where the terms come from: the engine's own forwards (``StepCosts.fit`` over ``StepRecord``s,
refitted as it runs: ``DraftCost``); probes on real caches of a bench's context
(``vericache_lab.predict.measure_step_costs``); this machine's calibration (``vericache_lab.sim.calibrate``);
or a GPU's roofline (``vericache_lab.sim.cost_model.gpu_step_costs``: ``vericache sim``'s sweep and the remote prefix model's table).

A round of k drafts yields E(k) = 1 + a + a^2 + ... + a^k tokens (a: the request's per-token
acceptance, the verifier's bonus token included) and costs k draft rows plus one verification chunk
of k + 1 rows over the full KV (``best_draft_len``). On a CPU batch, where a long verification chunk
is compute-bound (pairs), k comes out short; where verification is cheap against drafting (few
sequences, memory-bound), long. Requests whose full KV crosses a link keep the offload policy's own
choice (the link, not compute, sets k there).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import numpy.typing as npt

MIN_STEPS = 12   # forwards (with and without verification rows) before the fit is trusted
# A round is drafted only where it beats plain full steps by more than the fitted prices' own error (the
# fit prices each kind of step within ~4% on average: SmolLM2 8 x 4K, AMX): a marginal round gains
# little and, in a lock-step batch, can cost the whole batch a step (8 x 2K: 34 steps against 31).
MARGIN = 0.05
TERMS = ("c0", "t_row", "t_seq", "t_byte", "t_pair")


class StepSample(Protocol):
    """One forward as the fit reads it (``engine.requests.StepRecord``): its row kinds, rows, the K/V bytes
    its attention read, its query-key pairs, when it ran, and the seconds of its update after it (and
    of that, the drafted rounds' own updates, priced per round instead: ``DraftCost.round_s``)."""
    kinds: str
    rows: int
    kv_bytes: int
    pairs: int
    start: float
    end: float
    post: float
    round_post: float
    vocab_rows: int


@dataclass
class StepCosts:
    c0: float = 0.0
    t_row: float = 0.0
    t_seq: float = 0.0
    t_byte: float = 0.0
    t_pair: float = 0.0
    matmuls: Callable[[int], float] | None = field(default=None, repr=False, compare=False)  # replaces rows * t_row
    # the share of a draft row's weight matmuls the draft vocabulary's head saves (``model.set_draft_vocab``;
    # the head's part of one row's weights, measured by the calibration, kept by every refit): the terms
    # above price whole-head steps. A share, not seconds: in a batch the weights are read once for all
    # rows, and a row's part of them (what its head saves too) is far less than a lone row's
    vocab_share: float = 0.0

    def weights(self, rows: float) -> float:
        """Seconds of the weight matmuls at ``rows`` rows."""
        return self.matmuls(round(rows)) if self.matmuls is not None else rows * self.t_row

    def seq(self, kv_bytes: float, pairs: float) -> float:
        """One sequence's part of a forward: its own work and its attention."""
        return self.t_seq + kv_bytes * self.t_byte + pairs * self.t_pair

    def seconds(self, rows: float, kv_bytes: float, pairs: float, seqs: float = 0) -> float:
        """A whole forward."""
        return self.c0 + self.weights(rows) + seqs * self.t_seq + kv_bytes * self.t_byte + pairs * self.t_pair

    def to_dict(self) -> dict[str, float]:
        return {t: getattr(self, t) for t in TERMS}

    @classmethod
    def fit(cls, steps: Sequence[StepSample], matmuls: Callable[[int], float] | None = None,
            vocab_share: float = 0.0) -> StepCosts | None:
        """Least squares over ``StepRecord``s: c0 + rows * t_row + kv_bytes * t_byte + pairs * t_pair
        (t_seq folds into t_row: a decode step has one row per sequence), or with ``matmuls`` (the
        weights' measured seconds at a row count) that curve in place of rows * t_row. A step's seconds
        are its forward's and its update's (``post``: the round's accept and commits, the compressed
        cache's moves, guided swaps) less the drafted rounds' own updates (``round_post``), which
        ``DraftCost`` prices per round. ``vocab_share``: the share of its rows' part of the weights
        (``matmuls``) a step's draft-vocabulary rows saved (added back, so every step is priced as with the
        whole head, and kept on the result). None until there are enough steps, with and without
        verification."""
        steps = [s for s in steps if "prefill" not in s.kinds]
        with_verify = sum("verify" in s.kinds for s in steps)
        if len(steps) < MIN_STEPS or with_verify < 3 or len(steps) - with_verify < 3:
            return None
        x = np.array([[1.0, s.rows, s.kv_bytes, s.pairs] for s in steps])
        saved = [vocab_share * matmuls(s.rows) * s.vocab_rows / s.rows if matmuls is not None and s.rows else 0.0
                 for s in steps]
        seconds = np.array([s.end - s.start + s.post - s.round_post + v for s, v in zip(steps, saved)])
        return dataclasses.replace(cls.from_samples(x, seconds, matmuls), vocab_share=vocab_share)

    @classmethod
    def from_samples(cls, x: npt.NDArray[np.float64], seconds: npt.NDArray[np.float64],
                     matmuls: Callable[[int], float] | None = None) -> StepCosts:
        """The terms fitted to forwards: x [N, 4] holds each forward's (1, rows, K/V bytes, pairs). With
        ``matmuls`` the weights' part of each forward is that curve's (a CPU's integer matmuls need not
        grow along a line through 0: 57 ms at 1 row, 75 at 2, 280 at 16 on the 0.5B code model, AVX2)
        and the rest is fitted."""
        if matmuls is None:
            c0, t_row, t_byte, t_pair = nonnegative_lstsq(x, seconds)
            return cls(c0, t_row, 0.0, t_byte, t_pair)
        rest = seconds - np.array([matmuls(round(rows)) for rows in x[:, 1]])
        c0, t_byte, t_pair = nonnegative_lstsq(x[:, [0, 2, 3]], rest)
        return cls(c0, 0.0, 0.0, t_byte, t_pair, matmuls=matmuls)

    def usable(self) -> bool:
        """Whether these terms may decide: finite, none negative, and a step costing something. Timings
        too small for the clock (the ``tiny`` model's steps on a fast CPU) can fit every term to 0.0, and
        such a fit prices every choice at zero seconds."""
        terms = list(self.to_dict().values())
        per_step = self.c0 + self.t_seq + (self.matmuls(1) if self.matmuls is not None else self.t_row)
        return all(np.isfinite(t) and t >= 0 for t in terms) and per_step > 0


def nonnegative_lstsq(x: npt.NDArray[np.float64], y: npt.NDArray[np.float64]) -> list[float]:
    """Least squares with every coefficient >= 0 (a cost never pays back): columns that fit negative are
    dropped and the rest refitted; columns of very different sizes are scaled first."""
    scale = np.maximum(np.abs(x).max(axis=0), 1e-30)
    active = list(range(x.shape[1]))
    for _ in range(x.shape[1]):
        c, *_ = np.linalg.lstsq(x[:, active] / scale[active], y, rcond=None)
        if (c >= 0).all():
            break
        active = [a for a, v in zip(active, c) if v >= 0] or [0]
    coef = [0.0] * x.shape[1]
    for a, v in zip(active, c):
        coef[a] = max(float(v / scale[a]), 0.0)
    return coef


@dataclass
class CostsAt:
    """The terms at one geometry: (K/V bytes, pairs) of one row over a full cache of the context and
    over the compressor's cache, so a sequence's row of each kind has a price."""
    costs: StepCosts
    full_row: tuple[float, float]
    draft_row: tuple[float, float]

    @property
    def c0(self) -> float:
        return self.costs.c0

    def weights(self, rows: float) -> float:
        return self.costs.weights(rows)

    @property
    def full(self) -> float:
        """One sequence, one row over its full cache."""
        return self.costs.seq(*self.full_row)

    @property
    def draft(self) -> float:
        """One sequence, one row over its compressed cache."""
        return self.costs.seq(*self.draft_row)

    def verify(self, rows: float) -> float:
        """One sequence, a chunk of ``rows`` over its full cache (read once, ``rows`` x the pairs)."""
        kv_bytes, pairs = self.full_row
        return self.costs.seq(kv_bytes, rows * pairs + rows * (rows - 1) / 2)


# ---------------------------------------------------------------------- the round: draft length
def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a round of k drafts emits on average with per-token acceptance ``alpha`` (bonus included)."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def best_draft_len(alpha: float, draft_s: float, verify_s: Callable[[int], float], k_max: int) -> int:
    """argmax over 1..k_max of expected_tokens(alpha, k) / (k * draft_s + verify_s(k))."""
    if k_max < 1:
        raise ValueError(f"k_max must be >= 1, got {k_max}")
    rates = [expected_tokens(alpha, k) / (k * draft_s + verify_s(k)) for k in range(1, k_max + 1)]
    return 1 + int(np.argmax(rates))


class Calibrated(Protocol):
    """What ``DraftCost`` takes from a calibration (``drafting.calibrate.Calibration``): its costs, if any."""
    @property
    def costs(self) -> StepCosts | None: ...


@dataclass
class DraftCost:
    """The engine's cost-based draft length: costs from ``calibrate`` (timed forwards of the model and
    its weights' measured matmuls, asked once at the first choice: ``drafting.calibrate``) until the
    engine's own forwards fit, then refitted from them at most every ``every`` steps, the weights priced
    by the calibration's measured curve where it has one. A fit that is not ``usable`` never replaces
    the costs in hand. A drafted round also costs its update after the verification (accept, commits,
    guided trades: ~2 ms a round for SmolLM2 at 2K on AMX, a third of a full row's share of an 8-request
    step), the same whatever its length: ``round_s``, the mean of the latest rounds' measured updates,
    is added to every drafted round's price (0 until a round has run)."""

    every: int = 8
    calibrate: Callable[[], Calibrated] | None = field(default=None, repr=False)   # -> a ``Calibration``
    fitted: StepCosts | None = None
    source: str = "none"          # where ``fitted`` came from: none, calibrated or fitted
    matmuls: Callable[[int], float] | None = field(default=None, repr=False)   # the weights' seconds at a row count
    round_s: float = 0.0          # a drafted round's update, seconds (the mean of the latest)
    vocab_share: float = 0.0      # the share of a draft row's weights the draft vocabulary saves (calibrated)
    _fitted_at: int = field(default=0, repr=False)

    def refit(self, steps: Sequence[StepSample], n_steps: int, round_updates: Sequence[float] = ()) -> None:
        """Before a choice: calibrate if not yet asked (once), then refit from the latest 96 ``steps``
        when ``every`` forwards ran since the last fit (``n_steps``: forwards recorded so far), and
        ``round_s`` as the mean of ``round_updates`` (the latest drafted rounds' updates, seconds)."""
        if round_updates:
            self.round_s = sum(round_updates) / len(round_updates)
        if self.calibrate is not None:
            calibration, self.calibrate = self.calibrate(), None   # once, whatever it gives
            if calibration.costs is not None and calibration.costs.usable():
                self.matmuls, self.vocab_share = calibration.costs.matmuls, calibration.costs.vocab_share
                if self.fitted is None:
                    self.fitted, self.source = calibration.costs, "calibrated"
        if n_steps - self._fitted_at >= self.every:
            self._fitted_at = n_steps
            fit = StepCosts.fit(list(steps)[-96:], self.matmuls, self.vocab_share)
            if fit is not None and fit.usable():
                self.fitted, self.source = fit, "fitted"

    @staticmethod
    def _batch_prices(f: StepCosts, n_active: int, queued: bool) -> tuple[float, Callable[[float], float]]:
        """One request's part of a step among ``n_active``: (its share of the step, the seconds ``extra``
        rows of its own add to the weights' matmuls). A CPU's integer matmuls hardly grow with rows (AMX,
        the 0.5B code model: 31 ms at 1 row, 41 at 9), so a verification's extra rows cost what they add.
        Its share: with requests ``queued`` for admission, a request that finishes sooner lets one in, so
        its steps are worth its part of the step's fixed cost and weights ((c0 + weights(n)) / n, the whole
        step alone); with none queued (a closed batch) finishing sooner frees nothing the others use (they
        step on until their own ends), so a step of its own is worth only what its row adds to the step
        (weights(n) - weights(n - 1)): rounds then pay by attention alone (8 x 8K of the code model on AMX
        in q8qk: half the requests rounding on lookup proposals at the throughput share while the others'
        plain steps set the batch's end took it to 0.84x full)."""
        n = max(n_active, 1)
        base = f.weights(n)
        share = (f.c0 + base) / n if queued or n == 1 else base - f.weights(n - 1)
        return share, lambda extra: f.weights(n + extra) - base

    @staticmethod
    def _tail_step(f: StepCosts, n_active: int, queued: bool) -> float:
        """In a closed batch (none ``queued``, others beside it): the price of a step the request runs after
        the others have finished, its fixed cost and one row's weights (its row's own work is priced with
        its rows). Elsewhere 0: with a queue a step's share already counts them, and alone every step is
        its own."""
        return f.c0 + f.weights(1) if not queued and n_active > 1 else 0.0

    def choose(self, alpha: float, n_active: int, draft_cost: tuple[int, int], verify_cost: Callable[[int], tuple[int, int]],
               k_max: int, draft_yield: tuple[float, float] = (1.0, 1.0), queued: bool = True,
               slack: float = 0.0, behind_alpha: float | None = None) -> int | None:
        """The best k for one request: 0 when a plain full step yields more tokens a second than any
        round (``verify_cost(0)``: one row over the full KV), None before the fit exists. A round's
        price includes its update (``round_s``).
        ``draft_cost``: (K/V bytes, pairs) of one draft row over its compressed KV; ``verify_cost(k)``:
        the same for a chunk of k + 1 rows over its full KV. The step's fixed cost and its weights are
        shared by the ``n_active`` requests, or with none ``queued`` only a row's part counted
        (``_batch_prices``). ``draft_yield``: (drafts, rows) of the
        request's draft steps as measured (``drafting.round.draft_step_yield``): a step checking a lookup
        proposal carries more rows and may give several drafts, so a draft costs its step over its yield.
        A closed batch ends with its last request, and a round of single-row drafts takes k + 1 steps for
        E(k) <= k + 1 tokens: a request that rounds falls behind a plain step's pace, and past the steps the
        others still run (``slack``, steps a token it may lose without ending after them: the others'
        longest remaining output over its own, less 1) each step it lost is a step of its own at the
        batch's end (``_tail_step``),
        priced into the round at ``behind_alpha`` (default ``alpha``; the planner's is a cautious one: an
        unlucky round costs the batch's end more than a lucky one saves). SmolLM2 8 x 4K on AMX: rounds
        priced at their rows' attention alone took 66 to 87 steps against full's 62, 0.78-0.93x full."""
        if self.fitted is None or k_max < 1:
            return None
        f = self.fitted
        share, extra_rows = self._batch_prices(f, n_active, queued)
        tail = self._tail_step(f, n_active, queued)
        drafts, rows = draft_yield
        kv_bytes, pairs = draft_cost
        # a draft step's rows take their logits from the draft vocabulary's head: ``vocab_share`` of their
        # part of the weights less (alone, 4.4 of ~20 ms on the 0.5B; in a closed batch, of a row's margin)
        weights = (share + extra_rows(rows - 1.0)) * (1.0 - f.vocab_share)
        draft_s = (weights + f.seq(kv_bytes, pairs * rows)) / drafts

        def verify_s(k: int) -> float:   # k = 0: a plain full step, no round to update
            if k == 0:
                return share + extra_rows(0) + f.seq(*verify_cost(0))
            tokens = expected_tokens(alpha if behind_alpha is None else behind_alpha, k)
            steps = max(k / drafts, 1.0) + 1.0   # its draft steps (one at least, however many a step gives) and the verification
            behind = max(steps - tokens * (1.0 + slack), 0.0)   # steps lost past the slack
            return share + extra_rows(k) + f.seq(*verify_cost(k)) + self.round_s + tail * behind

        if not verify_s(0) > 0 and not queued and n_active > 1:
            return 0   # a closed batch whose rows add nothing to a step: no round can save anything
        if not draft_s > 0 or not verify_s(0) > 0:   # costs that price a step at nothing cannot decide
            return None
        k = best_draft_len(alpha, draft_s, verify_s, k_max)
        return k if expected_tokens(alpha, k) / (k * draft_s + verify_s(k)) > (1.0 + MARGIN) / verify_s(0) else 0

    def proposal_len(self, keep: float, n_active: int, draft_cost: Callable[[int], tuple[int, int]], room: int,
                     queued: bool = True) -> int:
        """Lookup proposal tokens worth checking in one draft step (``drafting.lookup``; 0: a single row),
        ``room`` at most: the L that maximises drafts a second, expected_tokens(keep, L) drafts from one
        step of L + 1 rows over the compressed KV (``keep``: the request's per-token rate of kept
        proposal tokens), against one draft a single-row step. ``draft_cost(rows)``: (K/V bytes, pairs)
        of that many rows over the compressed KV. Without the engine's own fit or a measured weights
        curve: ``room`` (a calibration's linear row cost prices a few more rows at one weight read too
        high)."""
        if room < 1 or self.fitted is None or (self.source != "fitted" and self.fitted.matmuls is None):
            return max(room, 0)
        f = self.fitted
        share, extra_rows = self._batch_prices(f, n_active, queued)

        def step(rows: int) -> float:
            return share + extra_rows(rows - 1) + f.seq(*draft_cost(rows))

        costs = [step(rows) for rows in range(1, room + 2)]
        if not all(c > 0 for c in costs):   # a fit that prices a step at nothing cannot size one (a fast machine)
            return room
        rates = [expected_tokens(keep, n) / costs[n] for n in range(1, room + 1)]
        best = int(np.argmax(rates))
        return best + 1 if rates[best] > 1.0 / costs[0] else 0
