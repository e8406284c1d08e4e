"""The prefix KV store on Redis.

Keys (``vc:`` namespace, per model id):
  vc:<model>:{<block hash>}:full          the block's full K/V (``codec.pack``)
  vc:<model>:{<block hash>}:<compressor>  the block's compressed form for that compressor spec
  vc:<model>:index                        a hash: prefix id (its last block's hash) -> JSON of the
                                          prefix (blocks, tokens, forms, bytes, created)
The braces are a Redis Cluster hash tag: on a cluster a block's forms share a slot and a prefix's
blocks spread over the masters (``remote.shards``); one server ignores them. Values carry a checksum;
a block that is missing or fails it ends a lookup there (the caller recomputes from that block). Every
get counts its bytes and seconds (``StoreStats``) so metrics and benches report what crossed the link.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from urllib.parse import urlparse

import torch

from vericache.kv.full import FullKVCache
from vericache.remote.bulk import BulkReader, RedisReplyError
from vericache.remote.chain import BLOCK_TOKENS, block_hashes
from vericache.remote.codec import CorruptValue, pack, unpack
from vericache.remote.forms import Form
from vericache.remote.shards import Shards, connect, split_remap

READERS = ("bulk", "redis-py")
FETCH_CONNECTIONS = 4   # connections one full-KV fetch is spread over (the verifier's open)


class StoreUnavailable(RuntimeError):
    """Redis cannot be reached (the caller recomputes)."""


@dataclass
class StoreStats:
    hits: int = 0                # blocks found
    misses: int = 0              # blocks looked up and not found (or corrupt)
    corrupt: int = 0
    bytes_read: dict = field(default_factory=dict)    # form kind ("full" | "compressed") -> bytes
    fetch_s: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, kind: str, nbytes: int, seconds: float, hits: int, misses: int, corrupt: int) -> None:
        with self.lock:
            self.bytes_read[kind] = self.bytes_read.get(kind, 0) + nbytes
            self.fetch_s += seconds
            self.hits, self.misses, self.corrupt = self.hits + hits, self.misses + misses, self.corrupt + corrupt


@dataclass
class Fetched:
    blocks: list[Form]
    nbytes: int
    seconds: float
    reason: str        # "hit" (all whole blocks), "miss", "corrupt" or "partial"
    count: int = 0     # blocks that arrived whole (``blocks`` holds them unless they went ``into``)


def _redis():
    try:
        import redis
    except ImportError as exc:  # pragma: no cover - the serve extra installs it
        raise RuntimeError(f"the prefix store needs the redis package (pip install 'vericache[serve]'): {exc}") from None
    return redis


class PrefixStore:
    def __init__(self, url: str, model_id: str, block_tokens: int = BLOCK_TOKENS, timeout_s: float = 10.0,
                 reader: str = "bulk", connections: int = FETCH_CONNECTIONS) -> None:
        """``reader``: how block values are read, "bulk" (``remote.bulk``: pipelined, into buffers of
        their size; redis:// URLs) or "redis-py" (its parser: hiredis when installed). ``connections``:
        how many the bulk reader spreads one prefix's full-KV fetch over (``get_full_into``)."""
        if isinstance(connections, bool) or not isinstance(connections, int) or connections < 1:
            raise ValueError(f"connections must be an integer >= 1, got {connections!r}")
        self.connections = connections
        if not isinstance(url, str) or not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"prefix store URL must be redis://host:port[/db], got {url!r}")
        if not model_id:
            raise ValueError("model_id must be a non-empty string")
        if reader not in READERS:
            raise ValueError(f"reader must be one of {READERS}, got {reader!r}")
        split_remap(url)   # a malformed ``remap`` is the caller's ValueError now, not at the first fetch
        if reader == "bulk" and not url.startswith("redis://"):
            reader = "redis-py"   # TLS and unix sockets: redis-py's own connections
        self.url, self.model_id, self.block_tokens, self.reader = url, model_id, block_tokens, reader
        self.timeout_s = timeout_s
        self.bulk = BulkReader(url, timeout_s) if reader == "bulk" else None
        self._shards: Shards | None = None   # connected at the first use (a store may start after us)
        self.stats = StoreStats()

    @property
    def shards(self) -> Shards:
        """The store's nodes: one server or a cluster's masters, found at the first use (``StoreUnavailable``
        while the URL's node cannot be reached)."""
        if self._shards is None:
            self._shards = Shards(self._call(connect, self.url, self.timeout_s, _redis()), self.bulk)
        return self._shards

    @property
    def client(self):
        """redis-py's client for the store: ``Redis``, or ``RedisCluster`` on a cluster."""
        return self.shards.client

    def key(self, h: str, form: str) -> str:
        """The Redis key of block ``h``'s ``form`` (``h`` a hash tag: see the module's docstring)."""
        return f"vc:{self.model_id}:{{{h}}}:{form}"

    def _call(self, fn, *args):
        errors = _redis().exceptions
        try:
            return fn(*args)
        except (errors.ConnectionError, errors.ClusterError, errors.RedisClusterException) as exc:
            raise StoreUnavailable(f"prefix store {self.url} unreachable: {exc}") from None
        except errors.TimeoutError as exc:
            raise StoreUnavailable(f"prefix store {self.url} timed out: {exc}") from None

    def version(self) -> str:
        info = self._call(self.client.info, "server")
        return info["redis_version"] if "redis_version" in info else next(iter(info.values()))["redis_version"]

    def masters(self) -> list[str]:
        """host:port of each node the prefixes are spread over: a cluster's masters, or the one server."""
        if self.shards.cluster:
            return [f"{host}:{port}" for host, port in self.shards.masters()]
        u = urlparse(self.url)
        return [f"{u.hostname}:{u.port or 6379}"] if u.hostname else [self.url]

    def hashes(self, token_ids: list[int]) -> list[str]:
        return block_hashes(self.model_id, token_ids, self.block_tokens)

    # ------------------------------------------------------------------ write
    def put(self, token_ids: list[int], forms: dict[str, list[Form]], meta: dict | None = None) -> dict:
        """Store each block's forms ({"full": [...], "<compressor spec>": [...]}, one per whole block
        of ``token_ids``); returns the prefix's index entry."""
        hashes = self.hashes(token_ids)
        for name, blocks in forms.items():
            if len(blocks) != len(hashes):
                raise ValueError(f"form {name!r} has {len(blocks)} blocks; the prefix has {len(hashes)} whole blocks")
        if not hashes:
            raise ValueError(f"a prefix needs at least one whole block of {self.block_tokens} tokens; "
                             f"got {len(token_ids)} tokens")
        pipe, total = self.client.pipeline(transaction=False), 0
        for i, h in enumerate(hashes):
            for name, blocks in forms.items():
                value = pack(blocks[i], {"model": self.model_id, "block": i, "form": name})
                total += len(value)
                pipe.set(self.key(h, name), value)
                if len(pipe) >= 16:  # bounded pipelines: values are megabytes each
                    self._call(pipe.execute)
        entry = {"id": hashes[-1], "blocks": len(hashes), "tokens": len(hashes) * self.block_tokens,
                 "forms": sorted(forms), "bytes": total, "created": time.time(), "hashes": hashes, **(meta or {})}
        pipe.hset(f"vc:{self.model_id}:index", hashes[-1], json.dumps(entry))
        self._call(pipe.execute)
        return entry

    # ------------------------------------------------------------------ read
    def match(self, token_ids: list[int], form: str = "full") -> int:
        """Leading whole blocks of ``token_ids`` whose ``form`` is stored."""
        hashes = self.hashes(token_ids)
        if not hashes:
            return 0
        keys = [self.key(h, form) for h in hashes]
        if self.shards.cluster:   # each master asked on its own: a failed one ends the match at its first block
            found = self._call(self.shards.exists, keys)
            if found[0] is None:
                raise StoreUnavailable(f"prefix store {self.url} unreachable: the master of {keys[0]} did not answer")
        else:
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(key)
            found = self._call(pipe.execute)
        n = 0
        while n < len(found) and found[n]:
            n += 1
        return n

    def get(self, token_ids: list[int], form: str = "full", max_blocks: int | None = None,
            device: torch.device | str = "cpu", into: Callable[[Form], None] | None = None) -> Fetched:
        """The leading blocks' ``form`` (up to ``max_blocks``), stopping at the first missing or
        corrupt one, or where the store went away (reason "unavailable", after one block at least; the
        caller computes from there). ``into``: called with each block as it
        arrives (its tensors are views of the received bytes, valid during the call), which then is
        not kept in ``Fetched.blocks``: the caller copies it where it belongs while the next arrives."""
        hashes = self.hashes(token_ids)[:max_blocks]
        t0, blocks, count, nbytes, reason = time.perf_counter(), [], 0, 0, "hit" if hashes else "miss"
        values = self._values([self.key(h, form) for h in hashes])
        try:
            for i, value in enumerate(values):
                if value is None:
                    reason = "miss" if i == 0 else "partial"
                    break
                nbytes += len(value)
                try:
                    tensors, _ = unpack(value, device, copy=False)
                except CorruptValue:
                    reason = "corrupt"
                    break
                count += 1
                if into is None:
                    blocks.append(tensors)
                else:
                    into(tensors)
        except StoreUnavailable:
            if not count:
                raise
            reason = "unavailable"   # the store went away mid-fetch: keep what arrived, compute from there
        finally:
            values.close()
        seconds = time.perf_counter() - t0
        kind = "full" if form == "full" else "compressed"
        self.stats.add(kind, nbytes, seconds, count, len(hashes) - count, int(reason == "corrupt"))
        return Fetched(blocks, nbytes, seconds, reason, count)

    def get_full_into(self, token_ids: list[int], full: FullKVCache, max_blocks: int | None = None) -> Fetched:
        """The leading blocks' full form written into the empty ``full`` at positions 0.. (the
        verifier's open). With the bulk reader and a CPU cache each block's bytes are received straight
        into the cache's rows, checksummed as they land, over ``connections`` connections at once (each
        a contiguous run of the blocks: Redis answers one connection's pipeline in order, and one
        stream's reads in one Python thread were the fetch's limit); ``full`` ends at the last good
        block before the first missing or corrupt one. Otherwise through ``get``."""
        if full.length:
            raise ValueError(f"get_full_into needs an empty cache; it holds {full.length} positions")
        if self.bulk is None or full.device.type != "cpu":
            return self.get(token_ids, "full", max_blocks, full.device, into=lambda b: full.append(b["k"], b["v"]))
        hashes = self.hashes(token_ids)[:max_blocks]
        bt = self.block_tokens
        want = [[full.layers, full.cfg.num_key_value_heads, bt, full.cfg.head_dim], str(full.dtype)]
        keys = [self.key(h, "full") for h in hashes]
        statuses: list[str | None] = [None] * len(keys)

        def dest(i: int, entries: list[dict]) -> list[memoryview] | None:
            if [e["name"] for e in entries] != ["k", "v"] or any([e["shape"], e["dtype"]] != want for e in entries):
                return None
            return full.byte_views(i * bt, bt)

        def fetch(reader: BulkReader, idx: list[int]) -> None:   # blocks idx (ascending) on a connection of their own
            replies = reader.get_many_into([keys[i] for i in idx], lambda j, entries: dest(idx[j], entries))
            try:
                for j, status in enumerate(replies):
                    statuses[idx[j]] = status
                    if status != "ok":
                        break
            finally:
                replies.close()

        t0 = time.perf_counter()
        full.begin(0, len(keys) * bt)    # every block's rows, received in place; cut to the good ones below
        everything = list(range(len(keys)))
        before = self.shards.owners(keys, everything)
        errors = self.shards.fan_out(keys, everything, fetch, self.connections)   # per node, a few runs each
        lost = [i for i, st in enumerate(statuses) if st is None]
        if errors and self.shards.retry_moved(keys, lost, before):   # the failed node's replica took over
            errors = self.shards.fan_out(keys, lost, fetch, self.connections)
        count = next((i for i, st in enumerate(statuses) if st != "ok"), len(statuses))
        full.truncate(count * bt)
        if errors and not count:   # a node failed before its first block: nothing to keep
            raise StoreUnavailable(f"prefix store {self.url} unreachable: {errors[0]}")
        stop = statuses[count] if count < len(keys) else "end"   # why the leading good blocks end
        reason = (("hit" if keys else "miss") if stop == "end" else "unavailable" if stop is None
                  else "corrupt" if stop == "corrupt" else "miss" if count == 0 else "partial")
        seconds, nbytes = time.perf_counter() - t0, full.nbytes()
        self.stats.add("full", nbytes, seconds, count, len(hashes) - count, int(reason == "corrupt"))
        return Fetched([], nbytes, seconds, reason, count)

    def _values(self, keys: list[str]) -> Generator:
        """The keys' values in order, as they arrive: all GETs pipelined, read by ``bulk`` (the
        default; on a cluster each master's keys on a connection of their own, all at once) or by
        redis-py."""
        try:
            if self.reader == "bulk" and self.shards.cluster:
                yield from self._cluster_values(keys)
            elif self.bulk is not None:   # the reader is "bulk"
                yield from self.bulk.get_many(keys)
            else:
                pipe = self.client.pipeline(transaction=False)
                for k in keys:
                    pipe.get(k)
                yield from pipe.execute() if keys else []
        except (OSError, RedisReplyError, _redis().exceptions.ConnectionError, _redis().exceptions.TimeoutError,
                _redis().exceptions.RedisClusterException) as exc:
            raise StoreUnavailable(f"prefix store {self.url} unreachable: {exc}") from None

    def _cluster_values(self, keys: list[str]) -> Generator:
        """``_values`` on a cluster: every master's GETs at once (one retry of a failed master's keys where
        its replica has taken its slots); then the values in the keys' order, up to the first key that
        did not arrive (raising its node's error there, as one server's reader does)."""
        values: list = [None] * len(keys)
        arrived = [False] * len(keys)

        def read(reader: BulkReader, idx: list[int]) -> None:
            for i, value in zip(idx, reader.get_many([keys[i] for i in idx])):
                values[i], arrived[i] = value, True

        everything = list(range(len(keys)))
        before = self.shards.owners(keys, everything)
        errors = self.shards.fan_out(keys, everything, read, 1)
        lost = [i for i in everything if not arrived[i]]
        if errors and self.shards.retry_moved(keys, lost, before):
            errors = self.shards.fan_out(keys, lost, read, 1)
        for i, value in enumerate(values):
            if not arrived[i]:
                raise errors[0] if errors else ConnectionError(f"no reply for {keys[i]}")
            yield value

    # ------------------------------------------------------------------ admin
    def ls(self) -> list[dict]:
        raw = self._call(self.client.hgetall, f"vc:{self.model_id}:index")
        out = [json.loads(v) for v in raw.values()]
        for e in out:
            e.pop("hashes", None)
        return sorted(out, key=lambda e: e["created"])

    def rm(self, prefix_id: str | None = None) -> int:
        """Remove one prefix (by id) or, with None, every prefix of this model; blocks another
        remaining prefix still lists are kept. Returns the keys deleted."""
        index = f"vc:{self.model_id}:index"
        entries = {k.decode(): json.loads(v) for k, v in self._call(self.client.hgetall, index).items()}
        if prefix_id is not None and prefix_id not in entries:
            raise ValueError(f"no prefix {prefix_id!r} stored for model {self.model_id!r}")
        doomed = [prefix_id] if prefix_id is not None else list(entries)
        keep = {h for pid, e in entries.items() if pid not in doomed for h in e["hashes"]}
        keys = [self.key(h, form) for pid in doomed for h in entries[pid]["hashes"] if h not in keep
                for form in entries[pid]["forms"]]
        deleted = self._call(self.client.delete, *keys) if keys else 0
        self._call(self.client.hdel, index, *doomed)
        return deleted
