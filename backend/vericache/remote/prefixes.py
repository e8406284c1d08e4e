"""Prefix operations behind ``vericache prefix put|get|ls|rm`` and the benches: compute a prompt's
stored forms with the model, write them, and report what a prompt would hit."""

from __future__ import annotations

import re
import time

import torch

from vericache.compress.base import prompt_scores
from vericache.compress.registry import parse_compressor
from vericache.kv.full import FullKVCache
from vericache.kv.tee import QueryRecorder, TeeCache
from vericache.remote.forms import compressed_forms, full_forms
from vericache.remote.store import PrefixStore


def model_id(loaded) -> str:
    """What keys a model's blocks: its name, the dtypes its K/V were computed in and the numerics, with
    q8qk's key coding (``LoadedModel.numerics_id``: K/V computed with other weights, dtypes or arithmetic
    must never be mixed in)."""
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", loaded.name or loaded.path.name)
    return (f"{name}-{str(loaded.dtype).removeprefix('torch.')}-kv{str(loaded.kv_dtype).removeprefix('torch.')}"
            f"-{loaded.numerics_id.replace(':', '-')}")


@torch.inference_mode()
def put_prompt(engine, store: PrefixStore, token_ids: list[int], compressors: list[str]) -> dict:
    """Prefill ``token_ids`` exactly on ``engine`` (an ``Engine``) and store the full form of every whole
    block, plus each compressor's form; returns the index entry (with the seconds it took)."""
    bt = store.block_tokens
    nb = len(token_ids) // bt
    if nb == 0:
        raise ValueError(f"a prefix needs at least {bt} tokens (one whole block); got {len(token_ids)}")
    t0 = time.perf_counter()
    loaded = engine.loaded
    cfg = loaded.config
    full = FullKVCache(cfg, loaded.device, loaded.kv_dtype, capacity=nb * bt)
    recorder = QueryRecorder(cfg.num_hidden_layers, 64)
    engine.prefill(token_ids[: nb * bt], [TeeCache(full, recorder)])
    forms = {"full": full_forms(full, nb, bt)}
    for spec in compressors:
        comp = parse_compressor(spec)
        scores = prompt_scores(comp, loaded.model, full, token_ids[: nb * bt], loaded.tokenizer)
        forms[comp.spec()] = compressed_forms(comp, full, recorder.recorded(), nb, bt, scores)
    entry = store.put(token_ids[: nb * bt], forms)
    entry.pop("hashes", None)
    entry["seconds"] = round(time.perf_counter() - t0, 3)
    return entry


def describe(store: PrefixStore, token_ids: list[int], compressors: list[str]) -> dict:
    """What a prompt would hit: leading blocks per form, and (fetching them) bytes and integrity."""
    forms: dict[str, dict] = {}
    out = {"prompt_tokens": len(token_ids), "whole_blocks": len(token_ids) // store.block_tokens, "forms": forms}
    for form in ["full"] + [parse_compressor(c).spec() for c in compressors]:
        got = store.get(token_ids, form)
        forms[form] = {"blocks": len(got.blocks), "tokens": len(got.blocks) * store.block_tokens,
                              "bytes": got.nbytes, "seconds": round(got.seconds, 4), "status": got.reason}
    return out
