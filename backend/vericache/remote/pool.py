"""A pool of verifiers for the drafter role (issue 55 item 2): ``--verifier`` given several times.

Placement: a request goes to the verifier that ranks first for its prefix by rendezvous hashing (the
highest sha256 of "url|key" first; key: the hash of the prompt's first 256-token block, the store's
own block hash, or of the whole prompt when shorter). The same prefix goes to the same verifier
whatever order the addresses were given in, so a prefix's full KV is fetched from the store by one
verifier, and a verifier added or removed moves only the prefixes that rank it first.

Failover: a verifier that stops answering (its stream fails: ``VerifierUnavailable``) does not fail the
request while another is left. The session reopens on the next verifier in the prefix's order over the
tokens committed so far (prompt and output, less the last token, which is not in any verifier's KV
yet); that verifier prefills them exactly and its first token must be the last committed one (else the
request fails: nothing wrong is ever emitted); the round in flight is sent again, and its reply is
applied as if nothing had happened. So a verifier's death costs its requests one recomputed prefill and
one round, and the tokens are full decoding's. Each move is an event ("verifier_failover") the metrics
count; when no verifier is left the request fails with 503 as before.
"""

from __future__ import annotations

import hashlib
import threading

from vericache.remote.chain import BLOCK_TOKENS, block_hashes
from vericache.remote.client import RemoteSession, VerifierClient, VerifierUnavailable


def rendezvous_order(urls: list[str], key: str) -> list[str]:
    """``urls`` by descending sha256("url|key"): the first is the key's verifier, the rest its fallbacks."""
    return sorted(urls, key=lambda u: hashlib.sha256(f"{u}|{key}".encode()).digest(), reverse=True)


def placement_key(model_id: str, prompt_ids: list[int]) -> str:
    """What a prompt is placed by: its first block's hash (prompts sharing a stored prefix share it)."""
    hashes = block_hashes(model_id, prompt_ids[:BLOCK_TOKENS], BLOCK_TOKENS)
    return hashes[0] if hashes else hashlib.sha256(repr(list(prompt_ids)).encode()).hexdigest()


class VerifierPool:
    """The verifiers a drafter may use (one or more ``grpc://host:port``), all serving ``model_id``."""

    def __init__(self, urls: list[str], model_id: str) -> None:
        if isinstance(urls, str):
            urls = [urls]
        if not urls:
            raise ValueError("a verifier pool needs at least one grpc://host:port address")
        if len(set(urls)) != len(urls):
            raise ValueError(f"verifier addresses must be distinct, got {urls}")
        self.model_id = model_id
        self.clients = {u: VerifierClient(u, model_id) for u in urls}
        self.events: list[tuple[str, dict]] = []   # drained by the metrics exporter (``Engine.take_events``)
        self._wake = threading.Event()

    @property
    def wake(self) -> threading.Event:
        return self._wake

    @wake.setter
    def wake(self, event: threading.Event) -> None:
        """The engine's event, set by every verifier's sessions when a reply lands."""
        self._wake = event
        for client in self.clients.values():
            client.wake = event

    @property
    def urls(self) -> list[str]:
        return list(self.clients)

    def order(self, prompt_ids: list[int]) -> list[VerifierClient]:
        """The verifiers for this prompt, its own first (``rendezvous_order``)."""
        return [self.clients[u] for u in rendezvous_order(self.urls, placement_key(self.model_id, prompt_ids))]

    def session(self, prompt_ids: list[int], max_tokens: int, compressor: str = "") -> PooledSession:
        return PooledSession(self, self.order(prompt_ids), prompt_ids, max_tokens, compressor)

    def close(self) -> None:
        for client in self.clients.values():
            client.close()


class PooledSession:
    """One request's session on its verifier, moved to the next in its order when that one fails (see
    the module's docstring). Tracks the committed tokens from the replies it passes on."""

    def __init__(self, pool: VerifierPool, order: list[VerifierClient], prompt_ids: list[int], max_tokens: int,
                 compressor: str) -> None:
        self.pool, self.order, self.compressor = pool, order, compressor
        self.prompt_len, self.max_tokens = len(prompt_ids), max_tokens
        self.tokens = list(prompt_ids)   # prompt + output: the last output token is in no verifier's KV yet
        self.pending: tuple[int, list[int]] | None = None   # the round out at the verifier: (start, tokens)
        self.reopening = False           # the current session's open re-derives the last committed token
        self.tried = 0                   # index into ``order`` of the current verifier
        self.current: RemoteSession = order[0].session(prompt_ids, max_tokens, compressor)
        self.closed = False

    @property
    def in_flight(self) -> bool:
        return self.current.in_flight

    @property
    def url(self) -> str:
        return self.current.client.url

    def verify(self, start: int, tokens: list[int]) -> None:
        self.pending = (start, list(tokens))
        if not self.reopening:   # else sent once the new verifier has caught up
            self.current.verify(start, tokens)

    def poll(self) -> tuple[dict, dict, float] | None:
        """The next reply for the engine (as ``RemoteSession.poll``), failing over first where the
        verifier is gone; raises ``VerifierUnavailable`` when none is left."""
        while True:
            try:
                item = self.current.poll()
            except VerifierUnavailable as exc:
                self._fail_over(exc)
                continue
            if item is None:
                return None
            _, msg, _ = item
            if msg["op"] == "opened" and self.reopening:
                self._caught_up(int(msg["token"]))
                continue
            if msg["op"] == "opened":
                self.tokens.append(int(msg["token"]))
            elif msg["op"] == "verified" and self.pending is not None:
                _, sent = self.pending
                self.tokens += sent[1 : 1 + int(msg["accepted"])] + [int(msg["token"])]
                self.pending = None
            return item

    def _caught_up(self, token: int) -> None:
        """The new verifier's open: its first token must be the last one committed; then the round in
        flight goes out again."""
        if token != self.tokens[-1]:
            raise VerifierUnavailable(f"verifier {self.url} reopened at token {token}, not the committed "
                                      f"{self.tokens[-1]}: the request cannot continue exactly")
        self.reopening = False
        if self.pending is not None:
            self.current.verify(*self.pending)

    def _fail_over(self, exc: VerifierUnavailable) -> None:
        gone = self.url
        self.current.close()
        self.tried += 1
        if self.tried >= len(self.order):
            raise exc
        nxt = self.order[self.tried]
        self.pool.events.append(("verifier_failover", {"from": gone, "to": nxt.url}))
        if len(self.tokens) == self.prompt_len:   # no first token yet: open afresh there
            self.current = nxt.session(self.tokens, self.max_tokens, self.compressor)
            return
        produced = len(self.tokens) - self.prompt_len
        self.current = nxt.session(self.tokens[:-1], max(self.max_tokens - produced + 1, 1), self.compressor)
        self.reopening = True

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.current.close()
