"""``vericache bench decode``: our full-KV decode against Hugging Face transformers ``generate``.

Same model directory, dtype, thread count and prompt, in one process, side by
side. Decode speed excludes prefill on both sides: ours from the engine's own
timers, transformers' as generate(max_new_tokens=T) minus generate(max_new_tokens=1).
"""

from __future__ import annotations

import statistics
import time

import torch

from vericache.llm import LLM
from vericache.sampling import SamplingParams
from vericache_lab.bench import llama_cpp_bench, openvino_bench
from vericache_lab.bench.batch import median_rows
from vericache_lab.bench.common import RowPredictor, code_prompt, cpu_model, engine_for, shared_prefills
from vericache_lab.report import markdown_table
from vericache_lab.sim import roofline


def mode_row(mode: str, ctx: int, out, ref) -> dict:
    """One mode's figures from its output (``ref``: full decoding's in the same repeat, or None)."""
    st = out.stats
    row = {"context": ctx, "mode": mode, "tokens_per_s": round(st["decode_tokens_per_s"], 1),
           "compressor": "" if mode == "full" else st["compressor"],
           "compression_ratio": st.get("compression_ratio", 1.0),
           "kv_resident_bytes": st.get("kv_resident_bytes"),
           "mean_acceptance_length": st.get("mean_acceptance_length", ""),
           "acceptance_rate": st.get("acceptance_rate", ""),
           "full_step_tokens": st.get("full_step_tokens", "")}   # tokens from plain full steps
    if ref is not None:
        row["ratio_to_full"] = round(st["decode_tokens_per_s"] / ref.stats["decode_tokens_per_s"], 2)
        row["identical_to_full"] = out.token_ids == ref.token_ids
    return row


def median_of_repeats(rows: list[dict]) -> list[dict]:
    """One context's rows, one per mode (``batch.median_rows``: its median run by tokens/s, every run's
    listed); where a mode ran more than once its ratio to full is the median of each repeat's own ratio
    (a repeat's modes run next to each other, so the host's drift between repeats cancels in each), every
    repeat's listed in ``ratio_to_full_runs``, and it is identical to full only if every repeat was."""
    out = median_rows(rows)
    for row in out:
        mine = [r for r in rows if r["mode"] == row["mode"]]
        if len(mine) > 1 and "ratio_to_full" in row:
            row["ratio_to_full_runs"] = [r["ratio_to_full"] for r in mine]
            row["ratio_to_full"] = statistics.median(row["ratio_to_full_runs"])
            row["identical_to_full"] = all(r["identical_to_full"] for r in mine)
    return out


def hf_decode_tokens_per_s(model: str, model_dir: str, prompt: list[int], max_tokens: int,
                           dtype: torch.dtype) -> float:
    from transformers import (
        AutoModelForCausalLM,  # dev extra: only this benchmark needs it
    )

    # a GGUF model: transformers reads the file itself (our cache keeps its matrices only as blocks)
    gguf = llama_cpp_bench.gguf_path(model)
    where, kwargs = (str(gguf.parent), {"gguf_file": gguf.name}) if gguf else (model_dir, {})
    hf = AutoModelForCausalLM.from_pretrained(where, dtype=dtype, **kwargs).eval()
    ids = torch.tensor([prompt])

    def run(n: int) -> float:
        t = time.perf_counter()
        with torch.inference_mode():
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                        do_sample=False, pad_token_id=0)
        return time.perf_counter() - t

    run(2)  # warm-up
    decode_s = run(max_tokens) - run(1)
    return (max_tokens - 1) / max(decode_s, 1e-9)


def generate_with_steps(engine, mode: str, prompt: list[int], params: SamplingParams, prefill=None) -> tuple:
    """``engine.generate`` for one request (from ``prefill``, a shared prefill of ``prompt``, when given),
    also returning the forward's step records (``StepRecord``)."""
    n = engine.instruments.n_steps
    out = engine.generate([engine.new_sequence(0, prompt, params)], mode, prefills=[prefill] if prefill else None)[0]
    steps = list(engine.instruments.steps)
    return out, steps[len(steps) - min(engine.instruments.n_steps - n, len(steps)):]


def run_decode_bench(model: str, contexts: list[int], max_tokens: int, modes: list[str], compressor: str,
                     draft_len: int | str = "auto", with_transformers: bool = True, dtype: str = "float32",
                     device: str = "cpu", log=print, llamacpp: bool = True, kv_dtype: str | None = None,
                     numerics: str | None = None, openvino: bool = True, repeats: int = 1) -> dict:
    """Decode tokens/s of each mode on the same prompt, side by side, one context at a time; on CPU
    each step kind's time against its roofline (``sim.roofline``) and llama.cpp where it imports.
    ``repeats``: the modes run that many times, alternating (full, vericache, full, vericache ...), so a
    shared machine's drift falls on both: each mode's row is its median run (every run's tokens/s in
    ``tokens_per_s_runs``) and its ``ratio_to_full`` the median of each repeat's ratio to that repeat's full."""
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an integer >= 1, got {repeats!r}")
    # Long: one bench run read top to bottom (per context: every mode on the same prompt, side by side,
    # then the baselines); the modes share the prompt, prefill and reference outputs.
    llm = LLM(model, device=device, dtype=dtype, compressor=compressor, draft_len=draft_len, kv_dtype=kv_dtype,
              numerics=numerics)
    engine, engines = llm.engine, {}
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    engine.generate([engine.new_sequence(0, code_prompt(llm.tokenizer, 64), params)], "full")  # warm-up
    roof = roofline.measure(llm, log) if llm.loaded.device.type == "cpu" else None
    rows, roof_rows, runs, row_costs = [], [], {}, []
    for ctx in contexts:
        prompt = code_prompt(llm.tokenizer, ctx)
        prefill = shared_prefills(engine, [prompt], params, log)[0]   # once for every mode
        bases = {m: engine_for(llm, m, engines)[1] for m in modes}
        predictor = RowPredictor(llm, ctx, roof.weights_s, log) if roof is not None else None
        ctx_rows: list[dict] = []
        for _ in range(repeats):
            results = {m: generate_with_steps(*engine_for(llm, m, engines), prompt, params, prefill) for m in modes}
            ref = results["full"][0] if "full" in results else None
            for mode, (out, steps) in results.items():          # mode: the label (vericache+int8 ...)
                row = mode_row(mode, ctx, out, ref)
                if predictor is not None:
                    st, rounds = out.stats, out.stats.get("rounds", 0)
                    per_round = ((len(out.token_ids) - 1) / rounds, st["drafted_tokens"] / rounds) if rounds else (1.0, 0.0)
                    row["predicted_tokens_per_s"] = round(predictor(engine_for(llm, mode, engines)[0], bases[mode], 1,
                                                                    *per_round), 1)
                    row["measured_over_predicted"] = round(row["tokens_per_s"] / row["predicted_tokens_per_s"], 2)
                if roof is not None:   # the last repeat's steps
                    runs[f"{mode} {ctx}"] = (bases[mode], steps)
                ctx_rows.append(row)
                log(f"context {ctx} {mode}: {row['tokens_per_s']} tok/s"
                    + (f", {row['ratio_to_full']}x full, identical={row['identical_to_full']}" if ref else "")
                    + (f", mean acceptance length {row['mean_acceptance_length']}" if bases[mode] == "vericache" else ""))
        rows += median_of_repeats(ctx_rows)
        # the baselines run next, and are over the last repeat's full decoding (the nearest in time)
        if llamacpp and roof is not None and llama_cpp_bench.available():
            for lc in llama_cpp_bench.rows(model, [prompt], max_tokens, log):
                rows.append({"context": ctx, "mode": lc["mode"], "tokens_per_s": round(lc["tokens_per_s"], 1),
                             "ratio_to_full": round(lc["tokens_per_s"] / ref.stats["decode_tokens_per_s"], 2) if ref else ""})
        if openvino and roof is not None:
            for ov in openvino_bench.rows(model, [prompt], max_tokens, compressor, [ref.token_ids] if ref else None, log):
                rows.append({"context": ctx, "mode": ov["mode"], "tokens_per_s": round(ov["tokens_per_s"], 1),
                             "ratio_to_full": round(ov["tokens_per_s"] / ref.stats["decode_tokens_per_s"], 2) if ref else "",
                             "identical_to_full": ov["identical_to_full"]})
        if with_transformers:
            # transformers in fp32, its fastest setting on this CPU (its bf16 attention is ~10x slower)
            hf_dtype = torch.float32 if llm.loaded.device.type == "cpu" else llm.loaded.dtype
            hf = hf_decode_tokens_per_s(model, str(llm.loaded.path), prompt, max_tokens, hf_dtype)
            row = {"context": ctx, "mode": f"transformers-generate (full KV, {str(hf_dtype).removeprefix('torch.')})",
                   "tokens_per_s": round(hf, 1)}
            if ref is not None:
                row["ratio_to_full"] = round(hf / ref.stats["decode_tokens_per_s"], 2)
            rows.append(row)
            log(f"context {ctx} transformers generate: {row['tokens_per_s']} tok/s")
    if roof is not None:  # measured again after the runs: each figure's better value counts
        roof = roof.best(roofline.measure(llm, log))
        for label, (base, steps) in runs.items():
            mode, ctx = label.rsplit(" ", 1)
            roof_rows += [{"context": int(ctx), **r} for r in roofline.summarize(steps, roof, base, mode)]
    for ctx in contexts:   # a verified row's marginal cost against a draft step, where both modes ran
        full, veri = runs.get(f"full {ctx}"), runs.get(f"vericache {ctx}")
        cost = roofline.verified_row_cost(full[1], veri[1]) if full and veri else None
        if cost:
            row_costs.append({"context": ctx, **cost})
            log(f"context {ctx}: a verified row costs {cost['verified_row_ms']} ms, "
                f"{cost['row_over_draft']} of a draft step ({cost['draft_step_ms']} ms)")
    return {"model": llm.loaded.name, "cpu": cpu_model(), "kv_dtype": str(llm.loaded.kv_dtype).removeprefix("torch."),
            "numerics": llm.loaded.numerics, "threads": torch.get_num_threads(), "rows": rows,
            "roofline": roof.to_dict() if roof else None, "roofline_rows": roof_rows,
            "verified_row_cost": row_costs, "step_records": runs}


COLUMNS = ["context", "mode", "compressor", "tokens_per_s", "tokens_per_s_runs", "predicted_tokens_per_s",
           "measured_over_predicted", "ratio_to_full", "ratio_to_full_runs", "identical_to_full",
           "mean_acceptance_length", "acceptance_rate", "compression_ratio"]


def decode_markdown(res: dict) -> str:
    text = f"{res['cpu']}, {res['threads']} threads.\n\n" + markdown_table(res["rows"], COLUMNS)
    if res["roofline_rows"]:
        text += ("\n\nSteps against the roofline:\n\n"
                 + markdown_table(res["roofline_rows"], ["context", *roofline.ROOFLINE_COLUMNS]))
    if res.get("verified_row_cost"):
        text += ("\n\nA verified row's marginal cost ((verification - full step) / (rows - 1)) against a draft step:\n\n"
                 + markdown_table(res["verified_row_cost"], list(res["verified_row_cost"][0])))
    return text


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
