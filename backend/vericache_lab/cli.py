"""The research harness's commands, added to ``vericache`` through the "vericache.commands" entry
point (pyproject.toml): ``demo``, ``train-tiny``, ``eval-model``, ``eval``, ``bench``, ``sim``, ``netlab``.
The core library never imports this package."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from vericache.cli_args import add_model_args
from vericache.engine.config import draft_len_arg
from vericache.model.registry import DEFAULT_MODEL


def _cmd_demo(args: argparse.Namespace) -> int:
    from vericache_lab.demo import DEMO_COMPRESSOR, run_demo

    run_demo(args.model, device=args.device, dtype=args.dtype, kv_dtype=args.kv_dtype, context=args.context,
             compressor=args.compressor or DEMO_COMPRESSOR, problem_id=args.problem)
    return 0


def _add_demo(sub) -> None:
    d = sub.add_parser("demo", help="the Quickstart demo: full vs lossy vs VeriCache on the real model")
    add_model_args(d)
    d.add_argument("--context", type=int, default=None, help="each task's context, in tokens (default: the "
                   "model's demo: 4096; 8000 for qwen2.5-coder-0.5b)")
    d.add_argument("--compressor", default=None, help="default: the demo's (SnapKV keeping 1/8)")
    d.add_argument("--problem", default=None, help="task 3's HumanEval problem, HumanEval/0 .. HumanEval/163 "
                   "(default: the model's demo: HumanEval/2; HumanEval/9 for qwen2.5-coder-0.5b)")
    d.set_defaults(func=_cmd_demo)


def _cmd_train_tiny(args: argparse.Namespace) -> int:
    from vericache_lab.train.trainer import TrainConfig, export_checkpoint, train

    tc = TrainConfig(out=args.out, minutes=args.minutes, seed=args.seed, threads=args.threads,
                     curriculum=args.curriculum, init_from=args.init_from, repeat_share=args.repeat_share)
    if args.export_to:
        print(f"exported {export_checkpoint(tc, args.export_to)}")
        return 0
    train(tc, log=lambda m: print(m, flush=True))
    return 0


def _add_train_tiny(sub) -> None:
    t = sub.add_parser("train-tiny", help="train the bundled model (resumable)")
    t.add_argument("--out", required=True)
    t.add_argument("--minutes", type=float, default=120.0)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--threads", type=int, default=0)
    t.add_argument("--curriculum", default="base", choices=["base", "copy"],
                   help="base: from scratch; copy: continuation, long short-and-copy-heavy stage first")
    t.add_argument("--init-from", default=None, help="start from this Hugging Face directory (same tokenizer)")
    t.add_argument("--repeat-share", type=float, default=0.0,
                   help="share of task documents that repeat a code span (induction-head data)")
    t.add_argument("--export-to", default=None, help="only export the run's latest checkpoint to this directory")
    t.set_defaults(func=_cmd_train_tiny)


def _cmd_eval_model(args: argparse.Namespace) -> int:
    from vericache_lab.eval.run_model_eval import run_model_eval

    result = run_model_eval(args.model, n=args.n, device=args.device, dtype=args.dtype, kv_dtype=args.kv_dtype,
                            log=lambda m: print(m, file=sys.stderr))  # stdout stays one JSON object
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


def _add_eval_model(sub) -> None:
    e = sub.add_parser("eval-model", help="held-out loss, retrieval and tool-call exact match of a model")
    add_model_args(e)
    e.add_argument("--n", type=int, default=50, help="tasks per metric")
    e.add_argument("--json", action="store_true")
    e.set_defaults(func=_cmd_eval_model)


def _cmd_eval_numerics(args: argparse.Namespace) -> int:
    from vericache_lab.eval.numerics_quality import run_numerics_quality

    res = run_numerics_quality(args.model, Path(args.text), tokens=args.tokens, chunk=args.chunk,
                               log=lambda m: print(m, file=sys.stderr, flush=True))
    print(json.dumps(res, indent=None if args.json else 2))
    return 0


def _add_eval_numerics(sub) -> None:
    e = sub.add_parser("eval-numerics", help="the integer numerics (q8, q8qk) against fp32: perplexity, argmax "
                                             "agreement, greedy text")
    e.add_argument("--model", default=DEFAULT_MODEL)
    e.add_argument("--text", required=True, help="a held-out text file (no test or training set reads it)")
    e.add_argument("--tokens", type=int, default=4096)
    e.add_argument("--chunk", type=int, default=1024)
    e.add_argument("--json", action="store_true")
    e.set_defaults(func=_cmd_eval_numerics)


def _cmd_eval(args: argparse.Namespace) -> int:
    from vericache_lab.eval.long_eval import FULL_GRID, QUALITY, QUICK_GRID, plot_long_eval, run_long_eval

    if args.suite == "humaneval":
        return _cmd_humaneval(args)
    args.model = args.model or DEFAULT_MODEL

    configs = args.compressors.split(";") if args.compressors else (QUICK_GRID if args.grid == "quick" else FULL_GRID)
    rows = run_long_eval(args.model, configs, n=args.n, lo=args.context_min, hi=args.context_max,
                         checkpoint=args.checkpoint, log=lambda m: print(m, file=sys.stderr, flush=True),
                         draft_weights=args.draft_weights, acceptance=tuple(args.acceptance.split(",")),
                         draft_len=args.draft_len,
                         sampling=None if args.temperature == 0 else {"temperature": args.temperature, "top_p": args.top_p,
                                                                      "top_k": args.top_k, "seed": args.seed})
    cols = ["config", "kv_kept", *QUALITY, "identical_to_full", "decode_tokens_per_s", "mean_acceptance_length",
            "acceptance_per_draft", "full_step_tokens", "lookup_kept_of_proposed", "guided_swaps_per_round"]
    return _report_rows(args, rows, cols, plot_long_eval, f"Functional quality on {args.model}: full vs lossy vs "
                        "VeriCache", "quality vs throughput")


def _report_rows(args: argparse.Namespace, rows: list[dict], cols: list[str], plot, title: str, caption: str) -> int:
    """An eval's rows: JSON or a table on stdout, the plot (``--plot``), the table recorded (``--record``)."""
    from vericache_lab.report import markdown_table, record

    table = markdown_table(rows, cols)
    print(json.dumps({"rows": rows}) if args.json else table)
    if args.plot:
        plot(rows, args.plot)
    record(args.record, title, table + (f"\n\n![{caption}]({Path(args.plot).name})" if args.plot else ""), args.argv)
    return 0


def _cmd_humaneval(args: argparse.Namespace) -> int:
    from vericache_lab.eval.humaneval import GRID, QUICK_GRID, plot_humaneval, run_humaneval

    configs = args.compressors.split(";") if args.compressors else (QUICK_GRID if args.grid == "quick" else GRID)
    configs = [] if configs == ["none"] else configs   # full decoding alone (the no-context baseline)
    contexts = tuple(int(c) for c in args.contexts.split(","))
    rows = run_humaneval(args.model or "qwen2.5-coder-0.5b", contexts, configs, limit=args.limit,
                         max_tokens=args.max_tokens, checkpoint=args.checkpoint,
                         log=lambda m: print(m, file=sys.stderr, flush=True), context_format=args.context_format,
                         draft_len=args.draft_len, numerics=args.numerics)
    cols = ["context", "config", "kv_kept", "pass_at_1", "parses", "identical_to_full", "seconds"]
    return _report_rows(args, rows, cols, plot_humaneval, f"HumanEval after a long code context on "
                        f"{args.model or 'qwen2.5-coder-0.5b'}: full vs lossy vs VeriCache", "pass@1 vs KV kept")


def _add_eval(sub) -> None:
    from vericache.kernels.linear_op import NUMERICS
    from vericache.model.draft_weights import DRAFT_WEIGHTS
    from vericache_lab.eval.humaneval import CONTEXT_FORMATS

    q = sub.add_parser("eval", help="quality under KV compression, full vs lossy vs vericache: long-context code, "
                       "needle and tool calls (default), or HumanEval after a long code context (eval humaneval)")
    q.add_argument("suite", nargs="?", default="long", choices=["long", "humaneval"])
    q.add_argument("--model", default=None, help=f"default: {DEFAULT_MODEL}; humaneval: qwen2.5-coder-0.5b")
    q.add_argument("--grid", default="full", choices=["full", "quick"],
                   help="full: SnapKV/StreamingLLM/H2O at 1/4, 1/8, 1/16, KIVI-2, SnapKV 1/8 + KIVI-2 (humaneval: "
                   "SnapKV, StreamingLLM, H2O, KVzip at 1/8 and 1/4, KIVI-2, INT4); quick: three")
    h = q.add_argument_group("humaneval")
    h.add_argument("--contexts", default="8000,16000", help="tokens of code before each problem, comma-separated")
    h.add_argument("--limit", type=int, default=None, help="the first N problems (quick runs)")
    h.add_argument("--max-tokens", type=int, default=384)
    h.add_argument("--numerics", default=None, choices=NUMERICS,
                   help="the forward's arithmetic (default: the model's; rows of each kept apart)")
    h.add_argument("--context-format", default="documents", choices=CONTEXT_FORMATS,
                   help="documents: stdlib files joined by end-of-text, the problem after the cut; repo: the files "
                   "in the model's repository format (<|file_sep|> path headers), the problem a file of its own")
    q.add_argument("--compressors", default=None, help="';'-separated specs (overrides --grid); humaneval: "
                   "'none' runs full decoding alone")
    q.add_argument("--n", type=int, default=20, help="cases per task (code, needle, tool)")
    q.add_argument("--context-min", type=int, default=2048)
    q.add_argument("--context-max", type=int, default=6144)
    q.add_argument("--checkpoint", default=None, help="JSON-lines file of finished rows (resumable)")
    q.add_argument("--draft-weights", default="fp32", choices=DRAFT_WEIGHTS,
                   help="what VeriCache's drafts read (fp32: exact numerics; q8: integer dots on the stored blocks)")
    q.add_argument("--draft-len", default="auto", type=draft_len_arg, help="VeriCache rows' draft length (or auto)")
    q.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else every request samples")
    q.add_argument("--top-p", type=float, default=1.0)
    q.add_argument("--top-k", type=int, default=0)
    q.add_argument("--seed", type=int, default=0, help="task i samples with seed + i (in every mode)")
    q.add_argument("--acceptance", default="coupled", type=_acceptance_list,
                   help="VeriCache rows' acceptance rules, comma-separated: coupled, rejection (a row each)")
    q.add_argument("--json", action="store_true")
    q.add_argument("--plot", default=None)
    q.add_argument("--record", default=None)
    q.set_defaults(func=_cmd_eval)


def _acceptance_list(text: str) -> str:
    from vericache.sampling import ACCEPTANCE_RULES

    bad = [r for r in text.split(",") if r not in ACCEPTANCE_RULES]
    if bad or not text:
        raise argparse.ArgumentTypeError(f"acceptance rules must be among {', '.join(ACCEPTANCE_RULES)}, got {text!r}")
    return text


def _cmd_netlab(args: argparse.Namespace) -> int:
    from vericache_lab import netlab

    if args.action == "up":
        lab = netlab.up(netlab.Shape(args.slow_gbps, args.rtt_ms, args.fast_gbps))
        print(json.dumps({"namespaces": netlab.NAMESPACES, "endpoints": lab.endpoints,
                          "measured": netlab.measure(lab)}, indent=2))
    elif args.action == "down":
        netlab.down()
        print("netlab down")
    else:
        print(json.dumps(netlab.status(), indent=2))
    return 0


def _add_netlab(sub) -> None:
    n = sub.add_parser("netlab", help="a shaped network on this machine: namespaces, veth pairs, tc (root)")
    n.add_argument("action", choices=["up", "down", "status"])
    n.add_argument("--slow-gbps", type=float, default=1.0)
    n.add_argument("--rtt-ms", type=float, default=20.0)
    n.add_argument("--fast-gbps", type=float, default=25.0)
    n.set_defaults(func=_cmd_netlab)


def add_lab_parsers(sub) -> None:
    from vericache_lab.bench.cli import add_bench_parser
    from vericache_lab.sim.cli import add_sim_parser

    _add_demo(sub)
    _add_train_tiny(sub)
    _add_eval_model(sub)
    _add_eval_numerics(sub)
    _add_eval(sub)
    add_bench_parser(sub)
    add_sim_parser(sub)
    _add_netlab(sub)
