"""The cost model: what a forward costs and what a VeriCache round yields. One model for everything that
predicts a step or a round: the engine's draft-length choice, the benches' predicted tokens/s
(``bench decode``, ``bench batch``, ``bench throughput`` through ``vericache sim --calibrate``) and the
remote prefix model (``sim.remote_prefix``).

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
(``measure_step_costs``); this machine's calibration (``sim.calibrate``); or a GPU's roofline
(``sim.cost_model.gpu_step_costs``: ``vericache sim``'s sweep and the remote prefix model's table).

A round of k drafts yields E(k) = 1 + a + a^2 + ... + a^k tokens (a: the request's per-token
acceptance, the verifier's bonus token included) and costs k draft rows plus one verification chunk
of k + 1 rows over the full KV (``best_draft_len``). On a CPU batch, where a long verification chunk
is compute-bound (pairs), k comes out short; where verification is cheap against drafting (few
sequences, memory-bound), long. Requests whose full KV crosses a link keep the offload policy's own
choice (the link, not compute, sets k there).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch

MIN_STEPS = 12   # forwards (with and without verification rows) before the fit is trusted
TERMS = ("c0", "t_row", "t_seq", "t_byte", "t_pair")


@dataclass
class StepCosts:
    c0: float = 0.0
    t_row: float = 0.0
    t_seq: float = 0.0
    t_byte: float = 0.0
    t_pair: float = 0.0
    matmuls: Callable[[int], float] | None = field(default=None, repr=False, compare=False)  # replaces rows * t_row

    def weights(self, rows: float) -> float:
        """Seconds of the weight matmuls at ``rows`` rows."""
        return self.matmuls(round(rows)) if self.matmuls is not None else rows * self.t_row

    def seq(self, kv_bytes: float, pairs: float) -> float:
        """One sequence's part of a forward: its own work and its attention."""
        return self.t_seq + kv_bytes * self.t_byte + pairs * self.t_pair

    def seconds(self, rows: float, kv_bytes: float, pairs: float, seqs: float = 0) -> float:
        """A whole forward."""
        return self.c0 + self.weights(rows) + seqs * self.t_seq + kv_bytes * self.t_byte + pairs * self.t_pair

    def to_dict(self) -> dict:
        return {t: getattr(self, t) for t in TERMS}

    @classmethod
    def fit(cls, steps: Sequence) -> "StepCosts | None":
        """Least squares over ``StepRecord``s: c0 + rows * t_row + kv_bytes * t_byte + pairs * t_pair
        (t_seq folds into t_row: a decode step has one row per sequence). None until there are enough
        steps, with and without verification."""
        steps = [s for s in steps if "prefill" not in s.kinds]
        with_verify = sum("verify" in s.kinds for s in steps)
        if len(steps) < MIN_STEPS or with_verify < 3 or len(steps) - with_verify < 3:
            return None
        x = np.array([[1.0, s.rows, s.kv_bytes, s.pairs] for s in steps])
        c0, t_row, t_byte, t_pair = nonnegative_lstsq(x, np.array([s.end - s.start for s in steps]))
        return cls(c0, t_row, 0.0, t_byte, t_pair)


def nonnegative_lstsq(x: np.ndarray, y: np.ndarray) -> list[float]:
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


@dataclass
class DraftCost:
    """The engine's cost-based draft length: refits from its recent forwards, at most every ``every`` steps."""

    every: int = 8
    fitted: StepCosts | None = None
    _fitted_at: int = field(default=0, repr=False)

    def refit(self, steps: Sequence, n_steps: int) -> None:
        """Before a choice: refit from the latest 96 ``steps`` when ``every`` forwards ran since the
        last fit (``n_steps``: forwards recorded so far)."""
        if n_steps - self._fitted_at >= self.every:
            self._fitted_at = n_steps
            self.fitted = StepCosts.fit(list(steps)[-96:]) or self.fitted

    def choose(self, alpha: float, n_active: int, draft_cost: tuple[int, int], verify_cost: Callable[[int], tuple[int, int]],
               k_max: int) -> int | None:
        """The best k for one request, or None before the fit exists. ``draft_cost``: (K/V bytes,
        pairs) of one draft row over its compressed KV; ``verify_cost(k)``: the same for a chunk of
        k + 1 rows over its full KV. The step's fixed cost is shared by the ``n_active`` requests."""
        if self.fitted is None or k_max < 1:
            return None
        f = self.fitted
        share = f.c0 / max(n_active, 1)
        draft_s = share + f.weights(1) + f.seq(*draft_cost)
        return best_draft_len(alpha, draft_s, lambda k: share + f.weights(k + 1) + f.seq(*verify_cost(k)), k_max)


# ---------------------------------------------------------------------- predictions
def predict_tokens_per_s(c: CostsAt, mode: str, n: int, tokens_per_round: float = 1.0, drafted: float = 0.0,
                         draft_weights: Callable[[int], float] | None = None, move_s: float = 0.0,
                         window: int = 32) -> float:
    """Decode tokens/s of ``n`` requests in ``mode`` (full, lossy, vericache) with every cache on the
    device (``bench decode``, ``bench batch``); vericache with ``drafted`` tokens per round emitting
    ``tokens_per_round`` (measured), its draft rows on ``draft_weights`` (default: the exact weights);
    every token also pays its share of its request's compression moves (one per ``window`` tokens).
    One sequence runs k draft steps, then a verification; many fall out of phase, so each step
    carries ~n k/(k+1) draft rows and n/(k+1) verification chunks, and a round takes k + 1 steps."""
    dw = draft_weights or c.weights
    if mode == "full":
        return n / (c.c0 + c.weights(n) + n * c.full)
    if mode == "lossy":
        tps = n / (c.c0 + c.weights(n) + n * c.draft)
    else:
        k = drafted
        if n == 1:   # k draft steps, then the verification
            round_s = k * (c.c0 + dw(1) + c.draft) + c.c0 + c.weights(round(k + 1)) + c.verify(k + 1)
        else:        # out of phase: k + 1 steps, each with n k/(k+1) draft rows and n/(k+1) chunks
            d_rows, v_seqs = n * k / (k + 1), n / (k + 1)
            step = (c.c0 + dw(round(d_rows)) + c.weights(round(v_seqs * (k + 1)))
                    + d_rows * c.draft + v_seqs * c.verify(k + 1))
            round_s = (k + 1) * step
        tps = n * tokens_per_round / round_s
    return 1 / (1 / tps + move_s / window)


def predict_offloaded(c: StepCosts, mode: str, n: int, context: int, kv_bytes_per_position: int, budget_bytes: float,
                      link_bytes_per_s: float, kept: float, window: int, acceptance: float, draft_len: float) -> float:
    """Decode tokens/s of a ``bench throughput`` row (the full KV in the host tier, behind a link).

    full: as many requests as the budget holds decode together, one token per step;
    lossy: all requests on their compressed KV (``kept`` of the tokens plus the window);
    vericache: a round is ``draft_len`` draft steps for all, and each request's verification (its full
    KV over the link, ``draft_len + 1`` queries over it, riding beside the drafts), ``acceptance``
    tokens each: naive = compute + link; staggered/grouped = max(compute, link) (P1 hides the smaller)."""
    full_req = (context + 1) * kv_bytes_per_position
    if mode == "full":
        b = max(min(n, int(budget_bytes // full_req)), 1)
        return b / c.seconds(b, b * full_req, b * context, seqs=b)
    keys = kept * context + window
    draft_step = c.seconds(n, n * keys * kv_bytes_per_position, n * keys, seqs=n)
    if mode == "lossy":
        return n / draft_step
    k = draft_len
    verify = c.seconds(n * (k + 1), n * full_req, n * (k + 1) * context, seqs=n) - c.c0
    link = n * full_req / link_bytes_per_s
    compute = k * draft_step + verify
    round_s = compute + link if mode.endswith("naive") else max(compute, link)
    return n * acceptance / round_s


# ---------------------------------------------------------------------- measured on real caches
@torch.inference_mode()
def measure_step_costs(llm, compressor, context: int, weights: Callable[[int], float], n_probe: int = 4,
                       repeats: int = 3) -> CostsAt:
    """The terms at a bench's geometry, timed on real caches of ``context`` positions (random K/V: the
    costs do not depend on the values): 1 and ``n_probe`` sequences of one row over full caches (c0 and
    a full row), over compressed caches (a draft row) and of 4 and 8 rows over full caches (a
    verification); ``weights``: the exact weights' matmul times, taken out of every probe."""
    from vericache.kv.compressed import CompressedKVCache
    from vericache.kv.full import FullKVCache
    from vericache.timing import best_seconds

    model, cfg, dt, dev = llm.loaded.model, llm.loaded.config, llm.loaded.kv_dtype, llm.loaded.device
    fulls, drafts = [], []
    for _ in range(n_probe):
        f = FullKVCache(cfg, dev, dt, capacity=context + 9)
        f.begin(0, context)
        f.k.normal_()
        f.v.normal_()
        fulls.append(f)
        c = CompressedKVCache(compressor, cfg, dev, dt, capacity=context + 9)
        c.load_prefill(f, [torch.randn(cfg.num_attention_heads, compressor.window, cfg.head_dim, dtype=dt)]
                       * cfg.num_hidden_layers)
        c.commit(context)
        drafts.append(c)

    def step_s(caches, rows: int) -> float:
        n = len(caches)
        toks = torch.zeros(n * rows, dtype=torch.long, device=dev)
        last = torch.arange(rows - 1, n * rows, rows, device=dev)
        # every run writes the same positions context.. (``begin`` there drops what a run left)
        return best_seconds(lambda: model(toks, [context] * n, [rows] * n, caches, logits_index=last), repeats)

    def per_seq(caches, rows: int) -> tuple[float, float]:
        """(fixed, per sequence) from 1 and n_probe sequences, the matmuls' own growth taken out."""
        one, many = step_s(caches[:1], rows), step_s(caches, rows)
        s = (many - one - (weights(n_probe * rows) - weights(rows))) / (n_probe - 1)
        return one - weights(rows) - s, s

    c0, full = per_seq(fulls, 1)
    probes = [(fulls[0].attention_cost(context, 1), full), (drafts[0].attention_cost(context, 1), per_seq(drafts, 1)[1])]
    probes += [(fulls[0].attention_cost(context, r), per_seq(fulls, r)[1]) for r in (4, 8)]
    # differences of noisy timings: on a busy machine one can come out negative, and no cost is negative
    t_seq, t_byte, t_pair = nonnegative_lstsq(np.array([[1.0, b, p] for (b, p), _ in probes]),
                                              np.array([s for _, s in probes]))
    costs = StepCosts(max(c0, 0.0), 0.0, t_seq, t_byte, t_pair, matmuls=weights)
    return CostsAt(costs, probes[0][0], probes[1][0])


@torch.inference_mode()
def move_seconds(compressor, cfg, dtype: torch.dtype, context: int, repeats: int = 4) -> float:
    """One compression move of a request at ``context`` positions: ``window`` committed tokens
    entering a store that holds what the compressor keeps of ``context`` (random K/V, timed)."""
    from vericache.kv.compressed import CompressedKVCache
    from vericache.kv.full import FullKVCache

    w, n_l = compressor.window, cfg.num_hidden_layers
    cap = context + (repeats + 2) * (w + compressor.align)
    full = FullKVCache(cfg, "cpu", dtype, capacity=cap)
    shape = (n_l, cfg.num_key_value_heads, cap, cfg.head_dim)
    full.append(torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype))
    cache = CompressedKVCache(compressor, cfg, "cpu", dtype, capacity=cap)
    cache.load_prefill(full, [torch.randn(cfg.num_attention_heads, w, cfg.head_dim, dtype=dtype)] * n_l)
    cache.commit(context)
    times, pos = [], context
    while len(times) < repeats:
        step = w + compressor.align
        t0 = time.perf_counter()
        cache.commit(pos + step, source=full)
        times.append(time.perf_counter() - t0)
        pos += step
    return sorted(times)[len(times) // 2]
