"""``vericache eval``: functional quality of full vs lossy vs VeriCache decoding.

Two workloads where a small drift breaks the result:
- code completion: a held-out standard-library function is cut after its first body lines,
  with the code before it as long context; the completion must make the function parse
  (``ast.parse``), and we also count exact matches with the full-KV completion;
- tool calls: a log or conversation (held-out layout) then a JSON call whose arguments must
  be copied exactly (argument exact match).
Lossy quality falls as compression rises; VeriCache's equals full-KV by construction, and
the table shows it measured, not assumed.
"""

from __future__ import annotations

import ast
import json
import random
import textwrap
from dataclasses import dataclass

from vericache.engine.engine import Engine
from vericache.llm import LLM
from vericache.model.registry import DEFAULT_MODEL
from vericache.sampling import SamplingParams
from vericache.train import corpus
from vericache.train.tasks import tool_call_task

EVICTION_RATIOS = (0.5, 0.25, 0.125)
DEFAULT_CONFIGS = [f"{m}:ratio={r}" for m in ("streaming", "snapkv", "h2o", "kvzip") for r in EVICTION_RATIOS] + [
    "kivi:bits=4", "kivi:bits=2", "int4", "fp8", "snapkv:ratio=0.25+kivi:bits=4"]


@dataclass
class CodeTask:
    prompt_ids: list[int]
    head: str  # the function's text in the prompt (header + first body lines)


def code_tasks(tok, n: int, context_tokens: int, seed: int = 7) -> list[CodeTask]:
    """Functions of held-out files, each cut after two body lines, with the file before it as context."""
    rng = random.Random(seed)
    tasks: list[CodeTask] = []
    for text in corpus.read_split(heldout=True):
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        lines = text.splitlines(keepends=True)
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.end_lineno - node.lineno >= 4:
                start, cut = node.lineno - 1, node.body[0].lineno + 1
                head = "".join(lines[start:cut])
                before = tok.encode("".join(lines[:start]))[-(context_tokens - len(tok.encode(head))):]
                tasks.append(CodeTask(before + tok.encode(head), head))
    rng.shuffle(tasks)
    return tasks[:n]


def function_parses(head: str, completion: str) -> bool:
    """Does header + body + completion, cut where the function's indentation ends, parse?"""
    text = head + completion
    lines = text.splitlines()
    indent = len(lines[0]) - len(lines[0].lstrip())
    body = [lines[0]]
    for line in lines[1:]:
        if line.strip() and len(line) - len(line.lstrip()) <= indent:
            break  # the function is over
        body.append(line)
    if len(body) == len(lines) and not text.endswith("\n"):
        body = body[:-1]  # the last line may be cut mid-token: judge complete lines only
    try:
        ast.parse(textwrap.dedent("\n".join(body)))
        return True
    except SyntaxError:
        return False


def tool_tasks(tok, n: int, context_tokens: int, seed: int = 8) -> list[tuple[list[int], dict]]:
    from vericache.eval.model_quality import build_prompt
    from vericache.eval.run_model_eval import heldout_tokens

    rng = random.Random(seed)
    filler = heldout_tokens(tok)
    out = []
    for _ in range(n):
        task = tool_call_task(rng, n_events=rng.randint(8, 20), heldout=True)
        ids, answer = build_prompt(tok, task, filler, context_tokens, rng)
        out.append((ids, json.loads(answer.rsplit("}", 1)[0])))
    return out


def _args_match(text: str, expected: dict) -> bool:
    try:
        obj, _ = json.JSONDecoder().raw_decode(text)
    except json.JSONDecodeError:
        return False
    return obj == expected


def run_functional_eval(model: str = DEFAULT_MODEL, configs: list[str] | None = None, n: int = 8,
                        context_tokens: int = 1536, max_tokens: int = 48, log=print) -> list[dict]:
    llm = LLM(model, device="cpu", dtype="float32")
    tok = llm.tokenizer
    codes = code_tasks(tok, n, context_tokens)
    tools = tool_tasks(tok, n, context_tokens)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)

    def run(engine: Engine, mode: str) -> dict:
        code_out = engine.generate([engine.new_sequence(i, t.prompt_ids, params) for i, t in enumerate(codes)], mode)
        tool_out = engine.generate([engine.new_sequence(i, ids, params) for i, (ids, _) in enumerate(tools)], mode)
        return {"code": code_out, "tool": tool_out}

    full = run(llm.engine, "full")
    rows = []

    def score(label: str, mode: str, spec: str, res: dict, ratio: float) -> None:
        code_ok = [function_parses(t.head, o.text) for t, o in zip(codes, res["code"])]
        same = [o.token_ids == f.token_ids for o, f in zip(res["code"], full["code"])]
        tool_ok = [_args_match(o.text, exp) for o, (_, exp) in zip(res["tool"], tools)]
        row = {"config": label, "mode": mode, "compressor": spec, "compression_ratio": round(ratio, 4),
               "code_parse_rate": round(sum(code_ok) / len(code_ok), 3),
               "code_exact_match_with_full": round(sum(same) / len(same), 3),
               "toolcall_argument_em": round(sum(tool_ok) / len(tool_ok), 3)}
        rows.append(row)
        log(json.dumps(row))

    score("full", "full", "", full, 1.0)
    for spec in configs or DEFAULT_CONFIGS:
        for mode in ("lossy", "vericache"):
            eng = Engine(llm.loaded, mode=mode, compressor=spec)
            res = run(eng, mode)
            ratios = [o.stats["compression_ratio"] for o in res["code"] + res["tool"]]
            score(f"{mode} {spec}", mode, spec, res, sum(ratios) / len(ratios))
    return rows


def plot_functional(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), sharex=True)
    full = next(r for r in rows if r["mode"] == "full")
    for ax, metric, title in ((axes[0], "code_exact_match_with_full", "code: exact match with full-KV"),
                              (axes[1], "toolcall_argument_em", "tool calls: argument exact match")):
        for mode, marker in (("lossy", "x"), ("vericache", "o")):
            pts = [(r["compression_ratio"], r[metric]) for r in rows if r["mode"] == mode]
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], marker=marker, label=mode)
        ax.axhline(full[metric], color="gray", linestyle="--", label="full KV")
        ax.set_xscale("log")
        ax.set_xlabel("compressed / full KV bytes")
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
