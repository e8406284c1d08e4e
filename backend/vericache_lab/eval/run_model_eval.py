"""``vericache eval-model``: the bundled model's quality floor, measured on held-out data."""

from __future__ import annotations

import time

from vericache.model.loader import load_model
from vericache.model.registry import DEFAULT_MODEL
from vericache_lab.data import corpus
from vericache_lab.eval.model_quality import heldout_loss, retrieval_exact_match, toolcall_exact_match


def heldout_tokens(tokenizer) -> list[int]:
    eot = tokenizer.token_to_id(corpus.EOT)
    ids: list[int] = []
    for text in corpus.read_split(heldout=True):
        ids += tokenizer.encode(text) + ([eot] if eot is not None else [])
    return ids


def run_model_eval(model: str = DEFAULT_MODEL, n: int = 50, device: str | None = None, dtype: str | None = None,
                   log=print, kv_dtype: str | None = None) -> dict:
    lm = load_model(model, device=device, dtype=dtype, kv_dtype=kv_dtype)
    held = heldout_tokens(lm.tokenizer)
    t0 = time.time()
    result = {"model": str(lm.path), "heldout_files": "stdlib ~2% (sha1(path) % 50 == 0)",
              "heldout_loss_nats_per_token": round(heldout_loss(lm.model, held, window=1024, max_windows=64), 4)}
    log(f"held-out loss {result['heldout_loss_nats_per_token']} nats/token")
    for ctx in (1024, 2048):
        r = retrieval_exact_match(lm.model, lm.tokenizer, held, n=n, context_tokens=ctx)
        result[f"retrieval_em_heldout_layouts_{ctx}"] = r.exact_match
        log(f"retrieval exact match at {ctx} tokens (held-out layouts): {r.exact_match:.2%}")
    result["retrieval_em_train_layouts_1536"] = retrieval_exact_match(
        lm.model, lm.tokenizer, held, n=n, context_tokens=1536, heldout=False).exact_match
    t = toolcall_exact_match(lm.model, lm.tokenizer, held, n=n, context_tokens=1024)
    result["toolcall_argument_em_heldout_layouts"] = t.exact_match
    result["toolcall_argument_em_train_layouts"] = toolcall_exact_match(
        lm.model, lm.tokenizer, held, n=n, context_tokens=1024, heldout=False).exact_match
    result["n_per_metric"] = n
    result["eval_seconds"] = round(time.time() - t0, 1)
    return result
