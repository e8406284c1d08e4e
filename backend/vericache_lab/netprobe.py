"""A tiny TCP probe for netlab: ``serve HOST PORT`` echoes pings then swallows a bulk transfer;
``send HOST PORT NBYTES`` prints {"rtt_ms", "gbps", "bytes"} (median of 20 round trips; bulk
throughput from the first byte sent to the receiver's acknowledgement of the last)."""

from __future__ import annotations

import json
import socket
import statistics
import struct
import sys
import time


def serve(host: str, port: int) -> None:
    with socket.socket() as ls:
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        ls.bind((host, port))
        ls.listen(1)
        print("ready", flush=True)
        conn, _ = ls.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while (b := conn.recv(1)) == b"p":
                conn.sendall(b"p")
            if b != b"b":  # the marker that ends the pings
                return
            (n,) = struct.unpack("<Q", _read(conn, 8, b""))
            left = n
            while left:
                chunk = conn.recv(min(left, 1 << 20))
                if not chunk:
                    return
                left -= len(chunk)
            conn.sendall(b"k")


def _read(conn, n: int, have: bytes) -> bytes:
    while n:
        chunk = conn.recv(n)
        if not chunk:
            raise ConnectionError("peer closed")
        have, n = have + chunk, n - len(chunk)
    return have


def send(host: str, port: int, nbytes: int) -> dict:
    with socket.create_connection((host, port), timeout=60) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        rtts = []
        for _ in range(20):
            t0 = time.perf_counter()
            s.sendall(b"p")
            _read(s, 1, b"")
            rtts.append(time.perf_counter() - t0)
        payload = bytes(1 << 20)
        t0 = time.perf_counter()
        s.sendall(b"b" + struct.pack("<Q", nbytes))  # 'b' ends the pings, then the length
        left = nbytes
        while left:
            k = min(left, len(payload))
            s.sendall(payload[:k])
            left -= k
        _read(s, 1, b"")
        dt = time.perf_counter() - t0
    return {"rtt_ms": round(statistics.median(rtts) * 1e3, 3), "gbps": round(nbytes * 8 / dt / 1e9, 3), "bytes": nbytes}


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2], int(sys.argv[3]))
    else:
        print(json.dumps(send(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))))
