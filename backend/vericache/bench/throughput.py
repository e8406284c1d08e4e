"""``vericache bench throughput``: full KV under a device budget vs lossy vs VeriCache (naive,
staggered, grouped) on the same requests, in one process and one run, with a timeline of link and compute.

On CPU the link is the emulated one (``kv.link.EmulatedLink``): a copier thread moves the real
bytes at the configured bandwidth, so every link figure from this command on CPU is *emulated*.
"""

from __future__ import annotations

import time

import torch

from vericache.bench.common import code_prompt
from vericache.engine.engine import Engine
from vericache.engine.serving import ServingEngine
from vericache.kv.link import CudaLink, EmulatedLink
from vericache.llm import LLM
from vericache.sampling import SamplingParams

MODES = ("full", "lossy", "vericache-naive", "vericache-staggered", "vericache-grouped")


def run_throughput(model: str, n_requests: int, context: int, max_tokens: int, device_budget: float,
                   link_gbps: float, compressor: str, device: str | None = None, modes=MODES,
                   resident_layers: int = 0, log=print) -> dict:
    """The modes side by side on the same requests; ``resident_layers`` > 0 adds vericache-resident
    (staggered, with that many layers of every request's full KV kept on the device)."""
    llm = LLM(model, device=device, dtype="float32" if device in (None, "cpu") else None)
    ids = code_prompt(llm.tokenizer, context * n_requests + n_requests)
    prompts = [ids[i * context : (i + 1) * context] for i in range(n_requests)]
    per_pos = llm.loaded.config.kv_bytes_per_position(llm.loaded.dtype.itemsize)
    all_full = n_requests * (context + max_tokens + 1) * per_pos
    budget = int(device_budget * all_full) if device_budget <= 1 else int(device_budget)
    log(f"{n_requests} requests x {context} tokens, {max_tokens} new each; full KV of all: {all_full / 1e6:.1f} MB; "
        f"device budget {budget / 1e6:.1f} MB; link {link_gbps} Gbit/s "
        f"({'emulated' if llm.loaded.device.type == 'cpu' else 'real PCIe'})")
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    rows, timelines, reference = [], {}, None
    if resident_layers:
        modes = tuple(modes) + ("vericache-resident",)
    for mode in modes:
        engine_mode, scheduler = (mode.split("-") + ["staggered"])[:2]
        resident = resident_layers if scheduler == "resident" else 0
        scheduler = "staggered" if scheduler == "resident" else scheduler
        link = None
        if engine_mode == "vericache":
            link = CudaLink(llm.loaded.device) if llm.loaded.device.type == "cuda" else EmulatedLink(link_gbps)
        srv = ServingEngine(Engine(llm.loaded, mode=engine_mode, compressor=compressor), device_budget=budget,
                            scheduler=scheduler, link=link, resident_layers=resident)
        try:
            rids = [srv.add_request(p, params) for p in prompts]
        except ValueError as exc:  # e.g. one request's verification buffer exceeds the budget
            rows.append({"mode": mode, "tokens_per_s": 0.0, "error": str(exc)})
            log(f"{mode}: cannot run: {exc}")
            continue
        t0 = time.perf_counter()
        last_log = t0
        while srv.has_unfinished():
            srv.step()
            if time.perf_counter() - last_log > 10:
                done = sum(len(srv.requests[r].seq.output_ids) for r in rids)
                log(f"  {mode}: {done}/{n_requests * max_tokens} tokens after {time.perf_counter() - t0:.0f} s")
                last_log = time.perf_counter()
        if llm.loaded.device.type == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        outs = [srv.requests[r].seq.output_ids for r in rids]
        if mode == "full":
            reference = outs
        tokens = sum(len(o) for o in outs)
        link_busy = link.stats.busy_s if link is not None else 0.0
        row = {"mode": mode, "tokens_per_s": round(tokens / wall, 2), "wall_s": round(wall, 2),
               "identical_to_full": outs == reference if reference is not None else None,
               "link_utilization": round(link_busy / wall, 3),
               "compute_utilization": round(srv.activity.busy_s() / wall, 3),
               "link_bytes": link.stats.bytes_moved if link is not None else 0,
               "mean_acceptance_length": _mean_acceptance(srv) if engine_mode == "vericache" else None,
               "mean_groups": round(srv.mean_groups, 2) if scheduler == "grouped" else None,
               "early_verifies": srv.early_verifies if engine_mode == "vericache" else None,
               "rounds": sum(srv.requests[r].rounds for r in rids)}
        rows.append(row)
        log(f"{mode}: {row['tokens_per_s']} tok/s, identical={row['identical_to_full']}, "
            f"link {row['link_utilization']:.0%}, compute {row['compute_utilization']:.0%}")
        timelines[mode] = (t0, srv.activity.intervals, list(link.stats.intervals) if link is not None else [])
        if link is not None:
            link.close()
    full_tps = rows[0]["tokens_per_s"] if rows and rows[0]["mode"] == "full" else None
    for r in rows:
        r["x_full"] = round(r["tokens_per_s"] / full_tps, 2) if full_tps else None
    return {"rows": rows, "timelines": timelines, "link": "emulated" if llm.loaded.device.type == "cpu" else "pcie"}


def _mean_acceptance(srv: ServingEngine) -> float:
    reqs = list(srv.requests.values())
    rounds = sum(r.rounds for r in reqs)
    return round(sum(r.accepted + r.rounds for r in reqs) / rounds, 2) if rounds else 0.0


def plot_timeline(timelines: dict, path: str, link_kind: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"prefill": "tab:gray", "decode": "tab:blue", "draft": "tab:green", "verify": "tab:red"}
    fig, axes = plt.subplots(len(timelines), 1, figsize=(10, 1.3 * len(timelines) + 0.8), squeeze=False)
    for ax, (mode, (t0, compute, link)) in zip(axes[:, 0], timelines.items()):
        for kind in colors:
            spans = [(s - t0, e - s) for s, e, k in compute if k == kind]
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
