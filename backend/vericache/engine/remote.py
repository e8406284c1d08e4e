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
from vericache.engine.request import DRAFTING, FINISHED, PREFILL, TRANSFERRING, Request
from vericache.remote.client import VerifierUnavailable
from vericache.remote.forms import load_compressed, load_full

log = logging.getLogger("vericache.engine")


def prefix_form(req: Request) -> str:
    return "full" if req.mode == "full" else req.opts.compressor.spec()


def start(srv, req: Request) -> None:
    """At allocation: start the prefix fetch and open the verifier session, as they apply."""
    ids = req.prefill_ids
    if srv.prefix is not None and req.prefill is None and (req.mode != "vericache" or srv.memory.remote):
        req.fetch = srv.prefix.fetch(ids, prefix_form(req), srv.eng.loaded.device)
    if srv.memory.is_remote(req):
        comp = req.opts.compressor.spec()
        req.session = srv.verifier.session(ids, max(req.seq.remaining, 1), comp)


def fetch_pending(srv, req: Request) -> bool:
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
            n = load_compressed(req.draft, got.blocks, srv.prefix.store.block_tokens)
        req.done_ids = req.prefix_tokens = n
    req.fetch_bytes, req.fetch_s = got.nbytes, got.seconds
    return False


def poll(srv) -> None:
    """Apply every verifier reply that has landed (first tokens, verified rounds, failures)."""
    for req in list(srv.requests.values()):
        if req.session is None or req.done:
            continue
        while not req.done:
            try:
                item = req.session.poll()
            except VerifierUnavailable as exc:
                srv.fail(req, f"verifier unavailable: {exc}", status=503)
                break
            if item is None:
                break
            tensors, msg, rtt = item
            srv.instruments.remote_rtts.append(rtt)
            if msg["op"] == "opened":
                _first_token(srv, req, msg)
            elif msg["op"] == "verified" and req.state == TRANSFERRING:
                _verified(srv, req, msg["accepted"], msg["token"], tensors["k"], tensors["v"])


def _first_token(srv, req: Request, msg: dict) -> None:
    req.verifier_hit_tokens = msg.get("hit_tokens", 0)
    if req.seq.output_ids:  # re-admitted after preemption: the token is known already
        return
    finished = req.seq.append(int(msg["token"]))
    req.first_token_at = time.perf_counter()
    log.info("request %s: first token from the verifier %.3f s after arrival (verifier had %d prompt tokens "
             "stored; drafter loaded %d, state %s)", req.id, req.first_token_at - req.added_at,
             req.verifier_hit_tokens, req.prefix_tokens, req.state)
    if finished:
        srv.release(req, FINISHED)
    elif req.state == PREFILL and req.prefilled:
        srv.set_state(req, DRAFTING)


def _verified(srv, req: Request, m: int, token: int, k, v) -> None:
    rs, start = req.round, req.position
    m = accept_draft(req.seq, None, rs.drafts, rs.qs, rs.drafts[:m] + [token])
    req.draft.commit_exact(start, k, v, start + 1 + m)   # the verifier's K/V replace the drafter's own
    record_round(rs, len(rs.drafts), m)
    srv.round_done(req, m)
    if req.seq.finished:
        srv.release(req, FINISHED)
    else:
        srv.set_state(req, DRAFTING)
        srv.charge(req)


def send_verifies(srv) -> None:
    """Put every complete remote round on the wire."""
    for req in srv.in_state(DRAFTING):
        if req.session is not None and req.round.complete:
            req.session.verify(req.position, [req.last_token] + req.round.drafts)
            srv.set_state(req, TRANSFERRING)


def waiting_on_remote(srv) -> bool:
    return any((r.session is not None and r.session.in_flight) or r.fetch is not None
               for r in srv.requests.values() if not r.done)
