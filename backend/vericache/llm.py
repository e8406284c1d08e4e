"""The user-facing Python API: ``LLM(...).generate(prompts, params)``."""

from __future__ import annotations

import torch

from vericache.compress.base import Compressor
from vericache.engine.runner import DEFAULT_COMPRESSOR, ModelRunner
from vericache.model.loader import load_model
from vericache.model.registry import DEFAULT_MODEL
from vericache.model.tokenizer import Tokenizer
from vericache.sampling import RequestOutput, SamplingParams


class LLM:
    """Load a model (a name such as "smollm2-135m" or "tiny", a Hugging Face directory or a .gguf
    file) and generate.

    mode: "full" (full-KV decoding), "lossy" (decode from the compressed KV: the lossy
    baselines) or "vericache" (draft from the compressed KV, verify with the full KV: lossless).
    compressor: a spec string such as "snapkv:ratio=0.25" or "snapkv:ratio=0.25+kivi:bits=4".
    draft_len: tokens drafted per round, or "auto" (adapts per request).
    draft_weights: what drafts read: "fp32" (the exact weights), "int8" or "int4" (CPU; verification exact).
    kv_dtype: what the full KV holds: "float16" (the CPU's default), "bfloat16" or "float32".
    """

    def __init__(self, model: str = DEFAULT_MODEL, device: str | torch.device | None = None,
                 dtype: str | torch.dtype | None = None, mode: str = "full",
                 compressor: str | Compressor = DEFAULT_COMPRESSOR, draft_len: int | str = "auto",
                 draft_weights: str = "fp32", kv_dtype: str | torch.dtype | None = None,
                 kernels: str | None = None) -> None:
        """``kernels``: what the forward runs on ("native" CPU ops, "triton", "torch"; ``load_model``)."""
        self.runner = None
        self.loaded = load_model(model, device=device, dtype=dtype, kv_dtype=kv_dtype, kernels=kernels)
        self.runner = ModelRunner(self.loaded, mode=mode, compressor=compressor, draft_len=draft_len,
                             draft_weights=draft_weights)
        self._next_id = 0

    @property
    def tokenizer(self) -> Tokenizer:
        return self.loaded.tokenizer

    def generate(self, prompts: str | list[str], params: SamplingParams | None = None) -> list[RequestOutput]:
        if isinstance(prompts, str):
            prompts = [prompts]
        if not isinstance(prompts, list) or not prompts:
            raise ValueError(f"prompts must be a non-empty string or list of strings, got {prompts!r:.80}")
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        seqs = []
        for i, p in enumerate(prompts):
            if not isinstance(p, str) or not p:
                raise ValueError(f"prompt {i} is empty or not a string: {p!r:.80}")
            seqs.append(self.runner.new_sequence(self._next_id + i, self.tokenizer.encode(p), params))
        self._next_id += len(prompts)
        return self.runner.generate(seqs)
