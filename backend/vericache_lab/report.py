"""Reports people read: a markdown table of rows, and a dated section with the exact command appended
to a markdown file (``--record docs/BENCHMARKS.md``). Shared by the benches and ``vericache sim``."""

from __future__ import annotations

import datetime
import shlex
import sys
from pathlib import Path


def command_line(argv: list[str] | None = None) -> str:
    return "vericache " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))


def record(path: str | None, title: str, markdown: str, argv: list[str] | None = None) -> None:
    """Append a section with the exact command, the date and the figures to a markdown file."""
    if not path:
        return
    f = Path(path)
    f.parent.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    with f.open("a") as out:
        out.write(f"\n## {title} ({stamp})\n\nCommand: `{command_line(argv)}`\n\n{markdown}\n")


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(str(r.get(c, "")) for c in columns) + " |")
    return "\n".join(lines)
