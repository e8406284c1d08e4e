"""How long a decoding stream stalls while a KVzip request's long prompt is prefilled beside it: in one engine,
a full-mode request decodes, then a VeriCache request over KVzip 1/8 with a ``--context``-token prompt is added;
the engine is stepped until that request has its first token. Prints its time to first token, the steps and
the longest one, and the neighbour's tokens and its longest gap between tokens meanwhile.

    python scripts/kvzip_stall_bench.py --model qwen2.5-coder-0.5b --context 8000

Run it at another commit by putting that commit's ``backend`` first on the path (a ``git worktree`` of it):
``PYTHONPATH=/tmp/base/backend python scripts/kvzip_stall_bench.py ...``.
"""

from __future__ import annotations

import argparse
import time

import torch

from vericache.engine.options import RequestOptions
from vericache.llm import LLM
from vericache.sampling import SamplingParams
from vericache_lab.bench.common import code_prompt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--context", type=int, default=8000)
    ap.add_argument("--compressor", default="kvzip:ratio=0.125")
    args = ap.parse_args()
    llm = LLM(args.model, mode="full")
    eng = llm.engine
    ids = code_prompt(llm.tokenizer, args.context + 300)
    neighbour = eng.new_sequence(0, ids[:200], SamplingParams(max_tokens=4000, ignore_eos=True))
    eng.add_sequence(neighbour, RequestOptions(mode="full"))
    while len(neighbour.output_ids) < 4:
        eng.step()
    long = eng.new_sequence(1, ids[300:], SamplingParams(max_tokens=2, ignore_eos=True))
    eng.add_sequence(long, RequestOptions(mode="vericache", compressor=args.compressor))
    t0 = time.perf_counter()
    made, last, gap, steps = len(neighbour.output_ids), t0, 0.0, []
    while not long.output_ids:
        n, start = len(neighbour.output_ids), time.perf_counter()
        eng.step()
        end = time.perf_counter()
        steps.append(end - start)
        if len(neighbour.output_ids) > n:
            gap, last = max(gap, end - last), end
        if len(steps) % 8 == 0:
            print(f"  {len(steps)} steps, {end - t0:.0f} s", flush=True)
    print(f"{torch.get_num_threads()} threads, {args.model}, {args.compressor}: the {len(long.prompt_ids)}-token "
          f"request's first token after {time.perf_counter() - t0:.1f} s, {len(steps)} steps (longest "
          f"{max(steps):.2f} s); the full-mode neighbour made {len(neighbour.output_ids) - made} tokens meanwhile, "
          f"its longest gap between tokens {gap:.2f} s")


if __name__ == "__main__":
    main()
