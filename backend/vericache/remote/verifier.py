"""The verifier role: full-KV sessions next to the prefix store, verifying drafts sent from afar.

A session is one request: ``open`` fetches the prompt's leading blocks' full K/V from the store
(the fast link), prefills the rest exactly and returns the first token; each ``verify`` runs
[x, d1 .. dk] at positions n .. n+k through the full cache and returns the accepted count m, the
verifier's token (correction or bonus) and the exact K/V of positions n .. n+m, so the drafter's
cache tracks the full model. ``close`` frees the session's KV. Greedy only: the drafter sends
token ids, not distributions.

One worker thread owns the model: each forward (``engine.batch``) carries the next chunk of every
open's tail prefill and every queued verification, so the weights are read once per step, opens
that land together prefill together, and one that lands later joins at the next chunk rather than
queueing behind whole prefills. Store fetches run in the callers' threads,
overlapping the worker.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from vericache.drafting.round import greedy_accepted
from vericache.engine.batch import RowKind, StepBatch
from vericache.engine.sequence import positions_needed
from vericache.kv.full import FullKVCache
from vericache.kv.tee import QueryRecorder, TeeCache
from vericache.remote.forms import compressed_forms, full_forms
from vericache.remote.store import PrefixStore, StoreUnavailable

log = logging.getLogger("vericache.verifier")


@dataclass
class Session:
    id: int
    prompt_ids: list[int]
    max_tokens: int
    compressor: str = ""             # the drafter's, for --store-prefixes
    full: FullKVCache | None = None
    hit_tokens: int = 0
    fetch_bytes: int = 0
    fetch_s: float = 0.0
    closed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


class VerifierCore:
    def __init__(self, engine, store: PrefixStore | None = None, store_prefixes: bool = False,
                 max_sessions: int = 256, autostart: bool = True, prefill_chunk: int = 64) -> None:
        """``autostart=False``: the worker waits for ``start()`` (work queued before it shares its turn).
        ``prefill_chunk``: tail tokens per session per forward; small, so opens that land while
        others prefill join them within a chunk's time instead of queueing behind whole prefills."""
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.prefill_chunk = prefill_chunk
        self.runner, self.store, self.store_prefixes = engine, store, store_prefixes
        self.max_sessions = max_sessions
        self.sessions: dict[int, Session] = {}
        self.events: list[tuple[str, dict]] = []      # drained by the metrics exporter
        self._ids = itertools.count()
        self._work: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="vericache-verifier", daemon=True)
        if autostart:
            self.start()

    def start(self) -> None:
        self._thread.start()

    def pending(self) -> int:
        """Work items queued for the worker."""
        return self._work.qsize()

    # ------------------------------------------------------------------ callers (any thread)
    def open(self, prompt_ids: list[int], max_tokens: int, compressor: str = "") -> tuple[Session, int]:
        """A new session over ``prompt_ids``; returns it and the first generated token."""
        self.runner.check_request(prompt_ids, _greedy(max_tokens))
        with self._lock:
            if len(self.sessions) >= self.max_sessions:
                raise RuntimeError(f"verifier is full: {self.max_sessions} sessions open")
            sess = Session(next(self._ids), list(prompt_ids), max_tokens, compressor)
            self.sessions[sess.id] = sess
        runner = self.runner
        full = FullKVCache(runner.cfg, runner.loaded.device, runner.loaded.kv_dtype,
                           capacity=positions_needed(len(prompt_ids), max_tokens))
        if self.store is not None:
            limit = (len(prompt_ids) - 1) // self.store.block_tokens  # the last token is always computed
            try:   # each block is received straight into the session's cache (this thread)
                got = self.store.get_full_into(prompt_ids, full, limit)
                sess.fetch_bytes, sess.fetch_s = got.nbytes, got.seconds
                self._event("prefix", {"link": "fast", "tier": "full", "bytes": got.nbytes, "seconds": got.seconds,
                                       "hit_blocks": got.count, "miss_blocks": limit - got.count})
            except StoreUnavailable as exc:
                log.warning("session %s: %s; recomputing the whole prompt", sess.id, exc)
                self._event("store_error", {"role": "verifier"})
                full.truncate(0)
        t0 = time.perf_counter()
        token = self._submit("open", sess, full).result()
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
        if start + len(tokens) > positions_needed(len(sess.prompt_ids), sess.max_tokens):
            raise ValueError(f"verify of {len(tokens)} tokens at {start} runs past prompt + max_tokens")
        return self._submit("verify", sess, (start, list(tokens))).result()

    def close(self, sess: Session) -> None:
        with sess.lock:
            sess.closed, sess.full = True, None  # the KV goes now
        with self._lock:
            self.sessions.pop(sess.id, None)

    def shutdown(self) -> None:
        self._stop.set()
        self._work.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _submit(self, kind: str, sess: Session, arg) -> Future:
        fut: Future = Future()
        self._work.put((kind, sess, arg, fut))
        return fut

    def _event(self, name: str, fields: dict) -> None:
        """``fields`` plus ``end``, the wall-clock time it happened (events are drained later)."""
        self.events.append((name, {**fields, "end": time.time()}))

    # ------------------------------------------------------------------ the worker
    def _loop(self) -> None:
        tails: list[Tail] = []    # opens whose tail prefill is under way
        while not self._stop.is_set():
            items = [] if tails else [self._work.get()]   # idle: wait; prefilling: take what is queued
            while True:
                try:
                    items.append(self._work.get_nowait())
                except queue.Empty:
                    break
            items = [x for x in items if x is not None]
            tails += [self._tail(sess, full, fut) for kind, sess, full, fut in items if kind == "open"]
            with torch.inference_mode():
                tails = self._step(tails, [x for x in items if x[0] == "verify"])

    def _step(self, tails: list[Tail], verifies: list) -> list[Tail]:
        """One forward: the next ``prefill_chunk`` tokens of every open's tail and every queued
        verification, so an open that lands while others prefill joins them at the next chunk.
        Returns the tails left to prefill."""
        batch = StepBatch()
        for t in tails:
            chunk = t.left[: self.prefill_chunk]
            t.left = t.left[len(chunk):]
            batch.add(t, RowKind.PREFILL, chunk, t.at, t.cache, "none" if t.left else "last")
            t.at += len(chunk)
        futs = self._add_verifies(batch, verifies)
        if not batch.rows:
            return []
        t0 = time.perf_counter()
        try:
            batch.run(self.runner.model, self.runner.loaded.device)
        except Exception as exc:  # noqa: BLE001 - reported to the callers
            log.exception("verifier forward failed")
            for fut in futs + [t.fut for t in tails]:
                fut.set_exception(exc)
            return []
        seconds = time.perf_counter() - t0
        prefill_rows = batch.of(RowKind.PREFILL)
        if prefill_rows:
            self._event("prefill", {"tokens": sum(len(r.tokens) for r in prefill_rows), "rows": len(prefill_rows),
                                    "seconds": seconds})
        if futs:
            self._event("verify_step", {"rows": len(futs), "seconds": seconds, "with_prefill": bool(prefill_rows)})
        self._finish_verifies(batch.of(RowKind.VERIFY), futs)
        for row in prefill_rows:
            if row.logits_for == "last":
                self._run(row.req.fut, self._opened, row.req, row.argmax[0])
        return [t for t in tails if t.left]

    def _tail(self, sess: Session, full: FullKVCache, fut: Future) -> Tail:
        """A session's cache (the stored blocks loaded) and the prompt tokens left to prefill."""
        sess.hit_tokens = full.length
        recorder = QueryRecorder(self.runner.cfg.num_hidden_layers, 64)
        return Tail(sess, fut, full, recorder, TeeCache(full, recorder), list(sess.prompt_ids[full.length:]), full.length)

    def _opened(self, tail: Tail, token: int) -> int:
        sess = tail.sess
        if self.store_prefixes and self.store is not None:
            self._store_prefix(sess, tail.full, tail.recorder.queries, sess.hit_tokens)
        with sess.lock:
            if not sess.closed:
                sess.full = tail.full
        return token

    @staticmethod
    def _run(fut: Future, fn, *args) -> None:
        try:
            fut.set_result(fn(*args))
        except Exception as exc:  # noqa: BLE001 - reported to the callers
            log.exception("verifier work failed")
            fut.set_exception(exc)

    def _store_prefix(self, sess: Session, full: FullKVCache, queries: list, hit: int) -> None:
        """Put the prompt's whole blocks (full, and the drafter's compressor's form) when some were missing."""
        bt = self.store.block_tokens
        nb = (len(sess.prompt_ids) - 1) // bt
        if nb * bt <= hit:
            return
        from vericache.compress.registry import parse_compressor
        forms = {"full": full_forms(full, nb, bt)}
        if sess.compressor:
            comp = parse_compressor(sess.compressor)
            forms[comp.spec()] = compressed_forms(comp, full, queries, nb, bt)
        try:
            self.store.put(sess.prompt_ids[: nb * bt], forms)
        except StoreUnavailable as exc:
            log.warning("could not store the prefix of session %s: %s", sess.id, exc)

    @staticmethod
    def _add_verifies(batch: StepBatch, items: list) -> list[Future]:
        futs = []
        for _, sess, (start, tokens), fut in items:
            if sess.full is None or sess.closed:
                fut.set_exception(ValueError(f"session {sess.id} is closed"))
                continue
            batch.add(sess, RowKind.VERIFY, tokens, start, sess.full, "all")
            futs.append(fut)
        return futs

    @staticmethod
    def _finish_verifies(rows: list, futs: list[Future]) -> None:
        for row, fut in zip(rows, futs):
            sess, start, targets = row.req, row.start, row.argmax
            m = greedy_accepted(targets, row.tokens[1:])
            keep = start + 1 + m
            sess.full.truncate(keep)
            fut.set_result((m, targets[m], *sess.full.copy_out(start, keep)))


@dataclass
class Tail:
    """An open in progress: the prompt tokens still to prefill (``left``, from position ``at``)."""
    sess: Session
    fut: Future
    full: FullKVCache
    recorder: QueryRecorder
    cache: TeeCache
    left: list[int]
    at: int


def _greedy(max_tokens: int):
    from vericache.sampling import SamplingParams
    return SamplingParams(max_tokens=max_tokens, temperature=0.0)
