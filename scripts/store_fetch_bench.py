"""How fast a prefix's full KV comes out of Redis, by reader: ``remote.bulk`` (pipelined GETs read
into buffers of their size), redis-py with hiredis, redis-py's pure-Python parser; beside one raw
TCP stream to the same host (``remote.netprobe``), the ceiling. The cache is allocated before each timed fetch (its pages touched
or not: set THP_MEM_ALLOC_ENABLE=1 for PyTorch's huge-page allocations, as the bench does).

    python scripts/store_fetch_bench.py [--url redis://host:port] [--blocks 23] [--repeat 5] [--connections 1,4]
    python scripts/store_fetch_bench.py --cluster [--blocks 23] [--repeat 5]

Without --url it starts its own redis-server on 127.0.0.1 (loopback). ``--cluster``: one redis-server and
a 3-master, 3-replica Redis Cluster on loopback (``vericache_lab.redis_local``), the same prefix in
both, the verifier's fetch (``get_full_into``, 4 connections) timed on each in turns: the cluster's
rate over the single server's, measured in one run (issue 55's target: >= 1.5x), and how many cores the
reader and the Redis processes kept busy while fetching (their CPU seconds over the fetches' wall time). Values are real codec blocks
of SmolLM2-135M's KV shape (256 positions: 11.8 MB each); the timed work is ``PrefixStore.get``
into a session's cache, checksum included, over 1 and 4 connections (``--connections``). Prints Gbit/s
per reader (best of --repeat).
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time

import torch

from vericache.kv.full import FullKVCache
from vericache.model.loader import load_model
from vericache.remote.chain import BLOCK_TOKENS, block_hashes
from vericache.remote.codec import pack
from vericache.remote.store import PrefixStore


def _redis(port: int, work: str) -> subprocess.Popen:
    p = subprocess.Popen(["redis-server", "--port", str(port), "--save", "", "--appendonly", "no", "--dir", work],
                         stdout=subprocess.DEVNULL)
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return p
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("redis-server did not start")


def _fill(store: PrefixStore, ids: list[int], shape: tuple) -> None:
    for h in block_hashes(store.model_id, ids):
        store.client.set(store.key(h, "full"), pack({"k": torch.randn(shape), "v": torch.randn(shape)}))


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used so far (/proc/PID/stat: utime, stime)."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cluster_vs_single(blocks: int, repeat: int) -> None:
    from vericache_lab.redis_local import LocalRedisCluster, free_port

    port, work = free_port(), tempfile.mkdtemp()
    single = _redis(port, work)
    cluster = LocalRedisCluster(work)
    try:
        cfg = load_model("smollm2-135m", device="cpu", dtype="float32").config
        shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, BLOCK_TOKENS, cfg.head_dim)
        ids = list(range(blocks * BLOCK_TOKENS + 1))
        stores = {"one redis-server": PrefixStore(f"redis://127.0.0.1:{port}", "fetch-bench"),
                  "3-master cluster": PrefixStore(cluster.url, "fetch-bench")}
        for store in stores.values():
            _fill(store, ids, shape)
        cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
        print(f"{blocks} blocks of {BLOCK_TOKENS} positions (SmolLM2-135M's KV); CPU {cpu}, {os.cpu_count()} cores; "
              f"get_full_into over {stores['one redis-server'].connections} connections, best of {repeat} in turns")
        best = dict.fromkeys(stores, float("inf"))
        servers = {"one redis-server": [single.pid], "3-master cluster": [p.pid for p in cluster.procs.values()]}
        busy = {name: [0.0, 0.0, 0.0] for name in stores}   # wall, the reader's CPU, the servers' CPU (seconds)
        nbytes = 0
        for _ in range(repeat):
            for name, store in stores.items():
                full = FullKVCache(cfg, "cpu", torch.float32, capacity=len(ids))
                before = [sum(_cpu_seconds(p) for p in servers[name]), time.process_time()]
                t0 = time.perf_counter()
                got = store.get_full_into(ids, full, blocks)
                wall = time.perf_counter() - t0
                best[name], nbytes = min(best[name], wall), got.nbytes
                busy[name][0] += wall
                busy[name][1] += time.process_time() - before[1]
                busy[name][2] += sum(_cpu_seconds(p) for p in servers[name]) - before[0]
                assert got.count == blocks, got.reason
        for name, seconds in best.items():
            wall, reader, server = busy[name]
            print(f"{name:20s} {nbytes * 8 / seconds / 1e9:6.2f} Gbit/s  ({nbytes / 1e6:.0f} MB in {seconds:.3f} s); "
                  f"cores busy while fetching: the reader {reader / wall:.2f}, Redis {server / wall:.2f}")
        print(f"cluster / single: {best['one redis-server'] / best['3-master cluster']:.2f}x")
    finally:
        single.terminate()
        cluster.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url")
    ap.add_argument("--blocks", type=int, default=23)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--connections", type=lambda t: [int(x) for x in t.split(",")], default=[1, 4],
                    help="comma-separated connection counts for the into-the-rows reader (get_full_into)")
    ap.add_argument("--cluster", action="store_true", help="a single server against a 3-master cluster, side by side")
    args = ap.parse_args()
    if args.cluster:
        return cluster_vs_single(args.blocks, args.repeat)
    server = None
    if args.url is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server, args.url = _redis(port, tempfile.mkdtemp()), f"redis://127.0.0.1:{port}"
    try:
        cfg = load_model("smollm2-135m", device="cpu", dtype="float32").config
        shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, BLOCK_TOKENS, cfg.head_dim)
        ids = list(range(args.blocks * BLOCK_TOKENS + 1))
        store = PrefixStore(args.url, "fetch-bench")
        _fill(store, ids, shape)
        cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
        print(f"{args.url}, {args.blocks} blocks of {BLOCK_TOKENS} positions; CPU {cpu}, {os.cpu_count()} cores")
        from redis._parsers import _HiredisParser, _RESP2Parser
        from redis.utils import HIREDIS_AVAILABLE

        readers = {f"bulk, into the rows, {c} conn": PrefixStore(args.url, "fetch-bench", connections=c)
                   for c in args.connections}
        readers["bulk, then copied"] = PrefixStore(args.url, "fetch-bench")
        if HIREDIS_AVAILABLE:
            readers["redis-py + hiredis"] = PrefixStore(args.url, "fetch-bench", reader="redis-py")
            readers["redis-py + hiredis"].client.connection_pool.connection_kwargs["parser_class"] = _HiredisParser
        readers["redis-py (Python parser)"] = PrefixStore(args.url, "fetch-bench", reader="redis-py")
        readers["redis-py (Python parser)"].client.connection_pool.connection_kwargs["parser_class"] = _RESP2Parser
        for name, st in readers.items():
            best, nbytes = float("inf"), 0
            for _ in range(args.repeat):
                full = FullKVCache(cfg, "cpu", torch.float32, capacity=len(ids))
                t0 = time.perf_counter()
                if "into the rows" in name:
                    got = st.get_full_into(ids, full, args.blocks)
                else:
                    got = st.get(ids, "full", args.blocks, into=lambda b: full.append(b["k"], b["v"]))
                best, nbytes = min(best, time.perf_counter() - t0), got.nbytes
                assert got.count == args.blocks, got.reason
            print(f"{name:28s} {nbytes * 8 / best / 1e9:6.2f} Gbit/s  ({nbytes / 1e6:.0f} MB in {best:.3f} s)")
        host = args.url.removeprefix("redis://").split(":")[0]
        probe = subprocess.Popen([sys.executable, "-m", "vericache_lab.netprobe", "serve", host, "6409"],
                                 stdout=subprocess.PIPE, text=True)
        probe.stdout.readline()
        raw = subprocess.run([sys.executable, "-m", "vericache_lab.netprobe", "send", host, "6409", str(nbytes)],
                             capture_output=True, text=True).stdout.strip()
        print(f"{'raw TCP stream (netprobe)':28s} {raw}")
    finally:
        if server is not None:
            server.terminate()


if __name__ == "__main__":
    main()
