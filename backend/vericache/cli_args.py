"""Argument types and progress output shared by every command-line module (``cli``, ``bench.cli``,
``sim.cli``), so none of them imports another's private helpers."""

from __future__ import annotations

import argparse
import sys
from typing import Callable

from vericache.model.registry import DEFAULT_MODEL


def draft_len(text: str) -> int | str:
    """``--draft-len``: an integer, or "auto"."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--draft-len must be an integer or 'auto', got {text!r}") from None


def ints(text: str) -> list[int]:
    """Comma-separated integers: ``1024,4096``."""
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def progress(args: argparse.Namespace) -> Callable[[str], None]:
    """Progress lines: on stdout, or on stderr when stdout carries the JSON result (``--json``)."""
    if getattr(args, "json", False):
        return lambda m: print(m, file=sys.stderr, flush=True)
    return print


def add_model_args(p: argparse.ArgumentParser) -> None:
    """--model, --device, --dtype, --kv-dtype."""
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"model name (see `vericache models`), Hugging Face directory or .gguf file (default: {DEFAULT_MODEL})")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda when present)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: bf16 on CUDA, fp32 on CPU)")
    add_kv_dtype_arg(p)


def add_kv_dtype_arg(p: argparse.ArgumentParser) -> None:
    """--kv-dtype: what the full KV caches hold (attention computes in fp32 on the CPU either way)."""
    p.add_argument("--kv-dtype", default=None, choices=["float16", "bfloat16", "float32"],
                   help="the full KV cache's dtype (default: float16 on the CPU, as llama.cpp; the weights' on CUDA)")


def add_mode_args(p: argparse.ArgumentParser) -> None:
    """--mode, --compressor, --draft-len, --draft-weights."""
    from vericache.engine.runner import DEFAULT_COMPRESSOR, MODES
    from vericache.model.draft_weights import DRAFT_WEIGHTS

    p.add_argument("--mode", default="full", choices=MODES)
    p.add_argument("--compressor", default=DEFAULT_COMPRESSOR, help="e.g. snapkv:ratio=0.25 or h2o:ratio=0.125+kivi:bits=4")
    p.add_argument("--draft-len", default="auto", type=draft_len, help="tokens per draft round, or auto")
    p.add_argument("--draft-weights", default="auto", choices=DRAFT_WEIGHTS,
                   help="weights the drafts read (CPU): fp32 (exact), q8 (int8 activations x the stored blocks), int8, int4, "
                        "or auto (per step, fp32 or q8, whichever measured "
                        "faster here for its draft rows; the default, fp32 off CPU); verification is exact either way")
