"""The cost model of remote prefix caching (``bench prefix`` rows, ``vericache sim --remote-prefix``).

``n`` requests arrive together; each is a stored prefix of ``prefix`` positions plus a ``tail`` the
engine computes, and decodes ``max_tokens``. A role's forward costs what ``sim.step_costs`` says:
fixed + weights(rows) + per-sequence attention (measured on this CPU at the prefix's context, or
the GPU roofline below). Links: ``slow`` (the drafting device to the store and to the verifier:
bytes / rate, plus a round trip per exchange) and the store's fetch rate next to the verifier.

- full-remote: the n full KVs share the slow link and land together after n B_full / R_slow; one
  forward prefills the n tails; then decode steps of n rows over the full KV.
- lossy-remote: the same with the compressed bytes, decoding over the compressed KV.
- vericache: the verifier fetches the n full KVs at the store's rate and prefills the n tails in one
  forward; the first tokens cross back (the open's round trip). Meanwhile the drafter fetches the
  compressed KV and prefills its tails. Then rounds: k draft steps of n rows (the drafter, on its
  draft weights), the chunks out and the replies back (a round trip and the kept K/V over the slow
  link), one verification of n (k + 1) rows (the verifier). A round emits A tokens per request.
Requests move in step (they arrive together), so a mode's TTFT and end-to-end time are the same for
all of them; the bench prints the mean of its measured ones beside these.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from vericache.sim.cost_model import GPUS, MODELS, GPU, ModelShape, gpus_needed, tensor_parallel
from vericache.sim.step_costs import StepCosts


@dataclass
class RemoteSetting:
    n: int                   # requests, arriving together
    prefix: int              # stored positions per request
    tail: int                # prompt tokens after the stored blocks (computed)
    max_tokens: int
    slow_Bps: float          # the slow link's rate (bytes/s)
    rtt_s: float             # its round trip
    store_Bps: float         # the verifier's fetch rate from the store (bytes/s)
    full_bytes: float        # one request's stored full KV
    comp_bytes: float        # one request's stored compressed KV
    kv_pos_bytes: float      # full K/V bytes of one position (what a verification sends back per token)
    tokens_per_round: float  # A: tokens a verification round emits per request (measured, or assumed)
    drafted: float           # k: tokens drafted per round


def _prefill(c: StepCosts, n: int, tail: int) -> float:
    """One forward of n tails of ``tail`` tokens over the stored prefix (a chunk of ``tail`` rows each)."""
    return c.c0 + c.weights(n * tail) + n * c.verify(tail)


def predict_remote(s: RemoteSetting, single: StepCosts, verifier: StepCosts | None = None,
                   draft_weights: Callable[[int], float] | None = None) -> dict[str, dict]:
    """{mode: {"ttft_s", "e2e_s"}} for full-remote, lossy-remote and vericache. ``single``: the
    drafting device's costs (full-remote's and lossy-remote's engine, vericache's drafter);
    ``verifier``: the verifying device's (default: the same); ``draft_weights``: the drafter's draft
    rows' matmul seconds (default: the exact weights')."""
    v, dw = verifier or single, draft_weights or single.weights
    out, n, later = {}, s.n, s.max_tokens - 1
    for mode, nbytes, per_seq in (("full-remote", s.full_bytes, single.full), ("lossy-remote", s.comp_bytes, single.draft)):
        ttft = s.rtt_s + n * nbytes / s.slow_Bps + _prefill(single, n, s.tail)
        step = single.c0 + single.weights(n) + n * per_seq
        out[mode] = {"ttft_s": ttft, "e2e_s": ttft + later * step}
    k, a = max(s.drafted, 1.0), max(s.tokens_per_round, 1.0)
    ttft = 1.5 * s.rtt_s + n * s.full_bytes / s.store_Bps + _prefill(v, n, s.tail)   # the open + its reply
    drafter_ready = s.rtt_s + n * s.comp_bytes / s.slow_Bps + _prefill(single, n, s.tail)
    draft = k * (single.c0 + dw(n) + n * single.draft)
    verify = v.c0 + v.weights(round(n * (k + 1))) + n * v.verify(k + 1)
    exchange = s.rtt_s + n * (a * s.kv_pos_bytes) / s.slow_Bps
    rounds = math.ceil(later / a)
    out["vericache"] = {"ttft_s": ttft, "e2e_s": max(ttft, drafter_ready) + rounds * (draft + exchange + verify),
                        "round_s": draft + exchange + verify}
    return out


# ---------------------------------------------------------------------- the paper's setting (GPU roofline)
NVLINK_BPS = 450e9          # H100/H200 NVLink 4: 900 GB/s bidirectional, half per direction
PCIE5_BPS = 50e9            # x16 Gen5, ~80% of 64 GB/s
MODELS_24_70 = {"mistral-small-24b": ModelShape("Mistral-Small-24B", 23.6e9, 40, 8, 128),
                "qwen2.5-32b": MODELS["qwen2.5-32b"], "llama3-70b": MODELS["llama3-70b"]}


def gpu_costs(gpu: GPU, model: ModelShape, context: int, efficiency: tuple[float, float] = (0.8, 0.5),
              comp_ratio: float = 0.125) -> StepCosts:
    """Step costs on ``gpu`` (tensor-parallel as the weights need) as rooflines: a forward reads the
    weights once and each sequence's KV once; its compute is 2 x params per row (+ attention)."""
    g = tensor_parallel(gpu, gpus_needed(gpu, model))
    bw, fl = g.hbm_bw * efficiency[0], g.flops * efficiency[1]
    kv = context * model.kv_bytes_per_token
    attn = 4 * model.layers * model.kv_heads * 4 * model.head_dim * context   # ~4 query heads per KV head

    def weights(rows: int) -> float:
        return max(model.weight_bytes / bw, 2 * model.params * rows / fl)

    def verify_row_cost() -> float:
        return attn / fl
    return StepCosts(c0=2e-3, full=kv / bw, draft=comp_ratio * kv / bw, verify0=kv / bw, verify_row=verify_row_cost(),
                     weights=weights)


def paper_table(prefix: int = 32768, tail: int = 256, n: int = 8, max_tokens: int = 256, tokens_per_round: float = 6.0,
                drafted: float = 8.0, comp_ratio: float = 0.125) -> list[dict]:
    """Predicted TTFT and end-to-end speed-ups of VeriCache over full-remote on H100/H200 for 24B-70B
    models, slow links of 10 and 25 Gbit/s, the verifier's store over NVLink or PCIe Gen5."""
    rows = []
    for gname in ("h100", "h200"):
        for mname, model in MODELS_24_70.items():
            costs = gpu_costs(GPUS[gname], model, prefix + tail, comp_ratio=comp_ratio)
            for slow_gbps in (10, 25):
                for fast_name, fast in (("nvlink", NVLINK_BPS), ("pcie5", PCIE5_BPS)):
                    full = prefix * model.kv_bytes_per_token
                    s = RemoteSetting(n, prefix, tail, max_tokens, slow_gbps * 1e9 / 8, 0.02, fast, full,
                                      comp_ratio * full, model.kv_bytes_per_token, tokens_per_round, drafted)
                    p = predict_remote(s, costs)
                    f, vc = p["full-remote"], p["vericache"]
                    rows.append({"gpu": gname, "model": mname, "slow_gbps": slow_gbps, "fast_link": fast_name,
                                 "full_remote_ttft_s": round(f["ttft_s"], 2), "vericache_ttft_s": round(vc["ttft_s"], 2),
                                 "ttft_x": round(f["ttft_s"] / vc["ttft_s"], 2),
                                 "full_remote_e2e_s": round(f["e2e_s"], 2), "vericache_e2e_s": round(vc["e2e_s"], 2),
                                 "e2e_x": round(f["e2e_s"] / vc["e2e_s"], 2)})
    return rows
