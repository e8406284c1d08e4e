"""The prefix KV store against a real redis-server: codec, hash chain, every compressor's stored
form round trip, partial hits, missing and corrupt blocks, ls/rm and the CLI."""

from __future__ import annotations

import json
import re

import pytest
import torch

from test_identity import COMPRESSORS
from vericache.compress.base import prompt_scores
from vericache.compress.registry import parse_compressor
from vericache.kv.compressed import CompressedKVCache
from vericache.kv.full import FullKVCache
from vericache.kv.tee import QueryRecorder, TeeCache
from vericache.remote.chain import block_hashes
from vericache.remote.codec import CorruptValue, pack, unpack
from vericache.remote.forms import compressed_forms
from vericache.remote.prefixes import model_id, put_prompt
from vericache.remote.store import PrefixStore, StoreUnavailable

BT = 64  # small blocks keep the prompts short


@pytest.fixture(scope="module")
def prefix(llm, code_prompts):
    return llm.tokenizer.encode(code_prompts["long"])[:400]  # 6 whole blocks + a tail


@pytest.fixture(scope="module")
def stored(llm, redis_server, prefix):
    store = PrefixStore(redis_server.url, model_id(llm.loaded) + "-store-tests", BT)
    entry = put_prompt(llm.engine, store, prefix, COMPRESSORS)
    return store, entry


def test_codec_round_trip_and_corruption():
    t = {"a": torch.randn(2, 3, 4), "b": torch.arange(5, dtype=torch.int32), "c": torch.zeros(0),
         "d": torch.randn(3).to(torch.float8_e4m3fn), "e": torch.randn(2, 2).half()}
    back, meta = unpack(pack(t, {"x": 1}))
    assert meta == {"x": 1}
    for name, x in t.items():
        assert back[name].dtype == x.dtype and back[name].shape == x.shape
        assert torch.equal(back[name].view(torch.uint8), x.view(torch.uint8))
    value = bytearray(pack(t))
    value[-3] ^= 0xFF
    with pytest.raises(CorruptValue, match="checksum"):
        unpack(bytes(value))
    with pytest.raises(CorruptValue):
        unpack(pack(t)[:-10])
    with pytest.raises(CorruptValue, match="magic"):
        unpack(b"garbage")


def with_digest(value: bytes, digest) -> bytes:
    """``value`` (a ``pack``ed one) with its header's digest replaced by ``digest(body)``."""
    import struct

    from vericache.remote.codec import MAGIC

    (hlen,) = struct.unpack("<I", value[len(MAGIC): len(MAGIC) + 4])
    header = json.loads(value[len(MAGIC) + 4: len(MAGIC) + 4 + hlen])
    body = value[len(MAGIC) + 4 + hlen:]
    header["digest"] = digest(body)
    head = json.dumps(header).encode()
    return MAGIC + struct.pack("<I", len(head)) + head + body


def test_values_are_crc32c_and_the_older_crc32_ones_still_read():
    """pack writes CRC-32C; a value written with zlib's CRC-32 (before session 35) still unpacks; a digest
    naming another checksum, or a right name with a wrong value, is corrupt."""
    import zlib

    import crc32c

    t = {"a": torch.randn(3, 5)}
    value = pack(t)
    assert f'"crc32c:{crc32c.crc32c(t["a"].numpy().tobytes()):08x}"'.encode() in value
    older = with_digest(value, lambda body: f"crc32:{zlib.crc32(body):08x}")
    assert torch.equal(unpack(older)[0]["a"], t["a"])
    for bad in (lambda body: f"md5:{zlib.crc32(body):08x}", lambda body: f"crc32:{zlib.crc32(body) ^ 1:08x}", lambda _: 7):
        with pytest.raises(CorruptValue, match="checksum"):
            unpack(with_digest(value, bad))


def test_hash_chain_shares_leading_blocks():
    a = list(range(1000))
    b = a[:600] + [7] * 400
    ha, hb = block_hashes("m", a, 256), block_hashes("m", b, 256)
    assert len(ha) == 3 and ha[:2] == hb[:2] and ha[2] != hb[2]
    assert block_hashes("other", a, 256)[0] != ha[0]
    assert block_hashes("m", a[:255], 256) == []
    with pytest.raises(ValueError, match="block_tokens"):
        block_hashes("m", a, 0)


def test_full_form_round_trip(llm, stored, prefix):
    store, entry = stored
    assert entry["blocks"] == len(prefix) // BT and "full" in entry["forms"]
    got = store.get(prefix, "full")
    assert got.reason == "hit" and len(got.blocks) == entry["blocks"] and got.nbytes > 0
    cfg = llm.loaded.config
    ref = FullKVCache(cfg, "cpu", llm.loaded.kv_dtype, capacity=len(prefix))
    llm.engine.prefill(prefix, [ref])
    full = FullKVCache(cfg, "cpu", llm.loaded.kv_dtype, capacity=len(prefix))
    n = full.load_blocks(got.blocks)
    assert n == entry["tokens"]
    assert torch.equal(full.k[:, :, :n], ref.k[:, :, :n]) and torch.equal(full.v[:, :, :n], ref.v[:, :, :n])


def into_cache(llm, store: PrefixStore, ids: list[int]) -> tuple[str, int]:
    full = FullKVCache(llm.loaded.config, "cpu", llm.loaded.kv_dtype, capacity=len(ids))
    got = store.get_full_into(ids, full)
    assert got.count * BT == full.length
    return got.reason, full.length


def test_bulk_reader_matches_redis_py_and_streams_into_a_cache(llm, stored, prefix, redis_server):
    """Both readers give byte-identical blocks; ``into`` hands each block over as it arrives."""
    store, entry = stored
    other = PrefixStore(redis_server.url, store.model_id, BT, reader="redis-py")
    a, b = store.get(prefix, "full"), other.get(prefix, "full")
    assert store.reader == "bulk" and a.count == b.count == len(a.blocks) == entry["blocks"]
    for x, y in zip(a.blocks, b.blocks):
        assert torch.equal(x["k"], y["k"]) and torch.equal(x["v"], y["v"])
    full = FullKVCache(llm.loaded.config, "cpu", llm.loaded.kv_dtype, capacity=len(prefix))
    got = store.get(prefix, "full", into=lambda blk: full.append(blk["k"], blk["v"]))
    assert got.blocks == [] and got.count == entry["blocks"] and full.length == entry["tokens"]
    assert torch.equal(full.k[:, :, : full.length], torch.cat([x["k"] for x in a.blocks], dim=2))
    assert store.get(list(reversed(prefix)), "full").reason == "miss"      # a null reply, nothing kept
    straight = FullKVCache(llm.loaded.config, "cpu", llm.loaded.kv_dtype, capacity=len(prefix))
    got = store.get_full_into(prefix, straight)                           # received into the cache rows
    assert got.reason == "hit" and straight.length == full.length
    assert torch.equal(straight.k[:, :, : full.length], full.k[:, :, : full.length])
    assert torch.equal(straight.v[:, :, : full.length], full.v[:, :, : full.length])
    for connections in (1, 3, 16):   # one prefix's blocks spread over connections: the same rows
        spread = FullKVCache(llm.loaded.config, "cpu", llm.loaded.kv_dtype, capacity=len(prefix))
        one = PrefixStore(redis_server.url, store.model_id, BT, connections=connections)
        assert one.get_full_into(prefix, spread).reason == "hit" and spread.length == full.length
        assert torch.equal(spread.k[:, :, : full.length], full.k[:, :, : full.length])
        assert torch.equal(spread.v[:, :, : full.length], full.v[:, :, : full.length])
    # a block written with zlib's CRC-32 (before session 35) reads alike; one naming no known checksum is corrupt
    import zlib

    import redis

    client, key = redis.Redis.from_url(redis_server.url), store.key(store.hashes(prefix)[0], "full")
    current = client.get(key)
    try:
        for digest, reason in ((lambda body: f"crc32:{zlib.crc32(body):08x}", "hit"), (lambda _: "sha0:0", "corrupt")):
            client.set(key, with_digest(current, digest))
            again = FullKVCache(llm.loaded.config, "cpu", llm.loaded.kv_dtype, capacity=len(prefix))
            got = store.get_full_into(prefix, again)
            assert got.reason == reason and (reason != "hit" or torch.equal(again.k[:, :, : full.length],
                                                                           full.k[:, :, : full.length])), got
    finally:
        client.set(key, current)
    with pytest.raises(ValueError, match="connections must be an integer >= 1, got 0"):
        PrefixStore(redis_server.url, "m", BT, connections=0)
    with pytest.raises(ValueError, match="reader"):
        PrefixStore(redis_server.url, "m", BT, reader="fast")
    with pytest.raises(ValueError, match="do not fit"):
        full.append(a.blocks[0]["k"][:, :1], a.blocks[0]["v"][:, :1])


@pytest.mark.parametrize("spec", COMPRESSORS)
def test_compressed_form_round_trip(llm, stored, prefix, spec):
    """What the drafter loads is bit for bit the form computed from the prefix, and it is compressed."""
    store, entry = stored
    comp = parse_compressor(spec)
    got = store.get(prefix, comp.spec())
    assert got.reason == "hit" and len(got.blocks) == entry["blocks"]
    cfg, n = llm.loaded.config, entry["tokens"]
    full = FullKVCache(cfg, "cpu", llm.loaded.kv_dtype, capacity=n)
    rec = QueryRecorder(cfg.num_hidden_layers, 64)
    llm.engine.prefill(prefix[:n], [TeeCache(full, rec)])
    scores = prompt_scores(comp, llm.loaded.model, full, prefix[:n], llm.tokenizer)
    expect = compressed_forms(comp, full, rec.queries, entry["blocks"], BT, scores)
    for block, want in zip(got.blocks, expect):
        assert set(block) == set(want)
        for name in want:
            assert torch.equal(block[name].view(torch.uint8), want[name].view(torch.uint8)), name
    cache = CompressedKVCache(comp, cfg, "cpu", llm.loaded.kv_dtype, capacity=n + 64)
    assert cache.load_stored(got.blocks, BT) == n
    assert cache.committed == cache.res_start == n
    assert cache.nbytes() < 0.6 * n * full.nbytes_per_position()  # really compressed
    k, v = cache.dequantized(0)
    assert torch.isfinite(k).all() and torch.isfinite(v).all()
    assert got.nbytes < 0.6 * store.get(prefix, "full").nbytes


def test_partial_hit_missing_and_corrupt_blocks(llm, stored, prefix, redis_server):
    store, entry = stored
    other = prefix[: 3 * BT] + list(reversed(prefix[3 * BT :]))
    assert store.match(other) == 3 and store.match(prefix) == entry["blocks"]
    got = store.get(other, "full")
    assert got.reason == "partial" and len(got.blocks) == 3
    assert into_cache(llm, store, other) == ("partial", 3 * BT)
    # a corrupted block ends the lookup there: the caller recomputes from it
    h = store.hashes(prefix)
    key = store.key(h[2], "full")
    good = redis_server.client.get(key)
    try:
        bad = bytearray(good)
        bad[len(bad) // 2] ^= 0x55
        redis_server.client.set(key, bytes(bad))
        got = store.get(prefix, "full")
        assert got.reason == "corrupt" and len(got.blocks) == 2
        assert store.stats.corrupt >= 1
        assert into_cache(llm, store, prefix) == ("corrupt", 2 * BT)    # cut back to the good blocks
        redis_server.client.set(key, bytes(good[:100]))                    # a truncated header
        assert into_cache(llm, store, prefix) == ("corrupt", 2 * BT)
        redis_server.client.delete(key)
        got = store.get(prefix, "full")
        assert got.reason == "partial" and len(got.blocks) == 2
        assert into_cache(llm, store, prefix) == ("partial", 2 * BT)
    finally:
        redis_server.client.set(key, good)


def test_ls_and_rm_keep_shared_blocks(llm, redis_server, prefix):
    store = PrefixStore(redis_server.url, model_id(llm.loaded) + "-rm-tests", BT)
    a, b = prefix[: 4 * BT], prefix[: 2 * BT] + list(reversed(prefix[2 * BT : 4 * BT]))
    ea = put_prompt(llm.engine, store, a, [])
    eb = put_prompt(llm.engine, store, b, ["snapkv:ratio=0.1"])
    assert {e["id"] for e in store.ls()} == {ea["id"], eb["id"]}
    assert store.rm(ea["id"]) == 2          # a's own two blocks; the two shared with b stay
    assert store.match(b) == 4 and store.match(a) == 2
    with pytest.raises(ValueError, match="no prefix"):
        store.rm(ea["id"])
    assert store.rm() == 4 * 2 and store.ls() == [] and store.match(b) == 0


def test_bad_input_and_store_down(llm):
    with pytest.raises(ValueError, match="redis://"):
        PrefixStore("http://x", "m")
    for reader in ("bulk", "redis-py"):
        store = PrefixStore("redis://127.0.0.1:1", "m", BT, timeout_s=0.5, reader=reader)
        with pytest.raises(StoreUnavailable, match="unreachable"):
            store.get(list(range(200)), "full")
    with pytest.raises(ValueError, match="whole block"):
        put_prompt(llm.engine, PrefixStore("redis://127.0.0.1:1", "m", BT), [1, 2, 3], [])


def test_prefix_cli(llm, redis_server, prefix, tmp_path, capsys):
    from vericache.cli import main

    f = tmp_path / "p.txt"  # a prompt no other test stores (rm keeps blocks another prefix lists)
    f.write_text("# the CLI test's own prefix\n" + llm.tokenizer.decode(prefix))
    base = ["--redis", redis_server.url, "--model", "tiny", "--dtype", "float32", "--json"]
    assert main(["prefix", "put", "--prompt-file", str(f), "--compressor", "kivi:bits=2", *base]) == 0
    put = json.loads(capsys.readouterr().out)
    assert put["blocks"] >= 1 and "kivi:window=32,bits=2,group=32" in put["forms"]
    assert main(["prefix", "get", "--prompt-file", str(f), "--compressor", "kivi:bits=2", *base]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["forms"]["full"]["status"] == "hit" and got["forms"]["full"]["blocks"] >= 1
    assert main(["prefix", "ls", *base]) == 0
    ls = json.loads(capsys.readouterr().out)
    assert ls["redis"].count(".") == 2 and put["id"] in [p["id"] for p in ls["prefixes"]]
    assert ls["model_id"].endswith("-fp32")
    assert main(["prefix", "ls", "--numerics", "q8", *base]) == 0      # every model flag reaches the load
    assert json.loads(capsys.readouterr().out)["model_id"].endswith("-q8")
    assert main(["prefix", "ls", "--numerics", "q8qk", *base]) == 0     # q8qk: its key coding's digest too
    assert re.search(r"-q8qk-[0-9a-f]{16}$", json.loads(capsys.readouterr().out)["model_id"])
    assert main(["prefix", "rm", "--id", put["id"], *base]) == 0
    assert json.loads(capsys.readouterr().out)["deleted_keys"] >= 2
    assert main(["prefix", "rm", *base]) == 2  # neither --id nor --all
