"""``vericache bench throughput``: full KV under a device budget vs lossy vs VeriCache (naive,
staggered, grouped) on the same requests, in one process and one run, with a timeline of link and compute.

On CPU the link is the emulated one (``kv.link.EmulatedLink``): a copier thread moves the real
bytes at the configured bandwidth, so every link figure from this command on CPU is *emulated*.
"""

from __future__ import annotations

from pathlib import Path

import torch

from vericache.engine.engine import Engine
from vericache.kv.link import CudaLink, EmulatedLink
from vericache.llm import LLM
from vericache.sampling import SamplingParams
from vericache_lab.bench.batch import decode_all, distinct_prompts
from vericache_lab.bench.common import shared_prefills
from vericache_lab.predict import predict_offloaded
from vericache_lab.sim.calibrate import default_path, load

MODES = ("full", "lossy", "vericache-naive", "vericache-staggered", "vericache-grouped")


def run_throughput(model: str, n_requests: int, context: int, max_tokens: int, device_budget: float,
                   link_gbps: float, compressor: str, device: str | None = None, modes=MODES,
                   resident_layers: int = 0, dtype: str | None = None, calibration: str | None = None,
                   log=print, kv_dtype: str | None = None) -> dict:
    """The modes side by side on the same requests, decode only (each prompt is prefilled once and
    shared). ``device_budget``: bytes of KV the device may hold (> 1) or a fraction (<= 1) of all
    requests' full KV. ``resident_layers`` > 0 adds vericache-resident (staggered, with that many
    layers of every request's full KV kept on the device)."""
    # Long: one bench run read top to bottom (setup, each mode on the same prefills side by side, the
    # ratios); the modes share the prompts, prefills and reference outputs, which splitting would pass around.
    llm = LLM(model, device=device, dtype=dtype, kv_dtype=kv_dtype)
    prompts = distinct_prompts(llm.tokenizer, n_requests, context)
    per_pos = llm.loaded.config.kv_bytes_per_position(llm.loaded.kv_dtype.itemsize)
    all_full = n_requests * (context + max_tokens + 1) * per_pos
    budget = int(device_budget * all_full) if device_budget <= 1 else int(device_budget)
    cuda = llm.loaded.device.type == "cuda"
    log(f"{n_requests} requests x {context} tokens, {max_tokens} new each; full KV of all: {all_full / 1e9:.2f} GB; "
        f"device budget {budget / 1e9:.2f} GB; link {link_gbps} Gbit/s ({'real PCIe' if cuda else 'emulated'})")
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    base = Engine(llm.loaded, mode="full", compressor=compressor, device_budget_gb=None)
    prefills = shared_prefills(base, prompts, params, log)
    cal_path = calibration or default_path(llm.loaded.name, str(llm.loaded.dtype).removeprefix("torch."))
    cal = load(Path(cal_path)) if not cuda else None
    if cal is None and not cuda:
        log(f"no calibration at {cal_path}: run `vericache sim --calibrate` for predicted_tokens_per_s")
    rows, timelines, reference = [], {}, None
    if resident_layers:
        modes = tuple(modes) + ("vericache-resident",)
    for mode in modes:
        engine_mode, scheduler = (mode.split("-") + ["staggered"])[:2]
        resident = resident_layers if scheduler == "resident" else 0
        scheduler = "staggered" if scheduler == "resident" else scheduler
        link = None
        if engine_mode == "vericache":
            link = CudaLink(llm.loaded.device) if cuda else EmulatedLink(link_gbps)
        # the paper's long-context scenario: the full KV tiered behind the link, the device budget binding
        engine = Engine(llm.loaded, mode=engine_mode, compressor=compressor, draft_weights="fp32", link=link,
                        tiered=True, device_budget_gb=budget / (1 << 30), scheduler=scheduler, resident_layers=resident)
        seqs = [engine.new_sequence(i, p, params) for i, p in enumerate(prompts)]
        try:
            res = decode_all(engine, seqs, None, prefills, log, mode, from_first_tokens=False)
        except ValueError as exc:  # e.g. one request's verification buffer exceeds the budget
            rows.append({"mode": mode, "tokens_per_s": 0.0, "error": str(exc)})
            log(f"{mode}: cannot run: {exc}")
            continue
        if cuda:
            torch.cuda.synchronize()
        outs = [s.output_ids for s in seqs]
        reference = outs if mode == "full" else reference
        row = mode_row(mode, res, seqs, engine, link, outs == reference if reference is not None else None)
        if cal is not None and not resident:
            comp = engine.defaults.compressor
            kept = comp.nominal_ratio(llm.loaded.kv_dtype.itemsize) if comp.evicts else 1.0
            rounds, drafted = row["rounds"], sum(s.stats.get("drafted_tokens", 0) for s in seqs)
            row["predicted_tokens_per_s"] = round(predict_offloaded(
                cal.step_costs, mode, n_requests, context + max_tokens // 2, cal.kv_bytes_per_position, budget,
                link_gbps * 1e9 / 8 * cal.link_efficiency, kept, comp.window,
                row["mean_acceptance_length"] or 1.0, drafted / rounds if rounds else 0.0), 2)
            row["measured_over_predicted"] = round(row["tokens_per_s"] / row["predicted_tokens_per_s"], 2)
        rows.append(row)
        log(f"{mode}: {row['tokens_per_s']} tok/s (model {row.get('predicted_tokens_per_s', '-')}), "
            f"identical={row['identical_to_full']}, link {row['link_utilization']:.0%}, "
            f"compute {row['compute_utilization']:.0%}")
        intervals = engine.instruments.intervals
        t_start = intervals[0][0] if intervals else 0.0
        timelines[mode] = (t_start, intervals, list(link.stats.intervals) if link is not None else [])
        if link is not None:
            link.close()
    add_ratios(rows)
    return {"rows": rows, "timelines": timelines, "link": "pcie" if cuda else "emulated",
            "device_budget_bytes": budget, "calibration": str(cal_path) if cal is not None else None}


def add_ratios(rows: list[dict]) -> None:
    """x_full (every row) and x_naive (vericache rows): tokens/s over those modes' in the same run."""
    by_mode = {r["mode"]: r["tokens_per_s"] for r in rows}
    for r in rows:
        r["x_full"] = round(r["tokens_per_s"] / by_mode["full"], 2) if by_mode.get("full") else None
        if by_mode.get("vericache-naive") and r["mode"].startswith("vericache"):
            r["x_naive"] = round(r["tokens_per_s"] / by_mode["vericache-naive"], 2)


def mode_row(mode: str, res: dict, seqs: list, engine: Engine, link, identical: bool | None) -> dict:
    """One mode's figures from its decode run (``decode_all``'s result) and its engine's instruments."""
    instruments = engine.instruments
    wall, outs = res["decode_s"], [s.output_ids for s in seqs]
    decoded = sum(len(o) - 1 for o in outs)
    rounds = sum(s.stats.get("rounds", 0) for s in seqs)
    link_busy = link.stats.busy_s if link is not None else 0.0
    vericache = mode.startswith("vericache")
    return {"mode": mode, "tokens_per_s": round(res["decoded"] / wall, 2), "wall_s": round(wall, 2),
            "identical_to_full": identical,
            "link_utilization": round(link_busy / wall, 3),
            "compute_utilization": round(instruments.busy_s() / wall, 3),
            "link_bytes": link.stats.bytes_moved if link is not None else 0,
            "mean_acceptance_length": round(decoded / rounds, 2) if rounds else None,
            "mean_groups": round(engine.stats()["mean_groups"], 2) if mode.endswith("-grouped") else None,
            "early_verifies": instruments.early_verifies if vericache else None,
            "preemptions": instruments.preemptions, "rounds": rounds,
            "kv_resident_bytes": res["kv_resident_bytes"]}


def plot_timeline(timelines: dict, path: str, link_kind: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"prefill": "tab:gray", "decode": "tab:blue", "draft": "tab:green", "verify": "tab:red"}
    # a step packs several kinds of rows: it is drawn in the colour of its costliest kind
    main = lambda kinds: next((k for k in ("verify", "prefill", "decode", "draft") if k in kinds), "prefill")  # noqa: E731
    fig, axes = plt.subplots(len(timelines), 1, figsize=(10, 1.3 * len(timelines) + 0.8), squeeze=False)
    for ax, (mode, (t0, compute, link)) in zip(axes[:, 0], timelines.items()):
        for kind in colors:
            spans = [(s - t0, e - s) for s, e, k in compute if main(k) == kind]
            if spans:
                ax.broken_barh(spans, (10, 8), color=colors[kind], label=kind)
        if link:
            ax.broken_barh([(s - t0, e - s) for s, e in link], (0, 8), color="tab:orange", label=f"link ({link_kind})")
        ax.set_yticks([4, 14], ["link", "compute"])
        ax.set_title(mode, fontsize=9, loc="left")
        ax.legend(fontsize=6, loc="upper right", ncol=5)
    axes[-1, 0].set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
