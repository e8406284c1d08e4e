"""The packed attention op alone against PyTorch's per-part kernels over the same full caches.

    python scripts/packed_microbench.py SEQS KEYS QUERIES [SEQS KEYS QUERIES ...]

One layer of SmolLM2-135M's shape (9 query heads, 3 KV heads, head dim 64, fp32): SEQS sequences,
each a chunk of QUERIES queries at the end of KEYS positions (a decode step at 1, a verification
at k+1, a prefill chunk at 512). Best of 15 calls each, side by side in one process.
"""

from __future__ import annotations

import sys

import torch

from vericache.kv.attention import merge
from vericache.kv.packed import KeyPart, attend_packed, torch_part
from vericache.timing import best_seconds

HQ, HKV, D = 9, 3, 64


def best_ms(fn, repeats: int = 15) -> float:
    return best_seconds(fn, repeats) * 1e3


def case(seqs: int, keys: int, queries: int) -> None:
    g = torch.Generator().manual_seed(0)
    kv = [(torch.randn(HKV, keys, D, generator=g), torch.randn(HKV, keys, D, generator=g)) for _ in range(seqs)]
    q = torch.randn(HQ, seqs * queries, D, generator=g)
    parts = [[KeyPart(k, v, n=keys, diag=keys - queries)] for k, v in kv]

    def torch_path() -> None:
        for i, seq_parts in enumerate(parts):
            qs = q[:, i * queries : (i + 1) * queries]
            merge([r for p in seq_parts for r in torch_part(qs, p)])

    packed = best_ms(lambda: attend_packed(q, [queries] * seqs, parts, HKV))
    ref = best_ms(torch_path)
    gb = seqs * 2 * HKV * keys * D * 4 / 1e9
    print(f"{seqs:3d} x {keys:5d} keys, {queries:3d} queries: packed {packed:7.2f} ms ({gb / packed * 1e3:5.1f} GB/s)"
          f"  torch {ref:7.2f} ms ({gb / ref * 1e3:5.1f} GB/s)  torch/packed {ref / packed:.2f}x")


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:]] or [16, 8000, 1, 16, 8000, 3, 1, 8000, 1, 1, 4096, 512]
    print(f"threads {torch.get_num_threads()}")
    for i in range(0, len(args), 3):
        case(*args[i : i + 3])
