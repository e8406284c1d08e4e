"""Run one `vericache bench ...` command at two commits, alternately, and print each mode's tokens/s side
by side: "unchanged within noise" measured in one run on one (shared, noisy) machine.

    python scripts/bench_commits.py --base 090fc3b --repeats 2 -- bench decode --model tiny --json ...

The base commit is checked out in a temporary git worktree and imported first on PYTHONPATH (same
virtual environment); the other side is this working tree. The bench command must print JSON (`--json`)
with a "rows" list of {"mode", "tokens_per_s"}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def cpu_name() -> str:
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def run_at(tree: Path, args: list[str], extra_env: dict[str, str] | None = None) -> dict[str, dict]:
    """The bench command's rows (mode -> its row: tokens/s, steps, tokens a round), run with ``tree``'s
    packages first on the path (and ``extra_env``)."""
    env = dict(os.environ, PYTHONPATH=f"{tree / 'backend'}:{tree / 'gateway'}", **(extra_env or {}))
    out = subprocess.run([sys.executable, "-m", "vericache.cli", *args], capture_output=True, text=True, env=env,
                         cwd=tree)
    if out.returncode:
        raise SystemExit(f"bench failed at {tree}:\n{out.stderr[-3000:]}")
    rows = json.loads(out.stdout)["rows"]
    return {label(r): r for r in rows if "tokens_per_s" in r}


def label(row: dict) -> str:
    """A row's name in the tables: its mode, and its context where the bench ran several."""
    return f"{row['mode']} @{row['context']}" if "context" in row else row["mode"]


def full_label(name: str) -> str:
    """The full-decoding row measured beside ``name`` (the same context)."""
    mode, _, context = name.partition(" ")
    return f"full {context}" if context else "full"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="the commit to compare against")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--base-env", action="append", default=[], metavar="KEY=VALUE",
                        help="set for the base's runs only: VERICACHE_CACHE_DIR=DIR for a commit whose model cache "
                             "layout differs from the head's (its converted models and kernel builds kept apart)")
    parser.add_argument("bench", nargs=argparse.REMAINDER, help="-- then the vericache arguments")
    args = parser.parse_args()
    bench = args.bench[1:] if args.bench[:1] == ["--"] else args.bench
    bad = [kv for kv in args.base_env if "=" not in kv]
    if bad:
        parser.error(f"--base-env takes KEY=VALUE, got {bad}")
    base_env = dict(kv.split("=", 1) for kv in args.base_env)
    runs: dict[str, dict[str, list[dict]]] = {"base": {}, "head": {}}
    with tempfile.TemporaryDirectory() as tmp:
        base_tree = Path(tmp) / "base"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base_tree), args.base],
                       check=True, capture_output=True)
        try:
            for i in range(args.repeats):
                for side, tree in (("base", base_tree), ("head", ROOT)):
                    rows = run_at(tree, bench, base_env if side == "base" else None)
                    for mode, row in rows.items():
                        runs[side].setdefault(mode, []).append(row)
                    print(f"[{i + 1}/{args.repeats}] {side}: {({m: r['tokens_per_s'] for m, r in rows.items()})}",
                          file=sys.stderr, flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base_tree)], check=False)
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    print(f"CPU: {cpu_name()}; base {args.base}, head {head} (+ working tree); `vericache {' '.join(bench)}`")
    # steps and tokens a round say whether the two ran the same work (an adaptive draft length may not)
    print("| mode | base tok/s (runs) | head tok/s (runs) | head / base (medians) | steps base / head (medians) "
          "| tokens a round base / head |")
    print("|---|---|---|---|---|---|")
    for mode in runs["base"]:
        b, h = runs["base"][mode], runs["head"].get(mode, [])
        def med(rows: list[dict], key: str):
            """The median of a numeric field (None where a row has none: a baseline row's steps, say)."""
            values = [r.get(key) for r in rows]
            return statistics.median(values) if values and all(isinstance(v, (int, float)) for v in values) else None

        tb, th = med(b, "tokens_per_s"), med(h, "tokens_per_s")
        ratio = th / tb if th and tb else float("nan")
        work = [f"{med(b, key)} / {med(h, key)}" for key in ("steps", "mean_acceptance_length")]
        rates = [", ".join(f"{r['tokens_per_s']:.2f}" for r in side) for side in (b, h)]
        print(f"| {mode} | {rates[0]} | {rates[1]} | {ratio:.3f} | {work[0]} | {work[1]} |")
    print_over_full(runs)
    return 0


def print_over_full(runs: dict[str, dict[str, list[dict]]]) -> None:
    """Each mode over full decoding in the same run (the ratio the targets are stated in), run by run."""
    print("\n| mode | over full, base (runs) | over full, head (runs) |\n|---|---|---|")
    for name in runs["base"]:
        full = full_label(name)
        if name == full or full not in runs["base"]:
            continue
        cells = [", ".join(f"{r['tokens_per_s'] / f['tokens_per_s']:.3f}" for r, f in zip(side[name], side[full])
                           if f["tokens_per_s"]) for side in (runs["base"], runs["head"])]
        print(f"| {name} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    sys.exit(main())
