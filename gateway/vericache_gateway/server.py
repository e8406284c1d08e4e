"""``vericache serve``: build the engine service and run the gateway with uvicorn."""

from __future__ import annotations

import os

from vericache.engine.engine import Engine
from vericache.engine.serving import ServingEngine
from vericache.model.loader import load_model
from vericache.serving.service import EngineService


def build_service(model: str = "tiny", mode: str = "vericache", compressor: str = "snapkv:ratio=0.125",
                  draft_len: int | str = "auto", device: str | None = None, dtype: str | None = None,
                  device_budget: int = 4 << 30, max_queue: int = 64) -> EngineService:
    loaded = load_model(model, device=device, dtype=dtype)
    engine = Engine(loaded, mode=mode, compressor=compressor, draft_len=draft_len)
    return EngineService(ServingEngine(engine, device_budget=device_budget), max_queue=max_queue)


def serve(host: str = "127.0.0.1", port: int = 8000, model: str = "tiny", api_key: str | None = None,
          **engine_kwargs) -> None:
    import uvicorn

    from vericache_gateway.app import create_app

    service = build_service(model, **engine_kwargs)
    app = create_app(service, model_name=model, api_key=api_key or os.environ.get("VERICACHE_API_KEY"))
    app.router.on_shutdown.append(lambda: service.shutdown(drain_timeout=30))  # drain in-flight requests
    uvicorn.run(app, host=host, port=port, log_level="info")
