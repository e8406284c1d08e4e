"""``vericache eval``: what lossy KV compression breaks on a real model, and that VeriCache does not.

Every prompt is prefilled once (exact) and that prefill is shared by full-KV decoding and by every
compressor in lossy and VeriCache mode, so the grid costs one prefill per prompt. Rows: full,
then per compressor lossy and VeriCache, each with its quality, decode tokens/s and (VeriCache)
acceptance length. Each (prompt batch, config) is appended to ``checkpoint`` (JSON lines) as it
finishes, and a rerun with the same checkpoint skips what is there.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from vericache.engine.engine import Engine
from vericache.llm import LLM
from vericache.model.registry import DEFAULT_MODEL
from vericache.sampling import SamplingParams
from vericache_lab.eval import long_tasks as lt
from vericache_lab.report import draft_sources

FULL_GRID = [f"{m}:ratio={r}" for m in ("snapkv", "streaming", "h2o") for r in (0.25, 0.125, 0.0625)] + [
    "kivi:bits=2", "snapkv:ratio=0.125+kivi:bits=2"]
QUICK_GRID = ["snapkv:ratio=0.125", "streaming:ratio=0.125", "kivi:bits=2"]
QUALITY = ("code_parse_rate", "code_match_full", "needle_accuracy", "tool_json_valid", "tool_args_match_full")


def build_tasks(tok, n: int, lo: int, hi: int) -> list[lt.LongTask]:
    return lt.code_tasks(tok, n, lo, hi) + lt.needle_tasks(tok, n, lo, hi) + lt.tool_tasks(tok, n, lo, hi)


def score(tasks: list[lt.LongTask], outs, full_outs) -> dict:
    def rate(flags: list[bool]) -> float:
        return round(sum(flags) / len(flags), 3) if flags else 0.0

    by = {k: [(t, o, f) for t, o, f in zip(tasks, outs, full_outs) if t.kind == k] for k in ("code", "needle", "tool")}
    calls = [(lt.parse_call(o.text), lt.parse_call(f.text)) for _, o, f in by["tool"]]
    return {
        "code_parse_rate": rate([lt.function_parses(t.head, o.text) for t, o, _ in by["code"]]),
        "code_match_full": rate([o.token_ids == f.token_ids for _, o, f in by["code"]]),
        "needle_accuracy": rate([lt.first_number(o.text) == t.answer for t, o, _ in by["needle"]]),
        "tool_json_valid": rate([c is not None for c, _ in calls]),
        "tool_args_match_full": rate([c is not None and ref is not None and c == ref for c, ref in calls]),
        "identical_to_full": rate([o.token_ids == f.token_ids for o, f in zip(outs, full_outs)]),
    }


def _output_record(o) -> dict:
    keep = ("compression_ratio", "rounds", "decode_tokens_per_s", "drafted_tokens", "accepted_tokens", "full_step_tokens",
            "round_tokens", "lookup_proposed_tokens", "lookup_kept_tokens", "guided_swaps")
    return {"token_ids": o.token_ids, "text": o.text, "stats": {k: o.stats[k] for k in keep if k in o.stats}}


class _Saved:
    """A finished output read back from the checkpoint (what scoring needs of a RequestOutput)."""

    def __init__(self, rec: dict) -> None:
        self.token_ids, self.text, self.stats = rec["token_ids"], rec["text"], rec["stats"]


def run_long_eval(model: str = DEFAULT_MODEL, configs: list[str] | None = None, n: int = 20, lo: int = 2048,
                  hi: int = 6144, batch: int = 20, checkpoint: str | None = None, log=print,
                  draft_weights: str = "fp32", sampling: dict | None = None,
                  acceptance: tuple[str, ...] = ("coupled",), draft_len: int | str = "auto") -> list[dict]:
    """``draft_weights``: what VeriCache's drafts read (``EngineConfig.draft_weights``); full and lossy rows are exact.
    ``sampling``: ``SamplingParams`` fields for every request (temperature, top_p, top_k; task i is seeded
    ``seed + i``), greedy if None; ``acceptance``: the VeriCache rows' rules (``sampling.ACCEPTANCE_RULES``),
    a row each ("vericache/rejection <spec>" for a rule other than coupled); ``draft_len``: theirs."""
    llm = LLM(model, device="cpu", dtype="float32")
    tasks = build_tasks(llm.tokenizer, n, lo, hi)
    configs = configs or FULL_GRID
    sampling = dict(sampling or {})
    rules = ["vericache" + ("" if rule == "coupled" else f"/{rule}") for rule in acceptance]
    labels = ["full"] + [f"{mode} {spec}" for spec in configs for mode in ("lossy", *rules)]
    log(f"{len(tasks)} tasks ({n} code, {n} needle, {n} tool), contexts {lo}-{hi} tokens, "
        f"{len(configs)} compressors x (lossy, vericache) + full")
    # checkpoint: one JSON line per (prompt batch, config) with its outputs and decode seconds
    done: dict[tuple[int, str], dict] = {}
    if checkpoint and Path(checkpoint).exists():
        for line in Path(checkpoint).read_text().splitlines():
            rec = json.loads(line)
            if (rec.get("model") == model and rec.get("n") == n and rec.get("contexts") == [lo, hi]
                    and rec.get("draft_weights", "fp32") == draft_weights and rec.get("sampling", {}) == sampling
                    and rec.get("draft_len", "auto") == draft_len):
                done[(rec["batch"], rec["config"])] = rec
    t0 = time.perf_counter()
    for b in range(0, len(tasks), batch):
        todo = [lab for lab in labels if (b, lab) not in done]
        if not todo:
            continue
        part = tasks[b : b + batch]
        base = Engine(llm.loaded, mode="full", device_budget_gb=None)
        shared = [base.shared_prefill(s) for s in _sequences(base, part, sampling, b)]
        log(f"[{time.perf_counter() - t0:6.0f} s] prompts {b + 1}-{b + len(part)}: prefilled once "
            f"({sum(p.seconds for p in shared):.0f} s), {len(todo)} configs to run")
        for label in todo:
            mode, _, spec = label.partition(" ")
            mode, _, rule = mode.partition("/")
            e = Engine(llm.loaded, mode=mode, compressor=spec or "snapkv:ratio=0.25", device_budget_gb=None,
                       draft_weights=draft_weights if mode == "vericache" else "fp32", acceptance=rule or "coupled", draft_len=draft_len)
            t = time.perf_counter()
            res = e.generate(_sequences(e, part, sampling, b), mode, prefills=shared)
            rec = {"model": model, "n": n, "contexts": [lo, hi], "draft_weights": draft_weights, "sampling": sampling,
                   "draft_len": draft_len, "batch": b, "config": label,
                   "seconds": time.perf_counter() - t, "outputs": [_output_record(o) for o in res]}
            done[(b, label)] = rec
            if checkpoint:
                with open(checkpoint, "a") as f:
                    f.write(json.dumps(rec) + "\n")
            log(f"[{time.perf_counter() - t0:6.0f} s]   {label}: {rec['seconds']:.1f} s")
        del shared
    return [_row(label, tasks, labels, done, batch) for label in labels]


def _sequences(runner: Engine, tasks: list[lt.LongTask], sampling: dict, first: int) -> list:
    """The tasks' requests; sampled ones seeded ``sampling["seed"] + task index`` (the same in every mode)."""
    fields = {k: v for k, v in sampling.items() if k != "seed"}
    seed = sampling.get("seed", 0)
    return [runner.new_sequence(i, t.prompt_ids, SamplingParams(max_tokens=t.max_tokens, seed=seed + first + i, **fields))
            for i, t in enumerate(tasks)]


def _row(label: str, tasks, labels, done, batch: int) -> dict:
    def outputs(lab: str) -> list:
        return [_Saved(o) for b in range(0, len(tasks), batch) for o in done[(b, lab)]["outputs"]]

    mode, _, spec = label.partition(" ")
    mode, _, rule = mode.partition("/")
    res, full = outputs(label), outputs("full")
    secs = sum(done[(b, label)]["seconds"] for b in range(0, len(tasks), batch))
    tokens = sum(max(len(o.token_ids) - 1, 0) for o in res)
    row = {"config": label, "mode": mode, "compressor": spec, **score(tasks, res, full),
           "decode_tokens_per_s": round(tokens / secs, 2) if secs else 0.0,
           "kv_kept": round(sum(o.stats.get("compression_ratio", 1.0) for o in res) / len(res), 4)}
    if mode == "vericache":
        row["acceptance"] = rule or "coupled"
        rounds = sum(o.stats["rounds"] for o in res)
        row["mean_acceptance_length"] = round(tokens / rounds, 2) if rounds else 0.0
        row.update(draft_sources([o.stats for o in res]))   # drafted rounds and plain full steps
    return row


def plot_long_eval(rows: list[dict], path: str) -> None:
    """Quality (mean of code match, needle accuracy, tool-argument match) vs decode tokens/s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def quality(r: dict) -> float:
        return (r["code_match_full"] + r["needle_accuracy"] + r["tool_args_match_full"]) / 3

    fig, ax = plt.subplots(figsize=(8, 5))
    full = next(r for r in rows if r["mode"] == "full")
    ax.scatter([full["decode_tokens_per_s"]], [quality(full)], marker="*", s=200, color="black", label="full KV", zorder=3)
    methods = sorted({r["compressor"].split(":")[0] if "+" not in r["compressor"] else r["compressor"]
                      for r in rows if r["mode"] != "full"})
    for i, method in enumerate(methods):
        color = plt.cm.tab10(i % 10)
        for mode, style in (("lossy", "--x"), ("vericache", "-o")):
            pts = sorted((r["decode_tokens_per_s"], quality(r)) for r in rows if r["mode"] == mode and
                         (r["compressor"] == method or r["compressor"].split(":")[0] == method and "+" not in r["compressor"]))
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, color=color, label=f"{mode} {method}")
    ax.set_xlabel("decode tokens/s (batched, this CPU)")
    ax.set_ylabel("quality: mean of code = full, needle, tool args = full")
    ax.set_ylim(-0.05, 1.05)
    ax.set_title("Lossy KV compression loses quality as it compresses; VeriCache keeps full-KV quality")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
