"""Build a ``BackgroundService`` from plain settings (used by the gateway and the Triton model)."""

from __future__ import annotations

from vericache.engine.runner import ModelRunner
from vericache.engine.step_loop import StepLoop
from vericache.model.loader import load_model
from vericache.model.registry import DEFAULT_MODEL
from vericache.serving.service import BackgroundService


def build_service(model: str = DEFAULT_MODEL, mode: str = "vericache", compressor: str = "snapkv:ratio=0.125",
                  draft_len: int | str = "auto", device: str | None = None, dtype: str | None = None,
                  device_budget: int = 4 << 30, max_queue: int = 64, prefix_store: str | None = None,
                  prefix_link: str = "local", verifier: str | None = None, prefix_model_id: str | None = None,
                  prefill_chunk: int = 512, draft_weights: str = "fp32", kv_dtype: str | None = None) -> BackgroundService:
    """``prefix_store`` (redis://...): prompts load their stored prefix KV over ``prefix_link``;
    ``verifier`` (grpc://...): the drafter role, vericache requests verified there;
    ``prefix_model_id``: the id the store and the verifier know the model's KV by (default: this
    model's own, ``remote.prefixes.model_id``); a drafter in a cheaper dtype than its verifier sets
    the verifier's, as its drafts only need to be close, while the verifier's KV must be exact."""
    loaded = load_model(model, device=device, dtype=dtype, kv_dtype=kv_dtype)
    engine = ModelRunner(loaded, mode=mode, compressor=compressor, draft_len=draft_len, draft_weights=draft_weights)
    fetcher = client = None
    if prefix_store or verifier:
        from vericache.remote.prefixes import model_id
        mid = prefix_model_id or model_id(loaded)
        if prefix_store:
            from vericache.remote.fetch import PrefixFetcher
            from vericache.remote.store import PrefixStore
            fetcher = PrefixFetcher(PrefixStore(prefix_store, mid), link=prefix_link)
        if verifier:
            from vericache.remote.client import VerifierClient
            client = VerifierClient(verifier, mid)
    serving = StepLoop(engine, device_budget=device_budget, prefix=fetcher, verifier=client,
                            prefill_chunk=prefill_chunk)
    return BackgroundService(serving, max_queue=max_queue)
