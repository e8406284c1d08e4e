"""The user-facing Python API: ``LLM(...).generate(prompts, params)``."""

from __future__ import annotations

from collections.abc import Callable

import torch

from vericache.compress.base import Compressor
from vericache.engine.config import DEFAULTS
from vericache.engine.engine import Engine
from vericache.model.tokenizer import Tokenizer
from vericache.sampling import RequestOutput, SamplingParams


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class LLM:
    """Load a model (a name such as "smollm2-135m" or "tiny", a Hugging Face directory or a .gguf
    file) and generate. Every argument's default is ``EngineConfig``'s (``engine.config``), the
    same the server and the benches run.

    mode: "vericache" (draft from the compressed KV, verify with the full KV: lossless), "full"
    (full-KV decoding) or "lossy" (decode from the compressed KV: the lossy baselines).
    compressor: a spec string such as "snapkv:ratio=0.125" or "snapkv:ratio=0.25+kivi:bits=4".
    draft_len: tokens drafted per round, or "auto" (adapts per request).
    draft_weights: what drafts read: "auto", "fp32" (the exact weights), "q8", "int8" or "int4" (CPU;
    verification exact). kv_dtype: what the full KV holds: "float16" (the CPU's default), "bfloat16"
    or "float32". kernels: what the forward runs on ("native" CPU ops, "triton", "torch").
    numerics: the CPU forward's arithmetic, the same for full decoding, verification and drafts: "q8qk"
    (int8 activations in exact integer dot products with the stored codes, and attention in integer
    dots too: ``kernels/int_scores.h``; a GGUF model's default), "q8" (the linears alone in integer dots)
    or "fp32" (exact dequantization; a float checkpoint's default).
    ``settings``: any other ``EngineConfig`` field (``prefill_chunk``, ``device_budget_gb``, ``tiered`` ...).
    """

    def __init__(self, model: str = DEFAULTS.model, device: str | torch.device | None = DEFAULTS.device,
                 dtype: str | torch.dtype | None = DEFAULTS.dtype, mode: str = DEFAULTS.mode,
                 compressor: str | Compressor = DEFAULTS.compressor, draft_len: int | str = DEFAULTS.draft_len,
                 draft_weights: str = DEFAULTS.draft_weights, kv_dtype: str | torch.dtype | None = DEFAULTS.kv_dtype,
                 kernels: str | None = DEFAULTS.kernels, numerics: str | None = DEFAULTS.numerics,
                 **settings) -> None:
        named = lambda x: dtype_name(x) if isinstance(x, torch.dtype) else x   # noqa: E731
        config = DEFAULTS.replace(model=model, mode=mode, compressor=compressor, draft_len=draft_len,
                                  draft_weights=draft_weights, device=None if device is None else str(device),
                                  dtype=named(dtype), kv_dtype=named(kv_dtype), kernels=kernels, numerics=numerics,
                                  **settings)   # validated before the load
        self.loaded = lm = config.load_model()
        # the config names what was loaded (the device, dtypes, kernels and numerics its defaults chose)
        self.engine = Engine(lm, config.replace(device=str(lm.device), dtype=dtype_name(lm.dtype),
                                                kv_dtype=dtype_name(lm.kv_dtype), kernels=lm.kernels,
                                                numerics=lm.numerics), time_costs_now=False)
        self._next_id = 0

    @property
    def tokenizer(self) -> Tokenizer:
        return self.loaded.tokenizer

    def generate(self, prompts: str | list[str], params: SamplingParams | None = None,
                 progress: Callable[[int, int], None] | None = None) -> list[RequestOutput]:
        """Complete ``prompts`` together; ``progress(done, total)``: prompt tokens prefilled so far, after
        each step that prefilled (a long prompt prefills ``prefill_chunk`` tokens a step)."""
        prompts = checked_prompts(prompts)
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        seqs = [self.engine.new_sequence(self._next_id + i, self.tokenizer.encode(p), params)
                for i, p in enumerate(prompts)]
        self._next_id += len(prompts)
        return self.engine.generate(seqs, progress=progress)


def checked_prompts(prompts: str | list[str]) -> list[str]:
    """``prompts`` as a list of non-empty strings (ValueError naming the first that is not): asked before
    anything is loaded by a caller that can (the CLI)."""
    if isinstance(prompts, str):
        prompts = [prompts]
    if not isinstance(prompts, list) or not prompts:
        raise ValueError(f"prompts must be a non-empty string or list of strings, got {prompts!r:.80}")
    for i, p in enumerate(prompts):
        if not isinstance(p, str) or not p:
            raise ValueError(f"prompt {i} is empty or not a string: {p!r:.80}")
    return prompts
