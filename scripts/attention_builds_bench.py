"""The packed attention op in each build this CPU runs, side by side: one decode query and a
512-query prefill chunk over one dense fp32 part (30 calls, the model's layer count), and one query
over 30 different layers of a full KV cache (streamed from DRAM); then the same 512-query chunk through
PyTorch's fused CPU flash kernel (the per-part path, ``kv.packed.torch_part``), in the same run.

    python scripts/attention_builds_bench.py --context 8000
"""

from __future__ import annotations

import argparse

import torch

from vericache.kernels import packed_kernels
from vericache.kernels.cpu import supported_isas
from vericache.kv.attention import merge
from vericache.kv.packed import KeyPart, op_args, torch_part
from vericache.timing import best_seconds
from vericache_lab.bench.common import cpu_model

HQ, HKV, D, LAYERS = 9, 3, 64, 30   # SmolLM2's attention shape


def best_ms(fn, repeats: int = 5) -> float:
    return best_seconds(fn, repeats) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=8000)
    ap.add_argument("--isas", default="", help="comma-separated builds; default every one this CPU runs but portable")
    args = ap.parse_args()
    isas = [i for i in args.isas.split(",") if i] or [i for i in supported_isas() if i != "portable"]
    n = args.context
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(HKV, n, D, generator=g), torch.randn(HKV, n, D, generator=g)
    layers_k = torch.randn(LAYERS, HKV, n, D, generator=g)
    layers_v = torch.randn(LAYERS, HKV, n, D, generator=g)
    print(f"{cpu_model()}; {torch.get_num_threads()} threads; context {n}; one layer's KV "
          f"{2 * HKV * n * D * 4 / 1e6:.1f} MB, 30 layers {2 * LAYERS * HKV * n * D * 4 / 1e6:.0f} MB")
    for isa in isas:
        op = packed_kernels(isa)
        row = {}
        for t in (1, 512):
            q = torch.randn(HQ, t, D, generator=g)
            ints, tensors = op_args(0, KeyPart(k, v, n=n - 512 + t, diag=n - 512), D)
            calls = LAYERS if t == 1 else 2
            ms = best_ms(lambda: [op.attend_packed(q, HKV, [t], ints, tensors) for _ in range(calls)])
            row[t] = ms * LAYERS / calls
        q = torch.randn(HQ, 1, D, generator=g)
        per_layer = [op_args(0, KeyPart(layers_k[i], layers_v[i], n=n, diag=n - 1), D) for i in range(LAYERS)]
        dram = best_ms(lambda: [op.attend_packed(q, HKV, [1], *a) for a in per_layer])
        gbps = 2 * LAYERS * HKV * n * D * 4 / dram / 1e6
        print(f"{isa:>9}: 1 query x 30 (one part) {row[1]:.1f} ms; 512 queries x 30 {row[512]:.0f} ms; "
              f"1 query over 30 layers from DRAM {dram:.1f} ms ({gbps:.1f} GB/s)")
    q = torch.randn(HQ, 512, D, generator=g)
    part = KeyPart(k, v, n=n, diag=n - 512)
    flash = best_ms(lambda: [merge(torch_part(q, part)) for _ in range(2)]) * LAYERS / 2
    print(f"  PyTorch flash (fp32, prefix + causal chunk merged): 512 queries x 30 {flash:.0f} ms")


if __name__ == "__main__":
    main()
