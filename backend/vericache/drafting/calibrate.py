"""Step costs before the engine has run a step: a few timed forwards over scratch caches.

The draft length is chosen from fitted step costs (``drafting.cost``), and the engine's own fit needs a
dozen forwards with and without verification rows. Without a prior, a batch's first rounds ran at the
policy's length whatever they cost: at 8 requests x 4K on a CPU those rounds alone made VeriCache slower
than full decoding. So the engine times its model when it is built: the same model, kernels and KV
dtype, forwards of 1 and 4 sequences of one row and of 2 sequences of 9 rows (a verification chunk),
over full caches of a short and a long context (random K/V: a forward's time does not depend on the
values). The two contexts separate a row's weights (``t_row``) from its attention (``t_byte``,
``t_pair``); 1 and 4 sequences the step's fixed work (``c0``). The long context is 4096 positions (or
the model's limit): at a short one a verified row's attention is too small to time, and a calibration
that prices it at nothing sends a batch into rounds that cost more than they give. About 2 s for
SmolLM2 on 2 Zen 2 cores, 0.5 s for ``tiny``. Random K/V is not real attention (real scores have a
few strong keys), so the planner lets these costs veto rounds but not size them (``DraftPlanner``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from vericache.drafting.cost import StepCosts
from vericache.kv.full import FullKVCache
from vericache.model.draft_weights import measured_choice
from vericache.timing import best_seconds

CONTEXTS = (256, 4096)   # positions in each scratch cache (the long one within the model's limit)
SHAPES = ((1, 1), (4, 1), (2, 9))   # (sequences, rows each): decode steps, verification chunks


@dataclass(frozen=True)
class Calibration:
    """Timed forwards of one model: x [N, 4] (1, rows, K/V bytes, pairs) and their seconds [N]; ``costs``
    fitted to them, None where they give no usable fit (``StepCosts.usable``)."""
    x: np.ndarray
    seconds: np.ndarray
    costs: StepCosts | None


@torch.inference_mode()
def calibrate(loaded, contexts: tuple[int, ...] = CONTEXTS, repeats: int = 2,
              matmuls: Callable[[int], float] | None = None) -> Calibration:
    """Time ``loaded`` (a ``LoadedModel``) at ``SHAPES`` over scratch caches of each context; with
    ``matmuls`` (the weights' measured seconds at a row count) the costs price the weights by that curve
    (``StepCosts.from_samples``). Nothing is timed for the Triton kernels on a CPU: Triton's interpreter
    (gpu-check's dry run) runs them in numpy, minutes a forward at 4096 positions, and its times describe
    no machine."""
    model, cfg, dev = loaded.model, loaded.config, loaded.device
    if interpreted(loaded):
        return Calibration(np.zeros((0, 4)), np.zeros(0), None)
    features, seconds = [], []
    longest_rows = max(r for _, r in SHAPES)
    for context in sorted({min(c, cfg.context_limit - longest_rows) for c in contexts}):
        caches = []
        for _ in range(max(n for n, _ in SHAPES)):
            cache = FullKVCache(cfg, dev, loaded.kv_dtype, capacity=context + longest_rows)
            cache.begin(0, context)   # every run writes positions context.. (``begin`` there drops the last run's)
            cache.fill_random()
            caches.append(cache)
        for n, rows in SHAPES:
            toks = torch.zeros(n * rows, dtype=torch.long, device=dev)
            last = torch.arange(rows - 1, n * rows, rows, device=dev)   # one logits row per sequence
            # .item(): the logits reach the host, so a CUDA forward is timed to its end
            run = lambda: model(toks, [context] * n, [rows] * n, caches[:n], logits_index=last)[0, 0].item()  # noqa: E731
            kv_bytes, pairs = (n * x for x in caches[0].attention_cost(context, rows))
            features.append([1.0, n * rows, kv_bytes, pairs])
            seconds.append(best_seconds(run, repeats))
    x, y = np.array(features), np.array(seconds)
    costs = StepCosts.from_samples(x, y, matmuls)
    return Calibration(x, y, costs if costs.usable() else None)


def model_calibration(loaded) -> Calibration:
    """``loaded``'s calibration, timed at the first ask and kept on it (``LoadedModel.calibration``), so
    every engine over one model shares it: a serving engine asks when it is built (``Engine``), the
    offline ``LLM`` at its first choice of a draft length. On the CPU's linear op the weights are priced
    by their own measured matmuls (``draft_weights.measured_choice``: its exact weights' row)."""
    if not loaded.calibration:
        matmuls = None
        if loaded.model.head_exact is not None and not interpreted(loaded):
            choice = measured_choice(loaded.model)
            matmuls = functools.partial(choice.seconds_at, "fp32")
        loaded.calibration.append(calibrate(loaded, matmuls=matmuls))
    return loaded.calibration[0]


def interpreted(loaded) -> bool:
    """The Triton kernels on a CPU: Triton's interpreter, whose times describe no machine."""
    return loaded.kernels == "triton" and loaded.device.type == "cpu"
