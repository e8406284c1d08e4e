"""Shared pieces of the benchmark commands: prompts, recording, plotting."""

from __future__ import annotations

import datetime
import platform
import shlex
import sys
from pathlib import Path

from vericache.eval.run_model_eval import heldout_tokens


def code_prompt(tokenizer, n_tokens: int) -> list[int]:
    """``n_tokens`` of real held-out standard-library code (repeated if the split is shorter)."""
    ids = heldout_tokens(tokenizer)
    while len(ids) < n_tokens:
        ids = ids + ids
    return ids[:n_tokens]


def engine_for(llm, label: str, engines: dict):
    """A bench mode label's engine and mode: "vericache+int8" is vericache with int8 draft weights
    (``model.draft_weights``); the engines share ``llm``'s model and are made once per label."""
    mode, _, weights = label.partition("+")
    if label not in engines:
        from vericache.engine.engine import Engine

        e = llm.engine
        draft_len = "auto" if e.policy.fixed is None else e.policy.fixed
        engines[label] = Engine(llm.loaded, mode=mode, compressor=e.compressor, draft_len=draft_len,
                                prefill_chunk=e.prefill_chunk, draft_weights=weights or "fp32")
    return engines[label], mode


def cpu_model() -> str:
    """The CPU this bench runs on (``lscpu``'s model name), named beside every figure."""
    info = Path("/proc/cpuinfo")
    line = next((ln for ln in info.read_text().splitlines() if ln.startswith("model name")), "") if info.exists() else ""
    return line.partition(":")[2].strip() or platform.processor() or "unknown CPU"


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
