"""The prefix store on a real Redis Cluster (issue 55 item 1): three masters and three replicas on
127.0.0.1 (``vericache_lab.redis_local.LocalRedisCluster``). The store's URL names one node and the cluster is found
from it; a prefix's blocks spread over every master and come back whole, every master streaming its
own; the compressed forms and both readers too; ls and rm across the cluster; a master that is gone
when a fetch runs costs the blocks from its first one on (computed again, never a wrong one), and once
its replica has taken over they come from the replica; a verifier process and a drafter fetching
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
    nodes = LocalRedisCluster(tmp_path_factory.mktemp("cluster"))
    yield nodes
    nodes.stop()


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
        full = FullKVCache(llm.loaded.config, "cpu", llm.loaded.kv_dtype, capacity=len(prefix))
        got = store.get_full_into(prefix, full)
        assert got.reason == "unavailable" and got.count == first_lost and full.length == first_lost * BT
        assert same_rows(full, reference_kv, full.length)       # what was kept is exact; the rest is computed
        nodes.wait_ok()                # the victim's replica now serves its slots
        assert victim not in nodes.masters()
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
