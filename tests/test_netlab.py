"""The shaped network on one machine (root only: CI runs as root) and the bench's refusal without it."""

from __future__ import annotations

import os

import pytest

from conftest import system_command
from vericache_lab import netlab


@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
def test_netlab_links_are_shaped_and_measured():
    system_command("ip"), system_command("tc")  # a missing one fails with its install command, never a skip
    reason = netlab.available()
    assert reason is None, reason
    lab = netlab.up(netlab.Shape(slow_gbps=0.5, rtt_ms=20, fast_gbps=5))
    try:
        st = netlab.status()
        assert all(len(st[role]) == 2 for role in netlab.NAMESPACES)  # two shaped veth ends per namespace
        m = netlab.measure(lab, slow_bytes=4 << 20, fast_bytes=32 << 20)
        for name in ("slow-store", "slow-verify"):
            assert 18 <= m[name]["rtt_ms"] <= 60, m[name]            # the relay's delay, both ways
            assert 0.2 <= m[name]["gbps"] <= 0.55, m[name]           # tbf's rate
        assert m["fast"]["rtt_ms"] < 5 and m["fast"]["gbps"] > 2 * m["slow-store"]["gbps"], m["fast"]
        before = netlab.link_bytes()
        assert set(before) == set(netlab.LINKS) and all(v > 4 << 20 for v in before.values())
    finally:
        netlab.down()
    assert all(v is None for v in netlab.status().values())


def test_bench_prefix_refuses_without_namespaces(monkeypatch, capsys):
    from vericache.cli import main

    monkeypatch.setattr(netlab, "available", lambda: "network namespaces need root (test)")
    assert main(["bench", "prefix", "--prefix-tokens", "300", "--requests", "1"]) == 1
    assert "network namespaces need root (test)" in capsys.readouterr().err
    with pytest.raises(ValueError, match="slow_gbps"):
        netlab.Shape(slow_gbps=0)


@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
def test_bench_prefix_short_run(capsys):
    """``bench prefix`` end to end on ``tiny``, small: full-remote and VeriCache on the shaped network with
    the store a 3-master Redis Cluster (the drafter reaching its nodes through their slow-link relays:
    ``remap``), VeriCache's output identical to full-remote's, every row carrying the cost model's
    prediction, the verifier's prefix fetched from the store over the fast link."""
    import json

    from vericache.cli import main

    system_command("redis-server")
    assert main(["bench", "prefix", "--model", "tiny", "--prefix-tokens", "600", "--requests", "2", "--max-tokens", "8",
                 "--slow-gbps", "0.5", "--fast-gbps", "5", "--modes", "full-remote,vericache",
                 "--compressor", "snapkv:ratio=0.25", "--store", "cluster", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert list(res["stores"]) == ["cluster"] and "3-master" in res["stores"]["cluster"]
    rows = {r["mode"]: r for r in res["rows"]}
    assert set(rows) == {"full-remote", "vericache"} and rows["vericache"]["identical_to_full"]
    for row in rows.values():
        assert row["ttft_s"] > 0 and row["measured_over_predicted"] > 0, row
    veri = rows["vericache"]
    assert veri["verifier_prefix_tokens"] == veri["prefix_tokens"] and veri["fast_link_bytes"] > 0   # from the store
    assert rows["vericache"]["slow_link_bytes"] < rows["full-remote"]["slow_link_bytes"]
    full = rows["full-remote"]   # the drafter reached the cluster's nodes only through their slow-link relays
    assert min(full["prefix_tokens"]) > 0 and full["slow_link_bytes"] >= full["drafter_fetch_bytes"] > 0
