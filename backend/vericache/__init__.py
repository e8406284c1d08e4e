"""VeriCache: lossless LLM inference from lossy KV caches."""

from vericache.engine.config import EngineConfig
from vericache.engine.engine import Engine
from vericache.llm import LLM
from vericache.model.loader import resolve_model
from vericache.sampling import RequestOutput, SamplingParams

__all__ = ["Engine", "EngineConfig", "LLM", "RequestOutput", "SamplingParams", "resolve_model"]
