"""VeriCache: lossless LLM inference from lossy KV caches."""

from vericache.llm import LLM
from vericache.model.loader import resolve_model
from vericache.sampling import RequestOutput, SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams", "resolve_model"]
