"""``vericache bench linear``: one forward's matmuls through the batch-invariant op in both numerics
(``q8``: integer dots; ``fp32``: exact dequantization), per ISA build, against MKL's fp32 ``F.linear``
on the same (dequantized) weights, measured side by side in one run.

For each row count: the op's time per numerics in every build this CPU runs (``avx512``, ``avx2``;
``portable`` when asked), MKL's time, the ratios to MKL and to the fp32 op of the same build, and at
one row the stored bytes over the read bandwidth measured in the run (the floor a decode step's
weights cannot beat). Each build is also checked bit for bit against the first, per numerics. Repeats interleave the contenders, so a noisy
moment on a shared machine hits them alike; the best of ``repeats`` counts.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch
import torch.nn.functional as F

from vericache.kernels.cpu import supported_isas
from vericache.kernels.linear_op import NUMERICS, LinearOp
from vericache.model.exact_linear import ExactLinear, exact_linears
from vericache.model.loader import load_model
from vericache_lab.bench.common import cpu_model
from vericache_lab.report import markdown_table
from vericache_lab.sim.roofline import read_bandwidth

COLUMNS = ["rows", "contender", "ms", "x_mkl", "fp32_over_this", "x_bytes_floor"]


def unpacked_weights(linears) -> list:
    """Each linear's stored weight without panels (the blocks alone)."""
    return [replace(lin.weight, panels=None) for lin in linears]


def _forward_matmuls(linears, xs, fn=None):
    """One forward's matmuls: each stored weight through ``fn`` (an op's numerics), or (fn None) MKL on
    the fp32 copies."""
    if fn is None:
        return [F.linear(xs[w.shape[1]], w) for w in linears]
    return [fn(xs[lin.weight.k], lin.weight) for lin in linears]


@torch.inference_mode()
def run_linear(model: str, rows: list[int], isas: list[str] | None = None, repeats: int = 5, log=print) -> dict:
    loaded = load_model(model, device="cpu", dtype="float32")
    lins = [w for lin in exact_linears(loaded.model) for w in ([lin] if len(lin.weights) == 1 else [])]
    stored = [lin.weight for lin in lins]
    dense = [lin.dense() for lin in lins]
    blocks = unpacked_weights(lins)
    unpacked = [ExactLinear([w], lin.bias, lin.op, lin.numerics) for lin, w in zip(lins, blocks)]
    isas = isas or [i for i in supported_isas() if i != "portable"]
    ops = {isa: LinearOp(isa) for isa in isas}
    # each build reads panels of its own layout (the VNNI build's are packed tighter): packed per build
    own = {isa: [ExactLinear([op.pack(w)], lin.bias, op, lin.numerics) for lin, w in zip(lins, blocks)]
           for isa, op in ops.items()}
    stored_bytes = sum(w.nbytes for w in stored)
    bandwidth = read_bandwidth()
    floor_s = stored_bytes / bandwidth
    log(f"{loaded.name}: {len(stored)} matrices, {stored_bytes / 1e6:.1f} MB stored "
        f"({', '.join(sorted({w.fmt for w in stored}))}), fp32 {sum(w.nbytes for w in dense) / 1e6:.0f} MB; "
        f"read {bandwidth / 1e9:.1f} GB/s -> {floor_s * 1e3:.1f} ms floor at one row; {torch.get_num_threads()} threads")
    out_rows, identical = [], True
    for m in rows:
        g = torch.Generator().manual_seed(m)
        xs = {k: torch.randn(m, k, generator=g) for k in {w.k for w in stored}}
        for numerics in NUMERICS:
            first = None
            for isa, op in ops.items():   # every build: the same bits
                ys = _forward_matmuls(own[isa], xs, op.numerics(numerics))
                first = first or ys
                identical &= all(torch.equal(a, b) for a, b in zip(ys, first))
        contenders = {f"{numerics}-{isa}": (lambda fn=op.numerics(numerics), isa=isa: _forward_matmuls(own[isa], xs, fn))
                      for isa, op in ops.items() for numerics in NUMERICS}
        # the q8 op without the panels packed at load: every many-row call decodes the blocks again
        isa0 = next(iter(ops))
        contenders[f"q8-decoding-{isa0}"] = lambda fn=ops[isa0].q8: _forward_matmuls(unpacked, xs, fn)
        contenders["mkl-fp32"] = lambda: _forward_matmuls(dense, xs)
        best = {name: float("inf") for name in contenders}
        for fn in contenders.values():
            fn()   # warm-up
        for _ in range(repeats):
            for name, fn in contenders.items():
                t0 = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - t0)
        for name, s in best.items():
            same_build_fp32 = best.get("fp32-" + name.rsplit("-", 1)[1], float("nan"))
            out_rows.append({"rows": m, "contender": name, "ms": round(s * 1e3, 2),
                             "x_mkl": round(s / best["mkl-fp32"], 3),
                             "fp32_over_this": round(same_build_fp32 / s, 2) if name.startswith("q8") else "",
                             "x_bytes_floor": round(s / floor_s, 2) if m == 1 else ""})
        log(f"  {m} rows: " + ", ".join(f"{n} {s * 1e3:.1f} ms" for n, s in best.items()))
    return {"model": loaded.name, "cpu": cpu_model(), "isas": isas, "threads": torch.get_num_threads(),
            "stored_bytes": stored_bytes, "fp32_bytes": sum(w.nbytes for w in dense),
            "read_GBps": round(bandwidth / 1e9, 2), "identical_across_builds": identical, "rows": out_rows}


def linear_markdown(res: dict) -> str:
    head = (f"{res['model']} on {res['cpu']}, {res['threads']} threads; builds {', '.join(res['isas'])}; "
            f"stored {res['stored_bytes'] / 1e6:.1f} MB (fp32 {res['fp32_bytes'] / 1e6:.0f} MB); read "
            f"{res['read_GBps']} GB/s; identical across builds: {res['identical_across_builds']}\n\n")
    return head + markdown_table(res["rows"], COLUMNS)


def plot_linear(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["contender"] for r in res["rows"]))
    counts = sorted({r["rows"] for r in res["rows"]})
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        ms = [next(r["ms"] for r in res["rows"] if r["rows"] == c and r["contender"] == name) for c in counts]
        ax.bar([j + i * width for j in range(len(counts))], ms, width, label=name)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(counts))], [str(c) for c in counts])
    ax.set_yscale("log")
    ax.set_xlabel("rows per call")
    ax.set_ylabel("one forward's matmuls (ms, log)")
    ax.set_title(f"{res['model']}: batch-invariant op (q8, fp32 numerics) vs MKL fp32\n{res['cpu']}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
