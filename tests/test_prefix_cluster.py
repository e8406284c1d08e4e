"""The prefix store on a real Redis Cluster (issue 55 item 1): three masters and three replicas on
127.0.0.1 (``vericache_lab.redis_local.LocalRedisCluster``). The store's URL names one node and the cluster is found
from it; a prefix's blocks spread over every master and come back whole, every master streaming its
own; the compressed forms and both readers too; ls and rm across the cluster; a master that is gone
when a fetch runs costs the blocks from its first one on (computed again, never a wrong one), and once
its replica has taken over they come from the replica; a master that stops answering mid-reply never
hangs a fetch nor gives a wrong block (its replica serves the rest once promoted); a verifier process and a drafter fetching
through the cluster decode what full decoding does, a master killed between their requests included."""

from __future__ import annotations

import pytest
import redis
import torch

from test_remote import Verifier, drafter, run
from vericache.compress.registry import parse_compressor
from vericache.kv.full import FullKVCache
from vericache.remote.prefixes import model_id, put_prompt
from vericache.remote.store import PrefixStore
from vericache.sampling import SamplingParams
from vericache_lab.redis_local import LocalRedisCluster

BT = 64   # small blocks: a 1,100-token prompt is 17 of them, so every master holds some
SPECS = ["snapkv:ratio=0.125", "kivi:bits=2"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with LocalRedisCluster(tmp_path_factory.mktemp("cluster")) as nodes:   # stopped after the module
        yield nodes


@pytest.fixture(scope="module")
def prefix(llm, code_prompts):
    return llm.tokenizer.encode(code_prompts["long"])[:1100]


@pytest.fixture(scope="module")
def reference_kv(llm, prefix):
    ref = FullKVCache(llm.loaded.config, "cpu", llm.loaded.kv_dtype, capacity=len(prefix))
    llm.engine.prefill(prefix, [ref])
    return ref


@pytest.fixture(scope="module")
def stored(llm, cluster, prefix):
    store = PrefixStore(cluster.url, model_id(llm.loaded) + "-cluster-tests", BT)
    return store, put_prompt(llm.engine, store, prefix, SPECS)


def get_calls(port: int) -> int:
    return redis.Redis(port=port).info("commandstats").get("cmdstat_get", {}).get("calls", 0)


def same_rows(full: FullKVCache, ref: FullKVCache, n: int) -> bool:
    return torch.equal(full.k[:, :, :n], ref.k[:, :, :n]) and torch.equal(full.v[:, :, :n], ref.v[:, :, :n])


def test_a_prefix_spreads_over_every_master_and_comes_back_whole(llm, cluster, stored, prefix, reference_kv):
    store, entry = stored
    masters = cluster.masters()
    assert type(store.client).__name__ == "RedisCluster" and len(masters) == 3
    assert store.masters() == [f"127.0.0.1:{p}" for p in masters]
    held = {p: redis.Redis(port=p).dbsize() for p in masters}
    assert all(n > 0 for n in held.values()), held           # the hash tags spread the blocks
    before = {p: get_calls(p) for p in masters}
    full = FullKVCache(llm.loaded.config, "cpu", llm.loaded.kv_dtype, capacity=len(prefix))
    got = store.get_full_into(prefix, full)
    assert got.reason == "hit" and got.count == entry["blocks"] == len(prefix) // BT
    assert full.length == entry["tokens"] and same_rows(full, reference_kv, full.length)
    assert all(get_calls(p) > before[p] for p in masters)    # every master streamed its own blocks
    blocks = store.get(prefix, "full")                        # the drafter's reader: the same bytes
    assert blocks.reason == "hit" and torch.equal(torch.cat([b["k"] for b in blocks.blocks], dim=2),
                                                  full.k[:, :, : full.length])
    assert store.match(prefix) == entry["blocks"] and store.match(list(reversed(prefix))) == 0


def test_a_remap_says_where_the_announced_nodes_are_reached(llm, cluster, stored, prefix, reference_kv):
    """``?remap=ANNOUNCED=REACHED,...`` (a client behind NAT or a relay, as ``bench prefix --store cluster``'s
    drafter): the slot map's nodes are reached where it says, the data too (a relay per master; one
    relay stopped loses that master's blocks, computed again, none wrong); a malformed pair is a ValueError
    naming it, before any connection."""
    import subprocess
    import sys

    from vericache_lab.redis_local import free_port

    store, entry = stored
    masters = cluster.masters()
    ports = {p: free_port() for p in masters}   # master -> its relay's port
    relays = {p: subprocess.Popen([sys.executable, "-m", "vericache.remote.relay", f"127.0.0.1:{r}", f"127.0.0.1:{p}",
                                   "0"], stdout=subprocess.PIPE, text=True) for p, r in ports.items()}
    try:
        assert all(proc.stdout.readline().strip() == "ready" for proc in relays.values())
        remap = ",".join(f"127.0.0.1:{p}=127.0.0.1:{r}" for p, r in ports.items())
        relayed = PrefixStore(f"{cluster.url}?remap={remap}", store.model_id, BT, timeout_s=2.0)
        assert relayed.masters() == sorted(f"127.0.0.1:{r}" for r in ports.values())
        full = FullKVCache(llm.loaded.config, "cpu", llm.loaded.kv_dtype, capacity=len(prefix))
        assert relayed.get_full_into(prefix, full).reason == "hit" and same_rows(full, reference_kv, full.length)
        first = int(store.shards.node_of(store.key(store.hashes(prefix)[0], "full")).port)
        relays[next(p for p in masters if p != first)].kill()   # one whose blocks come after some kept ones
        full = FullKVCache(llm.loaded.config, "cpu", llm.loaded.kv_dtype, capacity=len(prefix))
        got = relayed.get_full_into(prefix, full)
        assert got.reason != "hit" and got.count < entry["blocks"] and same_rows(full, reference_kv, got.count * BT)
    finally:
        for proc in relays.values():
            proc.kill()
    with pytest.raises(ValueError, match="7000=nowhere"):
        PrefixStore(f"{cluster.url}?remap=127.0.0.1:7000=nowhere", store.model_id, BT)


@pytest.mark.parametrize("spec", SPECS)
def test_compressed_forms_come_back_alike_through_both_readers(llm, cluster, stored, prefix, spec):
    store, entry = stored
    form = parse_compressor(spec).spec()
    other = PrefixStore(cluster.url, store.model_id, BT, reader="redis-py")
    a, b = store.get(prefix, form), other.get(prefix, form)
    assert a.reason == b.reason == "hit" and len(a.blocks) == len(b.blocks) == entry["blocks"]
    for x, y in zip(a.blocks, b.blocks):
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_ls_and_rm_reach_every_master(llm, cluster, prefix, capsys):
    import json

    from vericache.cli import main

    store = PrefixStore(cluster.url, model_id(llm.loaded) + "-cluster-rm", BT)
    entry = put_prompt(llm.engine, store, prefix[:640], [])
    assert [e["id"] for e in store.ls()] == [entry["id"]]
    assert main(["prefix", "ls", "--redis", cluster.url, "--model", "tiny", "--dtype", "float32", "--device", "cpu",
                 "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed["masters"] == store.masters() and len(listed["masters"]) == 3 and listed["redis"].startswith("7.")
    assert store.rm(entry["id"]) == entry["blocks"]          # its blocks' keys, on whichever master each lies
    assert store.ls() == [] and store.match(prefix[:640]) == 0


def test_a_dead_master_costs_its_blocks_and_its_replica_serves_them_after_failover(llm, tmp_path, prefix,
                                                                                   reference_kv):
    nodes = LocalRedisCluster(tmp_path)
    try:
        store = PrefixStore(nodes.url, model_id(llm.loaded) + "-failover", BT, timeout_s=2)
        entry = put_prompt(llm.engine, store, prefix, [])
        for port in nodes.masters():   # every write on its replica before a master goes
            redis.Redis(port=port).execute_command("WAIT", 1, 5000)
        keys = [store.key(h, "full") for h in store.hashes(prefix)]
        owner = {i: port for i, (_, port) in store.shards.owners(keys, list(range(len(keys)))).items()}
        url_port = int(nodes.url.rsplit(":", 1)[1])   # the node the store was found through stays
        victim = owner[min(i for i in owner if owner[i] not in (owner[0], url_port))]   # nor block 0's master
        first_lost = min(i for i in owner if owner[i] == victim)
        nodes.kill(victim)             # gone before the cluster notices: the slot map still names it
        assert store.match(prefix) == first_lost   # the blocks before the dead master's first one are matched
        full = FullKVCache(llm.loaded.config, "cpu", llm.loaded.kv_dtype, capacity=len(prefix))
        got = store.get_full_into(prefix, full)
        assert got.reason == "unavailable" and got.count == first_lost and full.length == first_lost * BT
        assert same_rows(full, reference_kv, full.length)       # what was kept is exact; the rest is computed
        nodes.wait_ok()                # the victim's replica now serves its slots
        assert victim not in nodes.masters()
        assert store.match(prefix) == entry["blocks"]
        again = FullKVCache(llm.loaded.config, "cpu", llm.loaded.kv_dtype, capacity=len(prefix))
        got = store.get_full_into(prefix, again)
        assert got.reason == "hit" and got.count == entry["blocks"] and same_rows(again, reference_kv, again.length)
    finally:
        nodes.stop()


def test_a_verifier_and_a_drafter_through_the_cluster_equal_full_decoding(llm, tmp_path, free_port, code_prompts):
    """Real processes: ``vericache serve --role verifier --prefix-store redis://<one node>`` and a drafter
    here, both on the cluster. A stored prompt decodes as full decoding does with its blocks from the
    store; with a master killed just before a request, and again after the failover."""
    nodes = LocalRedisCluster(tmp_path)
    mid = model_id(llm.loaded)
    verifier = Verifier(free_port(), nodes.url)
    try:
        ids = llm.tokenizer.encode(code_prompts["long"])[:600]
        put_prompt(llm.engine, PrefixStore(nodes.url, mid), ids[:512], [SPECS[0]])
        for port in nodes.masters():
            redis.Redis(port=port).execute_command("WAIT", 1, 5000)
        reference = llm.engine.generate([llm.engine.new_sequence(0, ids, SamplingParams(max_tokens=20))],
                                        "full")[0].token_ids
        verifier.wait_ready(mid)

        def decode() -> dict:
            seqs, reqs = run(drafter(llm, mid, nodes.url, verifier.url, SPECS[0]), {"p": ids}, timeout_s=120)
            assert reqs["p"].error is None and seqs["p"].output_ids == reference
            return seqs["p"].stats

        stats = decode()
        assert stats["prefix_tokens"] == 512 and stats["verifier_prefix_tokens"] == 512
        nodes.kill(next(p for p in nodes.masters() if not nodes.url.endswith(f":{p}")))
        decode()                        # blocks lost with the master are computed; the tokens are the same
        nodes.wait_ok()
        stats = decode()                # the replica has the blocks: a fresh drafter reads them all again
        assert stats["prefix_tokens"] == 512
    finally:
        verifier.stop()
        nodes.stop()


def test_a_master_that_stops_answering_mid_fetch_never_hangs_nor_gives_a_wrong_block(tmp_path):
    """A master SIGSTOPped while its replies are streaming (blocks of SmolLM2's KV shape, 5.9 MB each, far
    beyond the sockets' buffers): its connection times out, the slot map is read again, and once the
    cluster has promoted its replica (a one-second node timeout) its blocks are read there in the same
    fetch; whatever ends the fetch, it ends within the timeouts and every kept block is the stored one."""
    import os
    import signal
    import time

    from vericache.config import ModelConfig
    from vericache.model.registry import resolve_model
    from vericache.remote.chain import block_hashes
    from vericache.remote.codec import pack

    cfg = ModelConfig.from_file(resolve_model("smollm2-135m") / "config.json")
    nodes = LocalRedisCluster(tmp_path)
    stopped: list[int] = []
    try:
        bt, nb = 256, 12
        ids = list(range(nb * bt + 1))
        store = PrefixStore(nodes.url, "stop-test", bt, timeout_s=2)
        shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, bt, cfg.head_dim)
        gen = torch.Generator().manual_seed(0)
        blocks = [{"k": torch.randn(shape, generator=gen).half(), "v": torch.randn(shape, generator=gen).half()}
                  for _ in range(nb)]
        for h, b in zip(block_hashes("stop-test", ids, bt), blocks):
            store.client.set(store.key(h, "full"), pack(b))
        for port in nodes.masters():
            redis.Redis(port=port).execute_command("WAIT", 1, 5000)
        keys = [store.key(h, "full") for h in store.hashes(ids)]
        owner = {i: port for i, (_, port) in store.shards.owners(keys, list(range(nb))).items()}
        url_port = int(nodes.url.rsplit(":", 1)[1])
        victim = next(owner[i] for i in sorted(owner) if owner[i] not in (owner[0], url_port))
        full = FullKVCache(cfg, "cpu", torch.float16, capacity=len(ids))
        receive = full.byte_views

        def views(start: int, n: int):   # the victim's first block is landing: stop it there
            if owner[start // bt] == victim and not stopped:
                os.kill(nodes.procs[victim].pid, signal.SIGSTOP)
                stopped.append(start // bt)
            return receive(start, n)

        full.byte_views = views
        t0 = time.perf_counter()
        got = store.get_full_into(ids, full, nb)
        assert stopped and time.perf_counter() - t0 < 30
        assert got.reason in ("hit", "unavailable") and full.length == got.count * bt
        assert all(torch.equal(full.k[:, :, i * bt:(i + 1) * bt], blocks[i]["k"])
                   and torch.equal(full.v[:, :, i * bt:(i + 1) * bt], blocks[i]["v"]) for i in range(got.count))
        nodes.kill(victim)
        nodes.wait_ok()
        again = FullKVCache(cfg, "cpu", torch.float16, capacity=len(ids))
        got = store.get_full_into(ids, again, nb)
        assert got.reason == "hit" and got.count == nb and torch.equal(again.k[:, :, : nb * bt],
                                                                       torch.cat([b["k"] for b in blocks], dim=2))
    finally:
        for proc in nodes.procs.values():   # a stopped process must be continued to be killed cleanly
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
        nodes.stop()


def test_a_node_whose_port_is_taken_before_it_binds_starts_again_on_fresh_ports(tmp_path, monkeypatch):
    """A port found free can be taken before redis-server binds it (another server, a client's ephemeral
    port; CI saw it): the node exits at once and is started on fresh ports, not waited on for 30 s."""
    import socket
    import time

    import vericache_lab.redis_local as redis_local

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    real, handed = redis_local.free_port, []

    def racy_free_port() -> int:   # the first node's port is the one already taken
        port = taken.getsockname()[1] if not handed else real()
        handed.append(port)
        return port

    monkeypatch.setattr(redis_local, "free_port", racy_free_port)
    start = time.time()
    try:
        with LocalRedisCluster(tmp_path, masters=3, replicas=0) as nodes:
            assert handed[0] not in nodes.procs and len(nodes.live()) == 3 and len(nodes.masters()) == 3
            assert redis.Redis(port=nodes.masters()[0]).ping()
        assert time.time() - start < 25     # the dead node was not waited on for its 30 s
    finally:
        taken.close()
