"""The linear op on one matrix at a time, per build: where one decode row's time goes.

    python scripts/linear_microbench.py

For SmolLM2's shapes (random codes with layer-like scales): microseconds per call at one row, on 1
and 2 threads, as weights per second and stored bytes per second, the exact op beside the drafts'
integer dots (``LinearOp.draft``); a 49152-row matrix does not fit in cache, so it streams from DRAM.
Last, the cost of a call on a tiny matrix (Python, ctypes, an OpenMP fork).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from vericache.kernels.cpu import supported_isas
from vericache.kernels.linear_op import BLOCK, LinearOp, StoredWeight
from vericache_lab.bench.common import cpu_model

SHAPES = [("Q4_1", 3072, 576), ("Q4_1", 576, 1536), ("Q4_1", 49152, 576), ("Q8_0", 49152, 576)]


def stored(fmt: str, n: int, k: int, rng: np.random.Generator) -> StoredWeight:
    size, elems = BLOCK[fmt]
    raw = rng.integers(0, 256, size=(n, k // elems * size), dtype=np.uint8)
    scales = np.frombuffer(np.float16([0.01, 0.001]).tobytes(), np.uint8)
    raw.reshape(n, -1, size)[..., 0:2 if fmt == "Q8_0" else 4] = scales[: 2 if fmt == "Q8_0" else 4]
    return StoredWeight(fmt, torch.from_numpy(raw), n, k)


def per_call_us(fn, calls: int = 100) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def main() -> None:
    rng = np.random.default_rng(0)
    weights = [stored(*shape, rng) for shape in SHAPES]
    print(f"{cpu_model()}; one row per call")
    for isa in [i for i in supported_isas() if i != "portable"]:
        op = LinearOp(isa)
        for w in weights:
            x = torch.randn(1, w.k)
            for threads in (1, 2):
                exact = per_call_us(lambda: op(x, w, threads=threads))
                draft = per_call_us(lambda: op.draft(x, w, threads=threads))
                print(f"{isa:>7} {w.fmt} [{w.n:>5}, {w.k}] {threads} thread(s): exact {exact:7.0f} us "
                      f"({w.n * w.k / exact / 1e3:5.1f} Gweights/s, {w.nbytes / exact / 1e3:5.1f} GB/s), "
                      f"draft {draft:7.0f} us")
        tiny = stored("Q4_1", 16, 576, rng)
        x = torch.randn(1, 576)
        print(f"{isa:>7} call cost (16 x 576 Q4_1): {per_call_us(lambda: op(x, tiny), 10000):.1f} us")


if __name__ == "__main__":
    main()
