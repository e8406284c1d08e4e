"""``vericache serve``: build the engine service and run the gateway with uvicorn."""

from __future__ import annotations

import os

from vericache.model.registry import DEFAULT_MODEL
from vericache.serving.build import build_service


def serve(host: str = "127.0.0.1", port: int = 8000, model: str = DEFAULT_MODEL, api_key: str | None = None,
          backend: str = "embedded", triton_url: str = "127.0.0.1:8001", trace: str | None = None,
          max_per_key: int = 0, **engine_kwargs) -> None:
    import logging

    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    from vericache_gateway.app import create_app
    from vericache_gateway.backends import EmbeddedBackend, TritonBackend

    if backend == "triton":
        be = TritonBackend(triton_url, model=model, mode=engine_kwargs.get("mode", "vericache"),
                           compressor=engine_kwargs.get("compressor", "snapkv:ratio=0.125"),
                           draft_len=engine_kwargs.get("draft_len", "auto"))
    else:
        be = EmbeddedBackend(build_service(model, **engine_kwargs))
    app = create_app(be, model_name=model, api_key=api_key or os.environ.get("VERICACHE_API_KEY"), trace=trace,
                     max_per_key=max_per_key)
    app.router.on_shutdown.append(be.close)  # drains in-flight requests before the process exits
    uvicorn.run(app, host=host, port=port, log_level="info")
