"""``vericache bench decode``: our full-KV decode against Hugging Face transformers ``generate``.

Same model directory, dtype, thread count and prompt, in one process, side by
side. Decode speed excludes prefill on both sides: ours from the engine's own
timers, transformers' as generate(max_new_tokens=T) minus generate(max_new_tokens=1).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from vericache.bench.common import code_prompt, markdown_table
from vericache.llm import LLM
from vericache.sampling import SamplingParams


def hf_decode_tokens_per_s(path: str, prompt: list[int], max_tokens: int, dtype: torch.dtype) -> float:
    from transformers import (
        AutoModelForCausalLM,  # dev extra: only this benchmark needs it
    )

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    ids = torch.tensor([prompt])

    def run(n: int) -> float:
        t = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0)
        return time.perf_counter() - t

    run(2)  # warm-up
    decode_s = run(max_tokens) - run(1)
    return (max_tokens - 1) / max(decode_s, 1e-9)


@torch.inference_mode()
def kernel_seconds(llm, keys: int, repeat: int = 5) -> float:
    """The kernels of one decode step, timed alone: every weight matmul at one row (LM head
    included) plus one-query attention over ``keys`` keys in every layer."""
    from vericache.kv.packed import KeyPart, attend_packed

    m, cfg, dt = llm.loaded.model, llm.loaded.config, llm.loaded.kv_dtype
    x = torch.randn(1, cfg.hidden_size, dtype=llm.loaded.dtype)
    xo = torch.randn(1, cfg.num_attention_heads * cfg.head_dim, dtype=llm.loaded.dtype)
    xi = torch.randn(1, cfg.intermediate_size, dtype=llm.loaded.dtype)
    q = torch.randn(cfg.num_attention_heads, 1, cfg.head_dim, dtype=dt)
    k = torch.randn(cfg.num_key_value_heads, max(keys, 1), cfg.head_dim, dtype=dt)
    v = torch.randn_like(k)

    def step():  # the matmuls the forward runs: fused q/k/v and gate/up when the model has them
        for layer in m.model.layers:
            a, mlp = layer.self_attn, layer.mlp
            if a.qkv is not None:
                F.linear(x, *a.qkv)
            else:
                a.q_proj(x), a.k_proj(x), a.v_proj(x)
            if mlp.gate_up is not None:
                F.linear(x, mlp.gate_up)
            else:
                mlp.gate_proj(x), mlp.up_proj(x)
            a.o_proj(xo), mlp.down_proj(xi)
            attend_packed(q, [1], [[KeyPart(k, v, n=max(keys, 1))]], cfg.num_key_value_heads)
        m.lm_head(x)

    step()
    t = time.perf_counter()
    for _ in range(repeat):
        step()
    return (time.perf_counter() - t) / repeat


def run_decode_bench(model: str, contexts: list[int], max_tokens: int, modes: list[str], compressor: str,
                     draft_len: int | str = "auto", with_transformers: bool = True, dtype: str = "float32",
                     device: str = "cpu", log=print) -> list[dict]:
    """Decode tokens/s of each mode on the same prompt, side by side, one context at a time; for
    full and lossy, ``overhead`` = measured step time / the step's kernels timed alone."""
    llm = LLM(model, device=device, dtype=dtype, compressor=compressor, draft_len=draft_len)
    eng = llm.engine
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    eng.generate([eng.new_sequence(0, code_prompt(llm.tokenizer, 64), params)], "full")  # warm-up
    rows = []
    for ctx in contexts:
        prompt = code_prompt(llm.tokenizer, ctx)
        results = {m: eng.generate([eng.new_sequence(0, prompt, params)], m)[0] for m in modes}
        ref = results.get("full")
        for mode, out in results.items():
            st = out.stats
            row = {"context": ctx, "mode": mode, "tokens_per_s": round(st["decode_tokens_per_s"], 1),
                   "compressor": "" if mode == "full" else st["compressor"],
                   "compression_ratio": st.get("compression_ratio", 1.0),
                   "kv_resident_bytes": st.get("kv_resident_bytes"),
                   "mean_acceptance_length": st.get("mean_acceptance_length", ""),
                   "acceptance_rate": st.get("acceptance_rate", "")}
            if ref is not None:
                row["ratio_to_full"] = round(st["decode_tokens_per_s"] / ref.stats["decode_tokens_per_s"], 2)
                row["identical_to_full"] = out.token_ids == ref.token_ids
            if mode in ("full", "lossy") and st["decode_tokens_per_s"] > 0 and device == "cpu":
                kept = ctx if mode == "full" else int((ctx + max_tokens / 2) * st.get("compression_ratio", 1.0))
                kernels = kernel_seconds(llm, kept)
                row["step_ms"] = round(1e3 / st["decode_tokens_per_s"], 2)
                row["kernels_ms"] = round(kernels * 1e3, 2)
                row["overhead"] = round(row["step_ms"] / row["kernels_ms"], 2)
            rows.append(row)
            log(f"context {ctx} {mode}: {row['tokens_per_s']} tok/s"
                + (f", {row['ratio_to_full']}x full, identical={row['identical_to_full']}" if ref else "")
                + (f", mean acceptance length {row['mean_acceptance_length']}" if mode == "vericache" else ""))
        if with_transformers:
            # transformers in fp32, its fastest setting on this CPU (its bf16 attention is ~10x slower)
            hf_dtype = torch.float32 if llm.loaded.device.type == "cpu" else llm.loaded.dtype
            hf = hf_decode_tokens_per_s(str(llm.loaded.path), prompt, max_tokens, hf_dtype)
            row = {"context": ctx, "mode": f"transformers-generate (full KV, {str(hf_dtype).removeprefix('torch.')})",
                   "tokens_per_s": round(hf, 1)}
            if ref is not None:
                row["ratio_to_full"] = round(hf / ref.stats["decode_tokens_per_s"], 2)
            rows.append(row)
            log(f"context {ctx} transformers generate: {row['tokens_per_s']} tok/s")
    return rows


COLUMNS = ["context", "mode", "compressor", "tokens_per_s", "ratio_to_full", "identical_to_full",
           "mean_acceptance_length", "acceptance_rate", "compression_ratio", "step_ms", "kernels_ms", "overhead"]


def decode_markdown(rows: list[dict]) -> str:
    return markdown_table(rows, COLUMNS)


def plot_decode(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = sorted({r["context"] for r in rows})
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        vals = [next((r["tokens_per_s"] for r in rows if r["context"] == c and r["mode"] == mode), 0) for c in contexts]
        ax.bar([j + i * width for j in range(len(contexts))], vals, width, label=mode)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(contexts))], [f"{c:,}" for c in contexts])
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("decode tokens/s (CPU, batch 1)")
    ax.set_title("Decode speed by mode (bundled model, fp32)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
