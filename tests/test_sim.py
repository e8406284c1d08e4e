"""The cost model behaves like the roofline it claims to be."""

from __future__ import annotations

import json

import pytest
import torch

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


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine the script measures instead")
def test_gpu_check_says_no_device_on_cpu(capsys):
    from vericache.bench.gpu_check import main as gpu_main

    assert gpu_main(["--out", "/tmp/vericache-gpu-check"]) == 0
    assert "no CUDA device" in capsys.readouterr().out


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


def test_calibrated_prediction_charges_draft_weights_and_moves():
    """The bench rows' model: cheaper draft matmuls raise VeriCache's figure, compression moves lower
    every compressed mode's, and without a link a round is only its compute."""
    from vericache.sim.calibrate import Calibration, predict

    roof = {"read_bytes_per_s": 2e10, "attn_flops_per_s": 1e11, "flops_per_pair": 4 * 64 * 9 * 30,
            "weight_rows": [1, 16, 64], "weight_s": [0.03, 0.07, 0.14]}
    cal = Calibration("m", "float32", 2, 0.035, 0.002, 0.001, 2e10, 1e9, 1.0, 23040, roof)
    args = dict(kept=0.125, window=32, acceptance=3.0, draft_len=2.0)
    exact = predict(cal, "vericache", 16, 8000, **args)
    cheap = predict(cal, "vericache", 16, 8000, draft_matmul_s=lambda rows: 0.3 * cal.weights_s(rows), **args)
    assert cheap > exact > 0
    assert predict(cal, "vericache", 16, 8000, move_s=0.007, **args) < exact
    assert predict(cal, "lossy", 16, 8000, move_s=0.007, kept=0.125) < predict(cal, "lossy", 16, 8000, kept=0.125)
    draft = cal.step_s(16) + cal.attention_s(16, 0.125 * 8000 + 32)
    verify = 16 * (cal.step_seq + cal.step_row * 3) + cal.attention_s(16, 8000, 3)
    assert abs(exact - 16 * 3.0 / (2 * draft + verify)) < 1e-9
    assert predict(cal, "full", 16, 8000) == 16 / (cal.step_s(16) + cal.attention_s(16, 8000))
