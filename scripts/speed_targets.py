"""The code model's speed targets (issue 53) on this machine's CPU class, in one command: VeriCache against
full decoding (SnapKV 1/8) at 8K, 16K and 32K for one request and 8 x 8K, each with the modes alternating
(`--repeat`), and the acceptance per drafted token at 16K with draft length 16. Each target's JSON is
kept under --out as it finishes, so a run that is cut off resumes where it stopped; the summary is a
markdown table (ratios as each bench measured them side by side, the CPU and the kernels' build beside).

    VERICACHE_PREFILL_CACHE=/tmp/prefills nohup python scripts/speed_targets.py --out /tmp/targets > targets.log &

On 2 cores of a Zen 5 the defaults took 4 minutes (the `avx512vnni` build) and 10 (the `avx2` build) with the
prompts' prefills already cached (VERICACHE_PREFILL_CACHE keeps them across runs); a first run prefills them
too (8K, 16K, 32K and eight 8K prompts).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

BASELINES = ["--no-llamacpp", "--no-openvino"]   # the baselines' rows have their own runs (BENCHMARKS)


@dataclass(frozen=True)
class Target:
    name: str          # the file stem and the table's label
    args: list[str]    # `vericache` arguments, without --json


def targets(model: str, contexts: list[int], batch: tuple[int, int], acceptance_context: int, repeat: int,
            max_tokens: int, compressor: str) -> list[Target]:
    common = ["--model", model, "--max-tokens", str(max_tokens), "--modes", "full,vericache",
              "--compressor", compressor, *BASELINES]
    out = [Target(f"decode-{c}", ["bench", "decode", "--context", str(c), "--repeat", str(repeat),
                                  "--no-transformers", *common]) for c in contexts]
    n, c = batch
    if n:
        out.append(Target(f"batch-{n}x{c}", ["bench", "batch", "--requests", str(n), "--context", str(c),
                                             "--repeat", str(repeat), *common]))
    if acceptance_context:
        out.append(Target(f"acceptance-{acceptance_context}-k16",
                          ["bench", "decode", "--context", str(acceptance_context), "--draft-len", "16",
                           "--no-transformers", *common]))
    return out


def run(target: Target, out_dir: Path) -> dict:
    """The target's JSON: from its file where an earlier run finished it, else run now and keep it."""
    path = out_dir / f"{target.name}.json"
    if path.exists():
        print(f"{target.name}: done before ({path})", file=sys.stderr, flush=True)
        return json.loads(path.read_text())
    print(f"{target.name}: vericache {' '.join(target.args)}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "vericache.cli", *target.args, "--json"], capture_output=True,
                          text=True)
    if proc.returncode:
        raise SystemExit(f"{target.name} failed:\n{proc.stderr[-3000:]}")
    res = json.loads(proc.stdout) | {"command": "vericache " + " ".join(target.args),
                                     "seconds": round(time.perf_counter() - t0, 1)}
    path.write_text(json.dumps(res))
    print(f"{target.name}: {res['seconds']} s", file=sys.stderr, flush=True)
    return res


def summary_row(target: Target, res: dict) -> dict:
    """One table row: VeriCache's tokens/s over full's (the bench's own median of paired or mode medians),
    the runs, tokens a round, acceptance, identity."""
    rows = {r["mode"]: r for r in res["rows"] if "tokens_per_s" in r}
    full, veri = rows.get("full"), rows.get("vericache")
    if full is None or veri is None:
        raise SystemExit(f"{target.name}: the bench printed no full and vericache rows")
    ratio = veri.get("ratio_to_full", veri.get("x_full"))
    runs = veri.get("ratio_to_full_runs") or ""
    if not runs and veri.get("tokens_per_s_runs") and full.get("tokens_per_s_runs"):
        runs = [round(v / f, 2) for v, f in zip(veri["tokens_per_s_runs"], full["tokens_per_s_runs"])]
    return {"target": target.name, "vericache_over_full": ratio, "runs": runs, "full_tok_s": full["tokens_per_s"],
            "tokens_a_round": veri.get("mean_acceptance_length"),
            "acceptance_per_draft": veri.get("acceptance_rate", veri.get("acceptance_per_draft")),
            "identical": veri.get("identical_to_full"), "met": isinstance(ratio, (int, float)) and ratio >= 1.0}


def markdown(rows: list[dict], cpu: str) -> str:
    cols = list(rows[0])
    lines = [f"{cpu}; `python scripts/speed_targets.py` (each target's command in its JSON)", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    ratios = [r["vericache_over_full"] for r in rows if isinstance(r["vericache_over_full"], (int, float))]
    if ratios:
        lines += ["", f"median over the targets: {statistics.median(ratios):.2f}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path, help="where each target's JSON is kept (resume: run again)")
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--contexts", default="8000,16000,32000", help="one request each (comma-separated)")
    p.add_argument("--batch", default="8x8000", help="REQUESTSxCONTEXT, or 0 for none")
    p.add_argument("--acceptance-context", type=int, default=16000, help="draft length 16 here (0: none)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--compressor", default="snapkv:ratio=0.125")
    p.add_argument("--record", type=Path, default=None, help="append the summary to this markdown file")
    args = p.parse_args(argv)
    try:
        contexts = [int(c) for c in args.contexts.split(",") if c]
        n, _, c = args.batch.partition("x")
        batch = (int(n), int(c or 0))
    except ValueError:
        p.error(f"--contexts takes integers and --batch REQUESTSxCONTEXT, got {args.contexts!r}, {args.batch!r}")
    if args.repeat < 1 or any(x <= 0 for x in contexts) or (batch[0] and batch[1] <= 0):
        p.error("--repeat, every context and the batch's context must be positive")
    args.out.mkdir(parents=True, exist_ok=True)
    todo = targets(args.model, contexts, batch, args.acceptance_context, args.repeat, args.max_tokens,
                   args.compressor)
    results = [(t, run(t, args.out)) for t in todo]
    cpu = results[0][1].get("cpu", "unknown CPU") if results else "unknown CPU"
    text = markdown([summary_row(t, r) for t, r in results], cpu)
    print(text)
    if args.record:
        with args.record.open("a") as f:
            f.write("\n" + text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
