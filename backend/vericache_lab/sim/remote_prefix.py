"""The cost model of remote prefix caching (``bench prefix`` rows, ``vericache sim --remote-prefix``).

``n`` requests arrive together; each is a stored prefix of ``prefix`` positions plus a ``tail`` the
engine computes, and decodes ``max_tokens``. A role's forward costs what ``drafting.cost`` says:
fixed + weights(rows) + per-sequence attention (measured on this CPU at the prefix's context, or
the GPU roofline below). Links: ``slow`` (the drafting device to the store and to the verifier:
bytes / rate, plus a round trip per exchange) and the store's fetch rate next to the verifier.

- full-remote: the n full KVs share the slow link and land together after n B_full / R_slow; one
  forward prefills the n tails; then decode steps of n rows over the full KV.
- lossy-remote: the same with the compressed bytes, decoding over the compressed KV.
- vericache: the verifier's opens (``open_pipeline``): the n full KVs come from the store one after
  another at its rate, and each step of the verifier's loop prefills the tails whose KV is in, so the
  first tokens cross back (the open's round trip) one after another. Meanwhile the drafter fetches
  the compressed KV and prefills its tails. Then rounds (``predict_remote``): k draft steps, the chunk
  out and the reply back (a round trip and the kept K/V over the slow link), a verification forward
  shared by ``group`` sessions; a round emits A tokens per request.
A role's forward costs (``RemoteCosts``) are measured at the setting's geometry (``bench prefix``)
or composed from per-step costs (``costs_from_steps``: the GPU roofline below). The requests arrive
together; a mode's TTFT and end-to-end time are the mean over them (for full-remote and lossy-remote
the same for all; for VeriCache each session's open lands in turn), as the bench's measured ones are.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from vericache.drafting.cost import CostsAt
from vericache_lab.sim.cost_model import GPU, GPUS, MODELS, ModelShape, gpu_step_costs, gpus_needed, tensor_parallel


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
    group: float = 0.0       # sessions per verification forward (measured; 0: all n, in step)


@dataclass
class RemoteCosts:
    """Forward seconds of one role's engine at the setting's context, by sessions in the forward."""
    prefill: float                        # the n tails in one forward, over full caches
    prefill_tails: Callable[[float], float]  # m tails in one forward, over full caches (a verifier's opens)
    prefill_comp: float                   # ... over compressed caches (the drafter's own tails)
    decode_full: Callable[[float], float]   # sessions -> one decode row each, full caches
    decode_comp: Callable[[float], float]   # ... compressed caches, exact weights (lossy)
    draft: Callable[[float], float]         # ... compressed caches, the draft weights
    verify: Callable[[float], float]        # sessions -> a chunk of k + 1 rows each, full caches


def costs_from_steps(c: CostsAt, n: int, tail: int, k: float,
                     draft_weights: Callable[[int], float] | None = None) -> RemoteCosts:
    """``RemoteCosts`` composed from per-step costs (fixed + weights(rows) + per sequence)."""
    dw = draft_weights or c.weights
    return RemoteCosts(prefill=c.c0 + c.weights(n * tail) + n * c.verify(tail),
                       prefill_tails=lambda m: c.c0 + c.weights(round(m * tail)) + m * c.verify(tail),
                       prefill_comp=c.c0 + c.weights(n * tail) + n * c.draft * tail,
                       decode_full=lambda m: c.c0 + c.weights(round(m)) + m * c.full,
                       decode_comp=lambda m: c.c0 + c.weights(round(m)) + m * c.draft,
                       draft=lambda m: c.c0 + dw(round(m)) + m * c.draft,
                       verify=lambda m: c.c0 + c.weights(round(m * (k + 1))) + m * c.verify(k + 1))


def open_pipeline(arrivals: list[float], prefill: Callable[[int], float]) -> tuple[list[float], float]:
    """A verifier's opens: its sessions' full KVs in at ``arrivals`` (seconds, ascending: the store answers
    fetches in turn); each step of its loop prefills the tails of every session whose KV is in
    (``prefill(m)``: m tails in one forward), so opens that land while a forward runs share the next.
    (seconds to each session's first token, the loop's busy seconds)."""
    first: list[float] = []
    t = busy = 0.0
    while len(first) < len(arrivals):
        t = max(t, arrivals[len(first)])
        ready = sum(1 for a in arrivals[len(first):] if a <= t)
        step = prefill(ready)
        t, busy = t + step, busy + step
        first += [t] * ready
    return first, busy


def in_turn(sessions: int, fetch_s: float) -> list[float]:
    """When each of ``sessions`` fetches answered one after another lands (``fetch_s`` each)."""
    return [i * fetch_s for i in range(1, sessions + 1)]


def predict_remote(s: RemoteSetting, single: RemoteCosts, verifier: RemoteCosts | None = None) -> dict[str, dict]:
    """{mode: {"ttft_s", "e2e_s"}} for full-remote, lossy-remote and vericache. ``single``: the
    drafting device's costs (full-remote's and lossy-remote's engine, vericache's drafter);
    ``verifier``: the verifying device's (default: the same).

    VeriCache's rounds: each request drafts k tokens, its chunk goes out and the reply comes back
    (``exchange``), the verifier runs it in a forward with ``group`` sessions. A round of all n
    requests takes the longest of one request's own chain (its drafts, the exchange, its
    verification), the verifier's work (n / group forwards) and the drafter's (k n / group steps
    of group rows, requests out of step as much as their verifications are)."""
    v, n, later = verifier or single, s.n, s.max_tokens - 1
    out = {}
    for mode, nbytes, prefill, step in (("full-remote", s.full_bytes, single.prefill, single.decode_full(n)),
                                        ("lossy-remote", s.comp_bytes, single.prefill_comp, single.decode_comp(n))):
        ttft = s.rtt_s + n * nbytes / s.slow_Bps + prefill
        out[mode] = {"ttft_s": ttft, "e2e_s": ttft + later * step}
    k, a, g = max(s.drafted, 1.0), max(s.tokens_per_round, 1.0), min(s.group or n, n)
    # the open out, each session's fetch and tail in turn, its first token back
    opens, _ = open_pipeline(in_turn(n, s.full_bytes / s.store_Bps), v.prefill_tails)
    first = [1.5 * s.rtt_s + t for t in opens]
    drafter_ready = s.rtt_s + n * s.comp_bytes / s.slow_Bps + single.prefill_comp
    exchange = s.rtt_s + g * a * s.kv_pos_bytes / s.slow_Bps
    chain = k * single.draft(g) + exchange + v.verify(g)
    round_s = max(chain, n / g * v.verify(g), k * n / g * single.draft(g))
    rounds = math.ceil(later / a) * round_s
    out["vericache"] = {"ttft_s": sum(first) / n, "e2e_s": sum(max(t, drafter_ready) for t in first) / n + rounds,
                        "round_s": round_s, "chain_s": chain}
    return out


# ---------------------------------------------------------------------- the paper's setting (GPU roofline)
NVLINK_BPS = 450e9          # H100/H200 NVLink 4: 900 GB/s bidirectional, half per direction
PCIE5_BPS = 50e9            # x16 Gen5, ~80% of 64 GB/s
MODELS_24_70 = {"mistral-small-24b": ModelShape("Mistral-Small-24B", 23.6e9, 40, 8, 128),
                "qwen2.5-32b": MODELS["qwen2.5-32b"], "llama3-70b": MODELS["llama3-70b"]}


def gpu_costs(gpu: GPU, model: ModelShape, context: int, efficiency: tuple[float, float] = (0.8, 0.5),
              comp_ratio: float = 0.125) -> CostsAt:
    """The cost model's terms on ``gpu`` (tensor-parallel as the weights need, ``gpu_step_costs``) with
    2 ms of fixed work a step, at the geometry of ``context`` positions (full) and ``comp_ratio`` of
    them (compressed)."""
    g = tensor_parallel(gpu, gpus_needed(gpu, model))
    costs = gpu_step_costs(g, model, *efficiency, c0=2e-3)
    kv = context * model.kv_bytes_per_token
    return CostsAt(costs, (kv, context), (comp_ratio * kv, comp_ratio * context))


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
                    p = predict_remote(s, costs_from_steps(costs, n, tail, drafted))
                    f, vc = p["full-remote"], p["vericache"]
                    rows.append({"gpu": gname, "model": mname, "slow_gbps": slow_gbps, "fast_link": fast_name,
                                 "full_remote_ttft_s": round(f["ttft_s"], 2), "vericache_ttft_s": round(vc["ttft_s"], 2),
                                 "ttft_x": round(f["ttft_s"] / vc["ttft_s"], 2),
                                 "full_remote_e2e_s": round(f["e2e_s"], 2), "vericache_e2e_s": round(vc["e2e_s"], 2),
                                 "e2e_x": round(f["e2e_s"] / vc["e2e_s"], 2)})
    return rows
