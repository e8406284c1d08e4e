"""Time a long prompt's prefill (the engine's own: `Engine.shared_prefill`, its chunks, full KV) at a base
commit beside this tree, alternately, each run a fresh process; print each side's seconds and the ratio.

    python scripts/prefill_bench.py --base 0b22348 --model qwen2.5-coder-0.5b --context 16000,32000

The base is checked out in a temporary git worktree and imported first on PYTHONPATH (the same virtual
environment: its kernels build into the same cache, keyed by their source); the prompt is real code
(`bench.common.code_prompt`), the same tokens on both sides.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# one run in a child process: load, one untimed 512-token prefill (kernels loaded, buffers made), then the timed one
CHILD = """
import json, sys, time
from vericache import LLM, SamplingParams
from vericache_lab.bench.common import code_prompt
llm = LLM(sys.argv[1], mode="full")
engine, params = llm.engine, SamplingParams(max_tokens=1)
ids = code_prompt(llm.tokenizer, int(sys.argv[2]))
engine.shared_prefill(engine.new_sequence(0, ids[:512], params))
t0 = time.perf_counter()
engine.shared_prefill(engine.new_sequence(1, ids, params))
print(json.dumps({"tokens": len(ids), "seconds": time.perf_counter() - t0}))
"""


def run_side(backend: Path, model: str, context: int) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(backend), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", CHILD, model, str(context)], env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"the prefill at {backend} failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="the commit to compare against")
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--context", default="16000", help="prompt tokens, comma-separated (e.g. 16000,32000)")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    contexts = [int(c) for c in args.context.split(",")]
    if args.repeats < 1 or min(contexts) < 512:
        parser.error(f"--repeats must be >= 1 and every --context >= 512, got {args.repeats}, {contexts}")
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "base"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), args.base], check=True,
                       capture_output=True)
        try:
            sides = {"base": tree / "backend", "head": ROOT / "backend"}
            for context in contexts:
                seconds: dict[str, list[float]] = {"base": [], "head": []}
                for i in range(args.repeats):
                    for side, backend in sides.items():
                        seconds[side].append(run_side(backend, args.model, context)["seconds"])
                        print(f"  {context} tokens, run {i + 1} {side}: {seconds[side][-1]:.2f} s", flush=True)
                best = {side: min(s) for side, s in seconds.items()}
                print(f"{args.model}, {context}-token prefill, best of {args.repeats}: base {best['base']:.2f} s, "
                      f"head {best['head']:.2f} s ({best['base'] / best['head']:.2f}x)", flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], capture_output=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
