"""The engine's remote half (the prefix-caching scenario), kept out of the step loop's file.

- Prefix fetch: a request whose prompt may be stored starts a background fetch when it is admitted
  (full mode: the full form; lossy and remote vericache: the compressor's form); its prefill waits
  for it, loads what arrived, and computes the rest (a store outage or a bad block: from there).
- Remote verification (``--role drafter``): a vericache request has no full cache here. Admission
  opens a session on the verifier (which prefills exactly and sends the first token); the drafter
  prefills its own compressed cache meanwhile. Each complete round goes out as one message while the
  engine keeps stepping other requests; the reply (m, the verifier's token, the exact K/V of the
  kept positions) is applied between steps.
"""

from __future__ import annotations

import logging
import time

from vericache.drafting.round import accept_draft, record_round
from vericache.engine.request import Request, State
from vericache.remote.client import VerifierUnavailable
from vericache.remote.forms import load_full

log = logging.getLogger("vericache.engine")


def prefix_form(req: Request) -> str:
    return "full" if req.mode == "full" else req.opts.compressor.spec()


def start(loop, req: Request) -> None:
    """At allocation: start the prefix fetch and open the verifier session, as they apply."""
    ids = req.prefill_ids
    if loop.prefix is not None and req.prefill is None and (req.mode != "vericache" or loop.memory.remote):
        req.fetch = loop.prefix.fetch(ids, prefix_form(req), loop.runner.loaded.device)
    if loop.memory.is_remote(req):
        comp = req.opts.compressor.spec()
        req.session = loop.verifier.session(ids, max(req.seq.remaining, 1), comp)


def fetch_pending(loop, req: Request) -> bool:
    """True while the request's prefix fetch is in flight; applies it once it has landed."""
    if req.fetch is None:
        return False
    if not req.fetch.done():
        return True
    got, req.fetch = req.fetch.result(), None
    if got.blocks:
        if req.mode == "full":
            n = load_full(req.full, got.blocks)
        else:
            n = req.draft.load_stored(got.blocks, loop.prefix.store.block_tokens)
        req.done_ids = req.prefix_tokens = n
    req.fetch_bytes, req.fetch_s = got.nbytes, got.seconds
    return False


def poll(loop) -> None:
    """Apply every verifier reply that has landed (first tokens, verified rounds, failures)."""
    for req in list(loop.requests):
        if req.session is None or req.done:
            continue
        while not req.done:
            try:
                item = req.session.poll()
            except VerifierUnavailable as exc:
                loop.requests.fail(req, f"verifier unavailable: {exc}", status=503)
                break
            if item is None:
                break
            tensors, msg, rtt = item
            loop.instruments.remote_rtts.append(rtt)
            if msg["op"] == "opened":
                _first_token(loop, req, msg)
            elif msg["op"] == "verified" and req.state == State.AWAITING_VERIFIER:
                _verified(loop, req, msg["accepted"], msg["token"], tensors["k"], tensors["v"])


def _first_token(loop, req: Request, msg: dict) -> None:
    req.verifier_hit_tokens = msg.get("hit_tokens", 0)
    if req.seq.output_ids:  # re-admitted after preemption: the token is known already
        return
    finished = req.seq.append(int(msg["token"]))
    req.first_token_at = time.perf_counter()
    log.info("request %s: first token from the verifier %.3f s after arrival (verifier had %d prompt tokens "
             "stored; drafter loaded %d, state %s)", req.id, req.first_token_at - req.added_at,
             req.verifier_hit_tokens, req.prefix_tokens, req.state)
    if finished:
        loop.requests.release(req, State.FINISHED)
    elif req.state == State.PREFILL and req.prefilled:
        loop.requests.set_state(req, State.DRAFTING)


def _verified(loop, req: Request, m: int, token: int, k, v) -> None:
    rs, start = req.round, req.position
    m = accept_draft(req.seq, None, rs.drafts, rs.qs, rs.drafts[:m] + [token])
    req.draft.commit_exact(start, k, v, start + 1 + m)   # the verifier's K/V replace the drafter's own
    record_round(rs, len(rs.drafts), m)
    loop.requests.round_done(req, m)
    if req.seq.finished:
        loop.requests.release(req, State.FINISHED)
    else:
        loop.requests.set_state(req, State.DRAFTING)
        loop.requests.charge(req)


def send_verifies(loop) -> None:
    """Put every complete remote round on the wire."""
    for req in loop.requests.in_state(State.DRAFTING):
        if req.session is not None and req.round.complete:
            req.session.verify(req.position, [req.last_token] + req.round.drafts)
            loop.requests.set_state(req, State.AWAITING_VERIFIER)


def waiting_on_remote(loop) -> bool:
    return any((r.session is not None and r.session.in_flight) or r.fetch is not None
               for r in loop.requests if not r.done)
