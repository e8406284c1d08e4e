"""``vericache serve``: build the engine service and run the gateway with uvicorn."""

from __future__ import annotations

import os

from vericache.serving.build import build_service


def serve(host: str = "127.0.0.1", port: int = 8000, model: str = "tiny", api_key: str | None = None,
          **engine_kwargs) -> None:
    import uvicorn

    from vericache_gateway.app import create_app

    service = build_service(model, **engine_kwargs)
    app = create_app(service, model_name=model, api_key=api_key or os.environ.get("VERICACHE_API_KEY"))
    app.router.on_shutdown.append(lambda: service.shutdown(drain_timeout=30))  # drain in-flight requests
    uvicorn.run(app, host=host, port=port, log_level="info")
