"""Reports people read: a markdown table of rows, and a dated section with the exact command appended
to a markdown file (``--record docs/history/BENCHMARKS-by-issue.md``, the log; docs/BENCHMARKS.md keeps
the latest figures). Shared by the benches and ``vericache sim``."""

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
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    with f.open("a") as out:
        out.write(f"\n## {title} ({stamp})\n\nCommand: `{command_line(argv)}`\n\n{markdown}\n")


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(str(r.get(c, "")) for c in columns) + " |")
    return "\n".join(lines)


def draft_sources(stats: list[dict]) -> dict:
    """Where a VeriCache run's tokens came from, summed over its requests' stats: verified rounds of
    drafts (acceptance per drafted token, tokens a drafted round), of them the drafts that lookup
    proposals supplied (kept of proposed), plain full steps (the cost model's fallbacks and the
    policy's cool-downs), and the tokens guided selection traded into the stores per round."""
    def total(key: str) -> int:
        return sum(s.get(key, 0) for s in stats)

    full, drafted = total("full_step_tokens"), total("drafted_tokens")
    drafted_rounds = total("rounds") - full
    return {"acceptance_per_draft": round(total("accepted_tokens") / drafted, 3) if drafted else None,
            "tokens_per_drafted_round": round(total("round_tokens") / drafted_rounds, 2) if drafted_rounds else None,
            "full_step_tokens": full,
            "lookup_kept_of_proposed": f"{total('lookup_kept_tokens')}/{total('lookup_proposed_tokens')}",
            "guided_swaps_per_round": round(total("guided_swaps") / drafted_rounds, 1) if drafted_rounds else None}
