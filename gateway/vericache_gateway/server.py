"""``vericache serve``: build the engine service and run the gateway with uvicorn."""

from __future__ import annotations

import os

from vericache.engine.config import DEFAULTS, EngineConfig
from vericache.serving.build import build_service


def serve(config: EngineConfig = DEFAULTS, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          backend: str = "embedded", triton_url: str = "127.0.0.1:8001", trace: str | None = None,
          max_per_key: int = 0, **remote) -> None:
    """``config``: the engine (embedded) or what the Triton model runs (``backend="triton"``: labels,
    limits and option defaults); ``remote``: ``build_service``'s prefix store and verifier settings."""
    import logging

    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    from vericache_gateway.app import create_app
    from vericache_gateway.backends import EmbeddedBackend, TritonBackend

    if backend == "triton":
        be = TritonBackend(triton_url, config)
    else:
        be = EmbeddedBackend(build_service(config, **remote))
    app = create_app(be, model_name=config.model, api_key=api_key or os.environ.get("VERICACHE_API_KEY"), trace=trace,
                     max_per_key=max_per_key)
    app.router.on_shutdown.append(be.close)  # drains in-flight requests before the process exits
    uvicorn.run(app, host=host, port=port, log_level="info")
