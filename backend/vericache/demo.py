"""``vericache demo``: what the Quickstart shows on the bundled model."""

from __future__ import annotations

from vericache.llm import LLM
from vericache.sampling import SamplingParams

DEMO_PROMPT = 'import os\n\n\ndef read_config(path):\n    """Read a config file and return a dict."""\n'


def run_demo(model: str = "tiny", device: str | None = None, dtype: str | None = None) -> None:
    llm = LLM(model, device=device, dtype=dtype)
    print(f"model: {llm.loaded.path} ({llm.loaded.device}, {llm.loaded.dtype})")
    out = llm.generate(DEMO_PROMPT, SamplingParams(max_tokens=64))[0]
    print("---- prompt ----")
    print(DEMO_PROMPT, end="")
    print("---- full-KV greedy continuation ----")
    print(out.text)
    s = out.stats
    print(f"---- {len(out.token_ids)} tokens, finish={out.finish_reason}, prefill {s['prefill_s'] * 1e3:.0f} ms, "
          f"decode {s['decode_tokens_per_s']:.1f} tokens/s ----")
