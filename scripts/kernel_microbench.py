"""The quantized-KV attention kernel alone against fp32 flash attention over the same tokens.

    python scripts/kernel_microbench.py [tokens]

One layer call of SmolLM2-135M's shape (3 KV heads, 3 query heads each, head dim 64, one query
token): median of 100 calls per layout, beside the fused CPU flash kernel over fp32 K/V.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from vericache.kv.attention import attend_all
from vericache.kv.quantized import CHANNEL_GROUPS, FP8, TOKEN_GROUPS, Layout, attend_quantized

LAYOUTS = {
    "kivi-2": (Layout(CHANNEL_GROUPS, 2, 32), Layout(TOKEN_GROUPS, 2, 32)),
    "kivi-4": (Layout(CHANNEL_GROUPS, 4, 32), Layout(TOKEN_GROUPS, 4, 32)),
    "int4": (Layout(TOKEN_GROUPS, 4, 32),) * 2,
    "int8": (Layout(TOKEN_GROUPS, 8, 32),) * 2,
    "fp8": (Layout(FP8),) * 2,
}


def median_us(fn, repeats: int = 100) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 8000
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(3, n, 64, generator=g), torch.randn(3, n, 64, generator=g)
    q = torch.randn(9, 1, 64, generator=g)
    print(f"{n} tokens, {torch.get_num_threads()} threads")
    print(f"  fp32 flash: {median_us(lambda: attend_all(q, k, v)):.0f} us")
    for name, layouts in LAYOUTS.items():
        (kt, kg), (vt, vg) = layouts[0].encode(k), layouts[1].encode(v)
        kp, vp = {"tok": kt, "grp": kg}, {"tok": vt, "grp": vg}
        print(f"  {name}: {median_us(lambda: attend_quantized(q, layouts, kp, vp, n)):.0f} us")


if __name__ == "__main__":
    main()
