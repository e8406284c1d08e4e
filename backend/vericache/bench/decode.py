"""``vericache bench decode``: our full-KV decode against Hugging Face transformers ``generate``.

Same model directory, dtype, thread count and prompt, in one process, side by
side. Decode speed excludes prefill on both sides: ours from the engine's own
timers, transformers' as generate(max_new_tokens=T) minus generate(max_new_tokens=1).
"""

from __future__ import annotations

import time

import torch

from vericache.bench.common import code_prompt, markdown_table
from vericache.llm import LLM
from vericache.sampling import SamplingParams


def hf_decode_tokens_per_s(path: str, prompt: list[int], max_tokens: int, dtype: torch.dtype) -> float:
    from transformers import AutoModelForCausalLM  # dev extra: only this benchmark needs it

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


def run_decode_baseline(model: str, contexts: list[int], max_tokens: int, log=print) -> list[dict]:
    llm = LLM(model, device="cpu", dtype="float32")
    rows = []
    for ctx in contexts:
        prompt = code_prompt(llm.tokenizer, ctx)
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        llm.engine.generate_full([llm.engine.new_sequence(0, prompt[:64], params)])  # warm-up
        ours = llm.engine.generate_full([llm.engine.new_sequence(0, prompt, params)])[0]
        ours_tps = ours.stats["decode_tokens_per_s"]
        hf_tps = hf_decode_tokens_per_s(str(llm.loaded.path), prompt, max_tokens, torch.float32)
        row = {"context": ctx, "max_tokens": max_tokens, "threads": torch.get_num_threads(),
               "vericache_full_tok_s": round(ours_tps, 1), "transformers_tok_s": round(hf_tps, 1),
               "ratio": round(ours_tps / hf_tps, 2)}
        log(f"context {ctx}: ours {row['vericache_full_tok_s']} tok/s, transformers {row['transformers_tok_s']} "
            f"tok/s, ratio {row['ratio']}x")
        rows.append(row)
    return rows


def baseline_markdown(rows: list[dict]) -> str:
    return markdown_table(rows, ["context", "max_tokens", "threads", "vericache_full_tok_s",
                                 "transformers_tok_s", "ratio"])
