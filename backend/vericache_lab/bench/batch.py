"""``vericache bench batch``: many long requests decoded together, all KV in one memory.

No tiers and no link: the CPU analogue of self-speculative decoding on one GPU (MagicDec's
setting), where a draft step reads the weights plus the compressed KV and a verification reads
the full KV once for a whole round. Each prompt is prefilled once (exactly) and that prefill is
shared by every mode, so only the decode is timed, side by side in one process.
"""

from __future__ import annotations

import time

import torch

from vericache.engine.config import DEFAULTS
from vericache.engine.engine import Engine
from vericache.llm import LLM
from vericache.sampling import SamplingParams
from vericache_lab.bench import llama_cpp_bench, openvino_bench
from vericache_lab.bench.common import RowPredictor, code_prompt, cpu_model, engine_for, shared_prefills
from vericache_lab.report import draft_sources, markdown_table
from vericache_lab.sim import roofline

COLUMNS = ["mode", "tokens_per_s", "tokens_per_s_runs", "predicted_tokens_per_s", "measured_over_predicted", "x_full", "identical_to_full",
           "mean_acceptance_length", "acceptance_per_draft", "full_step_tokens", "lookup_kept_of_proposed",
           "guided_swaps_per_round", "kv_resident_bytes",
           "kv_resident_x_full", "decode_s", "load_s", "steps"]


STALL_COLUMNS = ["mode", "slowest_ms", "slowest_draft_ms", "median_draft_ms", "x_median_draft"]


def distinct_prompts(tokenizer, n: int, context: int) -> list[list[int]]:
    """``n`` prompts of ``context`` tokens, each a different stretch of real code."""
    ids = code_prompt(tokenizer, context + 997 * n)
    return [ids[997 * i : 997 * i + context] for i in range(n)]


def decode_all(engine: Engine, seqs, opts, prefills, log, label: str, from_first_tokens: bool = True,
               until: float | None = None) -> dict:
    """Add every sequence with its shared prefill, step to the end; time and peak resident bytes.

    With ``from_first_tokens`` the decode is timed from the step after every request has its first
    token; otherwise from the first step (requests that wait for admission are part of it). Either
    way loading a shared prefill into a cache and compressing the prompt count as prefill, not decode; but a
    later-admitted KVzip request's scoring pass runs as rows of steps that decode the others (prefill work
    beside decode rows, as a server runs it), and those steps are timed whole.
    ``until`` (a ``time.perf_counter()`` deadline): past it the requests left are aborted and the
    result says ``cut`` (the tokens decoded by then are what is timed)."""
    rids = [engine.add_sequence(s, opts, prefill=p) for s, p in zip(seqs, prefills)]
    errors: dict[int, str] = {}

    def step() -> None:
        errors.update((o.request_id, o.error) for o in engine.step() if o.error)

    t_load = time.perf_counter()
    while from_first_tokens and engine.has_unfinished() and not all(s.output_ids for s in seqs):
        step()
    before = sum(len(s.output_ids) for s in seqs)
    t0, last, steps, peak = time.perf_counter(), time.perf_counter(), 0, 0
    cut = False
    while engine.has_unfinished():
        if until is not None and time.perf_counter() > until:
            cut = True
            for rid in rids:
                engine.abort(rid)
            engine.collect()
            break
        step()
        steps += 1
        peak = max(peak, engine.resident_bytes())
        if time.perf_counter() - last > 15:
            done = sum(len(s.output_ids) for s in seqs)
            log(f"  {label}: {done} tokens after {time.perf_counter() - t0:.0f} s")
            last = time.perf_counter()
    t_end = time.perf_counter()
    failed = [errors[r] for r in rids if r in errors]
    if failed:
        raise RuntimeError(f"{label}: {len(failed)} requests failed: {failed[0]}")
    # loading shared prefills inside the timed span (requests admitted later) is prefill work too
    instruments = engine.instruments
    load_in_span = sum(e - s for s, e, k in instruments.intervals if k == "load" and s >= t0)
    return {"decode_s": t_end - t0 - load_in_span, "steps": steps, "kv_resident_bytes": peak, "cut": cut,
            "load_s": t0 - t_load + load_in_span, "decoded": sum(len(s.output_ids) for s in seqs) - before,
            "step_records": [s for s in instruments.steps if s.start >= t0]}


def decode_each(engine: Engine, seqs, opts, prefills, log, label: str) -> dict:
    """``decode_all`` for one sequence at a time (``bench batch --acceptance``): the same figures summed."""
    runs = [decode_all(engine, [s], opts, [p], log, label) for s, p in zip(seqs, prefills)]
    total = {k: sum(r[k] for r in runs) for k in ("decode_s", "steps", "load_s", "decoded")}
    return total | {"kv_resident_bytes": max(r["kv_resident_bytes"] for r in runs), "cut": False,
                    "step_records": [s for r in runs for s in r["step_records"]]}


def mode_row(mode: str, res: dict, seqs, reference: list | None, compressor_label: str) -> dict:
    """One mode's figures from its decode (``decode_all``'s ``res``) and its finished sequences."""
    outs = [s.output_ids for s in seqs]
    decoded = sum(len(o) - 1 for o in outs)  # the first token of each comes from the prefill
    rounds = sum(s.stats.get("rounds", 0) for s in seqs)
    return {"mode": mode, "tokens_per_s": round(res["decoded"] / res["decode_s"], 2),
            "decode_s": round(res["decode_s"], 2), "load_s": round(res["load_s"], 2),
            "steps": res["steps"], "kv_resident_bytes": res["kv_resident_bytes"],
            "identical_to_full": outs == reference if reference is not None else None,
            "mean_acceptance_length": round(decoded / rounds, 2) if rounds else None,
            "compressor": compressor_label, "decoded": decoded, "rounds": rounds,
            "drafted": sum(s.stats.get("drafted_tokens", 0) for s in seqs),
            **(draft_sources([s.stats for s in seqs]) if rounds else {})}   # drafted rounds, full steps


def run_batch(model: str, n_requests: int, context: int, max_tokens: int, modes: list[str], compressor: str,
              dtype: str | None = None, draft_len: int | str = "auto", device: str | None = None, log=print,
              llamacpp: bool = True, llamacpp_flash_attn: str = "both", llamacpp_copies: bool = False,
              kv_dtype: str | None = None, numerics: str | None = None, one_at_a_time: bool = False,
              lookup: bool = DEFAULTS.lookup, openvino: bool = True, repeats: int = 1) -> dict:
    """Each mode's decode over the same shared prefills; on CPU also each step kind's time against
    its roofline (``sim.roofline``) and, where they import, llama.cpp and OpenVINO GenAI on the same GGUF.
    ``one_at_a_time``: each request decoded alone (``--acceptance``: the drafts' acceptance on these
    prompts, without the batch's cost-model choices). ``lookup``: the requests' lookup proposals.
    ``repeats``: the modes run that many times, alternating (full, vericache, full, vericache ...); each
    mode's row is its median run, with every run's tokens/s beside it (a shared machine's speed drifts by
    more than the differences measured)."""
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an integer >= 1, got {repeats!r}")
    llm = LLM(model, device=device, dtype=dtype, compressor=compressor, draft_len=draft_len, kv_dtype=kv_dtype,
              numerics=numerics, lookup=lookup)
    engine, tok, engines = llm.engine, llm.tokenizer, {}
    prompts = distinct_prompts(tok, n_requests, context)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    log(f"{n_requests} requests x {context} tokens, {max_tokens} new each, {llm.loaded.name} "
        f"(weights {llm.loaded.dtype}, KV {llm.loaded.kv_dtype}) on {llm.loaded.device}; compressor {compressor}")
    t0 = time.perf_counter()
    prefills = shared_prefills(engine, prompts, params, log)
    prefill_s = time.perf_counter() - t0
    roof = roofline.measure(llm, log) if llm.loaded.device.type == "cpu" else None
    predictor = RowPredictor(llm, context, roof.weights_s, log) if roof is not None else None
    rows, reference, runs = [], None, {}
    for mode in modes * repeats:           # a label: full, lossy, vericache or vericache+int8
        mode_engine, base = engine_for(llm, mode, engines)
        seqs = [engine.new_sequence(i, p, params) for i, p in enumerate(prompts)]
        res = (decode_each if one_at_a_time else decode_all)(mode_engine, seqs, None, prefills, log, mode)
        runs[mode] = (base, res["step_records"])
        outs = [s.output_ids for s in seqs]
        reference = outs if mode == "full" else reference
        row = mode_row(mode, res, seqs, reference, mode_engine.defaults.compressor_label)
        if predictor is not None:
            per_round = (row["decoded"] / row["rounds"], row["drafted"] / row["rounds"]) if row["rounds"] else (1.0, 0.0)
            row["predicted_tokens_per_s"] = round(predictor(mode_engine, base, 1 if one_at_a_time else n_requests,
                                                            *per_round), 2)
            row["measured_over_predicted"] = round(row["tokens_per_s"] / row["predicted_tokens_per_s"], 2)
        rows.append(row)
        log(row_line(row))
    rows = median_rows(rows)
    if llamacpp and llama_cpp_bench.available() and llm.loaded.device.type == "cpu":
        rows += llama_cpp_bench.rows(model, prompts, max_tokens, log, llamacpp_flash_attn, llamacpp_copies)
    if openvino and llm.loaded.device.type == "cpu" and not one_at_a_time:
        rows += openvino_bench.rows(model, prompts, max_tokens, compressor, reference, log)
    if roof is not None:  # measured again after the runs: each figure's better value counts
        roof = roof.best(roofline.measure(llm, log))
    add_x_full(rows)
    return {"model": llm.loaded.name, "weights": str(llm.loaded.dtype).removeprefix("torch."), "kv_dtype": str(llm.loaded.kv_dtype).removeprefix("torch."),
            "numerics": llm.loaded.numerics, "cpu": cpu_model(),
            "threads": torch.get_num_threads(), "prefill_s": round(prefill_s, 1),
            "rows": rows, "roofline": roof.to_dict() if roof else None,
            "roofline_rows": [x for label, (m, st) in runs.items() for x in roofline.summarize(st, roof, m, label)]
            if roof else [],
            "stalls": [{"mode": label} | st for label, (m, steps) in runs.items()
                       if (st := roofline.stall(steps, m)) is not None],
            "step_records": runs}


def row_line(row: dict) -> str:
    """A mode's row as one progress line."""
    line = (f"{row['mode']}: {row['tokens_per_s']} tok/s (model {row.get('predicted_tokens_per_s', '-')}), "
            f"identical={row['identical_to_full']}, resident KV {row['kv_resident_bytes'] / 1e6:.0f} MB")
    if row["mean_acceptance_length"]:
        line += f", {row['mean_acceptance_length']} tokens/round ({row['full_step_tokens']} tokens from full steps)"
    return line


def median_rows(rows: list[dict]) -> list[dict]:
    """One row per mode, in first-run order: a mode run more than once keeps its median run (by tokens/s,
    the lower middle of an even count) and lists every run's tokens/s as ``tokens_per_s_runs``."""
    by_mode: dict[str, list[dict]] = {}
    for row in rows:
        by_mode.setdefault(row["mode"], []).append(row)
    out = []
    for runs in by_mode.values():
        ranked = sorted(runs, key=lambda r: r["tokens_per_s"])
        row = dict(ranked[(len(ranked) - 1) // 2])
        if len(runs) > 1:
            row["tokens_per_s_runs"] = [r["tokens_per_s"] for r in runs]
        out.append(row)
    return out


def add_x_full(rows: list[dict]) -> None:
    """Each row's tokens/s and resident KV over the full mode's in the same run."""
    full = next((r for r in rows if r["mode"] == "full"), None)
    for r in rows:
        r["x_full"] = round(r["tokens_per_s"] / full["tokens_per_s"], 2) if full else None
        if full and "kv_resident_bytes" in r:
            r["kv_resident_x_full"] = round(r["kv_resident_bytes"] / full["kv_resident_bytes"], 3)


def batch_markdown(res: dict) -> str:
    text = f"{res['cpu']}, {res['threads']} threads.\n\n" + markdown_table(res["rows"], COLUMNS)
    if res["roofline_rows"]:
        text += "\n\nSteps against the roofline:\n\n" + markdown_table(res["roofline_rows"], roofline.ROOFLINE_COLUMNS)
    if res.get("stalls"):
        text += ("\n\nThe slowest decode step (forward + postprocess) against the median draft step:\n\n"
                 + markdown_table(res["stalls"], STALL_COLUMNS))
    return text
