"""One forward's weight matmuls of the real model at 1..64 rows: exact fp32 against each draft-weights
copy (``model/draft_weights.py``), measured side by side in one run. Usage:
    python scripts/draft_weights_bench.py [--model smollm2-135m] [--rows 1,3,16,64]
"""

from __future__ import annotations

import argparse

import torch

from vericache.llm import LLM
from vericache.model.draft_weights import QUANTIZERS, weight_matrices
from vericache.timing import best_seconds
from vericache_lab.bench.common import cpu_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rows", default="1,3,16,64")
    args = ap.parse_args()
    weights = weight_matrices(LLM(args.model, device="cpu").loaded.model)
    copies = {kind: [q(w) for w in weights] for kind, q in QUANTIZERS.items()}
    print(f"{cpu_model()}, {torch.get_num_threads()} threads; {len(weights)} matmuls per forward")
    print("rows  fp32 ms  " + "  ".join(f"{k} ms (x fp32)" for k in copies))
    with torch.inference_mode():
        for rows in map(int, args.rows.split(",")):
            xs = [torch.randn(rows, w.shape[1]) for w in weights]
            exact = best_seconds(lambda: [x @ w.t() for x, w in zip(xs, weights)], 5)
            cells = []
            for kind, lins in copies.items():
                t = best_seconds(lambda: [lin(x) for x, lin in zip(xs, lins)], 5)
                cells.append(f"{t * 1e3:6.1f} ({exact / t:.2f}x)")
            print(f"{rows:4d}  {exact * 1e3:7.1f}  " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
