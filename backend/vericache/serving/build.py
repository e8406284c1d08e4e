"""Build an ``EngineService`` from plain settings (used by the gateway and the Triton model)."""

from __future__ import annotations

from vericache.engine.engine import Engine
from vericache.engine.serving import ServingEngine
from vericache.model.loader import load_model
from vericache.model.registry import DEFAULT_MODEL
from vericache.serving.service import EngineService


def build_service(model: str = DEFAULT_MODEL, mode: str = "vericache", compressor: str = "snapkv:ratio=0.125",
                  draft_len: int | str = "auto", device: str | None = None, dtype: str | None = None,
                  device_budget: int = 4 << 30, max_queue: int = 64) -> EngineService:
    loaded = load_model(model, device=device, dtype=dtype)
    engine = Engine(loaded, mode=mode, compressor=compressor, draft_len=draft_len)
    return EngineService(ServingEngine(engine, device_budget=device_budget), max_queue=max_queue)
