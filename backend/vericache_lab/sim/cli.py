"""``vericache sim``: the cost model's table and plot."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from vericache.cli_args import ints, progress
from vericache_lab.sim.cost_model import (
    GPUS,
    MODELS,
    PCIE,
    SimConfig,
    explain,
    gpus_needed,
    simulate,
    tensor_parallel,
)


def sim_config(gpu: str, link: str, model: str, context: int, n_gpus: int = 0, **kw) -> SimConfig:
    n = n_gpus or gpus_needed(GPUS[gpu], MODELS[model])
    return SimConfig(tensor_parallel(GPUS[gpu], n), MODELS[model], PCIE[link] * n, context, **kw)


def run_sim(gpu: str, link: str, models: list[str], contexts: list[int], ratio: float, acceptance: float,
            draft_len: int, n_gpus: int = 0) -> list[dict]:
    rows = []
    for m in models:
        for ctx in contexts:
            cfg = sim_config(gpu, link, m, ctx, n_gpus, ratio=ratio, acceptance_length=acceptance, draft_len=draft_len)
            for mode, r in simulate(cfg).items():
                rows.append({"gpus": cfg.gpu.name, "link": link, "model": m, "context": ctx, "mode": mode, **r})
    return rows


def plot_sim(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(4.5 * len(models), 4), squeeze=False)
    for ax, m in zip(axes[0], models):
        for mode in dict.fromkeys(r["mode"] for r in rows):
            pts = [(r["context"], r["tokens_per_s"]) for r in rows if r["model"] == m and r["mode"] == mode]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=mode)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(m)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("modelled tokens/s (max batch)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def add_sim_parser(sub) -> None:

    p = sub.add_parser("sim", help="cost model: full / lossy / vericache-naive / -staggered / -resident on a GPU with "
                                   "PCIe; `sim remote`: remote prefix caching with D drafters, V verifiers, S store shards")
    p.add_argument("scenario", nargs="?", default="offload", choices=["offload", "remote"],
                   help="offload (default): one GPU's host tier; remote: the prefix-caching scenario at cluster scale")
    r = p.add_argument_group("sim remote")
    r.add_argument("--drafters", type=ints, default=[1, 2, 4, 8, 16, 32, 64])
    r.add_argument("--verifiers", type=ints, default=[1, 2, 4, 8])
    r.add_argument("--shards", type=ints, default=[1, 4, 16])
    r.add_argument("--requests-per-drafter", type=int, default=8)
    r.add_argument("--prefix-tokens", type=int, default=32768, help="each request's stored prefix")
    r.add_argument("--shard-gbps", type=float, default=10.0, help="one store shard's reply rate (one Redis thread)")
    r.add_argument("--fast-gbps", type=float, default=100.0, help="a verifier's link to the store")
    r.add_argument("--slow-gbps", type=float, default=10.0, help="a drafter's link")
    p.add_argument("--gpu", default="h100", choices=sorted(GPUS))
    p.add_argument("--link", default="gen5", choices=sorted(PCIE))
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated: {', '.join(MODELS)}")
    p.add_argument("--context", type=ints, default=[8192, 32768, 131072])
    p.add_argument("--ratio", type=float, default=0.125, help="compressed / full KV bytes")
    p.add_argument("--acceptance-length", type=float, default=24.0, help="tokens per verification round")
    p.add_argument("--draft-len", type=int, default=32)
    p.add_argument("--gpus", type=int, default=0, help="tensor-parallel GPUs (0: fewest that hold the weights)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--plot", default=None)
    p.add_argument("--record", default=None, help="append the table and the command to this markdown file")
    p.add_argument("--remote-prefix", action="store_true",
                   help="the remote prefix-caching scenario on H100/H200 (24B-70B models, 10/25 Gbit/s slow links, "
                        "NVLink or PCIe Gen5 to the store): TTFT and end-to-end vs full-remote; the prefix is the "
                        "last --context")
    p.add_argument("--calibrate", action="store_true",
                   help="measure this machine's rates (weight step, attention bandwidth and compute, link) with "
                        "--calib-model and store them for `bench throughput`'s predicted_tokens_per_s")
    p.add_argument("--calib-model", default=None, help="model to calibrate with (default: the default model)")
    p.add_argument("--calib-dtype", default=None, help="weights dtype to calibrate (float32 or bfloat16)")
    p.add_argument("--calib-out", default=None, help="where to store the calibration (default: the cache dir)")
    p.set_defaults(func=_cmd_sim)


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from vericache.model.registry import DEFAULT_MODEL
    from vericache_lab.sim.calibrate import calibrate, default_path, save

    model = args.calib_model or DEFAULT_MODEL
    dtype = args.calib_dtype or "float32"
    cal = calibrate(model, dtype, log=progress(args))
    path = Path(args.calib_out) if args.calib_out else default_path(model, dtype)
    save(cal, path)
    print(json.dumps({**asdict(cal), "path": str(path)}) if args.json else f"stored in {path}")
    return 0


def _cmd_remote_prefix(args: argparse.Namespace) -> int:
    """The paper's remote prefix-caching setting, predicted (``sim.remote_prefix.paper_table``)."""
    from vericache_lab.report import markdown_table, record
    from vericache_lab.sim.remote_prefix import paper_table

    if not 0 < args.ratio <= 1:
        raise ValueError(f"--ratio must be in (0, 1], got {args.ratio}")
    rows = paper_table(prefix=args.context[-1], tokens_per_round=args.acceptance_length, drafted=args.draft_len,
                       comp_ratio=args.ratio)
    if args.json:
        print(json.dumps({"rows": rows}))
        return 0
    table = markdown_table(rows, list(rows[0]))
    note = (f"8 requests x {args.context[-1]}-token stored prefixes + 256-token tails, 256 new tokens each; "
            f"{args.acceptance_length:g} tokens per round from {args.draft_len} drafted; slow link RTT 20 ms; "
            f"compressed KV {args.ratio:g} of the full bytes. Modelled, not measured.")
    print(table + "\n\n" + note)
    record(args.record, "Remote prefix caching, the paper's setting (modelled, not measured)", table + "\n\n" + note,
           args.argv)
    return 0


def _cmd_remote_cluster(args: argparse.Namespace) -> int:
    """``vericache sim remote``: the prefix-caching scenario at cluster scale (``sim.remote_cluster``), on
    --gpu with the first of --models (default llama3-70b), --prefix-tokens a request."""
    from vericache_lab.report import markdown_table, record
    from vericache_lab.sim.remote_cluster import plot_cluster, sweep
    from vericache_lab.sim.remote_prefix import MODELS_24_70, RemoteSetting, costs_from_steps, gpu_costs

    shapes = {**MODELS, **MODELS_24_70}
    name = args.models.split(",")[0] if args.models != ",".join(MODELS) else "llama3-70b"
    if name not in shapes:
        raise ValueError(f"unknown model shape {name!r}; available: {', '.join(shapes)}")
    for flag in ("shard_gbps", "fast_gbps", "slow_gbps", "requests_per_drafter", "prefix_tokens"):
        if getattr(args, flag) <= 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be > 0, got {getattr(args, flag)}")
    model, prefix, tail, n = shapes[name], args.prefix_tokens, 256, args.requests_per_drafter
    costs = gpu_costs(GPUS[args.gpu], model, prefix + tail, comp_ratio=args.ratio)
    full = prefix * model.kv_bytes_per_token
    s = RemoteSetting(n, prefix, tail, 256, args.slow_gbps * 1e9 / 8, 0.02, args.fast_gbps * 1e9 / 8, full,
                      args.ratio * full, model.kv_bytes_per_token, args.acceptance_length, args.draft_len)
    rows = sweep(s, args.shard_gbps * 1e9 / 8, args.fast_gbps * 1e9 / 8, costs_from_steps(costs, n, tail, args.draft_len),
                 lambda sessions: costs_from_steps(costs, sessions, tail, args.draft_len),
                 args.drafters, args.verifiers, args.shards)
    title = (f"{name} on {args.gpu}, {prefix}-token prefixes, {n} requests a drafter; links: slow {args.slow_gbps:g}, "
             f"fast {args.fast_gbps:g}, a shard {args.shard_gbps:g} Gbit/s (modelled, not measured)")
    if args.plot:
        plot_cluster(rows, args.plot, title)
    if args.json:
        print(json.dumps({"rows": rows}))
        return 0
    table = markdown_table(rows, ["drafters", "verifiers", "shards", "mode", "ttft_s", "e2e_s", "tokens_per_s",
                                  "ttft_limit", "decode_limit"])
    print(table + "\n\n" + title)
    record(args.record, "Remote prefix caching at cluster scale (modelled, not measured)", table + "\n\n" + title,
           args.argv)
    return 0


def _cmd_sim(args: argparse.Namespace) -> int:
    from vericache_lab.report import markdown_table

    if args.calibrate:
        return _cmd_calibrate(args)
    if args.remote_prefix:
        return _cmd_remote_prefix(args)
    if args.scenario == "remote":
        return _cmd_remote_cluster(args)
    models = [m for m in args.models.split(",") if m]
    bad = [m for m in models if m not in MODELS]
    if bad:
        raise ValueError(f"unknown model shapes {bad}; available: {', '.join(MODELS)}")
    if not 0 < args.ratio <= 1:
        raise ValueError(f"--ratio must be in (0, 1], got {args.ratio}")
    rows = run_sim(args.gpu, args.link, models, args.context, args.ratio, args.acceptance_length, args.draft_len,
                   args.gpus)
    if args.plot:
        plot_sim(rows, args.plot)
    if args.json:
        print(json.dumps({"rows": rows}))
        return 0
    from vericache_lab.report import record

    table = markdown_table(rows, ["model", "gpus", "context", "mode", "batch", "tokens_per_s", "x_full",
                                  "link_utilization", "resident_fraction"])
    notes = [explain(sim_config(args.gpu, args.link, m, args.context[-1], args.gpus, ratio=args.ratio,
                                acceptance_length=args.acceptance_length, draft_len=args.draft_len)) for m in models]
    print(table + "\n\n" + "\n\n".join(notes))
    plot_md = f"\n\n![sim]({Path(args.plot).name})" if args.plot else ""
    record(args.record, f"Cost model ({args.gpu}, PCIe {args.link}; modelled, not measured)",
           table + "\n\n" + "\n\n".join(notes) + plot_md, args.argv)
    return 0
