"""Where a decode step's time goes, beyond its matmuls and its attention: the per-step fixed cost.

    python scripts/step_fixed_cost.py [--contexts 512,2048,8000] [--rounds 15] [--json out.json]

On the real model (one sequence, full KV in the loader's KV dtype, random K/V), per context and
interleaved round by round so a busy moment hits every figure alike: a decode step's forward on the
native path and on the PyTorch module's path, the same step's matmuls alone (every exact linear at one
row, the LM head included) and its attention alone (30 packed calls over the same cache). fixed =
step - matmuls - attention, medians; the intercept of step - matmuls against context is the fixed
cost the roofline fit sees (issue 30's target: <= 3 ms).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from vericache.kv.full import FullKVCache
from vericache.kv.packed import KeyPart, attend_packed
from vericache.llm import LLM
from vericache.model.exact_linear import exact_linears
from vericache_lab.bench.common import cpu_model


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--contexts", default="512,2048,8000")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    llm = LLM(args.model)
    model, cfg = llm.loaded.model, llm.loaded.config
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    x1 = {n: torch.randn(1, n) for n in {lin.in_features for lin in exact_linears(model)}}
    q = torch.randn(hq, 1, d)
    rows = []
    for ctx in map(int, args.contexts.split(",")):
        cache = FullKVCache(cfg, "cpu", llm.loaded.kv_dtype, capacity=ctx + 1)
        cache.begin(0, ctx)
        cache.k.normal_()
        cache.v.normal_()
        tok = torch.tensor([11])

        def step(native: bool) -> None:
            saved = model.native
            model.native = saved if native else None
            cache.truncate(ctx)
            model(tok, [ctx], [1], [cache])
            model.native = saved

        def matmuls() -> None:
            for lin in exact_linears(model):
                lin(x1[lin.in_features])

        def attention() -> None:
            for layer in range(cfg.num_hidden_layers):
                k, v = cache.layer_views(layer, ctx)
                attend_packed(q, [1], [[KeyPart(k, v, n=ctx)]], hkv)

        fns = {"native": lambda: step(True), "module": lambda: step(False), "matmuls": matmuls, "attention": attention}
        for fn in fns.values():
            fn()
        times: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(args.rounds):
            for name, fn in fns.items():
                times[name].append(timed(fn))
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        row = {"context": ctx, **{f"{k}_ms": round(v, 2) for k, v in med.items()},
               "fixed_native_ms": round(med["native"] - med["matmuls"] - med["attention"], 2),
               "fixed_module_ms": round(med["module"] - med["matmuls"] - med["attention"], 2)}
        rows.append(row)
        print(row, flush=True)
    xs = [r["context"] for r in rows]
    out = {"cpu": cpu_model(), "model": args.model, "kv_dtype": str(llm.loaded.kv_dtype).removeprefix("torch."),
           "threads": torch.get_num_threads(), "rows": rows}
    if len(rows) > 1:   # step - matmuls against context: its intercept is the fixed cost a roofline fit sees
        for path in ("native", "module"):
            ys = [r[f"{path}_ms"] - r["matmuls_ms"] for r in rows]
            mx, my = statistics.mean(xs), statistics.mean(ys)
            slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
            out[f"intercept_{path}_ms"] = round(my - slope * mx, 2)
    print(json.dumps({k: v for k, v in out.items() if k != "rows"}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
