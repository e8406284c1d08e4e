"""Pipelined GETs of large Redis values, each read straight into a buffer of its exact size.

redis-py (with hiredis or without) reads a reply in 64 KB pieces and joins them into a new Python
``bytes``; for the prefix store's multi-megabyte blocks that costs a copy of every byte in the
interpreter. This reader sends all of a lookup's GETs at once (one round trip, not one per block),
then ``recv_into``s each value into a ``bytearray`` of its length (the socket reads release the GIL),
so the only copies left are the kernel's and the one into the KV cache. It speaks just the RESP
replies a GET can get: a bulk string, a null, an error. ``scripts/store_fetch_bench.py`` measures it
against redis-py with and without hiredis: alone on this 2-core CPU they tie (Redis's own reply path
is the limit there); with the drafter busy beside it this reader was 1.7x redis-py + hiredis.
"""

from __future__ import annotations

import json
import socket
import struct
from collections.abc import Callable, Generator, Iterator
from urllib.parse import unquote, urlparse

from vericache.remote.codec import MAGIC, BodyCheck, CorruptValue

READ_SIZE = 1 << 20


class RedisReplyError(RuntimeError):
    """The server answered a command with an error reply (-ERR ...)."""


def _command(*args: bytes) -> bytes:
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)


class BulkReader:
    """``get_many(keys)`` over a fresh connection to ``url`` (redis://[user:password@]host:port[/db])."""

    def __init__(self, url: str, timeout_s: float = 10.0) -> None:
        u = urlparse(url)
        if u.scheme != "redis" or not u.hostname:
            raise ValueError(f"the bulk reader needs a redis://host:port[/db] URL, got {url!r}")
        self.address = (u.hostname, u.port or 6379)
        self.db = int(u.path.strip("/") or 0)
        self.auth = [unquote(x).encode() for x in (u.username, u.password) if x] if u.password else []
        self.timeout_s = timeout_s

    def at(self, host: str, port: int) -> BulkReader:
        """The same reader (credentials, db, timeout) for another node: a cluster's master."""
        other = BulkReader.__new__(BulkReader)
        other.__dict__.update(self.__dict__, address=(host, port))
        return other

    def get_many(self, keys: list[str]) -> Iterator[bytearray | None]:
        """Each key's value (None when missing), in order, as it arrives. Raises OSError (socket.timeout
        included) when the server cannot be reached, ``RedisReplyError`` on an error reply."""
        for conn in self._session(keys):
            yield conn.read()

    def get_many_into(self, keys: list[str], dest: Callable[[int, list[dict]], list[memoryview] | None]
                      ) -> Generator[str, None, None]:
        """Each key's ``codec.pack`` value received straight into memory the caller owns: ``dest(i,
        entries)`` gets the value's tensor entries (name, dtype, shape, offset, nbytes) and returns
        writable byte views covering its body in offset order (a KV cache's rows, say), or None to
        refuse the value (counted "corrupt"). Yields per key
        "ok", "missing" or "corrupt" (bad header or checksum: the views hold garbage). The checksum is
        computed on each piece as it lands, while it is still in the CPU's cache."""
        for i, conn in enumerate(self._session(keys)):
            yield conn.read_codec_into(lambda entries: dest(i, entries))

    def _session(self, keys: list[str]) -> Iterator[_Replies]:
        """A connection with every GET sent; yields it once per key, to read that key's reply."""
        with socket.create_connection(self.address, timeout=self.timeout_s) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Replies(sock)
            setup = ([_command(b"AUTH", *self.auth)] if self.auth else []) + (
                [_command(b"SELECT", str(self.db).encode())] if self.db else [])
            sock.sendall(b"".join(setup + [_command(b"GET", k.encode()) for k in keys]))
            for _ in setup:
                conn.read()
            for _ in keys:
                yield conn


class _Replies:
    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.pending = sock, bytearray()   # bytes received past the last reply read

    def _fill(self) -> None:
        chunk = self.sock.recv(READ_SIZE)
        if not chunk:
            raise ConnectionError("the store closed the connection mid-reply")
        self.pending += chunk

    def _line(self) -> bytes:
        while (end := self.pending.find(b"\r\n")) < 0:
            self._fill()
        line = bytes(self.pending[:end])
        del self.pending[: end + 2]
        return line

    def _take(self, n: int) -> bytes:
        while len(self.pending) < n:
            self._fill()
        out = bytes(self.pending[:n])
        del self.pending[:n]
        return out

    def _into(self, view: memoryview) -> None:
        have = min(len(self.pending), len(view))
        view[:have] = self.pending[:have]
        del self.pending[:have]
        while have < len(view):
            got = self.sock.recv_into(view[have:])
            if not got:
                raise ConnectionError("the store closed the connection mid-value")
            have += got

    def _skip(self, n: int) -> None:
        scratch = memoryview(bytearray(min(n, READ_SIZE)))
        while n:
            k = min(n, len(scratch))
            self._into(scratch[:k])
            n -= k

    def read_codec_into(self, dest: Callable[[list[dict]], list[memoryview] | None]) -> str:
        """One bulk reply holding a ``codec.pack`` value, its body received into ``dest(entries)``'s views."""
        line = self._line()
        if line[:1] == b"-":
            raise RedisReplyError(line[1:].decode(errors="replace"))
        if line[:1] != b"$":
            raise ConnectionError(f"unexpected reply {line[:40]!r}")
        n = int(line[1:])
        if n < 0:
            return "missing"
        lead = len(MAGIC) + 4
        if n < lead:
            self._skip(n + 2)
            return "corrupt"
        head = self._take(lead)
        (hlen,) = struct.unpack("<I", head[len(MAGIC):])
        if head[: len(MAGIC)] != MAGIC or hlen > n - lead:
            self._skip(n - lead + 2)
            return "corrupt"
        body = n - lead - hlen
        try:
            header = json.loads(self._take(hlen))
            entries = sorted(header["tensors"], key=lambda e: e["offset"])
            views = dest(entries) if sum(e["nbytes"] for e in entries) == body else None
        except (ValueError, KeyError, TypeError, CorruptValue):
            views = None
        if views is None or sum(v.nbytes for v in views) != body:
            self._skip(body + 2)
            return "corrupt"
        check = BodyCheck(header.get("digest"))
        for v in views:
            self._into(v)
            check.add(v)
        self._take(2)
        return "ok" if check.ok() else "corrupt"

    def read(self) -> bytearray | None:
        """One reply: a bulk string's bytes, None for a null, the status line's for +OK."""
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"-":
            raise RedisReplyError(rest.decode(errors="replace"))
        if kind == b"+":
            return bytearray(rest)
        if kind != b"$":
            raise ConnectionError(f"unexpected reply {line[:40]!r}")
        n = int(rest)
        if n < 0:
            return None
        out = bytearray(n + 2)                      # the value and its trailing CRLF
        view, have = memoryview(out), min(len(self.pending), n + 2)
        view[:have] = self.pending[:have]
        del self.pending[:have]
        while have < n + 2:
            got = self.sock.recv_into(view[have:])
            if not got:
                raise ConnectionError("the store closed the connection mid-value")
            have += got
        view.release()
        del out[n:]                                  # drop the CRLF (in place: no copy of the value)
        return out
