"""Argument types and progress output shared by every command-line module (``cli``, ``bench.cli``,
``sim.cli``), so none of them imports another's private helpers."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from vericache.engine.config import add_engine_args, add_kv_dtype_arg, add_numerics_arg  # noqa: F401 - re-exported
from vericache.engine.config import draft_len_arg as draft_len  # noqa: F401 - re-exported


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
    """--model, --device, --dtype, --kv-dtype, --kernels (``engine.config``'s defaults)."""
    add_engine_args(p, ("model",))


def add_mode_args(p: argparse.ArgumentParser) -> None:
    """--mode, --compressor, --draft-len, --draft-weights, --draft-vocab, --lookup, --acceptance
    (``engine.config``'s ``MODE_FIELDS``, its defaults)."""
    add_engine_args(p, ("mode",))
