"""The cost model behaves like the roofline it claims to be."""

from __future__ import annotations

import json

import pytest
import torch

from vericache.cli import main
from vericache_lab.sim.cost_model import GPUS, MODELS, PCIE, SimConfig, simulate


def _cfg(**kw):
    base = dict(gpu=GPUS["h100"], model=MODELS["llama3-8b"], link_bw=PCIE["gen5"], context=32768)
    return SimConfig(**{**base, **kw})


def test_batch_is_memory_bound_and_compression_raises_it():
    r = simulate(_cfg())
    kv = 32768 * MODELS["llama3-8b"].kv_bytes_per_token
    assert r["full"]["batch"] == int((80e9 * 0.9 - MODELS["llama3-8b"].weight_bytes) // kv)
    assert r["lossy"]["batch"] >= 7 * r["full"]["batch"]


def test_staggering_never_loses_and_link_bounds_it():
    for ctx in (8192, 32768, 131072):
        r = simulate(_cfg(context=ctx))
        assert r["vericache-staggered"]["tokens_per_s"] >= r["vericache-naive"]["tokens_per_s"]
        # staggered is at most link-bound: batch * tokens/round / (batch * full KV / link)
        c = _cfg(context=ctx)
        link_bound = c.acceptance_length * c.link_bw / (ctx * c.model.kv_bytes_per_token)
        assert r["vericache-staggered"]["tokens_per_s"] <= link_bound * 1.001


def test_longer_accepted_runs_and_faster_links_help():
    slow = simulate(_cfg(acceptance_length=8))["vericache-staggered"]["tokens_per_s"]
    fast = simulate(_cfg(acceptance_length=40))["vericache-staggered"]["tokens_per_s"]
    gen4 = simulate(_cfg(link_bw=PCIE["gen4"]))["vericache-staggered"]["tokens_per_s"]
    assert slow < fast and gen4 < simulate(_cfg())["vericache-staggered"]["tokens_per_s"]


def test_resident_fraction_trades_batch_for_link_bytes():
    """Keeping part of the full KV on the device never loses to streaming all of it (f = 0 is on the
    grid) and, with a slow link, the best fraction is above 0."""
    for link in (PCIE["gen4"], PCIE["gen5"] / 8):
        r = simulate(_cfg(link_bw=link))
        res = r["vericache-resident"]
        assert res["tokens_per_s"] >= r["vericache-staggered"]["tokens_per_s"]
        assert 0 < res["resident_fraction"] <= 1 and res["batch"] <= r["vericache-staggered"]["batch"]
    slow = simulate(_cfg(link_bw=PCIE["gen5"] / 8))["vericache-resident"]
    assert slow["tokens_per_s"] > simulate(_cfg(link_bw=PCIE["gen5"] / 8))["vericache-staggered"]["tokens_per_s"]


def test_sim_command(capsys, tmp_path):
    assert main(["sim", "--context", "8192,32768", "--json", "--plot", str(tmp_path / "s.png")]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert {r["mode"] for r in rows} == {"full", "lossy", "vericache-naive", "vericache-staggered", "vericache-resident"}
    assert {r["model"] for r in rows} == set(MODELS) and (tmp_path / "s.png").exists()
    assert main(["sim", "--models", "gpt-9"]) == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_cuda_link_copies_layer_by_layer():
    from vericache.config import ModelConfig
    from vericache.kv.full import FullKVCache
    from vericache.kv.link import CudaLink

    cfg = ModelConfig(num_hidden_layers=3)
    src = FullKVCache(cfg, "cpu", torch.float32, 64)
    src.begin(0, 64)
    src.k.normal_()
    src.k, src.v = src.k.pin_memory(), src.v.pin_memory()
    dst = FullKVCache(cfg, "cuda", torch.float32, 64)
    link = CudaLink(torch.device("cuda"))
    t = link.submit(src, 64, dst)
    t.wait_all()
    assert torch.equal(dst.k.cpu(), src.k) and t.layers_done() == 3
    assert link.stats.bytes_moved == 2 * src.k.numel() * 4 and link.stats.busy_s > 0
    half = FullKVCache(cfg, "cuda", torch.float32, 64, layers=1)  # only the last layer moves
    t = link.submit(src, 64, half, first_layer=2)
    t.wait_all()
    assert torch.equal(half.k[0].cpu(), src.k[2])


def test_step_cost_model_composes_measured_step_costs(llm):
    """drafting.cost: measured on real caches (tiny model, short context), no cost negative (each is
    a difference of timings, small for the tiny model: noise can take one to zero, never below) and
    something measured, and the predictions follow from them: drafts over a compressed cache beat
    full, cheaper draft matmuls raise VeriCache, and one sequence's round is k drafts then a verification."""
    from vericache.compress.registry import parse_compressor
    from vericache_lab.predict import measure_step_costs, predict_tokens_per_s

    weights = lambda rows: 0.002 + 0.0001 * rows  # noqa: E731
    # measured with no matmul time taken out: each term stays a difference of timings that grows with
    # the work (taking out a guessed ``weights`` took every term to 0.0 on a fast Zen 5)
    c = measure_step_costs(llm, parse_compressor("snapkv:ratio=0.125"), 600, lambda rows: 0.0, repeats=2)
    assert min(c.full, c.draft, c.verify(1), c.c0) >= 0 and min(c.costs.to_dict().values()) >= 0
    assert c.full + c.draft + c.verify(4) > 0 and c.verify(8) >= c.verify(4)
    assert c.draft_row[0] < c.full_row[0]          # the geometry: a draft row reads fewer bytes
    fake = _at(weights=weights)
    assert predict_tokens_per_s(fake, "lossy", 8) > predict_tokens_per_s(fake, "full", 8)
    base = predict_tokens_per_s(fake, "vericache", 8, 3.0, 2.0)
    assert predict_tokens_per_s(fake, "vericache", 8, 3.0, 2.0, draft_weights=lambda r: 0.5 * weights(r)) > base
    assert predict_tokens_per_s(fake, "vericache", 8, 3.0, 2.0, move_s=0.01) < base
    one = predict_tokens_per_s(fake, "vericache", 1, 3.0, 2.0)
    round_s = 2 * (0.01 + weights(1) + fake.draft) + 0.01 + weights(3) + fake.verify(3)
    assert abs(one - 3.0 / round_s) < 1e-9


def _at(c0=0.01, t_seq=0.004, t_byte=1e-9, t_pair=1e-6, weights=lambda rows: 0.03 + 0.001 * rows):
    """Costs at a geometry: a full row reads 16 MB and 2000 pairs, a draft row 2 MB and 250."""
    from vericache.drafting.cost import CostsAt, StepCosts
    return CostsAt(StepCosts(c0=c0, t_seq=t_seq, t_byte=t_byte, t_pair=t_pair, matmuls=weights), (16e6, 2000), (2e6, 250))


def _costs(**kw):
    from vericache_lab.sim.remote_prefix import costs_from_steps
    return costs_from_steps(_at(**kw), n=4, tail=120, k=8.0)


def _setting(**kw):
    from vericache_lab.sim.remote_prefix import RemoteSetting
    base = dict(n=4, prefix=6000, tail=120, max_tokens=64, slow_Bps=1e9 / 8, rtt_s=0.02, store_Bps=1e9,
                full_bytes=270e6, comp_bytes=37e6, kv_pos_bytes=46e3, tokens_per_round=6.0, drafted=8.0)
    return RemoteSetting(**{**base, **kw})


def test_remote_prefix_model_charges_each_link_where_it_is_crossed():
    from vericache_lab.sim.remote_prefix import predict_remote
    p, slower = predict_remote(_setting(), _costs()), predict_remote(_setting(slow_Bps=0.5e9 / 8), _costs())
    # full-remote's TTFT is its fetch over the slow link; VeriCache's first token comes from the verifier
    assert slower["full-remote"]["ttft_s"] > 1.9 * p["full-remote"]["ttft_s"] - 1
    assert slower["vericache"]["ttft_s"] == p["vericache"]["ttft_s"]
    assert p["lossy-remote"]["ttft_s"] < p["full-remote"]["ttft_s"]
    longer = predict_remote(_setting(tokens_per_round=12.0), _costs())
    assert longer["vericache"]["e2e_s"] < p["vericache"]["e2e_s"]
    slow_verifier = predict_remote(_setting(), _costs(), verifier=_costs(t_pair=1e-5))
    assert slow_verifier["vericache"]["e2e_s"] > p["vericache"]["e2e_s"]
    assert slow_verifier["full-remote"] == p["full-remote"]
    # verifications out of step (one session per forward) read the weights once each: rounds get longer
    apart = predict_remote(_setting(group=1.0), _costs())
    assert apart["vericache"]["round_s"] > p["vericache"]["round_s"]
    assert apart["vericache"]["round_s"] >= 4 * _costs().verify(1)


def test_a_verifiers_opens_land_in_turn_and_share_prefills_that_find_them_waiting():
    """``open_pipeline``: each session's first token once its fetch (the i-th in turn) is in and the
    loop's next forward, which prefills every tail then in, is done; VeriCache's predicted TTFT is the
    mean over the sessions (as the bench's measured one)."""
    from vericache_lab.sim.remote_prefix import in_turn, open_pipeline, predict_remote

    def per_forward(m: int) -> float:
        return 0.4 + 0.1 * m     # the weights once a forward, then per tail

    assert in_turn(4, 1.0) == [1.0, 2.0, 3.0, 4.0]
    assert open_pipeline(in_turn(4, 1.0), per_forward) == ([1.5, 2.5, 3.5, 4.5], 2.0)   # each alone: the store's pace
    # a slow forward: the opens that land meanwhile share the next one
    first, busy = open_pipeline(in_turn(4, 0.25), lambda m: 1.0 + 0.1 * m)
    assert first == pytest.approx([1.35, 2.65, 2.65, 2.65]) and busy == pytest.approx(2.4)
    s, c = _setting(), _costs()
    opens, _ = open_pipeline(in_turn(s.n, s.full_bytes / s.store_Bps), c.prefill_tails)
    vc = predict_remote(s, c)["vericache"]
    assert vc["ttft_s"] == pytest.approx(1.5 * s.rtt_s + sum(opens) / s.n) and vc["ttft_s"] < 1.5 * s.rtt_s + opens[-1]
    slow_store = predict_remote(_setting(store_Bps=s.store_Bps / 4), c)["vericache"]   # each fetch 4x as long
    assert slow_store["ttft_s"] > vc["ttft_s"] + 1.5 * (s.n + 1) / 2 * s.full_bytes / s.store_Bps
    assert slow_store["e2e_s"] > vc["e2e_s"]


def test_sim_remote_prefix_command(capsys):
    assert main(["sim", "--remote-prefix", "--context", "32768", "--acceptance-length", "6", "--draft-len", "8",
                 "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert {r["gpu"] for r in rows} == {"h100", "h200"} and len(rows) == 2 * 3 * 2 * 2
    for r in rows:
        assert r["vericache_ttft_s"] < r["full_remote_ttft_s"]
        # a faster store link only helps VeriCache's TTFT
        twin = next(x for x in rows if x["gpu"] == r["gpu"] and x["model"] == r["model"]
                    and x["slow_gbps"] == r["slow_gbps"] and x["fast_link"] != r["fast_link"])
        fast, slow = (r, twin) if r["fast_link"] == "nvlink" else (twin, r)
        assert fast["vericache_ttft_s"] < slow["vericache_ttft_s"]
    assert main(["sim", "--remote-prefix", "--ratio", "0"]) != 0
    assert "--ratio must be in (0, 1], got 0.0" in capsys.readouterr().err


def test_prefix_bench_reads_traces_into_busy_shares_and_fetch_rates():
    from vericache_lab.bench.prefix_timeline import busy_share, fetch_rate_gbps, link_rates, spans
    t0 = 1000.0
    records = [{"event": "phase", "kind": "draft", "seconds": 0.5, "end": t0 + 1.0},
               {"event": "prefill", "seconds": 2.0, "end": t0 + 3.0},
               {"event": "verify_step", "seconds": 2.0, "end": t0 + 3.0, "with_prefill": True},   # the same forward
               {"event": "prefix", "tier": "full", "bytes": 250e6, "seconds": 1.0, "end": t0 + 1.0},
               {"event": "prefix", "tier": "full", "bytes": 250e6, "seconds": 1.0, "end": t0 + 1.5},
               {"event": "phase", "kind": "draft", "seconds": 0.5, "end": t0 + 20.0}]               # after the window
    sp = spans(records, t0, t0 + 10)
    assert len(sp) == 5 and sp[0]["start"] == 0.5
    assert busy_share(sp, 10.0) == 0.25                   # 0.5 + 2.0 of 10 s; the shared forward once
    assert fetch_rate_gbps(sp) == round(500e6 * 8 / 1.5 / 1e9, 3)
    assert fetch_rate_gbps([s for s in sp if s["event"] != "prefix"]) is None
    rates = link_rates([(t0, {"fast": 0}), (t0 + 0.5, {"fast": 125_000_000})], t0)
    assert rates == {"fast": [(0.5, 2.0)]}


def test_remote_costs_are_measured_at_the_bench_geometry(llm):
    from vericache.compress.registry import parse_compressor
    from vericache_lab.bench.prefix_model import measure_remote_costs
    c = measure_remote_costs(llm, parse_compressor("snapkv:ratio=0.25"), context=300, n=2, tail=16, k=3.0,
                             draft_kind="int8", repeats=1)
    for f in (c.decode_full, c.decode_comp, c.draft, c.verify):
        assert 0 < f(1) and 0 < f(2) and f(1.5) == pytest.approx((f(1) + f(2)) / 2)
    # measured times only: positive, and the tails' table ends at the n-tail prefill (which one is faster
    # is the machine's business, not the test's: CI failed once on a noisy neighbour)
    assert c.prefill > 0 and c.prefill_comp > 0 and 0 < c.prefill_tails(1) and c.prefill_tails(2) == c.prefill
    assert c.prefill_tails(1.5) == pytest.approx((c.prefill_tails(1) + c.prefill) / 2)


def test_the_cluster_model_is_the_one_node_model_at_one_of_each_and_names_its_limits():
    """``sim.remote_cluster`` at one drafter, one verifier and an unbounded store, its fast link at the
    one-node model's fetch rate, predicts what ``predict_remote`` does; more drafters on one shard make
    the store the limit (VeriCache's verifiers read the full KV through it too); more shards lift it and
    the verifier's link or the rounds take over; more verifiers share the sessions."""
    from vericache_lab.sim.remote_cluster import Cluster, predict_cluster
    from vericache_lab.sim.remote_prefix import predict_remote

    s = _setting()
    one = predict_cluster(s, Cluster(1, 1, 1, 1e18, s.store_Bps), _costs(), _costs())
    ref = predict_remote(s, _costs())
    for mode in ref:
        assert one[mode]["ttft_s"] == pytest.approx(ref[mode]["ttft_s"], rel=1e-12), mode
        assert one[mode]["e2e_s"] == pytest.approx(ref[mode]["e2e_s"], rel=1e-12), mode
    shard = 1e9   # bytes/s
    # a verifier whose 64 tails' prefills (attention over 6K positions each) take longer than their fetches
    slow = predict_cluster(s, Cluster(16, 1, 1, shard, s.store_Bps), _costs(), _costs())
    assert slow["vericache"]["ttft_limit"] == "verifier compute"
    verifier = _costs(t_pair=1e-7)   # ... and one whose prefills are cheap beside them
    crowded = predict_cluster(s, Cluster(16, 1, 1, shard, s.store_Bps), _costs(), verifier)
    assert crowded["vericache"]["ttft_limit"] == "store" and crowded["full-remote"]["ttft_limit"] == "store"
    spread = predict_cluster(s, Cluster(16, 1, 16, shard, s.store_Bps), _costs(), verifier)
    assert spread["vericache"]["ttft_s"] < crowded["vericache"]["ttft_s"]
    assert spread["vericache"]["ttft_limit"] == "verifier fast link"
    pooled = predict_cluster(s, Cluster(16, 4, 16, shard, s.store_Bps), _costs(), verifier)
    # one store answering in turn: its fetches dealt round four verifiers land when they would at one
    alone, dealt = (predict_cluster(s, Cluster(1, v, 1, 0.3e9, s.store_Bps), _costs(), verifier)["vericache"]
                    for v in (1, 4))
    assert dealt["ttft_s"] == pytest.approx(alone["ttft_s"]) and dealt["e2e_s"] <= alone["e2e_s"]
    assert alone["ttft_limit"] == "store"
    assert pooled["vericache"]["ttft_s"] < spread["vericache"]["ttft_s"]
    assert pooled["vericache"]["tokens_per_s"] > spread["vericache"]["tokens_per_s"] > crowded["vericache"]["tokens_per_s"]


def test_sim_remote_command_sweeps_and_plots(capsys, tmp_path):
    plot = tmp_path / "remote.png"
    assert main(["sim", "remote", "--drafters", "1,8", "--verifiers", "1,2", "--shards", "1,4", "--json",
                 "--plot", str(plot)]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert len(rows) == 2 * 2 * 2 * 3 and plot.stat().st_size > 10_000
    assert {r["ttft_limit"] for r in rows} >= {"store", "slow link"}
    assert main(["sim", "remote", "--shard-gbps", "0"]) != 0
    assert "--shard-gbps must be > 0" in capsys.readouterr().err
