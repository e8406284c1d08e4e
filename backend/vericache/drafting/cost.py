"""Draft length chosen by the costs: the k that maximises a request's expected tokens per second.

A round of k drafts yields E(k) = 1 + a + a^2 + ... + a^k tokens (a: the request's per-token
acceptance, the verifier's bonus token included) and costs k draft rows plus one verification
chunk of k + 1 rows over the full KV. What a row costs comes from the engine's own forwards: every
step's time is fitted as ``t0 + rows * t_row + kv_bytes * t_byte + pairs * t_pair``
(``StepRecord``: rows, K/V bytes read, query-key pairs), so the choice follows the machine. On a
CPU batch, where a long verification chunk is compute-bound (pairs), k comes out short; where
verification is cheap against drafting (few sequences, memory-bound), it comes out long. Requests
whose full KV crosses a link keep the schedule's own choice (the link, not compute, sets k there).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

MIN_STEPS = 12   # forwards (with and without verification rows) before the fit is trusted


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


@dataclass
class StepCostFit:
    """Seconds of a forward ~ t0 + rows * t_row + kv_bytes * t_byte + pairs * t_pair (least squares,
    coefficients kept >= 0: a cost never pays back)."""

    coef: tuple[float, float, float, float]

    @classmethod
    def fit(cls, steps: Sequence) -> "StepCostFit | None":
        """From ``StepRecord``s; None until there are enough of them, with and without verification."""
        steps = [s for s in steps if "prefill" not in s.kinds]
        with_verify = sum("verify" in s.kinds for s in steps)
        if len(steps) < MIN_STEPS or with_verify < 3 or len(steps) - with_verify < 3:
            return None
        x = np.array([[1.0, s.rows, s.kv_bytes, s.pairs] for s in steps])
        y = np.array([s.end - s.start for s in steps])
        scale = np.maximum(x.max(axis=0), 1e-30)                    # columns of very different sizes
        active = [0, 1, 2, 3]
        for _ in range(4):                                           # drop columns that fit negative
            c, *_ = np.linalg.lstsq(x[:, active] / scale[active], y, rcond=None)
            if (c >= 0).all():
                break
            active = [a for a, v in zip(active, c) if v >= 0] or [0]
        coef = [0.0] * 4
        for a, v in zip(active, c):
            coef[a] = max(float(v / scale[a]), 0.0)
        return cls(tuple(coef))

    def seconds(self, rows: float, kv_bytes: float, pairs: float) -> float:
        t0, t_row, t_byte, t_pair = self.coef
        return t0 + rows * t_row + kv_bytes * t_byte + pairs * t_pair


@dataclass
class DraftCost:
    """The engine's cost-based draft length: refits from its recent forwards every ``every`` steps."""

    every: int = 8
    fitted: StepCostFit | None = None
    _ticks: int = field(default=0, repr=False)

    def tick(self, steps: Sequence) -> None:
        """After each forward: refit from the latest 96 every ``every`` forwards."""
        self._ticks += 1
        if self._ticks % self.every == 0:
            self.fitted = StepCostFit.fit(list(steps)[-96:]) or self.fitted

    def choose(self, alpha: float, n_active: int, draft_cost: tuple[int, int], verify_cost: Callable[[int], tuple[int, int]],
               k_max: int) -> int | None:
        """The best k for one request, or None before the fit exists. ``draft_cost``: (K/V bytes,
        pairs) of one draft row over its compressed KV; ``verify_cost(k)``: the same for a chunk of
        k + 1 rows over its full KV. The step's fixed cost is shared by the ``n_active`` requests."""
        if self.fitted is None or k_max < 1:
            return None
        f, share = self.fitted, self.fitted.coef[0] / max(n_active, 1)
        draft_s = share + f.seconds(1, *draft_cost) - f.coef[0]
        return best_draft_len(alpha, draft_s, lambda k: share + f.seconds(k + 1, *verify_cost(k)) - f.coef[0], k_max)
