"""Step costs before the engine has run a step: a few timed forwards over scratch caches.

The draft length is chosen from fitted step costs (``drafting.cost``), and the engine's own fit needs a
dozen forwards with and without verification rows. Without a prior, a batch's first rounds ran at the
policy's length whatever they cost: at 8 requests x 4K on a CPU those rounds alone made VeriCache slower
than full decoding. So the engine times its model when it is built: the same model, kernels and KV
dtype, over full caches of random K/V (a forward's time does not depend on the values), in two parts:

1. the weights' curve: forwards of one sequence of 1, 2, 4 ... 64 rows over a short context (256
   positions, where attention is a few percent of a forward): a forward's weights and fixed work by
   row count, which on a CPU grow along no line (integer matmuls: 47 ms at 1 row, 130 at 16 on the
   0.5B code model, AVX2);
2. attention: forwards of 1 and 4 sequences of one row and of 2 sequences of 9 rows (a verification
   chunk) over a long context (4096 positions, or the model's limit), each against the curve's forward
   of as many rows: what remains is each extra sequence's own work (``t_seq``), each K/V byte read
   (``t_byte``) and each query-key pair (``t_pair``: the compute that makes a verified row cost as much
   as a draft step at 32K on a 2-core CPU).

The weights are timed inside whole forwards, not as matmuls alone: the separately timed matmuls of the
0.5B code model (70 ms at 1 row, AVX2) cost more than its whole forward (47 ms), and a fit against them
priced attention at nearly nothing, so rounds ran at 32K where each verified row costs a draft step.
About 5 s for the 0.5B code model on 2 Zen 3 cores, 0.5 s for ``tiny``. Random K/V is not real attention
(real scores have a few strong keys), so the planner lets these costs veto rounds but not size them
(``DraftPlanner``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt
import torch

from vericache.drafting.cost import StepCosts, nonnegative_lstsq
from vericache.kv.full import FullKVCache
from vericache.model.draft_weights import interpolate_rows
from vericache.timing import best_seconds

if TYPE_CHECKING:
    from vericache.model.loader import LoadedModel

SHORT = 256                              # positions where a forward is its weights
LONG = 4096                              # positions where attention shows (within the model's limit)
CURVE_ROWS = (1, 2, 4, 8, 16, 32, 64)    # one sequence's rows at SHORT: the weights' curve
SHAPES = ((1, 1), (4, 1), (2, 9))        # (sequences, rows each) at LONG: decode steps, verification chunks
# Timings taken through a stall of the host (another process's threads on the same 2 cores: ``tiny``'s 4096
# forwards 0.2-0.5 s against 2-10 ms, 1 calibration in 60 beside a running eval) fit no usable costs;
# timed once more they do (a stall rarely spans two calibrations).
ATTEMPTS = 2


@dataclass(frozen=True)
class WeightsCurve:
    """A forward's seconds beyond its attention and its sequences' own work, by row count: measured at
    ``rows``, linear between them, proportional to rows beyond the last."""
    rows: tuple[int, ...]
    seconds: tuple[float, ...]

    def __call__(self, n_rows: int) -> float:
        return interpolate_rows(self.rows, self.seconds, n_rows)


@dataclass(frozen=True)
class Calibration:
    """Timed forwards of one model: x [N, 5] (sequences, rows, K/V bytes, pairs, context) and their
    seconds [N]; ``costs`` fitted to them (the weights priced by their curve), None where they give no
    usable fit (``StepCosts.usable``)."""
    x: npt.NDArray[np.float64]
    seconds: npt.NDArray[np.float64]
    costs: StepCosts | None


@torch.inference_mode()
def calibrate(loaded: LoadedModel, repeats: int = 2, short: int = SHORT, long: int = LONG,
              attempts: int = ATTEMPTS) -> Calibration:
    """Time ``loaded`` (a ``LoadedModel``) at ``CURVE_ROWS`` over a scratch cache of ``short`` positions
    and at ``SHAPES`` over ``long`` ones, and fit the costs (``fit_calibration``), up to ``attempts``
    times while the fit is not usable (timings through a stall of the host). Nothing is timed for
    the Triton kernels on a CPU: Triton's interpreter (gpu-check's dry run) runs them in numpy, minutes a
    forward at 4096 positions, and its times describe no machine."""
    if attempts < 1:
        raise ValueError(f"attempts must be >= 1, got {attempts}")
    if interpreted(loaded):
        return Calibration(np.zeros((0, 5)), np.zeros(0), None)
    model, cfg, dev = loaded.model, loaded.config, loaded.device
    # a small model's context (gpu-check's dry run: 60 positions) holds fewer rows: the curve stops there
    curve_rows = [r for r in CURVE_ROWS if r <= cfg.context_limit // 2] or [1]
    most_rows = max(max(curve_rows), max(r for _, r in SHAPES))
    if cfg.context_limit < 2 * most_rows:   # too short to time attention apart from the weights
        return Calibration(np.zeros((0, 5)), np.zeros(0), None)
    short = max(min(short, cfg.context_limit - most_rows), 0)
    long = max(min(long, cfg.context_limit - most_rows), short)
    caches = [FullKVCache(cfg, dev, loaded.kv_dtype, capacity=long + most_rows, key_codes=loaded.key_codes)
              for _ in range(max(n for n, _ in SHAPES))]

    def timed(context: int, n: int, rows: int) -> tuple[list[float], float]:
        """One shape's features (as ``Calibration.x``'s rows) and its best seconds."""
        for cache in caches[:n]:
            cache.begin(0, context)   # every run writes positions context.. (``begin`` there drops the last run's)
        toks = torch.zeros(n * rows, dtype=torch.long, device=dev)
        last = torch.arange(rows - 1, n * rows, rows, device=dev)   # one logits row per sequence
        # .item(): the logits reach the host, so a CUDA forward is timed to its end
        def run() -> float:
            return float(model(toks, [context] * n, [rows] * n, caches[:n], logits_index=last)[0, 0].item())

        kv_bytes, pairs = (n * x for x in caches[0].attention_cost(context, rows))
        return [n, n * rows, kv_bytes, pairs, context], best_seconds(run, repeats)

    for cache in caches:
        cache.begin(0, long)
        cache.fill_random()
    shapes = [(short, 1, rows) for rows in curve_rows] + [(long, n, rows) for n, rows in SHAPES]
    for _ in range(attempts):
        features, seconds = zip(*(timed(*shape) for shape in shapes))
        x, y = np.array(features, dtype=np.float64), np.array(seconds)
        costs = fit_calibration(x, y, lambda rows: caches[0].attention_cost(short, rows), len(curve_rows))
        if costs.usable():
            share = min(vocab_saving(loaded, repeats) / max(costs.weights(1), 1e-9), 1.0)
            return Calibration(x, y, dataclasses.replace(costs, vocab_share=share))
    return Calibration(x, y, None)


def vocab_saving(loaded: LoadedModel, repeats: int = 2) -> float:
    """Seconds a draft row's logits save on ``loaded``'s draft vocabulary (``set_draft_vocab``)
    against its whole head, measured at one row (0 without one): 3.4 ms of a 0.5B draft step at 32,768
    of 151,936 tokens (Zen 5), of ~20 ms of the weights (``StepCosts.vocab_share`` is that share)."""
    model, vocab = loaded.model, loaded.model.vocab_head
    if vocab is None:
        return 0.0
    head = model.head_exact or model.lm_head
    x = torch.randn(1, loaded.config.hidden_size, device=loaded.device)
    whole = best_seconds(lambda: head(x), repeats)
    return max(whole - best_seconds(lambda: vocab(x), repeats), 0.0)


def fit_calibration(x: npt.NDArray[np.float64], seconds: npt.NDArray[np.float64],
                    short_cost: Callable[[int], tuple[int, int]], n_curve: int = len(CURVE_ROWS)) -> StepCosts:
    """The costs from a calibration's forwards (x as in ``Calibration``; the first ``n_curve``
    are the curve's, one sequence each at the short context). Each long forward of n sequences and R
    rows, less the curve's forward of R rows, leaves (n - 1) t_seq + (its K/V bytes and pairs less the
    curve forward's) priced at t_byte and t_pair: fitted by least squares, none negative. The curve then
    sheds the short forward's own sequence and attention (``short_cost(rows)``: its (K/V bytes, pairs)),
    so ``StepCosts.seconds`` adds them back once at any context."""
    k = n_curve
    curve_rows, curve_s = x[:k, 1].astype(int), seconds[:k]
    measured = WeightsCurve(tuple(int(r) for r in curve_rows), tuple(float(s) for s in curve_s))
    rest, terms = [], []
    for (n, rows, kv_bytes, pairs, _), s in zip(x[k:], seconds[k:]):
        short_bytes, short_pairs = short_cost(int(rows))
        rest.append(s - measured(int(rows)))
        terms.append([n - 1, kv_bytes - short_bytes, pairs - short_pairs])
    t_seq, t_byte, t_pair = nonnegative_lstsq(np.array(terms), np.array(rest))
    weights = WeightsCurve(measured.rows, tuple(
        max(s - t_seq - np.dot(short_cost(r), (t_byte, t_pair)), 0.0) for r, s in zip(measured.rows, measured.seconds)))
    return StepCosts(0.0, 0.0, t_seq, t_byte, t_pair, matmuls=weights)


def model_calibration(loaded: LoadedModel) -> Calibration:
    """``loaded``'s calibration, timed at the first ask and kept on it (``LoadedModel.calibration``), so
    every engine over one model shares it: a serving engine asks when it is built (``Engine``), the
    offline ``LLM`` at its first choice of a draft length."""
    if not loaded.calibration:
        loaded.calibration.append(calibrate(loaded))
    calibration: Calibration = loaded.calibration[0]
    return calibration


def interpreted(loaded: LoadedModel) -> bool:
    """The Triton kernels on a CPU: Triton's interpreter, whose times describe no machine."""
    return bool(loaded.kernels == "triton" and loaded.device.type == "cpu")
