"""``vericache demo``: the Quickstart. Two real long-context tasks on the real model, decoded with
the full KV, with a lossy compressed KV (SnapKV keeping 1/8), and with VeriCache over that same
compressed KV (on CPU its drafts read int4 or int8 weights, whichever this machine runs faster for
the step: ``model/draft_weights.py``). Each prompt is prefilled once and that exact prefill is
shared by the three modes, so their tok/s compare decoding alone."""

from __future__ import annotations

from vericache.engine.engine import Engine
from vericache_lab.eval import long_tasks as lt
from vericache.llm import LLM
from vericache.model.registry import DEFAULT_MODEL
from vericache.sampling import SamplingParams

DEMO_COMPRESSOR = "snapkv:ratio=0.125"
CODE_TOKENS = 128   # a completion long enough that the decode, not the first tokens, sets the speed


def _first_line(text: str) -> str:
    line = text.strip("\n").split("\n", 1)[0]
    return line if len(line) <= 38 else line[:35] + "..."


def batch_tokens_per_s(outs) -> float:
    """Decode throughput of one batch: tokens after the first (which prefill makes) over its decode time."""
    seconds = max(o.stats["decode_s"] for o in outs)
    return sum(len(o.token_ids) - 1 for o in outs) / seconds if seconds else 0.0


def run_demo(model: str = DEFAULT_MODEL, device: str | None = None, dtype: str | None = None,
             context: int = 4096, compressor: str = DEMO_COMPRESSOR, kv_dtype: str | None = None) -> dict:
    llm = LLM(model, device=device, dtype=dtype, kv_dtype=kv_dtype)
    tok = llm.tokenizer
    needle = lt.needle_tasks(tok, 1, context - 64, context, seed=3)[0]
    code = lt.code_tasks(tok, 1, context - 64, context, seed=5, max_tokens=CODE_TOKENS)[0]
    tasks = [needle, code]
    from vericache_lab.bench.common import cpu_model

    where = cpu_model() if llm.loaded.device.type == "cpu" else str(llm.loaded.device)
    print(f"model {model} on {where} (weights {llm.loaded.dtype}, {llm.loaded.numerics} numerics, KV "
          f"{llm.loaded.kv_dtype}); compressor {compressor}")
    print(f"task 1: a value hidden in a {len(needle.prompt_ids)}-token Python file; asked in chat for it "
          f"(right answer: {needle.answer})")
    print(f"task 2: complete `{code.head.splitlines()[0].strip()}` after {len(code.prompt_ids)} tokens of its source file")
    print(f"\n{'mode':>9} {'tok/s':>6} {'vs full':>7} {'KV kept':>7}  {'task 1 answer':<38} {'task 2':<15} notes"
          f"   (tok/s: both tasks decoded as one batch)")
    outs = {}
    params = [SamplingParams(max_tokens=t.max_tokens) for t in tasks]
    prefills = [llm.engine.shared_prefill(llm.engine.new_sequence(i, t.prompt_ids, p))
                for i, (t, p) in enumerate(zip(tasks, params))]
    draft_weights = "auto" if llm.loaded.device.type == "cpu" else "fp32"
    for mode in ("full", "lossy", "vericache"):
        engine = Engine(llm.loaded, llm.engine.config, mode=mode, compressor=compressor,
                        draft_weights=draft_weights if mode == "vericache" else "fp32")
        seqs = [engine.new_sequence(i, t.prompt_ids, p) for i, (t, p) in enumerate(zip(tasks, params))]
        outs[mode] = engine.generate(seqs, prefills=prefills)
    speed = {mode: batch_tokens_per_s(res) for mode, res in outs.items()}
    for mode, (ans, comp) in outs.items():
        same = [o.token_ids == f.token_ids for o, f in zip(outs[mode], outs["full"])]
        right = "right" if lt.first_number(ans.text) == needle.answer else "WRONG"
        parses = "parses" if lt.function_parses(code.head, comp.text) else "SYNTAX ERROR"
        notes = "identical to full" if all(same) else "DIFFERS from full"
        if mode == "vericache":
            rounds = sum(o.stats["rounds"] for o in outs[mode])
            drafted, accepted = (sum(o.stats[k] for o in outs[mode]) for k in ("drafted_tokens", "accepted_tokens"))
            emitted = sum(len(o.token_ids) - 1 for o in outs[mode])
            per_token = comp.stats["draft_steps"] / max(len(comp.token_ids) - 1, 1)
            notes += (f"; {emitted / rounds:.1f} tokens/round, acceptance {accepted / max(drafted, 1):.0%}"
                      f", drafts on {draft_weights} weights; task 2: {per_token:.2f} drafter forwards a token"
                      f" ({comp.stats['lookup_kept_tokens']} drafts from lookup)")
        kept = sum(o.stats.get("compression_ratio", 1.0) for o in outs[mode]) / len(tasks)
        print(f"{mode:>9} {speed[mode]:6.1f} {speed[mode] / speed['full']:6.2f}x {kept:7.1%}  "
              f"{right + ': ' + _first_line(ans.text):<38} {parses:<15} {notes}")
    for mode in ("vericache", "lossy"):
        if mode == "lossy" and outs["lossy"][1].token_ids == outs["full"][1].token_ids:
            continue
        print(f"\n---- task 2, {mode} completion{' (== full KV)' if mode == 'vericache' else ' (drifted)'} ----")
        print(code.head + outs[mode][1].text)
    return outs
