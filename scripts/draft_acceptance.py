"""Acceptance of VeriCache's drafts by what they read, on one prompt and one shared exact prefill.

    python scripts/draft_acceptance.py --context 8000 --compressor snapkv:ratio=0.125

Rows: fp32 drafts (the exact op), q8 drafts as shipped (integer dots in the layers, exact LM head),
and q8 with the LM head on integer dots too (what q8 drafts did before the head was kept exact).
"""

from __future__ import annotations

import argparse

from vericache import LLM, SamplingParams
from vericache.engine.engine import Engine
from vericache.model.draft_weights import Q8Linear
from vericache_lab.bench.common import code_prompt, cpu_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--context", type=int, default=8000)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--compressor", default="snapkv:ratio=0.125")
    args = ap.parse_args()
    llm = LLM(args.model, device="cpu")
    prompt = code_prompt(llm.tokenizer, args.context)
    params = SamplingParams(max_tokens=args.max_tokens)
    base = Engine(llm.loaded, mode="vericache", compressor=args.compressor)
    shared = base.shared_prefill(base.new_sequence(0, prompt, params))
    model = llm.loaded.model
    print(f"{args.model}, {args.context} tokens, {args.compressor}, {cpu_model()}")
    for label, weights, q8_head in (("fp32", "fp32", False), ("q8", "q8", False), ("q8 + q8 head", "q8", True)):
        runner = Engine(llm.loaded, mode="vericache", compressor=args.compressor, draft_weights=weights)
        if q8_head:
            model.quantize_drafts("q8")
            copies, _ = model.draft_sets["q8"]
            model.draft_sets["q8"] = (copies, Q8Linear(model.head_exact))
            model.quantize_drafts("q8")   # apply the set (steps re-apply only when the kind changes)
        out = runner.generate([runner.new_sequence(0, prompt, params)], prefills=[shared])[0]
        st = out.stats
        print(f"{label:>14}: acceptance {st['accepted_tokens'] / max(st['drafted_tokens'], 1):.3f}, "
              f"{st['rounds']} rounds, {len(out.token_ids) / max(st['rounds'], 1):.2f} tokens a round")
        if q8_head:
            model.draft_sets.pop("q8")   # back to the shipped q8 set on the next build
            model.quantize_drafts("fp32")


if __name__ == "__main__":
    main()
