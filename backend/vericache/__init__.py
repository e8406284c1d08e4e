"""VeriCache: lossless LLM inference from lossy KV caches.

The public names load on first use (PEP 562): `import vericache.remote.relay` (a delay relay, one per
slow-link service) or `vericache --help` need not import PyTorch and the engine, ~1.4 s a process."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vericache.engine.config import EngineConfig
    from vericache.engine.engine import Engine
    from vericache.llm import LLM
    from vericache.model.loader import resolve_model
    from vericache.sampling import RequestOutput, SamplingParams

# each public name -> the module that defines it
_PUBLIC = {
    "Engine": "vericache.engine.engine",
    "EngineConfig": "vericache.engine.config",
    "LLM": "vericache.llm",
    "RequestOutput": "vericache.sampling",
    "SamplingParams": "vericache.sampling",
    "resolve_model": "vericache.model.loader",
}

__all__ = ["Engine", "EngineConfig", "LLM", "RequestOutput", "SamplingParams", "resolve_model"]


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'vericache' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
