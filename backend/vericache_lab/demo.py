"""``vericache demo``: the Quickstart. Three real long-context tasks on the real model, decoded with
the full KV, with a lossy compressed KV (SnapKV keeping 1/8), and with VeriCache over that same
compressed KV (on CPU its drafts read the weights this machine runs fastest for the step:
``model/draft_weights.py``): a value hidden in a long file, a function completed after its source file,
and a HumanEval problem after a long stretch of other code, its completion run against the problem's
own tests in a sandbox (``eval.humaneval``: the paper's workload; ``--model qwen2.5-coder-0.5b``, a real
code model, is where lossy code failing its test shows). Each prompt is prefilled once and that exact
prefill is shared by the three modes, so their tok/s compare decoding alone."""

from __future__ import annotations

from dataclasses import dataclass

from vericache.engine.engine import Engine
from vericache.llm import LLM
from vericache.model.registry import DEFAULT_MODEL
from vericache.sampling import SamplingParams
from vericache_lab.eval import humaneval as he
from vericache_lab.eval import long_tasks as lt

DEMO_COMPRESSOR = "snapkv:ratio=0.125"


@dataclass(frozen=True)
class DemoSettings:
    """A model's demo: each task's context in tokens and task 3's HumanEval problem."""
    context: int = 4096
    problem: str = "HumanEval/2"   # truncate_number: short, and its test checks the exact arithmetic


# The code model at 8K: HumanEval/9 (rolling_max) is a problem full decoding solves after 8,000 tokens of
# other code while SnapKV 1/8's lossy completion fails its test (docs/results/humaneval-qwen2.5-coder-0.5b.jsonl).
DEMO_SETTINGS = {"qwen2.5-coder-0.5b": DemoSettings(context=8000, problem="HumanEval/9")}


def demo_settings(model: str) -> DemoSettings:
    """The demo's defaults for ``model`` (its own where it has some, else SmolLM2's)."""
    return DEMO_SETTINGS.get(model, DemoSettings())
CODE_TOKENS = 128   # a completion long enough that the decode, not the first tokens, sets the speed
HUMANEVAL_TOKENS = 160   # a HumanEval body (stopped at the next top-level statement)


def _first_line(text: str) -> str:
    line = text.strip("\n").split("\n", 1)[0]
    return line if len(line) <= 38 else line[:35] + "..."


def batch_tokens_per_s(outs) -> float:
    """Decode throughput of one batch: tokens after the first (which prefill makes) over its decode time."""
    seconds = max(o.stats["decode_s"] for o in outs)
    return sum(len(o.token_ids) - 1 for o in outs) / seconds if seconds else 0.0


def humaneval_task(tok, problem_id: str, context: int) -> tuple[dict, list[int]]:
    """HumanEval's ``problem_id`` and its prompt placed after ``context`` tokens of other code, as
    ``vericache eval humaneval --contexts <context>`` places it (ValueError naming the id when there is
    none such)."""
    problems = {p["task_id"]: p for p in he.load_problems()}
    if problem_id not in problems:
        raise ValueError(f"unknown HumanEval problem {problem_id!r}; they are HumanEval/0 .. HumanEval/{len(problems) - 1}")
    problem = problems[problem_id]
    return problem, he.context_ids(tok, context) + tok.encode(problem["prompt"])


def run_demo(model: str = DEFAULT_MODEL, device: str | None = None, dtype: str | None = None,
             context: int | None = None, compressor: str = DEMO_COMPRESSOR, kv_dtype: str | None = None,
             problem_id: str | None = None) -> dict:
    """The three tasks, full vs lossy vs VeriCache (``context``, ``problem_id``: the model's ``demo_settings``)."""
    settings = demo_settings(model)
    context, problem_id = context or settings.context, problem_id or settings.problem
    llm = LLM(model, device=device, dtype=dtype, kv_dtype=kv_dtype)
    tok = llm.tokenizer
    needle = lt.needle_tasks(tok, 1, context - 64, context, seed=3)[0]
    code = lt.code_tasks(tok, 1, context - 64, context, seed=5, max_tokens=CODE_TOKENS)[0]
    problem, problem_ids = humaneval_task(tok, problem_id, context)
    from vericache_lab.bench.common import cpu_model

    where = cpu_model() if llm.loaded.device.type == "cpu" else str(llm.loaded.device)
    print(f"model {model} on {where} (weights {llm.loaded.dtype}, {llm.loaded.numerics} numerics, KV "
          f"{llm.loaded.kv_dtype}); compressor {compressor}")
    print(f"task 1: a value hidden in a {len(needle.prompt_ids)}-token Python file; asked in chat for it "
          f"(right answer: {needle.answer})")
    print(f"task 2: complete `{code.head.splitlines()[0].strip()}` after {len(code.prompt_ids)} tokens of its source file")
    print(f"task 3: {problem_id} (`{problem['entry_point']}`) after {context} tokens of other code; "
          f"its completion runs the problem's tests")
    print(f"\n{'mode':>9} {'tok/s':>6} {'vs full':>7} {'KV kept':>7}  {'task 1 answer':<38} {'task 2':<15} "
          f"{'task 3':<16} notes   (tok/s: the three tasks decoded as one batch)")
    outs = {}
    prompts = [needle.prompt_ids, code.prompt_ids, problem_ids]
    params = [SamplingParams(max_tokens=needle.max_tokens), SamplingParams(max_tokens=code.max_tokens),
              SamplingParams(max_tokens=HUMANEVAL_TOKENS, stop=he.STOPS)]
    prefills = [llm.engine.shared_prefill(llm.engine.new_sequence(i, ids, p))
                for i, (ids, p) in enumerate(zip(prompts, params))]
    draft_weights = "auto" if llm.loaded.device.type == "cpu" else "fp32"
    for mode in ("full", "lossy", "vericache"):
        engine = Engine(llm.loaded, llm.engine.config, mode=mode, compressor=compressor,
                        draft_weights=draft_weights if mode == "vericache" else "fp32")
        seqs = [engine.new_sequence(i, ids, p) for i, (ids, p) in enumerate(zip(prompts, params))]
        outs[mode] = engine.generate(seqs, prefills=prefills)
    speed = {mode: batch_tokens_per_s(res) for mode, res in outs.items()}
    sandbox = he.sandbox_prefix()
    for mode, (ans, comp, solved) in outs.items():
        same = [o.token_ids == f.token_ids for o, f in zip(outs[mode], outs["full"])]
        right = "right" if lt.first_number(ans.text) == needle.answer else "WRONG"
        parses = "parses" if lt.function_parses(code.head, comp.text) else "SYNTAX ERROR"
        verdict = he.run_tests(problem, he.cut_at_stops(solved.text), sandbox=sandbox)
        tested = "passes its test" if verdict.passed else "FAILS its test"
        notes = "identical to full" if all(same) else "DIFFERS from full"
        if mode == "vericache":
            rounds = sum(o.stats["rounds"] for o in outs[mode])
            drafted, accepted = (sum(o.stats[k] for o in outs[mode]) for k in ("drafted_tokens", "accepted_tokens"))
            emitted = sum(len(o.token_ids) - 1 for o in outs[mode])
            per_token = comp.stats["draft_steps"] / max(len(comp.token_ids) - 1, 1)
            notes += (f"; {emitted / rounds:.1f} tokens/round, acceptance {accepted / max(drafted, 1):.0%}"
                      f", drafts on {draft_weights} weights; task 2: {per_token:.2f} drafter forwards a token"
                      f" ({comp.stats['lookup_kept_tokens']} drafts from lookup)")
        kept = sum(o.stats.get("compression_ratio", 1.0) for o in outs[mode]) / len(prompts)
        print(f"{mode:>9} {speed[mode]:6.1f} {speed[mode] / speed['full']:6.2f}x {kept:7.1%}  "
              f"{right + ': ' + _first_line(ans.text):<38} {parses:<15} {tested:<16} {notes}")
    print_completions(outs, code.head, problem["prompt"])
    return outs


def print_completions(outs: dict, code_head: str, problem_prompt: str) -> None:
    """Tasks 2 and 3 as VeriCache completed them, and as the lossy cache did where it drifted."""
    for task, head in ((1, code_head), (2, problem_prompt)):
        for mode in ("vericache", "lossy"):
            if mode == "lossy" and outs["lossy"][task].token_ids == outs["full"][task].token_ids:
                continue
            print(f"\n---- task {task + 1}, {mode} completion{' (== full KV)' if mode == 'vericache' else ' (drifted)'} ----")
            print(head + (outs[mode][task].text if task == 1 else he.cut_at_stops(outs[mode][task].text)))
