"""Build a ``BackgroundService`` from an ``EngineConfig`` (the gateway and the Triton model)."""

from __future__ import annotations

from vericache.engine.config import DEFAULTS, EngineConfig
from vericache.engine.engine import Engine
from vericache.serving.service import BackgroundService


def build_service(config: EngineConfig = DEFAULTS, prefix_store: str | None = None, prefix_link: str = "local",
                  verifier: str | list[str] | None = None, prefix_model_id: str | None = None) -> BackgroundService:
    """``prefix_store`` (redis://...): prompts load their stored prefix KV over ``prefix_link``;
    ``verifier`` (grpc://..., or several: a pool, ``remote.pool``): the drafter role, vericache requests
    verified there;
    ``prefix_model_id``: the id the store and the verifier know the model's KV by (default: this
    model's own, ``remote.prefixes.model_id``); a drafter in a cheaper dtype than its verifier sets
    the verifier's, as its drafts only need to be close, while the verifier's KV must be exact."""
    loaded = config.load_model()
    fetcher = client = None
    if prefix_store or verifier:
        from vericache.remote.prefixes import model_id
        mid = prefix_model_id or model_id(loaded)
        if prefix_store:
            from vericache.remote.fetch import PrefixFetcher
            from vericache.remote.store import PrefixStore
            fetcher = PrefixFetcher(PrefixStore(prefix_store, mid), link=prefix_link)
        if verifier:
            from vericache.remote.pool import VerifierPool
            client = VerifierPool([verifier] if isinstance(verifier, str) else list(verifier), mid)
    return BackgroundService(Engine(loaded, config, prefix=fetcher, verifier=client))
