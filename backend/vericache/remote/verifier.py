"""The verifier role: full-KV sessions next to the prefix store, verifying drafts sent from afar.

A session is one request: ``open`` fetches the prompt's leading blocks' full K/V from the store
(the fast link), prefills the rest exactly and returns the first token; each ``verify`` runs
[x, d1 .. dk] at positions n .. n+k through the full cache and returns the accepted count m, the
verifier's token (correction or bonus) and the exact K/V of positions n .. n+m, so the drafter's
cache tracks the full model. ``close`` frees the session's KV. Greedy only: the drafter sends
token ids, not distributions.

It runs an ``Engine`` (full mode, every cache in one memory): a session is a request in state
``serving`` (``Engine.add_session``) whose verification rows come from the network instead of
from local drafts (``Served``), and the round's end is ``drafting.round``'s
``verify_for_drafter``. One worker thread owns the loop: callers' opens, verifications and closes
are queued to it, and each step carries the next ``prefill_chunk`` tokens of every open's tail
prefill and every queued verification, so the weights are read once per step, opens that land
together prefill together, and one that lands later joins at the next chunk rather than queueing
behind whole prefills. Store fetches run in the callers' threads, overlapping the worker.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from vericache.engine.engine import Engine, Served
from vericache.engine.options import Intake, RequestOptions
from vericache.engine.owner import EngineOwner
from vericache.kv.full import FullKVCache
from vericache.kv.tee import QueryRecorder
from vericache.remote.forms import compressed_forms, full_forms
from vericache.remote.store import PrefixStore, StoreUnavailable
from vericache.sampling import SamplingParams, positions_needed

log = logging.getLogger("vericache.verifier")


@dataclass
class Session:
    id: int
    intake: Intake                   # its prompt and budget, checked when it opened (``Engine.intake``)
    compressor: str = ""             # the drafter's, for --store-prefixes
    full: FullKVCache | None = None
    hit_tokens: int = 0
    fetch_bytes: int = 0
    fetch_s: float = 0.0
    closed: bool = False
    request_id: int = -1             # its request in the step loop, once the worker has added it
    recorder: QueryRecorder | None = None
    opened: Future = field(default_factory=Future, repr=False)   # the first token
    replies: list = field(default_factory=list, repr=False)      # futures of verifications not yet answered
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def prompt_ids(self) -> list[int]:
        return self.intake.prompt_ids


class VerifierCore:
    def __init__(self, loaded, store: PrefixStore | None = None, store_prefixes: bool = False,
                 max_sessions: int = 256, autostart: bool = True, prefill_chunk: int = 64) -> None:
        """``autostart=False``: the worker waits for ``start()`` (work queued before it shares its turn).
        ``prefill_chunk``: tail tokens per session per forward; small, so opens that land while
        others prefill join them within a chunk's time instead of queueing behind whole prefills."""
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.prefill_chunk = prefill_chunk
        self.store, self.store_prefixes = store, store_prefixes
        self.max_sessions = max_sessions
        self.sessions: dict[int, Session] = {}
        self.events: list[tuple[str, dict]] = []      # drained by the metrics exporter
        self._ids = itertools.count()
        self._lock = threading.Lock()
        # full mode, the sessions' KV in one memory; the step budget admits every session's chunk: each
        # is capped per session (``Served.chunk``)
        self.engine = Engine(loaded, mode="full", prefill_chunk=1 << 30, max_running=max_sessions, tiered=False,
                             device_budget_gb=None)
        self._answers: list[tuple[Future, object]] = []   # results of this step, given after its events
        self._owner = EngineOwner("vericache-verifier", self.engine.sessions_busy, self._step, self._step_failed,
                                  autostart=autostart)

    def start(self) -> None:
        self._owner.start()

    def pending(self) -> int:
        """Work items queued for the worker."""
        return self._owner.pending()

    # ------------------------------------------------------------------ callers (any thread)
    def open(self, prompt_ids: list[int], max_tokens: int, compressor: str = "") -> tuple[Session, int]:
        """A new session over ``prompt_ids``; returns it and the first generated token."""
        intake = self.engine.intake(prompt_ids, SamplingParams(max_tokens=max_tokens), RequestOptions(mode="full"))
        with self._lock:
            if len(self.sessions) >= self.max_sessions:
                raise RuntimeError(f"verifier is full: {self.max_sessions} sessions open")
            sess = Session(next(self._ids), intake, compressor)
            self.sessions[sess.id] = sess
        loaded = self.engine.loaded
        full = FullKVCache(loaded.config, loaded.device, loaded.kv_dtype,
                           capacity=positions_needed(len(prompt_ids), max_tokens), key_codes=loaded.key_codes)
        if self.store is not None:
            limit = (len(prompt_ids) - 1) // self.store.block_tokens  # the last token is always computed
            try:   # each block is received straight into the session's cache (this thread)
                got = self.store.get_full_into(prompt_ids, full, limit)
                sess.fetch_bytes, sess.fetch_s = got.nbytes, got.seconds
                if got.reason == "unavailable":   # a node failed mid-fetch: the blocks before its first are kept
                    log.warning("session %s: the prefix store failed after %d of %d blocks; computing the rest",
                                sess.id, got.count, limit)
                    self._event("store_error", {"role": "verifier"})
                self._event("prefix", {"link": "fast", "tier": "full", "bytes": got.nbytes, "seconds": got.seconds,
                                       "hit_blocks": got.count, "miss_blocks": limit - got.count})
            except StoreUnavailable as exc:
                log.warning("session %s: %s; recomputing the whole prompt", sess.id, exc)
                self._event("store_error", {"role": "verifier"})
                full.truncate(0)
        t0 = time.perf_counter()
        self._owner.call(lambda: self._add_session(sess, full))
        token = sess.opened.result()
        log.info("session %s: %d of %d prompt tokens from the store (%.1f MB in %.3f s), then queue + prefill %.3f s",
                 sess.id, sess.hit_tokens, len(prompt_ids), sess.fetch_bytes / 1e6, sess.fetch_s,
                 time.perf_counter() - t0)
        return sess, token

    def verify(self, sess: Session, start: int, tokens: list[int]) -> tuple[int, int, torch.Tensor, torch.Tensor]:
        """Verify [x, d1 .. dk] at ``start``: (m, token, K, V [L, Hkv, m+1, D] of start .. start+m)."""
        if sess.closed or sess.full is None:
            raise ValueError(f"session {sess.id} is closed")
        if not tokens or start != sess.full.length:
            raise ValueError(f"verify at position {start} with {len(tokens)} tokens; session {sess.id} "
                             f"expects position {sess.full.length} and at least one token")
        if start + len(tokens) > positions_needed(len(sess.prompt_ids), sess.intake.params.max_tokens):
            raise ValueError(f"verify of {len(tokens)} tokens at {start} runs past prompt + max_tokens")
        fut: Future = Future()
        self._owner.call(lambda: self._queue_verification(sess, start, list(tokens), fut))
        return fut.result()

    def close(self, sess: Session) -> None:
        """The session ends: its request is aborted at the worker's next turn (its KV freed then)."""
        with sess.lock:
            sess.closed, sess.full = True, None
        with self._lock:
            self.sessions.pop(sess.id, None)
        self._owner.call(lambda: self._close_session(sess))

    def shutdown(self) -> None:
        self._owner.stop()

    def _event(self, name: str, fields: dict) -> None:
        """``fields`` plus ``end``, the wall-clock time it happened (events are drained later)."""
        self.events.append((name, {**fields, "end": time.time()}))

    # ------------------------------------------------------------------ on the engine's thread
    def _step_failed(self, exc: Exception) -> bool:
        """The loop itself broke: fail what it holds, every session's waiters get the error; go on."""
        self.engine.fail_unfinished(f"{type(exc).__name__}: {exc}")
        for sess in list(self.sessions.values()):
            self._fail(sess, exc)
        return True

    def _close_session(self, sess: Session) -> None:
        """Its KV goes now; an open or a verification still waiting gets an error."""
        if sess.request_id >= 0:
            self.engine.abort(sess.request_id)
            self.engine.forget(sess.request_id)
        self._fail(sess, ValueError(f"session {sess.id} is closed"))

    def _queue_verification(self, sess: Session, start: int, tokens: list[int], fut: Future) -> None:
        sess.replies.append(fut)
        if sess.closed or sess.request_id < 0 or not self.engine.queue_verification(
                sess.request_id, start, tokens, self._reply(sess, fut)):
            sess.replies.remove(fut)
            fut.set_exception(ValueError(f"session {sess.id} is closed"))

    def _add_session(self, sess: Session, full: FullKVCache) -> None:
        sess.hit_tokens = full.length
        if self.store_prefixes and self.store is not None:
            sess.recorder = QueryRecorder(self.engine.loaded.config.num_hidden_layers, 64)
        served = Served(lambda token: self._opened(sess, full, token), self.prefill_chunk, sess.recorder)
        try:
            sess.request_id = self.engine.add_session(sess.intake, sess.id, full, served)
        except Exception as exc:  # noqa: BLE001 - reported to the caller
            sess.opened.set_exception(exc)

    def _reply(self, sess: Session, fut: Future):
        def reply(result: tuple) -> None:
            sess.replies.remove(fut)
            self._answers.append((fut, result))
        return reply

    def _step(self) -> None:
        """One step of the loop; its forward's events; then its answers (so a caller that reads the
        events sees this step's); any session its step failed gets the error."""
        instruments = self.engine.instruments
        n = instruments.n_steps
        try:
            with torch.inference_mode():
                self.engine.step()
            if instruments.n_steps > n:
                rec = instruments.steps[-1]
                seconds, by_kind = rec.end - rec.start, rec.by_kind
                if "prefill" in by_kind:
                    rows, tokens = by_kind["prefill"]
                    self._event("prefill", {"tokens": tokens, "rows": rows, "seconds": seconds})
                if "verify" in by_kind:
                    self._event("verify_step", {"rows": by_kind["verify"][0], "seconds": seconds,
                                                "with_prefill": "prefill" in by_kind})
        finally:
            answers, self._answers = self._answers, []
            for fut, result in answers:
                if not fut.done():
                    fut.set_result(result)
        for sess in list(self.sessions.values()):
            error = self.engine.failure(sess.request_id)
            if error is not None:
                self._fail(sess, RuntimeError(f"session {sess.id}: {error}"))

    @staticmethod
    def _fail(sess: Session, exc: Exception) -> None:
        """Whatever the session's callers still wait for gets ``exc``."""
        for fut in [sess.opened, *sess.replies]:
            if not fut.done():
                fut.set_exception(exc)
        sess.replies.clear()

    def _opened(self, sess: Session, full: FullKVCache, token: int) -> None:
        """The prompt is in (called from the loop's update): store the prefix if asked, answer the open."""
        if sess.recorder is not None:
            self._store_prefix(sess, full, sess.recorder.recorded(), sess.hit_tokens)
        with sess.lock:
            if not sess.closed:
                sess.full = full
        self._answers.append((sess.opened, token))   # answered after the step's events (``_step``)

    def _store_prefix(self, sess: Session, full: FullKVCache, queries: list, hit: int) -> None:
        """Put the prompt's whole blocks (full, and the drafter's compressor's form) when some were missing."""
        store = self.store
        if store is None:
            return
        bt = store.block_tokens
        nb = (len(sess.prompt_ids) - 1) // bt
        if nb * bt <= hit:
            return
        from vericache.compress.registry import parse_compressor
        forms = {"full": full_forms(full, nb, bt)}
        if sess.compressor:
            comp = parse_compressor(sess.compressor)
            forms[comp.spec()] = compressed_forms(comp, full, queries, nb, bt)
        try:
            store.put(sess.prompt_ids[: nb * bt], forms)
        except StoreUnavailable as exc:
            log.warning("could not store the prefix of session %s: %s", sess.id, exc)
