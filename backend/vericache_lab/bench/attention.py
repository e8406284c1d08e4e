"""``vericache bench attention``: what a draft step reads and how fast, per compressor.

One exact prefill of ``context`` tokens is shared by every row. For the full cache and each
compressed cache built from it: the bytes one decode step reads (weights aside), the time of that
step's attention (every layer's call, nothing else), the achieved read rate against this
machine's measured memory read bandwidth, and the time of a whole one-token model step.
``full:torch`` is the full cache's attention through PyTorch's kernels (per part, flash on CPU)
instead of the packed op, measured in the same run (its step_ms is the model step, packed op).
``roofline_ms``: what that one-token step should cost here (``sim.roofline``: weights at one row +
max(its KV bytes / read bandwidth, its flops / the op's peak)).
"""

from __future__ import annotations

import time

import torch

from vericache.compress.base import prompt_scores
from vericache.compress.registry import parse_compressor
from vericache.kv.attention import merge
from vericache.kv.compressed import CompressedKVCache
from vericache.kv.packed import attend_packed, torch_part
from vericache.llm import LLM
from vericache.sampling import SamplingParams
from vericache_lab.bench.common import code_prompt, cpu_model
from vericache_lab.report import markdown_table
from vericache_lab.sim import roofline

COLUMNS = ["compressor", "bytes_per_token", "x_full_bytes", "attention_ms", "x_full_attention", "achieved_GBps",
           "x_read_bandwidth", "step_ms", "roofline_ms", "x_roofline", "kept_tokens"]


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] * 1e3  # the median


@torch.inference_mode()
def run_attention(model: str, context: int, compressors: list[str], repeats: int = 10, dtype: str | None = None,
                  device: str | None = None, log=print, kv_dtype: str | None = None) -> dict:
    llm = LLM(model, device=device, dtype=dtype, kv_dtype=kv_dtype)
    runner, cfg, loaded = llm.engine, llm.loaded.config, llm.loaded
    prompt = code_prompt(llm.tokenizer, context)
    t0 = time.perf_counter()
    shared = runner.shared_prefill(runner.new_sequence(0, prompt, SamplingParams(max_tokens=1)))
    log(f"prefill of {context} tokens: {time.perf_counter() - t0:.0f} s ({loaded.name}, KV {loaded.kv_dtype})")
    roof = roofline.measure(llm, log)
    bandwidth = roof.read_bytes_per_s / 1e9
    g = torch.Generator().manual_seed(0)
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q = torch.randn(hq, 1, d, generator=g).to(loaded.attn_dtype)
    kv = torch.randn(hkv, 1, d, generator=g).to(loaded.attn_dtype)
    token = torch.tensor([prompt[-1]], device=loaded.device)
    rows = []
    seq = runner.new_sequence(0, prompt, SamplingParams(max_tokens=1))
    for spec in ["full", "full:torch", *compressors]:
        cache = full = shared.reset(seq)
        torch_kernels = spec == "full:torch"  # the same parts through PyTorch's per-part kernels, side by side
        if not spec.startswith("full"):
            comp = parse_compressor(spec)
            cache = CompressedKVCache(comp, cfg, loaded.device, loaded.kv_dtype, capacity=context + 1,
                                      key_codes=loaded.key_codes)
            cache.load_prefill(full, shared.queries)
            cache.set_prefill_scores(prompt_scores(comp, loaded.model, full, prompt, llm.tokenizer), context)
            cache.commit(context, source=full)

        def attention() -> None:
            cache.begin(context, 1)
            for layer in range(cfg.num_hidden_layers):
                parts = cache.parts(layer, q, kv, kv)
                if torch_kernels:
                    merge([r for p in parts for r in torch_part(q, p)])
                else:
                    attend_packed(q, [1], [parts], hkv)

        def step() -> None:
            loaded.model(token, [context], [1], [cache])

        read, pairs = cache.attention_cost(context, 1)  # K/V bytes one decode step reads, its own new token included
        attn_ms, step_ms = median_ms(attention, repeats), median_ms(step, repeats)
        kept = context + 1 if spec.startswith("full") else cache.kept_tokens()
        rows.append({"compressor": spec, "bytes_per_token": read, "attention_ms": round(attn_ms, 2),
                     "achieved_GBps": round(read / attn_ms / 1e6, 2), "step_ms": round(step_ms, 2),
                     "kept_tokens": kept})
        rows[-1]["x_read_bandwidth"] = round(rows[-1]["achieved_GBps"] / bandwidth, 3)
        rows[-1]["roofline_ms"] = round(roof.step_s(1, read, pairs) * 1e3, 2)
        rows[-1]["x_roofline"] = round(step_ms / rows[-1]["roofline_ms"], 2)
        log(f"  {spec}: {read / 1e6:.1f} MB/token, attention {attn_ms:.1f} ms ({rows[-1]['achieved_GBps']} GB/s), "
            f"step {step_ms:.1f} ms")
    full = rows[0]
    for r in rows:
        r["x_full_bytes"] = round(r["bytes_per_token"] / full["bytes_per_token"], 4)
        r["x_full_attention"] = round(r["attention_ms"] / full["attention_ms"], 3)
    return {"model": loaded.name, "cpu": cpu_model(), "context": context, "roofline": roof.to_dict(), "kv_dtype": str(loaded.kv_dtype).removeprefix("torch."),
            "threads": torch.get_num_threads(), "read_bandwidth_GBps": round(bandwidth, 1), "rows": rows}


def attention_markdown(res: dict) -> str:
    return (f"{res['cpu']}; {res['model']}, context {res['context']}, KV {res['kv_dtype']}, {res['threads']} threads; "
            f"measured read bandwidth {res['read_bandwidth_GBps']} GB/s.\n\n" + markdown_table(res["rows"], COLUMNS))


def plot_attention(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["rows"]
    names = [r["compressor"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    a.barh(names, [r["bytes_per_token"] / 1e6 for r in rows], color="tab:blue")
    a.set_xscale("log")
    a.set_xlabel("KV MB read per draft step (log)")
    b.barh(names, [r["attention_ms"] for r in rows], color="tab:orange")
    for i, r in enumerate(rows):
        b.annotate(f"{r['achieved_GBps']} GB/s", (r["attention_ms"], i), xytext=(3, -3), textcoords="offset points",
                   fontsize=8)
    b.set_xlabel(f"attention ms per step ({res['threads']} threads; memory reads {res['read_bandwidth_GBps']} GB/s)")
    b.set_yticks([])
    fig.suptitle(f"{res['model']}: one draft step at {res['context']} tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
