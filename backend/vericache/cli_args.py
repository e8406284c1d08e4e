"""Argument types and progress output shared by every command-line module (``cli``, ``bench.cli``,
``sim.cli``), so none of them imports another's private helpers."""

from __future__ import annotations

import argparse
import sys
from typing import Callable


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
