"""The cost model of a local decode (``bench decode``, ``bench batch``): what one step of each kind
costs at the bench's own geometry, measured on the engine's real caches, composed into tokens/s.

A forward over ``n`` sequences is charged ``c0 + weights(rows) + sum of per-sequence costs``:
- ``c0``: the fixed work of a step (norms, rotary, the Python around 30 layers);
- ``weights(rows)``: the weight matmuls at that many rows (fp32, or the draft copies' own times);
- per sequence: its attention and cache calls for one row over a full cache of ``context``
  positions (``full``), over the compressor's cache (``draft``), and for a chunk of r rows over the
  full cache (``verify(r) = verify0 + verify_row * r``, verification's compute-bound part).
Measured with 1 and ``n_probe`` sequences of random K/V (the costs do not depend on the values).

A VeriCache round of a request drafts k tokens and verifies k + 1 rows, emitting A tokens (both
measured in the run being predicted). One sequence runs k draft steps and then a verification;
many sequences fall out of phase, so each step carries ~n k/(k+1) draft rows and n/(k+1)
verification chunks, and a round takes k + 1 such steps. Every token also pays its share of its
request's compression moves (one per ``window`` tokens).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from vericache.kv.compressed import CompressedKVCache
from vericache.kv.full import FullKVCache
from vericache.timing import best_seconds


@dataclass
class StepCosts:
    c0: float           # seconds of a step's fixed work
    full: float         # per sequence, one row over a full cache of ``context``
    draft: float        # per sequence, one row over the compressed cache
    verify0: float      # per sequence, a chunk over the full cache: verify0 + verify_row * rows
    verify_row: float
    weights: Callable[[int], float]   # fp32 weight matmuls at ``rows`` rows

    def verify(self, rows: float) -> float:
        return self.verify0 + self.verify_row * rows


@torch.inference_mode()
def measure_step_costs(llm, compressor, context: int, weights: Callable[[int], float], n_probe: int = 4,
                       repeats: int = 3) -> StepCosts:
    """Time forwards over real caches of ``context`` positions (random K/V): 1 and ``n_probe``
    sequences of one row (full, compressed) and of 4 and 8 rows (full), exact weights."""
    model, cfg, dt = llm.loaded.model, llm.loaded.config, llm.loaded.kv_dtype
    dev = llm.loaded.device
    fulls = []
    for _ in range(n_probe):
        f = FullKVCache(cfg, dev, dt, capacity=context + 9)
        f.begin(0, context)
        f.k.normal_()
        f.v.normal_()
        fulls.append(f)
    drafts = []
    for f in fulls:
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
    _, draft = per_seq(drafts, 1)
    _, v4 = per_seq(fulls, 4)
    _, v8 = per_seq(fulls, 8)
    # differences of noisy timings: on a busy machine a small one can come out negative, and no
    # cost is negative
    full, draft, v4, v8 = (max(x, 0.0) for x in (full, draft, v4, v8))
    row = max((v8 - v4) / 4, 0.0)
    return StepCosts(max(c0, 0.0), full, draft, max(v4 - 4 * row, 0.0), row, weights)


def predict_tokens_per_s(c: StepCosts, mode: str, n: int, tokens_per_round: float = 1.0, drafted: float = 0.0,
                         draft_weights: Callable[[int], float] | None = None, move_s: float = 0.0,
                         window: int = 32) -> float:
    """Decode tokens/s of ``n`` requests in ``mode`` (full, lossy, vericache); vericache with
    ``drafted`` tokens per round emitting ``tokens_per_round`` (measured), its draft rows on
    ``draft_weights`` (default: the exact weights)."""
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


@torch.inference_mode()
def move_seconds(compressor, cfg, dtype: torch.dtype, context: int, repeats: int = 4) -> float:
    """One compression move of a request at ``context`` positions: ``window`` committed tokens
    entering a store that holds what the compressor keeps of ``context`` (random K/V, timed)."""
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
