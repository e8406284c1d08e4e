"""After a step's forward: each row's result applied to its request (``StepLoop.step``'s last
part). Prefill chunks advance and, at the prompt's end, compress it and pick the first token; decode
rows append their token; draft rows add their token to the round; verifications accept up to the
first mismatch and commit the verifier's K/V (``drafting.round``). Then each request finishes, or is
charged for what it now holds (which may preempt newer ones). An exception fails only its request."""

from __future__ import annotations

import logging
import time

import torch

from vericache.drafting.round import add_draft, finish_round
from vericache.engine.batch import RowKind, StepBatch
from vericache.engine.request import DONE, Request, State
from vericache.kv.full import FullKVCache
from vericache.kv.link import StreamedKV
from vericache.sampling import choose_token

log = logging.getLogger("vericache.engine")


def postprocess(loop, batch: StepBatch) -> None:
    handlers = {RowKind.PREFILL: _after_prefill, RowKind.DECODE: _after_decode, RowKind.DRAFT: _after_draft,
                RowKind.VERIFY: _after_verify}
    for row in batch.rows:
        req = row.req
        if req.done or req.state == State.WAITING:
            continue  # aborted, or preempted by an earlier row's growth in this step
        try:
            handlers[row.kind](loop, req, row)
            if req.seq.finished:
                loop.requests.release(req, State.FINISHED)
            elif req.state not in (State.WAITING, *DONE):
                loop.requests.charge(req)
        except Exception as exc:  # noqa: BLE001 - this request fails; the others go on
            log.exception("request %s failed in %s", req.id, row.kind)
            loop.requests.fail(req, f"{type(exc).__name__}: {exc}")


def finish_prefill(loop, req: Request, logits: torch.Tensor, context: FullKVCache | None) -> None:
    """The prompt (and any recomputed output) is in the caches: compress, pick the first token."""
    runner, seq, n = loop.runner, req.seq, req.done_ids
    if req.prefill_buf is not None:  # home to the host tier
        req.full.load(req.prefill_buf, n)
    if req.draft is not None:
        comp = req.opts.compressor
        ids = req.prefill_ids
        # a prompt partly loaded from the prefix store has no whole-prompt context here
        whole = req.draft.prefill_context()
        scores = None if whole is None else comp.on_prefill(runner.model, context or whole, ids, runner.tokenizer)
        req.draft.set_prefill_scores(scores, n)
        # compression starts once the whole prompt is in (an exact prefill); beside a full
        # cache the draft cache takes the prompt's K/V from it
        req.draft.commit(n, source=context)
    if req.resident is not None:  # the resident layers go up once
        req.resident.load(req.prefill_buf or req.full, n)
    req.prefill_buf = None
    if loop.memory.is_remote(req):  # the first token is the verifier's (exact), not the drafter's
        req.prefilled = True
        if seq.output_ids:
            loop.requests.set_state(req, State.DRAFTING)
        return
    if not seq.output_ids:
        seq.append(choose_token(logits, seq.params, seq.generator))
        req.first_token_at = time.perf_counter()
    loop.requests.set_state(req, State.DRAFTING if req.mode == "vericache" else State.DECODING)


def _after_prefill(loop, req: Request, row) -> None:
    req.done_ids += len(row.tokens)
    if row.logits is not None:
        finish_prefill(loop, req, row.logits[0], req.prefill_buf or req.full)


def _after_decode(loop, req: Request, row) -> None:
    if req.draft is not None:  # lossy: the drafter's own K/V are final
        req.draft_bytes_read += req.draft.nbytes()
        req.draft.commit(req.position + 1)
    params = req.seq.params
    req.seq.append(row.argmax[0] if params.greedy else choose_token(row.logits[0], params, req.seq.generator))


def _after_draft(loop, req: Request, row) -> None:
    req.draft_bytes_read += req.draft.nbytes()
    add_draft(req.seq, req.round, row.logits[0], row.argmax[0])


def _after_verify(loop, req: Request, row) -> None:
    rs, start = req.round, req.position
    write_back = None
    if isinstance(row.cache, StreamedKV):
        write_back = lambda s, e: _write_back(loop, req, row.cache, s, e)  # noqa: E731
    req.verify_bytes_read += req.full.nbytes()
    m = finish_round(req.seq, rs, row.logits, start, req.full, req.draft, write_back, row.argmax)
    loop.requests.round_done(req, m)
    if req.state == State.TRANSFERRING:
        loop.device.free(("verify", req.id))
        req.transfer = None
        loop.requests.set_state(req, State.DRAFTING)


def _write_back(loop, req: Request, view: StreamedKV, start: int, keep: int) -> None:
    """The verified positions, written on the device, back to the host tier."""
    req.full.begin(start, keep - start)
    req.full.overwrite(view.buf, start, keep, first_layer=loop.memory.resident_layers)
    if req.resident is not None:  # the resident layers were written on the device
        req.full.overwrite(req.resident, start, keep)
        req.resident.truncate(keep)
