"""Argument parsing for ``vericache bench ...``."""

from __future__ import annotations

import argparse
import json


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _cmd_baseline(args: argparse.Namespace) -> int:
    import torch

    from vericache.bench.decode import baseline_markdown, run_decode_baseline
    from vericache.bench.common import record

    if args.threads:
        torch.set_num_threads(args.threads)
    rows = run_decode_baseline(args.model, args.context, args.max_tokens)
    if args.json:
        print(json.dumps({"rows": rows}))
    else:
        print(baseline_markdown(rows))
    record(args.record, "Full-KV decode vs Hugging Face transformers (CPU, fp32)", baseline_markdown(rows))
    return 0


def add_bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks (figures, not tests)")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    b = bsub.add_parser("decode", help="decode tokens/s: our full-KV decode vs transformers generate")
    b.add_argument("--model", default="tiny")
    b.add_argument("--context", type=_ints, default=[1024, 4096, 16384])
    b.add_argument("--max-tokens", type=int, default=128)
    b.add_argument("--threads", type=int, default=0)
    b.add_argument("--json", action="store_true")
    b.add_argument("--record", default=None, help="append the figures and the command to this markdown file")
    b.set_defaults(func=_cmd_baseline)
