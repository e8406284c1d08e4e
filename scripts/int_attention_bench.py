"""The packed attention op on one layer of the code model's shape (14 query heads, 2 KV heads of 64) over a
full cache of N fp16 keys, fp32 attention against the q8qk numerics' integer attention on each unit this
CPU runs (the build's own `maddubs`, VNNI, AMX), the cache keeping its keys' codes (as an engine's does):
a decode row (T = 1), a verification of 8 drafts (T = 9) and a 64-row chunk. Prints ms a call, best of
``--repeats`` timed calls, and each unit's output bits against the portable build's.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/int_attention_bench.py --context 32000
"""

from __future__ import annotations

import argparse
import time

import torch

from vericache.config import ModelConfig
from vericache.kernels import packed_kernels
from vericache.kernels.cpu import best_isa, supported_isas
from vericache.kernels.linear_op import score_unit
from vericache.kv.full import FullKVCache
from vericache.kv.packed import op_args

HQ, HKV, D = 14, 2, 64
UNIT_NAMES = {0: "fp32", 1: "int (build)", 2: "int VNNI", 3: "int AMX"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=32000)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    n, isa = args.context, best_isa()
    op = packed_kernels(isa)
    units = sorted({0, 1, score_unit("q8qk", isa)})
    cfg = ModelConfig(vocab_size=32, hidden_size=HQ * D, num_hidden_layers=1, num_attention_heads=HQ,
                      num_key_value_heads=HKV)
    torch.manual_seed(0)
    print(f"{isa} build, {torch.get_num_threads()} threads, {n} fp16 keys, one layer (Hq {HQ}, Hkv {HKV}, D {D})")
    for t in (1, 9, 64):
        cache = FullKVCache(cfg, "cpu", torch.float16, capacity=n + t, key_codes=True)
        cache.begin(0, n)
        cache.fill_random()
        cache.begin(n - t, t)
        q = torch.randn(HQ, t, D)
        part = cache.parts(0, q, cache.k[0, :, n - t : n].clone(), cache.v[0, :, n - t : n].clone())[0]
        ints, tensors = op_args(0, part, D)
        row = []
        for unit in units:
            out = op.attend_packed(q, HKV, [t], ints, tensors, unit)   # the first call codes every key
            best = float("inf")
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                op.attend_packed(q, HKV, [t], ints, tensors, unit)
                best = min(best, time.perf_counter() - t0)
            same = "" if unit == 0 or "portable" not in supported_isas() else \
                f" (portable's bits: {torch.equal(out, packed_kernels('portable').attend_packed(q, HKV, [t], ints, tensors, 1))})"
            row.append(f"{UNIT_NAMES[unit]} {1e3 * best:.3f} ms{same}")
        print(f"T={t:3d}: " + ", ".join(row))


if __name__ == "__main__":
    main()
