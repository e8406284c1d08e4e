"""Argument parsing for ``vericache bench ...``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from vericache.cli_args import add_kv_dtype_arg, add_numerics_arg, draft_len, ints, progress
from vericache.engine.config import DEFAULTS
from vericache.model.registry import DEFAULT_MODEL
from vericache_lab.bench.common import mode_labels


def _cmd_decode(args: argparse.Namespace) -> int:
    import torch

    from vericache_lab.bench.decode import decode_markdown, plot_decode, run_decode_bench
    from vericache_lab.report import record
    from vericache_lab.sim.roofline import Roofline, plot_roofline

    if args.threads:
        torch.set_num_threads(args.threads)
    modes = mode_labels(args.modes)
    res = run_decode_bench(args.model, args.context, args.max_tokens, modes, args.compressor, args.draft_len,
                           with_transformers=not args.no_transformers, dtype=args.dtype, kv_dtype=args.kv_dtype, log=progress(args),
                           llamacpp=not args.no_llamacpp, numerics=args.numerics, openvino=not args.no_openvino,
                           repeats=args.repeat)
    runs = res.pop("step_records")
    title = f"Decode: {', '.join(modes)} (CPU, weights {args.dtype}, batch 1, {torch.get_num_threads()} threads)"
    if args.plot:
        plot_decode(res["rows"], args.plot)
    if args.roofline_plot and res["roofline"]:
        plot_roofline(runs, Roofline(**res["roofline"]), args.roofline_plot, f"{title}\n{res['cpu']}")
    print(json.dumps(res) if args.json else decode_markdown(res))
    plots = "".join(f"\n\n![{name}]({Path(p).name})" for name, p in (("decode", args.plot), ("roofline", args.roofline_plot)) if p)
    record(args.record, title, decode_markdown(res) + plots, args.argv)
    return 0


def _add_decode(bsub) -> None:
    b = bsub.add_parser("decode", help="decode tokens/s of full / lossy / vericache (and transformers generate)")
    b.add_argument("--model", default=DEFAULT_MODEL)
    b.add_argument("--modes", default="full",
                   help="comma-separated: full,lossy,vericache; a label mode[+weights][+vocab=N][@compressor] runs one "
                         "variant, e.g. vericache+int8 (drafts on int8 weights), vericache+vocab=0 (drafts over the "
                         "whole vocabulary) or vericache+auto@kivi:bits=2")
    b.add_argument("--compressor", default=DEFAULTS.compressor)
    b.add_argument("--draft-len", default=DEFAULTS.draft_len, type=draft_len)
    b.add_argument("--context", type=ints, default=[1024, 4096, 16384])
    b.add_argument("--max-tokens", type=int, default=128)
    b.add_argument("--threads", type=int, default=0)
    b.add_argument("--repeat", type=int, default=1,
                   help="run the modes this many times, alternating; each row is its mode's median run, its ratio "
                        "to full the median of each repeat's")
    b.add_argument("--no-transformers", action="store_true", help="skip the Hugging Face generate baseline")
    b.add_argument("--no-llamacpp", action="store_true", help="skip the llama.cpp row (it runs where llama_cpp imports)")
    b.add_argument("--no-openvino", action="store_true",
                   help="skip the OpenVINO GenAI rows (they run where openvino_genai imports: pip install -e '.[openvino]')")
    b.add_argument("--dtype", default="float32", help="weights: float32 or bfloat16 (attention stays fp32)")
    add_numerics_arg(b)
    add_kv_dtype_arg(b)
    b.add_argument("--json", action="store_true")
    b.add_argument("--plot", default=None, help="write a PNG bar chart here")
    b.add_argument("--roofline-plot", default=None, help="PNG: every decode step's time against its roofline")
    b.add_argument("--record", default=None, help="append the figures and the command to this markdown file")
    b.set_defaults(func=_cmd_decode)


def _cmd_throughput(args: argparse.Namespace) -> int:
    import torch

    from vericache_lab.bench.throughput import plot_timeline, run_throughput
    from vericache_lab.report import markdown_table, record

    if args.threads:
        torch.set_num_threads(args.threads)
    from vericache_lab.bench.throughput import MODES

    budget = args.device_budget_gb * 1e9 if args.device_budget_gb is not None else args.device_budget
    modes = mode_labels(args.modes)
    if not modes or set(modes) - set(MODES):
        raise ValueError(f"--modes must be among {', '.join(MODES)}, got {args.modes!r}")
    res = run_throughput(args.model, args.requests, args.context, args.max_tokens, budget,
                         args.link_gbps, args.compressor, device=args.device, modes=modes,
                         resident_layers=args.resident_layers,
                         dtype=args.dtype, calibration=args.calibration, log=progress(args), kv_dtype=args.kv_dtype)
    if args.plot:
        plot_timeline(res["timelines"], args.plot, res["link"])
    cols = ["mode", "tokens_per_s", "predicted_tokens_per_s", "measured_over_predicted", "x_full", "x_naive",
            "identical_to_full", "link_utilization", "compute_utilization", "mean_acceptance_length", "link_bytes",
            "preemptions", "early_verifies", "mean_groups", "wall_s"]
    table = markdown_table(res["rows"], cols)
    print(json.dumps({k: v for k, v in res.items() if k != "timelines"}) if args.json else table)
    plot_md = f"\n\n![timeline]({Path(args.plot).name})" if args.plot else ""
    record(args.record, f"Throughput under a device budget (link: {res['link']})", table + plot_md, args.argv)
    return 0


def _add_throughput(bsub) -> None:
    t = bsub.add_parser("throughput", help="full under a budget vs lossy vs vericache naive/staggered/grouped")
    t.add_argument("--model", default=DEFAULT_MODEL)
    t.add_argument("--requests", type=int, default=12)
    t.add_argument("--context", type=int, default=4096)
    t.add_argument("--max-tokens", type=int, default=64)
    t.add_argument("--device-budget", type=float, default=0.25,
                   help="device KV budget: a fraction (<= 1) of all requests' full KV, or bytes")
    t.add_argument("--device-budget-gb", type=float, default=None,
                   help="device KV budget in GB (overrides --device-budget)")
    t.add_argument("--link-gbps", type=float, default=4.0, help="emulated link bandwidth on CPU (Gbit/s)")
    t.add_argument("--dtype", default=None, help="weights: float32 (CPU default) or bfloat16")
    add_kv_dtype_arg(t)
    t.add_argument("--calibration", default=None,
                   help="calibration file from `vericache sim --calibrate` (default: the cache dir's)")
    t.add_argument("--compressor", default=DEFAULTS.compressor)
    t.add_argument("--modes", default="full,lossy,vericache-naive,vericache-staggered,vericache-grouped",
                   help="comma-separated, among full, lossy, vericache-naive, vericache-staggered, vericache-grouped")
    t.add_argument("--resident-layers", type=int, default=0,
                   help="also run vericache-resident: staggered with this many layers of each full KV kept on the device")
    t.add_argument("--device", default=None)
    t.add_argument("--threads", type=int, default=0)
    t.add_argument("--json", action="store_true")
    t.add_argument("--plot", default=None, help="timeline PNG of link and compute per mode")
    t.add_argument("--record", default=None)
    t.set_defaults(func=_cmd_throughput)


def _cmd_prefix(args) -> int:
    from vericache_lab.bench.prefix import prefix_markdown, run_prefix_bench
    from vericache_lab.bench.prefix_timeline import plot_prefix
    from vericache_lab.netlab import Shape
    from vericache_lab.report import record

    try:
        res = run_prefix_bench(args.model, args.prefix_tokens, args.requests, args.max_tokens,
                               Shape(args.slow_gbps, args.rtt_ms, args.fast_gbps), args.compressor,
                               mode_labels(args.modes), args.draft_dtype, args.threads_per_device,
                               not args.no_predict, args.store.split(","), log=progress(args))
    except RuntimeError as exc:  # no namespaces, no redis-server, a failed run: say so, exit non-zero
        import sys
        print(f"vericache bench prefix: error: {exc}", file=sys.stderr)
        return 1
    if args.plot:
        plot_prefix(res, args.plot)
    print(json.dumps(res) if args.json else prefix_markdown(res))
    record(args.record, "Remote prefix caching", prefix_markdown(res)
           + (f"\n\n![prefix timeline]({Path(args.plot).name})" if args.plot else ""), args.argv)
    return 0


def _add_prefix(bsub) -> None:
    px = bsub.add_parser("prefix", help="remote prefix caching on a shaped network (root): recompute, "
                         "full-remote (per-device threads and all threads), lossy-remote, vericache")
    px.add_argument("--model", default=DEFAULT_MODEL)
    px.add_argument("--prefix-tokens", type=int, default=6000)
    px.add_argument("--requests", type=int, default=4)
    px.add_argument("--max-tokens", type=int, default=64)
    px.add_argument("--slow-gbps", type=float, default=1.0)
    px.add_argument("--rtt-ms", type=float, default=20.0)
    px.add_argument("--fast-gbps", type=float, default=25.0)
    px.add_argument("--compressor", default=DEFAULTS.compressor)
    px.add_argument("--modes", default="recompute,full-remote,full-remote-all,lossy-remote,vericache")
    px.add_argument("--threads-per-device", type=int, default=1,
                    help="threads of each engine (full-remote's, the drafter, the verifier): one device each; "
                         "full-remote-all gets every core")
    px.add_argument("--store", default="redis",
                    help="comma-separated, run in turn: redis (one server), cluster (a 3-master Redis Cluster, "
                         "each node behind its own relay on the drafter's slow link)")
    px.add_argument("--no-predict", action="store_true", help="skip the cost model's rows (measuring its step costs)")
    px.add_argument("--draft-dtype", default="float32", help="the drafter's weights (lossy-remote, vericache)")
    px.add_argument("--json", action="store_true")
    px.add_argument("--plot", default=None, help="write the timeline PNG here")
    px.add_argument("--record", default=None)
    px.set_defaults(func=_cmd_prefix)


def _cmd_attention(args) -> int:
    import torch

    from vericache_lab.bench.attention import attention_markdown, plot_attention, run_attention
    from vericache_lab.report import record

    if args.threads:
        torch.set_num_threads(args.threads)
    res = run_attention(args.model, args.context, [c for c in args.compressors.split(",") if c], args.repeats,
                        args.dtype, args.device, log=progress(args), kv_dtype=args.kv_dtype)
    print(json.dumps(res, indent=None if args.json else 2))
    if args.plot:
        plot_attention(res, args.plot)
    record(args.record, "Attention over compressed KV", attention_markdown(res)
           + (f"\n\n![attention]({Path(args.plot).name})" if args.plot else ""), args.argv)
    return 0


def _add_attention(bsub) -> None:
    at = bsub.add_parser("attention", help="per compressor: KV bytes a draft step reads, attention time, GB/s")
    at.add_argument("--model", default=DEFAULT_MODEL)
    at.add_argument("--context", type=int, default=8000)
    at.add_argument("--compressors", default="snapkv:ratio=0.125,kivi:bits=2,kivi:bits=4,int4,int8,fp8,"
                    "snapkv:ratio=0.125+kivi:bits=2", help="comma-separated compressor specs")
    at.add_argument("--repeats", type=int, default=10)
    at.add_argument("--dtype", default=None, help="weights: float32 (CPU default) or bfloat16")
    add_kv_dtype_arg(at)
    at.add_argument("--device", default=None)
    at.add_argument("--threads", type=int, default=0)
    at.add_argument("--json", action="store_true")
    at.add_argument("--plot", default=None, help="write a PNG here")
    at.add_argument("--record", default=None)
    at.set_defaults(func=_cmd_attention)


def _cmd_linear(args) -> int:
    import torch

    from vericache_lab.bench.linear import linear_markdown, plot_linear, run_linear
    from vericache_lab.report import record

    if args.threads:
        torch.set_num_threads(args.threads)
    isas = [i for i in args.isas.split(",") if i] or None
    res = run_linear(args.model, args.rows, isas, args.repeats, log=progress(args))
    if args.plot:
        plot_linear(res, args.plot)
    print(json.dumps(res) if args.json else linear_markdown(res))
    record(args.record, "Linear op vs MKL fp32", linear_markdown(res)
           + (f"\n\n![linear]({Path(args.plot).name})" if args.plot else ""), args.argv)
    return 0 if res["identical_across_builds"] else 1


def _cmd_attention_op(args) -> int:
    import torch

    from vericache_lab.bench.attention_op import run_attention_op
    from vericache_lab.report import markdown_table, record

    if args.threads:
        torch.set_num_threads(args.threads)
    res = run_attention_op(args.context, [c for c in args.caches.split(",") if c], args.rows, shape=args.shape,
                           numerics=args.numerics, repeats=args.repeats, log=progress(args))
    print(json.dumps(res, indent=None if args.json else 2))
    record(args.record, "The packed attention op on synthetic caches",
           f"{res['cpu']}, {res['threads']} threads, read bandwidth {res['read_bandwidth_GBps']} GB/s, "
           f"{res['shape']}'s heads, {res['numerics']} on the {res['isa']} build\n\n"
           + markdown_table(res["rows"], ["cache", "rows", "MB", "ms", "GBps", "x_read_bandwidth"]), args.argv)
    return 0


def _add_attention_op(bsub) -> None:
    ao = bsub.add_parser("attention-op", help="the packed attention op alone on synthetic 30-layer caches: "
                         "ms and GB/s per cache and query rows")
    ao.add_argument("--context", type=int, default=8192)
    ao.add_argument("--caches", default="full,fp8,kivi2,int8", help="full (fp16), kivi2, kivi4, int4, int8, fp8")
    ao.add_argument("--rows", type=ints, default=[1, 3, 17], help="query rows a KV head's group sees (T)")
    ao.add_argument("--shape", default="smollm2", help="layers and heads: smollm2's or qwen2.5-coder-0.5b's")
    ao.add_argument("--numerics", default="fp32",
                    help="fp32 scores, or q8qk: the integer scores over kept key codes (--caches full)")
    ao.add_argument("--repeats", type=int, default=10)
    ao.add_argument("--threads", type=int, default=0)
    ao.add_argument("--json", action="store_true")
    ao.add_argument("--record", default=None)
    ao.set_defaults(func=_cmd_attention_op)


def _add_linear(bsub) -> None:
    li = bsub.add_parser("linear", help="one forward's matmuls: the batch-invariant op in both numerics per ISA build vs MKL fp32")
    li.add_argument("--model", default=DEFAULT_MODEL)
    li.add_argument("--rows", type=ints, default=[1, 16, 64, 512])
    li.add_argument("--isas", default="", help="comma-separated builds (avx512, avx2, portable); default: "
                    "every build this CPU runs but the portable one")
    li.add_argument("--repeats", type=int, default=5)
    li.add_argument("--threads", type=int, default=0)
    li.add_argument("--json", action="store_true")
    li.add_argument("--plot", default=None, help="write a PNG here")
    li.add_argument("--record", default=None)
    li.set_defaults(func=_cmd_linear)


def _cmd_batch(args: argparse.Namespace) -> int:
    import torch

    from vericache_lab.bench.batch import batch_markdown, run_batch
    from vericache_lab.report import record
    from vericache_lab.sim.roofline import Roofline, plot_roofline

    if args.threads:
        torch.set_num_threads(args.threads)
    modes = mode_labels(args.modes)
    res = run_batch(args.model, args.requests, args.context, args.max_tokens, modes, args.compressor, args.dtype,
                    args.draft_len, args.device, log=progress(args), llamacpp=not args.no_llamacpp,
                    llamacpp_flash_attn=args.llamacpp_flash_attn, llamacpp_copies=args.llamacpp_copies,
                    kv_dtype=args.kv_dtype, numerics=args.numerics, one_at_a_time=args.acceptance, lookup=args.lookup,
                    openvino=not args.no_openvino, repeats=args.repeat)
    runs = res.pop("step_records")
    table = batch_markdown(res)
    print(json.dumps(res) if args.json else table)
    title = (f"Batch decode, all KV in one memory: {args.requests} x {args.context} tokens, "
             f"{res['model']}, weights {res['weights']}, {torch.get_num_threads()} threads")
    if args.plot and res["roofline"]:
        plot_roofline(runs, Roofline(**res["roofline"]), args.plot, f"{title}\n{res['cpu']}")
    record(args.record, title, table + (f"\n\n![roofline]({Path(args.plot).name})" if args.plot else ""), args.argv)
    return 0


def _add_batch(bsub) -> None:
    bt = bsub.add_parser("batch", help="N long requests decoded together, all KV in one memory (shared prefill)")
    bt.add_argument("--model", default=DEFAULT_MODEL)
    bt.add_argument("--requests", type=int, default=16)
    bt.add_argument("--context", type=int, default=8000)
    bt.add_argument("--max-tokens", type=int, default=128)
    bt.add_argument("--modes", default="full,lossy,vericache",
                    help="comma-separated: full,lossy,vericache; a label mode[+weights][+vocab=N][@compressor] runs one "
                         "variant, e.g. vericache+int8 (drafts on int8 weights), vericache+vocab=0 (drafts over the "
                         "whole vocabulary) or vericache+auto@kivi:bits=2")
    bt.add_argument("--compressor", default=DEFAULTS.compressor)
    bt.add_argument("--draft-len", default=DEFAULTS.draft_len, type=draft_len)
    bt.add_argument("--dtype", default=None, help="weights: float32 (CPU default) or bfloat16 (AMX; attention stays fp32)")
    add_kv_dtype_arg(bt)
    add_numerics_arg(bt)
    bt.add_argument("--device", default=None)
    bt.add_argument("--threads", type=int, default=0)
    bt.add_argument("--no-llamacpp", action="store_true", help="skip the llama.cpp row (it runs where llama_cpp imports)")
    bt.add_argument("--repeat", type=int, default=1,
                    help="run the modes this many times, alternating; each row is its mode's median run")
    bt.add_argument("--no-openvino", action="store_true",
                    help="skip the OpenVINO GenAI rows (they run where openvino_genai imports: pip install -e '.[openvino]')")
    bt.add_argument("--llamacpp-flash-attn", default="both", choices=["both", "on", "off"],
                    help="llama.cpp rows with its flash attention, without, or both (each prefills again)")
    bt.add_argument("--llamacpp-copies", action="store_true",
                    help="llama.cpp prefills the first prompt once and decodes every sequence from a copy of its KV")
    bt.add_argument("--lookup", default=DEFAULTS.lookup, action=argparse.BooleanOptionalAction,
                    help="the requests' prompt-lookup proposals (drafting.lookup)")
    bt.add_argument("--acceptance", action="store_true",
                    help="decode the requests one at a time (with a fixed --draft-len: the drafts' acceptance on "
                         "these prompts, acceptance_per_draft and tokens_per_drafted_round, without batching)")
    bt.add_argument("--json", action="store_true")
    bt.add_argument("--plot", default=None, help="PNG: every decode step's time against its roofline")
    bt.add_argument("--record", default=None)
    bt.set_defaults(func=_cmd_batch)


def _cmd_serve_load(args: argparse.Namespace) -> int:
    import asyncio

    from vericache_lab.bench.serve import LaunchedServer, plot_soak, run_load, soak_verdict
    from vericache_lab.report import record

    soak = args.soak is not None
    if soak:
        if args.soak <= 0:
            raise ValueError(f"--soak takes minutes > 0, got {args.soak}")
        args.duration = args.soak * 60
    if args.sample_every <= 0:
        raise ValueError(f"--sample-every takes seconds > 0, got {args.sample_every}")
    elif args.requests is None and args.duration is None:
        raise ValueError("give --requests N, --duration SECONDS or --soak MINUTES")
    server = LaunchedServer(args.model, log=progress(args)) if soak and args.url is None else None
    url, pid = (server.url, server.pid) if server else ((args.url or "http://127.0.0.1:8000").rstrip("/"), args.server_pid)
    try:
        res = asyncio.run(run_load(url, args.model, args.concurrency, args.requests, args.duration, args.max_tokens,
                                   args.request_rate, args.cancel_prob, args.seed, pid, log=progress(args),
                                   nonstream_prob=args.nonstream_prob, bad_prob=args.bad_prob,
                                   sample_every=args.sample_every))
    finally:
        if server is not None:
            server.close()
    failures = soak_verdict(res, args.rss_bound_mb) if soak else []
    if soak:
        res.update({"soak_minutes": args.soak, "rss_bound_mb": args.rss_bound_mb, "passed": not failures,
                    "failures": failures})
    if args.plot:
        plot_soak(res, args.plot)
    print(json.dumps(res, indent=None if args.json else 2))
    record(args.record, "Serving load" + (f" (soak, {args.soak} min)" if soak else ""),
           f"```json\n{json.dumps(res, indent=2)}\n```", args.argv)
    for why in failures:
        progress(args)(f"soak FAILED: {why}")
    return 1 if failures else 0


def _add_serve(bsub) -> None:
    sv = bsub.add_parser("serve", help="streaming load generator (and soak) against an OpenAI-compatible URL")
    sv.add_argument("--url", default=None, help="the server (default http://127.0.0.1:8000; with --soak: start one)")
    sv.add_argument("--model", default=DEFAULT_MODEL)
    sv.add_argument("--concurrency", type=int, default=8)
    sv.add_argument("--requests", type=int, default=None)
    sv.add_argument("--duration", type=float, default=None, help="run for this many seconds")
    sv.add_argument("--soak", type=float, default=None, metavar="MINUTES",
                    help="soak for this many minutes (own server unless --url; exit 1 on a 5xx, a leak or memory growth)")
    sv.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals per second (default: closed loop)")
    sv.add_argument("--max-tokens", type=int, default=64)
    sv.add_argument("--cancel-prob", type=float, default=None, help="share of clients that hang up mid-stream "
                    "(default 0; 0.1 with --soak)")
    sv.add_argument("--nonstream-prob", type=float, default=None, help="share of non-streaming requests "
                    "(default 0; 0.3 with --soak)")
    sv.add_argument("--bad-prob", type=float, default=None, help="share of bad requests, which must get a 4xx "
                    "(default 0; 0.05 with --soak)")
    sv.add_argument("--rss-bound-mb", type=float, default=64.0, help="soak: allowed RSS growth after the warm-up")
    sv.add_argument("--seed", type=int, default=0)
    sv.add_argument("--server-pid", type=int, default=None, help="sample this process's RSS during the run")
    sv.add_argument("--sample-every", type=float, default=10.0, metavar="SECONDS",
                    help="how often the server's RSS and KV bytes are sampled (default 10)")
    sv.add_argument("--plot", default=None, help="PNG of the server's RSS and KV bytes over the run (with "
                                                 "--prompt-tokens: each mode's throughput and TTFT)")
    sv.add_argument("--json", action="store_true")
    sv.add_argument("--record", default=None)
    long = sv.add_argument_group("long contexts (--prompt-tokens): every request at once, each mode, beside bench batch")
    long.add_argument("--prompt-tokens", type=int, default=None,
                      help="send --concurrency distinct prompts of this many tokens of code (bench batch's)")
    long.add_argument("--modes", default="full,lossy,vericache", help="comma-separated modes to run")
    long.add_argument("--compressor", default=DEFAULTS.compressor, help="the server's compressor (and batch's)")
    long.add_argument("--no-batch", action="store_true", help="skip bench batch at the same load")
    sv.set_defaults(func=_serve_defaults)


def _cmd_serve_long(args: argparse.Namespace) -> int:
    from vericache_lab.bench.serve_long import COLUMNS, plot_serve_long, run_serve_long
    from vericache_lab.report import markdown_table, record

    modes = mode_labels(args.modes)
    if args.prompt_tokens < 1 or args.concurrency < 1:
        raise ValueError(f"--prompt-tokens and --concurrency must be >= 1, got {args.prompt_tokens}, {args.concurrency}")
    res = run_serve_long(args.model, args.prompt_tokens, args.concurrency, args.max_tokens, modes, args.compressor,
                         url=args.url and args.url.rstrip("/"), batch=not args.no_batch, log=progress(args))
    text = f"{res['cpu']}.\n\n" + markdown_table(res["rows"], COLUMNS)
    if args.plot:
        plot_serve_long(res, args.plot)
        text += f"\n\n![serve]({Path(args.plot).name})"
    print(json.dumps(res) if args.json else text)
    record(args.record, f"Serving {args.concurrency} x {args.prompt_tokens} tokens", text, args.argv)
    return 0


def _serve_defaults(args: argparse.Namespace) -> int:
    """The soak's mix unless given: a tenth hang up, three tenths want a whole body, one in twenty is bad."""
    if args.prompt_tokens is not None:
        return _cmd_serve_long(args)
    soak = args.soak is not None
    for name, soak_default in (("cancel_prob", 0.1), ("nonstream_prob", 0.3), ("bad_prob", 0.05)):
        if getattr(args, name) is None:
            setattr(args, name, soak_default if soak else 0.0)
    return _cmd_serve_load(args)


def _cmd_triton(args: argparse.Namespace) -> int:
    import tempfile

    from vericache.engine.options import check_mode
    from vericache_lab.bench.triton_streams import COLUMNS, run_triton_streams
    from vericache_lab.report import markdown_table, record

    if min(args.streams, args.requests, args.max_tokens, args.repeats) < 1:
        raise ValueError(f"--streams, --requests, --max-tokens and --repeats must be >= 1, got "
                         f"{args.streams}, {args.requests}, {args.max_tokens}, {args.repeats}")
    if args.prompt_tokens is not None and args.prompt_tokens < 1:
        raise ValueError(f"--prompt-tokens must be >= 1, got {args.prompt_tokens}")
    modes = [check_mode(m.strip()) for m in args.modes.split(",")] if args.modes else None
    if args.prompt_tokens is not None and modes is None:
        modes = ["full", "vericache"]
    with tempfile.TemporaryDirectory(prefix="vericache-bench-triton-") as work:
        res = run_triton_streams(Path(work), args.model, args.streams, args.requests, args.max_tokens, args.repeats,
                                 grpc_url=args.grpc_url, log=progress(args), prompt_tokens=args.prompt_tokens,
                                 modes=modes)
    prompts = f"{res['prompt_tokens']}-token prompts, " if res["prompt_tokens"] else ""
    text = (f"{res['cpu']}; {res['model']}; {res['streams']} streams x {res['requests_per_stream']} requests x "
            f"{prompts}{res['max_tokens']} tokens (greedy).\n\n" + markdown_table(res["rows"], COLUMNS) +
            f"\n\nTriton / embedded tokens/s: {res['triton_over_embedded']} (median of {res['ratios']}; by mode "
            f"{res['triton_over_embedded_by_mode']}); identical texts: {res['identical_texts']}" +
            (f"; over full mode, each side: {res['x_full']}" if "x_full" in res else ""))
    print(json.dumps(res) if args.json else text)
    record(args.record, f"Triton under {args.streams} gRPC streams vs the embedded engine", text, args.argv)
    return 0 if res["identical_texts"] else 1


def _add_triton(bsub) -> None:
    tr = bsub.add_parser("triton", help="the Triton model under N gRPC streams (tritonclient) vs the embedded "
                                        "engine at the same load, alternating, side by side")
    tr.add_argument("--model", default=None, help="the engine's model (default: the model repository's default)")
    tr.add_argument("--streams", type=int, default=32)
    tr.add_argument("--requests", type=int, default=2, help="requests each stream sends, one after another")
    tr.add_argument("--max-tokens", type=int, default=64)
    tr.add_argument("--repeats", type=int, default=2, help="Triton/embedded pairs (alternating)")
    tr.add_argument("--grpc-url", default=None, help="a running tritonserver's gRPC host:port (default: start one)")
    tr.add_argument("--prompt-tokens", type=int, default=None,
                    help="one request a stream, this many tokens of code each (bench batch's prompts), all at once")
    tr.add_argument("--modes", default=None,
                    help="comma-separated request modes, each in turn (default: the server's; with --prompt-tokens "
                         "full,vericache)")
    tr.add_argument("--json", action="store_true")
    tr.add_argument("--record", default=None)
    tr.set_defaults(func=_cmd_triton)


def add_bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks (figures, not tests)")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    _add_decode(bsub)
    _add_throughput(bsub)
    _add_batch(bsub)
    _add_attention(bsub)
    _add_attention_op(bsub)
    _add_linear(bsub)
    _add_prefix(bsub)
    _add_serve(bsub)
    _add_triton(bsub)
    _add_gpu_check(bsub)


def _add_gpu_check(bsub) -> None:
    from vericache_lab.bench.gpu_check import add_arguments, run

    g = bsub.add_parser("gpu-check", help="the device check: identity, rates and 16 x 32K decode on one GPU "
                                          "(--dry-run: the same code on the CPU, Triton's interpreter)")
    add_arguments(g)
    g.set_defaults(func=run)


