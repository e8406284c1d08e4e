"""The engine's remote half (the prefix-caching scenario), kept out of the step loop's file.

- Prefix fetch: a request whose prompt may be stored starts a background fetch when it is admitted
  (full mode: the full form; lossy and remote vericache: the compressor's form); its prefill waits
  for it, loads what arrived, and computes the rest (a store outage or a bad block: from there).
- Remote verification (``--role drafter``): a vericache request has no full cache here. Admission
  opens a session on the verifier (which prefills exactly and sends the first token); the drafter
  prefills its own compressed cache meanwhile. Each complete round goes out as one message while the
  engine keeps stepping other requests; the reply (m, the verifier's token, the exact K/V of the
  kept positions) is applied between steps.
``RemoteRounds`` holds the two remote parts and the request table, memory and instruments it
updates; the scheduler asks it at a prefill (``start``, ``fetch_pending``), the loop around a step
(``poll`` before, ``send_verifies`` after).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol

import torch

from vericache.drafting.round import finish_round
from vericache.engine.memory import KVMemory
from vericache.engine.requests import Fetched, Instruments, Request, RequestTable, State, VerifierSession

log = logging.getLogger("vericache.engine")


class RemoteUnavailable(RuntimeError):
    """A remote part (the verifier) is gone: its requests fail with 503 (``remote.client`` raises it)."""


def prefix_form(req: Request) -> str:
    return req.placement.prefix_form(req.opts.compressor.spec())


class BlockGeometry(Protocol):
    block_tokens: int   # positions per stored block


RemoteEvent = tuple[str, dict[str, Any]]   # (event, its fields): fetches, store outages, failovers (metrics)


class PrefixSource(Protocol):
    """Where a drafter's prompt prefixes come from (``remote.fetch.PrefixFetcher``)."""
    events: list[RemoteEvent]
    wake: threading.Event   # set when a fetch lands (the engine's loop waits on it)

    @property
    def store(self) -> BlockGeometry: ...

    def fetch(self, token_ids: list[int], form: str, device: torch.device | str) -> Future[Fetched]: ...


class VerifierSource(Protocol):
    """Where a drafter's rounds are verified (``remote.client.VerifierClient``): one session a request."""
    events: list[RemoteEvent]
    wake: threading.Event   # set when a reply lands

    def session(self, prompt_ids: list[int], max_tokens: int, compressor: str = "") -> VerifierSession: ...


class RemoteRounds:
    def __init__(self, prefix: PrefixSource | None, verifier: VerifierSource | None, requests: RequestTable,
                 memory: KVMemory, instruments: Instruments, device: torch.device, charge: Callable[[Request], None]) -> None:
        """``prefix``: a prefix store's fetcher or None; ``verifier``: the remote verifier's client or
        None; ``charge``: the scheduler's charge after a request's caches grew (it may preempt)."""
        self.prefix, self.verifier = prefix, verifier
        self.requests, self.memory, self.instruments, self.device, self.charge = requests, memory, instruments, device, charge

    def start(self, req: Request) -> None:
        """At allocation: start the prefix fetch and open the verifier session, as they apply."""
        ids = req.prefill_ids
        if self.prefix is not None and req.prefill.shared is None and req.placement.loads_stored_prefix:
            req.remote.fetch = self.prefix.fetch(ids, prefix_form(req), self.device)
        if req.placement.remote:
            if self.verifier is None:   # placement is remote only where the engine has a verifier
                raise RuntimeError("a remote placement needs the engine's verifier client")
            comp = req.opts.compressor.spec()
            req.remote.session = self.verifier.session(ids, max(req.seq.remaining, 1), comp)

    def fetch_pending(self, req: Request) -> bool:
        """True while the request's prefix fetch is in flight; applies it once it has landed."""
        if req.remote.fetch is None:
            return False
        if not req.remote.fetch.done():
            return True
        got, req.remote.fetch = req.remote.fetch.result(), None
        if got.blocks and self.prefix is not None:   # a fetch is only started with a prefix source
            if not req.placement.draft_here:
                n = req.kv.full_kv().load_blocks(got.blocks)
            else:
                n = req.kv.draft_kv().load_stored(got.blocks, self.prefix.store.block_tokens)
            req.prefill.done_ids = req.remote.prefix_tokens = n
        req.remote.fetch_bytes, req.remote.fetch_s = got.nbytes, got.seconds
        return False

    def poll(self) -> None:
        """Apply every verifier reply that has landed (first tokens, verified rounds, failures)."""
        for req in list(self.requests):
            if req.remote.session is None or req.done:
                continue
            while not req.done:
                try:
                    item = req.remote.session.poll()
                except RemoteUnavailable as exc:
                    self.requests.fail(req, f"verifier unavailable: {exc}", status=503)
                    break
                if item is None:
                    break
                tensors, msg, rtt = item
                self.instruments.remote_rtts.append(rtt)
                if msg["op"] == "opened":
                    self._first_token(req, msg)
                elif msg["op"] == "verified" and req.state == State.AWAITING_VERIFIER:
                    self._verified(req, msg["accepted"], msg["token"], tensors["k"], tensors["v"])

    def _first_token(self, req: Request, msg: dict[str, Any]) -> None:
        req.remote.verifier_hit_tokens = msg.get("hit_tokens", 0)
        if req.seq.output_ids:  # re-admitted after preemption: the token is known already
            return
        finished = req.seq.append(int(msg["token"]))
        req.measured.first_token_at = time.perf_counter()
        log.info("request %s: first token from the verifier %.3f s after arrival (verifier had %d prompt tokens "
                 "stored; drafter loaded %d, state %s)", req.id, req.measured.first_token_at - req.measured.added_at,
                 req.remote.verifier_hit_tokens, req.remote.prefix_tokens, req.state)
        if finished:
            self.requests.release(req, State.FINISHED)
        elif req.state == State.PREFILL and req.prefill.complete:
            self.requests.set_state(req, State.DRAFTING)

    def _verified(self, req: Request, m: int, token: int, k: torch.Tensor, v: torch.Tensor) -> None:
        rs = req.drafting.round
        m = finish_round(req.seq, rs, req.position, req.kv.draft_kv(), targets=rs.drafts[:m] + [token], exact_kv=(k, v))
        self.requests.round_done(req, m)
        if req.seq.finished:
            self.requests.release(req, State.FINISHED)
        else:
            self.requests.set_state(req, State.DRAFTING)
            self.charge(req)

    def send_verifies(self) -> None:
        """Put every complete remote round on the wire."""
        for req in self.requests.in_state(State.DRAFTING):
            if req.remote.session is not None and req.drafting.round.complete:
                req.remote.session.verify(req.position, [req.last_token] + req.drafting.round.drafts)
                self.requests.set_state(req, State.AWAITING_VERIFIER)

    def waiting(self) -> bool:
        """A verifier reply or a prefix fetch is still to come."""
        return any((r.remote.session is not None and r.remote.session.in_flight) or r.remote.fetch is not None
                   for r in self.requests if not r.done)
