"""The verifier over gRPC (translation only: the logic is ``verifier.VerifierCore``).

Service ``vericache.Verifier``, messages are ``codec.pack`` bytes (no protoc step):
  Session (bidirectional stream, one per request):
    -> {"op": "open", "prompt_ids", "max_tokens", "model_id", "compressor"}
    <- {"op": "opened", "token", "hit_tokens", "fetch_bytes", "fetch_s"}
    -> {"op": "verify", "start", "tokens"}
    <- {"op": "verified", "accepted", "token"} + tensors k, v [L, Hkv, m+1, D]
  The stream's end (the drafter finished, aborted, or went away) closes the session: its KV is freed.
  Health (unary): {"model_id", "sessions", "store"}.
Bad messages end the stream with INVALID_ARGUMENT; a full verifier with RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import logging
from concurrent import futures

import grpc

from vericache.remote.codec import CorruptValue, pack, unpack
from vericache.remote.verifier import VerifierCore

log = logging.getLogger("vericache.verifier")
SERVICE = "vericache.Verifier"
MAX_MESSAGE = 512 << 20
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE), ("grpc.max_send_message_length", MAX_MESSAGE)]


class VerifierServicer:
    def __init__(self, core: VerifierCore, model_id: str) -> None:
        self.core, self.model_id = core, model_id

    def health(self, request: bytes, context) -> bytes:
        store = self.core.store.url if self.core.store is not None else ""
        return pack({}, {"model_id": self.model_id, "sessions": len(self.core.sessions), "store": store})

    def session(self, requests, context):
        sess = None
        context.add_callback(lambda: sess is not None and self.core.close(sess))
        try:
            for raw in requests:
                try:
                    _, msg = unpack(raw)
                    op = msg.get("op")
                    if op == "open" and sess is None:
                        if msg.get("model_id") != self.model_id:
                            raise ValueError(f"drafter model {msg.get('model_id')!r} != verifier model {self.model_id!r}")
                        sess, token = self.core.open(msg["prompt_ids"], int(msg["max_tokens"]), msg.get("compressor", ""))
                        yield pack({}, {"op": "opened", "token": token, "hit_tokens": sess.hit_tokens,
                                        "fetch_bytes": sess.fetch_bytes, "fetch_s": sess.fetch_s})
                    elif op == "verify" and sess is not None:
                        m, token, k, v = self.core.verify(sess, int(msg["start"]), [int(t) for t in msg["tokens"]])
                        yield pack({"k": k, "v": v}, {"op": "verified", "accepted": m, "token": token})
                    else:
                        raise ValueError(f"unexpected message {op!r} (session open: {sess is not None})")
                except (ValueError, TypeError, KeyError, CorruptValue) as exc:
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                except RuntimeError as exc:
                    context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        finally:
            if sess is not None:
                self.core.close(sess)


def start_server(core: VerifierCore, model_id: str, address: str, max_workers: int = 64) -> grpc.Server:
    """Serve ``core`` on ``address`` (host:port); returns the started server."""
    servicer = VerifierServicer(core, model_id)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=CHANNEL_OPTIONS)
    handler = grpc.method_handlers_generic_handler(SERVICE, {
        "Session": grpc.stream_stream_rpc_method_handler(servicer.session),
        "Health": grpc.unary_unary_rpc_method_handler(servicer.health),
    })
    server.add_generic_rpc_handlers((handler,))
    if server.add_insecure_port(address) == 0:
        raise OSError(f"cannot listen on {address}")
    server.start()
    return server
