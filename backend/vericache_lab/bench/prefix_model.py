"""``bench prefix``'s predicted rows: each role's forwards measured here after the runs at the
bench's geometry (context, tail, sessions, draft length) with that role's thread count; the links as
measured; the store's fetch rate, the acceptance and the sessions per verification forward as the
VeriCache run measured them; composed by ``sim.remote_prefix``."""

from __future__ import annotations

import bisect

import torch

from vericache.timing import best_seconds
from vericache_lab.sim.remote_prefix import RemoteCosts, RemoteSetting, predict_remote


def _interpolated(xs: list[int], ys: list[float]):
    def at(x: float) -> float:
        i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 != x0 else y0
    return at


@torch.inference_mode()
def measure_remote_costs(llm, compressor, context: int, n: int, tail: int, k: float, draft_kind: str = "auto",
                         repeats: int = 3) -> RemoteCosts:
    """Time each forward the model needs on real caches of ``context`` positions (random K/V): the n
    tails' prefill, decode rows over full and compressed caches, draft rows on the draft weights and
    verification chunks of k + 1 rows, at 1, 2 .. n sessions (interpolated between)."""
    from vericache.engine.engine import Engine
    from vericache.kv.compressed import CompressedKVCache
    from vericache.kv.full import FullKVCache

    model, cfg, dt, dev = llm.loaded.model, llm.loaded.config, llm.loaded.kv_dtype, llm.loaded.device
    rows_v = max(round(k + 1), 1)
    fulls, comps = [], []
    for _ in range(n):
        f = FullKVCache(cfg, dev, dt, capacity=context + rows_v + 1)
        f.begin(0, context)
        f.k.normal_()
        f.v.normal_()
        c = CompressedKVCache(compressor, cfg, dev, dt, capacity=context + max(rows_v, tail) + 1)
        c.load_prefill(f, [torch.randn(cfg.num_attention_heads, compressor.window, cfg.head_dim, dtype=dt)]
                       * cfg.num_hidden_layers)
        c.commit(context)
        fulls.append(f)
        comps.append(c)

    def fwd(caches, rows: int, start: int, draft: bool = False, times: int = repeats) -> float:
        m = len(caches)
        toks = torch.zeros(m * rows, dtype=torch.long, device=dev)
        last = torch.arange(rows - 1, m * rows, rows, device=dev)
        extra = {"n_draft": m * rows} if draft else {}
        return best_seconds(lambda: model(toks, [start] * m, [rows] * m, caches, logits_index=last, **extra), times)

    drafter = Engine(llm.loaded, mode="vericache", compressor=compressor, draft_weights=draft_kind).runner
    sessions = sorted({1, 2, n} & set(range(1, n + 1)))
    table: dict[str, list[float]] = {"full": [], "comp": [], "draft": [], "verify": []}
    for m in sessions:
        table["full"].append(fwd(fulls[:m], 1, context))
        table["comp"].append(fwd(comps[:m], 1, context))
        kind = drafter.draft_kind(m)   # what the drafter's steps of m draft rows read
        if kind == "fp32":
            table["draft"].append(table["comp"][-1])
        else:
            if model.draft_weights != kind:
                model.quantize_drafts(kind)
            table["draft"].append(fwd(comps[:m], 1, context, draft=True))
        table["verify"].append(fwd(fulls[:m], rows_v, context))
    prefill = fwd(fulls, tail, context - tail, times=2)
    prefill_one = fwd(fulls[:1], tail, context - tail, times=2)   # a verifier's open alone
    prefill_tails = _interpolated([1, n], [prefill_one, prefill]) if n > 1 else (lambda m: prefill)
    prefill_comp = fwd(comps, tail, context, times=2)   # the tails after the stored compressed blocks
    return RemoteCosts(prefill=prefill, prefill_tails=prefill_tails, prefill_comp=prefill_comp, decode_full=_interpolated(sessions, table["full"]),
                       decode_comp=_interpolated(sessions, table["comp"]), draft=_interpolated(sessions, table["draft"]),
                       verify=_interpolated(sessions, table["verify"]))


def _costs(model: str, compressor: str, context: int, n: int, tail: int, k: float, threads: int, log) -> RemoteCosts:
    from vericache.compress.registry import parse_compressor
    from vericache.llm import LLM

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        costs = measure_remote_costs(LLM(model, device="cpu", dtype="float32"), parse_compressor(compressor),
                                     context, n, tail, k)
    finally:
        torch.set_num_threads(before)
    log(f"forwards at {context} positions, {threads} thread(s), {n} sessions: prefill of the tails "
        f"{costs.prefill:.2f} s (one alone {costs.prefill_tails(1):.2f}; over compressed caches {costs.prefill_comp:.2f}); decode full {costs.decode_full(n) * 1e3:.0f} ms, compressed "
        f"{costs.decode_comp(n) * 1e3:.0f}, draft {costs.draft(n) * 1e3:.0f} (1 session {costs.draft(1) * 1e3:.0f}); "
        f"verify {costs.verify(n) * 1e3:.0f} (1 session {costs.verify(1) * 1e3:.0f})")
    return costs


def add_predictions(rows: list[dict], model: str, compressor: str, measured: dict, n: int, prefix_tokens: int,
                    max_tokens: int, threads_per_device: int, cores: int, log=print) -> None:
    """Add predicted_ttft_s, predicted_e2e_s, ttft_over_predicted and e2e_over_predicted (also as
    measured_over_predicted, the name the other benches' rows use) to each
    full-remote, lossy-remote and vericache row (recompute is not modelled)."""
    from vericache.model.loader import load_model

    by = {r["mode"]: r for r in rows}
    loaded = load_model(model, device="cpu", dtype="float32")
    kv_pos = loaded.config.kv_bytes_per_position(loaded.kv_dtype.itemsize)
    vc = by.get("vericache", {})
    stored = max((max(r["prefix_tokens"], default=0) for r in rows), default=0) or prefix_tokens
    tails = [t for r in rows if max(r["prefix_tokens"], default=0) for t in r["tail_tokens"]]
    tail = round(sum(tails) / len(tails)) if tails else 1
    comp = next((r["drafter_fetch_bytes"] / n for r in (by.get("vericache"), by.get("lossy-remote"))
                 if r and r["drafter_fetch_bytes"]), stored * kv_pos / 8)
    slow, fast = measured["slow-store"], measured["fast"]
    store_gbps = vc.get("verifier_fetch_gbps") or fast["gbps"]
    k = vc.get("drafted_per_round", 1.0)
    setting = RemoteSetting(n, stored, tail, max_tokens, slow["gbps"] * 1e9 / 8, slow["rtt_ms"] / 1e3,
                            store_gbps * 1e9 / 8, stored * kv_pos, comp, kv_pos, vc.get("tokens_per_round", 1.0),
                            k, vc.get("sessions_per_verify", 0.0))
    context = stored + tail
    predicted = predict_remote(setting, _costs(model, compressor, context, n, tail, k, threads_per_device, log))
    if "full-remote-all" in by:
        every = _costs(model, compressor, context, n, tail, k, cores, log)
        predicted["full-remote-all"] = predict_remote(setting, every)["full-remote"]
    for mode, p in predicted.items():
        row = by.get(mode)
        if row is None:
            continue
        row["predicted_ttft_s"], row["predicted_e2e_s"] = round(p["ttft_s"], 3), round(p["e2e_s"], 3)
        row["e2e_over_predicted"] = round(row["e2e_s"] / p["e2e_s"], 2)
        row["measured_over_predicted"] = row["e2e_over_predicted"]   # the name every bench's rows use
        row["ttft_over_predicted"] = round(row["ttft_s"] / p["ttft_s"], 2)
