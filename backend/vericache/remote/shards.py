"""Where a prefix's blocks live: one Redis server, or the masters of a Redis Cluster (Valkey alike).

The store's URL names one node; ``connect`` asks it (``INFO cluster``) whether it is part of a cluster
and returns the matching client: redis-py's ``Redis`` or its ``RedisCluster``, which learns the slot
map from that node (``CLUSTER SLOTS``) and follows MOVED replies. A block's keys carry the block's hash
as a hash tag (``vc:<model>:{<hash>}:<form>``, ``PrefixStore.key``): Redis places a key by the CRC16
slot of its tag, so a block's forms share a slot while a prefix's blocks, whose hashes differ, spread
over every master. ``Shards.groups`` splits a fetch's keys by the master that holds them, so each
master streams its blocks on a connection of its own, all at once (``PrefixStore.get_full_into``).

A master that dies mid-fetch fails only its connection: the blocks that arrived are kept up to the
first one missing and the rest is computed (checksums guard every block, so nothing wrong is used);
``refresh`` re-reads the slot map, so once the cluster has promoted the dead master's replica the next
fetch reads its blocks there.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from vericache.remote.bulk import BulkReader, RedisReplyError

Address = tuple[str, int]


def split_remap(url: str) -> tuple[str, dict[Address, Address]]:
    """``url`` without its ``remap`` query parameter, and that parameter's map. A cluster's slot map names
    each node by the address it announces; a client that reaches the nodes elsewhere (through NAT, a port
    forward, or a relay on a slow link) says where: ``redis://HOST:PORT?remap=ANNOUNCED=REACHED,...``,
    each side ``host:port``. Raises ValueError naming a malformed pair."""
    u = urlsplit(url)
    query = parse_qsl(u.query, keep_blank_values=True)
    remap: dict[Address, Address] = {}
    for name, value in query:
        if name != "remap":
            continue
        for pair in filter(None, value.split(",")):
            try:
                announced, reached = (_address(side) for side in pair.split("="))
            except ValueError:
                raise ValueError(f"remap pairs are ANNOUNCED_HOST:PORT=REACHED_HOST:PORT, got {pair!r} in {url!r}") from None
            remap[announced] = reached
    rest = urlencode([(k, v) for k, v in query if k != "remap"])
    return urlunsplit((u.scheme, u.netloc, u.path, rest, u.fragment)), remap


def _address(side: str) -> Address:
    host, _, port = side.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(side)
    return host, int(port)


def connect(url: str, timeout_s: float, redis_module):
    """A redis-py client for ``url``: ``RedisCluster`` when the node is in a cluster, else ``Redis``
    (``split_remap``: where the cluster's nodes are reached). Raises redis-py's ConnectionError /
    TimeoutError when the node cannot be reached."""
    url, remap = split_remap(url)
    plain = redis_module.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    if str(plain.info("cluster").get("cluster_enabled", 0)) != "1":
        return plain
    plain.close()
    return redis_module.cluster.RedisCluster.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                                      address_remap=lambda a: remap.get((a[0], int(a[1])), a))


def is_cluster(client) -> bool:
    from redis.cluster import RedisCluster

    return isinstance(client, RedisCluster)


class Shards:
    """The nodes a list of keys is read from: ``bulk`` (a reader for the URL's node) alone, or, on a
    cluster, a reader per master, each given the keys of its slots."""

    def __init__(self, client, bulk: BulkReader | None) -> None:
        self.client, self.bulk = client, bulk
        self.cluster = is_cluster(client)

    def groups(self, keys: list[str]) -> list[tuple[BulkReader, list[int]]]:
        """(reader, indices into ``keys``) per node holding some of them, in the keys' order within each;
        one group on a single server."""
        if self.bulk is None:
            raise ValueError("shards are read by the bulk reader only")
        if not self.cluster:
            return [(self.bulk, list(range(len(keys))))] if keys else []
        by_node: dict[tuple[str, int], list[int]] = {}
        for i, key in enumerate(keys):
            node = self.node_of(key)
            by_node.setdefault((node.host, int(node.port)), []).append(i)
        return [(self.bulk.at(host, port), idx) for (host, port), idx in by_node.items()]

    def node_of(self, key: str):
        """The cluster node (redis-py's ``ClusterNode``) that holds ``key`` by the current slot map."""
        from redis.crc import key_slot

        return self.client.nodes_manager.get_node_from_slot(key_slot(key.encode()))

    def exists(self, keys: list[str]) -> list[bool | None]:
        """Whether each key is stored, asked of the master holding it (one pipeline a master); None for
        the keys of a master that did not answer, asked once more where the slot map, read again, names
        another master for them (its replica promoted). Cluster only."""
        import redis

        found: list[bool | None] = [None] * len(keys)

        def ask(indices: list[int]) -> bool:   # False where some master failed
            by_node: dict[str, tuple[object, list[int]]] = {}
            for i in indices:
                node = self.node_of(keys[i])
                by_node.setdefault(node.name, (node, []))[1].append(i)
            answered = True
            for node, ids in by_node.values():
                try:
                    pipe = self.client.get_redis_connection(node).pipeline(transaction=False)
                    for i in ids:
                        pipe.exists(keys[i])
                    for i, n in zip(ids, pipe.execute()):
                        found[i] = bool(n)
                except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError,
                        redis.exceptions.ResponseError):   # gone, or MOVED: its slots have another master
                    answered = False
            return answered

        if not ask(list(range(len(keys)))):
            lost = [i for i, f in enumerate(found) if f is None]
            before = {i: self.node_of(keys[i]).name for i in lost}
            self.refresh()
            if any(self.node_of(keys[i]).name != before[i] for i in lost):
                ask(lost)
        return found

    def owners(self, keys: list[str], indices: list[int]) -> dict[int, tuple[str, int]]:
        """The node (host, port) that holds each of ``keys[i]``, i in ``indices``, by the current slot map."""
        return {i: reader.address for reader, idx in self.groups([keys[i] for i in indices])
                for i in (indices[j] for j in idx)}

    def fan_out(self, keys: list[str], indices: list[int], read: Callable[[BulkReader, list[int]], None],
                connections: int) -> list[Exception]:
        """``read(reader, idx)`` for ``indices`` (ascending) of ``keys``, grouped by the node holding
        them, each group cut into contiguous runs so about ``connections`` run in all (at least one a
        node), all at once (threads; the first here). Returns the errors the reads raised (a node that
        failed: OSError, or an error reply such as MOVED); the other nodes' reads complete."""
        groups = self.groups([keys[i] for i in indices])
        per_node = max(1, -(-connections // max(len(groups), 1)))
        work = [(reader, [indices[j] for j in idx[lo:hi]]) for reader, idx in groups
                for lo, hi in runs(len(idx), per_node)]
        errors: list[Exception] = []

        def one(reader: BulkReader, idx: list[int]) -> None:
            try:
                read(reader, idx)
            except (OSError, RedisReplyError) as exc:
                errors.append(exc)

        threads = [threading.Thread(target=one, args=w, daemon=True) for w in work[1:]]
        for t in threads:
            t.start()
        if work:
            one(*work[0])
        for t in threads:
            t.join()
        return errors

    def retry_moved(self, keys: list[str], lost: list[int], before: dict[int, tuple[str, int]]) -> bool:
        """After a failed read: re-read the slot map and say whether any of the ``lost`` keys now lives on
        another node than ``before`` (a replica promoted in the failed master's place: worth one retry)."""
        self.refresh()
        return bool(lost) and self.owners(keys, lost) != {i: before[i] for i in lost}

    def masters(self) -> list[tuple[str, int]]:
        """(host, port) of every master of the cluster (none for one server)."""
        return sorted((n.host, int(n.port)) for n in self.client.get_primaries()) if self.cluster else []

    def refresh(self, on_error: Callable[[Exception], None] | None = None) -> None:
        """Re-read the cluster's slot map (after a master failed: its replica may have taken its slots)."""
        if not self.cluster:
            return
        try:
            self.client.nodes_manager.initialize()
        except Exception as exc:   # every node unreachable: the next call raises it
            if on_error is not None:
                on_error(exc)


def runs(n: int, parts: int) -> list[tuple[int, int]]:
    """0 .. n-1 cut into at most ``parts`` contiguous (lo, hi) runs of nearly equal length."""
    parts = max(1, min(parts, n))
    bounds = [n * i // parts for i in range(parts + 1)]
    return [(lo, hi) for lo, hi in zip(bounds, bounds[1:]) if hi > lo]
