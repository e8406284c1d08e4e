"""Python function calls per decode step of the step loop (cProfile), a count that machine noise does
not move: run it at two commits to see what a change costs the loop's Python.

    PYTHONPATH=<tree>/backend python scripts/step_calls.py vericache

(it drives the engine's step loop; before commit 3bd51f3 that was ``engine.serving.ServingEngine`` and
``LLM.engine``; from issue 39 on, ``LLM.engine`` is the ``Engine`` and its loop is ``LLM.engine.loop``.)
"""

from __future__ import annotations

import cProfile
import pstats
import sys

import vericache
from vericache.sampling import SamplingParams

try:
    from vericache.engine.step_loop import StepLoop
except ImportError:  # an older tree
    from vericache.engine.serving import ServingEngine as StepLoop


def main(mode: str) -> None:
    llm = vericache.LLM("tiny", device="cpu", dtype="float32", mode=mode, compressor="snapkv:ratio=0.125")
    engine = llm.engine
    loop = engine.loop if hasattr(engine, "loop") else StepLoop(getattr(llm, "runner", None) or engine, offload=False)
    loop.add_request(list(range(5, 517)), SamplingParams(max_tokens=120, ignore_eos=True))
    for _ in range(10):  # prefill and the first steps
        loop.step()
    profile, steps = cProfile.Profile(), 0
    profile.enable()
    while loop.has_unfinished():
        loop.step()
        steps += 1
    profile.disable()
    print(f"{mode}: {round(pstats.Stats(profile).total_calls / steps)} Python calls per step over {steps} steps")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "vericache")
