"""The cost model's predictions, used only by the research harness: a mode's tokens/s with every cache
on the device (``predict_tokens_per_s``) or tiered behind a link (``predict_offloaded``), and the terms
measured on real caches (``measure_step_costs``, ``move_seconds``). The model itself (``StepCosts``,
``CostsAt``, the draft length) is the core's: ``vericache.drafting.cost``."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from vericache.drafting.cost import CostsAt, StepCosts, nonnegative_lstsq


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
        # as the engine's full caches: q8qk's keep their codes (coded by the first timed call, read after)
        f = FullKVCache(cfg, dev, dt, capacity=context + 9, key_codes=llm.loaded.key_codes)
        f.begin(0, context)
        f.k.normal_()
        f.v.normal_()
        fulls.append(f)
        c = CompressedKVCache(compressor, cfg, dev, dt, capacity=context + 9, key_codes=llm.loaded.key_codes)
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
