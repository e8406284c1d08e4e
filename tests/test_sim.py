"""The cost model behaves like the roofline it claims to be."""

from __future__ import annotations

import json

from vericache.cli import main
from vericache.sim.cost_model import GPUS, MODELS, PCIE, SimConfig, simulate


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


def test_sim_command(capsys, tmp_path):
    assert main(["sim", "--context", "8192,32768", "--json", "--plot", str(tmp_path / "s.png")]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert {r["mode"] for r in rows} == {"full", "lossy", "vericache-naive", "vericache-staggered"}
    assert {r["model"] for r in rows} == set(MODELS) and (tmp_path / "s.png").exists()
    assert main(["sim", "--models", "gpt-9"]) == 2
