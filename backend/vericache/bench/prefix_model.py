"""``bench prefix``'s predicted rows: the step costs measured here after the runs (at the bench's
context, with each engine's thread count), the links as measured, the store's fetch rate and the
acceptance as the VeriCache run measured them, composed by ``sim.remote_prefix``."""

from __future__ import annotations

import torch

from vericache.sim.remote_prefix import RemoteSetting, predict_remote


def _costs(model: str, compressor: str, context: int, threads: int, log):
    """(step costs, the drafter's auto draft-weights matmul seconds) with ``threads`` threads."""
    from vericache.compress.registry import parse_compressor
    from vericache.engine.engine import Engine
    from vericache.llm import LLM
    from vericache.model.draft_weights import measured_choice
    from vericache.sim import roofline
    from vericache.sim.step_costs import measure_step_costs

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        llm = LLM(model, device="cpu", dtype="float32")
        roof = roofline.measure(llm, log)
        costs = measure_step_costs(llm, parse_compressor(compressor), context, roof.weights_s)
        eng = Engine(llm.loaded, mode="vericache", compressor=compressor, draft_weights="auto")
        eng.draft_kind(1)   # builds the quantized copies
        choice = measured_choice(eng.model)
    finally:
        torch.set_num_threads(before)
    log(f"step costs at {context} positions, {threads} thread(s): fixed {costs.c0 * 1e3:.1f} ms, per sequence full "
        f"{costs.full * 1e3:.1f} / draft {costs.draft * 1e3:.1f} / verify {costs.verify0 * 1e3:.1f} + "
        f"{costs.verify_row * 1e3:.2f} per row; weights {costs.weights(1) * 1e3:.0f} ms at 1 row")
    return costs, (lambda rows: choice.seconds_at("auto", rows))


def add_predictions(rows: list[dict], model: str, compressor: str, measured: dict, n: int, prefix_tokens: int,
                    max_tokens: int, threads_per_device: int, cores: int, log=print) -> None:
    """Add predicted_ttft_s, predicted_e2e_s and e2e_over_predicted to each full-remote, lossy-remote
    and vericache row (recompute is not modelled)."""
    from vericache.model.loader import load_model

    by = {r["mode"]: r for r in rows}
    cfg = load_model(model, device="cpu", dtype="float32")
    kv_pos = cfg.config.kv_bytes_per_position(cfg.kv_dtype.itemsize)
    vc = by.get("vericache", {})
    stored = max((max(r["prefix_tokens"], default=0) for r in rows), default=0) or prefix_tokens
    tail = max((sum(r["tail_tokens"]) / len(r["tail_tokens"]) for r in rows if r["tail_tokens"] and
                max(r["prefix_tokens"], default=0)), default=1)
    comp = next((r["drafter_fetch_bytes"] / n for r in (by.get("vericache"), by.get("lossy-remote"))
                 if r and r["drafter_fetch_bytes"]), stored * kv_pos / 8)
    slow, fast = measured["slow-store"], measured["fast"]
    store_gbps = vc.get("verifier_fetch_gbps") or fast["gbps"]
    setting = RemoteSetting(n, stored, round(tail), max_tokens, slow["gbps"] * 1e9 / 8, slow["rtt_ms"] / 1e3,
                            store_gbps * 1e9 / 8, stored * kv_pos, comp, kv_pos, vc.get("tokens_per_round", 1.0),
                            vc.get("drafted_per_round", 1.0))
    context = stored + round(tail)
    per_device, draft_w = _costs(model, compressor, context, threads_per_device, log)
    predicted = predict_remote(setting, per_device, draft_weights=draft_w)
    if "full-remote-all" in by:
        every, _ = _costs(model, compressor, context, cores, log)
        predicted["full-remote-all"] = predict_remote(setting, every)["full-remote"]
    for mode, p in predicted.items():
        row = by.get(mode)
        if row is None:
            continue
        row["predicted_ttft_s"], row["predicted_e2e_s"] = round(p["ttft_s"], 3), round(p["e2e_s"], 3)
        row["e2e_over_predicted"] = round(row["e2e_s"] / p["e2e_s"], 2)
        row["ttft_over_predicted"] = round(row["ttft_s"] / p["ttft_s"], 2)
