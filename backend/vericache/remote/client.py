"""The drafter's side of the verifier: one gRPC bidirectional stream per request.

``send`` never blocks on the network: messages go on the stream's queue, and a reader thread puts
each reply (or the stream's failure) on the session's inbox and wakes the engine (``wake``), which
polls the inbox between steps. Closing the session cancels the stream, which frees the verifier's KV.
"""

from __future__ import annotations

import queue
import threading
import time

import grpc

from vericache.engine.remote_rounds import RemoteUnavailable
from vericache.grpc_channel import RECONNECT_BACKOFF
from vericache.remote.codec import pack, unpack
from vericache.remote.server import CHANNEL_OPTIONS, SERVICE


class VerifierUnavailable(RemoteUnavailable):
    """The verifier cannot be reached or dropped the session (HTTP 503 for the request)."""


class VerifierClient:
    def __init__(self, url: str, model_id: str) -> None:
        target = url.removeprefix("grpc://")
        if not target or ":" not in target:
            raise ValueError(f"verifier URL must be grpc://host:port, got {url!r}")
        self.url, self.model_id = url, model_id
        self.channel_options = CHANNEL_OPTIONS + RECONNECT_BACKOFF   # a restarted verifier seen within ~2 s
        self.channel = grpc.insecure_channel(target, options=self.channel_options)
        self._stream = self.channel.stream_stream(f"/{SERVICE}/Session")
        self._health = self.channel.unary_unary(f"/{SERVICE}/Health")
        self.wake = threading.Event()   # set whenever any session has a reply
        self.events: list[tuple[str, dict]] = []   # none: one verifier has nowhere to fail over (``remote.pool``)

    def health(self, timeout_s: float = 2.0) -> dict:
        """The verifier's health reply; ``VerifierUnavailable`` when it does not answer in time."""
        try:
            _, meta = unpack(self._health(b"", timeout=timeout_s))
        except grpc.RpcError as exc:
            raise VerifierUnavailable(f"verifier {self.url} unavailable: {exc.code().name}") from None
        if meta.get("model_id") != self.model_id:
            raise VerifierUnavailable(f"verifier {self.url} serves {meta.get('model_id')!r}, not {self.model_id!r}")
        return meta

    def session(self, prompt_ids: list[int], max_tokens: int, compressor: str = "") -> RemoteSession:
        return RemoteSession(self, prompt_ids, max_tokens, compressor)

    def close(self) -> None:
        self.channel.close()


class RemoteSession:
    def __init__(self, client: VerifierClient, prompt_ids: list[int], max_tokens: int, compressor: str) -> None:
        self.client = client
        self._out: queue.Queue = queue.Queue()
        self.inbox: queue.Queue = queue.Queue()
        self.in_flight = True                     # the open's reply is awaited
        self.closed = False
        self._out.put(pack({}, {"op": "open", "prompt_ids": list(prompt_ids), "max_tokens": max_tokens,
                                "model_id": client.model_id, "compressor": compressor}))
        self.sent_at = time.perf_counter()
        self._call = client._stream(iter(self._out.get, None), wait_for_ready=False)
        threading.Thread(target=self._read, daemon=True, name="vericache-verifier-reader").start()

    def verify(self, start: int, tokens: list[int]) -> None:
        """Send a round's chunk [x, d1 .. dk] at ``start``; the reply lands in ``inbox``."""
        self.in_flight, self.sent_at = True, time.perf_counter()
        self._out.put(pack({}, {"op": "verify", "start": start, "tokens": list(tokens)}))

    def poll(self) -> tuple[dict, dict, float] | None:
        """The next reply (tensors, message, round-trip seconds), or None; raises VerifierUnavailable."""
        try:
            item = self.inbox.get_nowait()
        except queue.Empty:
            return None
        if isinstance(item, Exception):
            raise item
        self.in_flight = False
        return item

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._out.put(None)
            self._call.cancel()

    def _read(self) -> None:
        try:
            for raw in self._call:
                tensors, msg = unpack(raw)
                self.inbox.put((tensors, msg, time.perf_counter() - self.sent_at))
                self.client.wake.set()
        except grpc.RpcError as exc:
            if not self.closed:
                detail = exc.details() or exc.code().name
                self.inbox.put(VerifierUnavailable(f"verifier {self.client.url}: {exc.code().name}: {detail}"))
        except Exception as exc:  # noqa: BLE001 - a reply that does not parse
            self.inbox.put(VerifierUnavailable(f"verifier {self.client.url}: bad reply: {exc}"))
        else:
            if not self.closed:
                self.inbox.put(VerifierUnavailable(f"verifier {self.client.url} ended the session"))
        self.client.wake.set()
