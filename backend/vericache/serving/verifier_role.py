"""``vericache serve --role verifier``: the verifier engine next to the prefix store, over gRPC,
with its Prometheus metrics on their own port."""

from __future__ import annotations

import logging
import signal
import threading

from vericache.engine.config import EngineConfig
from vericache.remote.prefixes import model_id
from vericache.remote.server import start_server
from vericache.remote.store import PrefixStore
from vericache.remote.verifier import VerifierCore
from vericache.serving.trace import TraceFile, tee

log = logging.getLogger("vericache.verifier")


def run_verifier(config: EngineConfig, host: str, port: int, prefix_store: str | None = None,
                 store_prefixes: bool = False, metrics_port: int = 0, ready: threading.Event | None = None,
                 trace: str | None = None) -> None:
    """``config``: the model and where it runs (the verifier decodes in full mode). ``trace``: also write the verifier's events (fetches, prefills, verifications) to this
    JSON-lines file (``serving.trace``)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    loaded = config.load_model()
    mid = model_id(loaded)
    store = PrefixStore(prefix_store, mid) if prefix_store else None
    core = VerifierCore(loaded, store, store_prefixes)
    server = start_server(core, mid, f"{host}:{port}")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    sink = tee(_metrics(mid, host, metrics_port) if metrics_port else None, TraceFile(trace) if trace else None)
    print(f"verifier {mid} on grpc://{host}:{port} (store: {prefix_store or 'none'})", flush=True)
    if ready is not None:
        ready.set()
    while not stop.wait(0.5):
        while core.events:
            event, fields = core.events.pop(0)
            sink(event, fields)
    server.stop(grace=2).wait()
    core.shutdown()


def _metrics(mid: str, host: str, port: int):
    from prometheus_client import start_http_server

    from vericache.serving.metrics import Metrics, metrics_sink

    m = Metrics(mid, "verifier", "")
    start_http_server(port, addr=host, registry=m.registry)
    return metrics_sink(m)


