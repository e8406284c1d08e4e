"""``vericache demo``: the Quickstart. One long prompt decoded in full, lossy and vericache modes."""

from __future__ import annotations

from vericache.bench.common import code_prompt
from vericache.engine.engine import Engine
from vericache.llm import LLM
from vericache.model.registry import DEFAULT_MODEL
from vericache.sampling import SamplingParams

DEMO_COMPRESSOR = "snapkv:ratio=0.125"


def run_demo(model: str = DEFAULT_MODEL, device: str | None = None, dtype: str | None = None,
             context: int = 4096, max_tokens: int = 96, compressor: str = DEMO_COMPRESSOR) -> dict:
    llm = LLM(model, device=device, dtype=dtype)
    prompt = code_prompt(llm.tokenizer, context)  # held-out standard-library code
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    print(f"model {llm.loaded.path.name} on {llm.loaded.device} ({llm.loaded.dtype}); prompt: {len(prompt)} tokens "
          f"of held-out Python; compressor: {compressor}")
    outs = {}
    for mode in ("full", "lossy", "vericache"):
        eng = Engine(llm.loaded, mode=mode, compressor=compressor)
        outs[mode] = eng.generate([eng.new_sequence(0, prompt, params)])[0]
    full = outs["full"]
    for mode, out in outs.items():
        st = out.stats
        same = "identical to full" if out.token_ids == full.token_ids else \
            f"DIFFERS from full at token {next(i for i, (a, b) in enumerate(zip(out.token_ids, full.token_ids)) if a != b)}"
        line = f"{mode:>9}: {st['decode_tokens_per_s']:7.1f} tok/s  ({st['decode_tokens_per_s'] / full.stats['decode_tokens_per_s']:.2f}x full)  {same}"
        if mode != "full":
            line += f"  KV kept: {st['compression_ratio']:.1%} of full bytes"
        if mode == "vericache":
            line += (f"  acceptance {st['acceptance_rate']:.0%}, {st['mean_acceptance_length']:.1f} tokens/round "
                     f"over {st['rounds']} rounds")
        print(line)
    print("---- vericache output (== full-KV output) ----")
    print(outs["vericache"].text)
    if outs["lossy"].token_ids != full.token_ids:
        print("---- lossy output (drifted) ----")
        print(outs["lossy"].text)
    return outs
