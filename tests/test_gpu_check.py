"""The device check (issue 33): ``vericache bench gpu-check --dry-run`` runs every part end to end on the
CPU (toy shapes, the Triton kernels in Triton's interpreter) through the real command line, and the
random-weight model it times is what it says it is."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vericache.model.random_model import SHAPES, random_model
from vericache_lab.bench.gpu_check import DRY_SIZES, KERNEL_SETS

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """One dry run of the whole check as a user starts it; its JSON, its exit status and its log."""
    pytest.importorskip("triton")
    out = tmp_path_factory.mktemp("gpu_check")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")   # the CPU path even where a GPU is
    env.pop("TRITON_INTERPRET", None)                   # the command sets it itself
    proc = subprocess.run([sys.executable, "-m", "vericache.cli", "bench", "gpu-check", "--dry-run", "--json",
                           "--out", str(out)], capture_output=True, text=True, env=env, timeout=900)
    saved = json.loads((out / "gpu_check.json").read_text()) if (out / "gpu_check.json").exists() else None
    return proc, saved


def test_the_dry_run_runs_every_part_and_exits_0(dry_run):
    proc, saved = dry_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = json.loads(proc.stdout)
    assert printed == saved and saved["dry_run"] is True
    for part in ("rates", "identity", "decode", "attention", "cost_model"):
        assert "skipped" not in saved[part] and "error" not in saved[part], (part, saved[part])
        assert not any("error" in row for row in saved[part] if isinstance(row, dict)), (part, saved[part])


def test_the_dry_run_measures_rates_and_copies(dry_run):
    rates = dry_run[1]["rates"]
    assert rates["memory"]["read_GBps"] > 0 and rates["memory"]["bytes"] == DRY_SIZES.read_bytes
    cfg = SHAPES[DRY_SIZES.model]
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    # K and V, every layer and KV head, fp16 (the CPU's KV dtype)
    per_position = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 2
    link = rates["link"]
    assert link["link"] == "emulated" and link["bytes"] == DRY_SIZES.link_positions * per_position
    assert link["link_GBps"] > 0 and link["layer_chunk_bytes"] * cfg["num_hidden_layers"] == link["bytes"]
    copies = rates["verified_copies"]
    assert copies["positions"] == 33 and copies["into_draft_cache_us"] > 0 and copies["write_back_to_host_us"] > 0


def test_the_dry_run_finds_vericache_identical_on_both_kernel_sets(dry_run):
    rows = dry_run[1]["identity"]
    assert [(r["kernels"], r["compressor"]) for r in rows] == [(k, f) for k in KERNEL_SETS for f in DRY_SIZES.families]
    # the Triton kernels are batch-invariant: identity by construction. PyTorch's (MKL here, cuBLAS on a
    # GPU) are not: reported, not required (a near-tie may resolve differently, DESIGN's caveat)
    assert all(r["identical_to_full"] is True for r in rows if r["kernels"] == "triton"), rows
    assert all(isinstance(r["identical_to_full"], bool) for r in rows)
    assert all(r["mean_acceptance_length"] >= 1 for r in rows)


def test_the_dry_run_decodes_every_mode_on_both_kernel_sets(dry_run):
    rows = dry_run[1]["decode"]
    assert [(r["kernels"], r["mode"]) for r in rows] == [(k, m) for k in KERNEL_SETS for m in ("full", "lossy", "vericache")]
    for r in rows:
        assert not r["cut"] and r["tokens_per_s"] > 0
        assert r["output_tokens"] == DRY_SIZES.requests * DRY_SIZES.max_tokens and r["decoded"] > 0, r
    assert all(r["identical_to_full"] is True for r in rows if r["mode"] == "vericache" and r["kernels"] == "triton")
    attention = dry_run[1]["attention"]
    assert [a["kernels"] for a in attention] == list(KERNEL_SETS)
    assert all(a["read_GBps"] > 0 and a["keys_per_request"] == DRY_SIZES.context for a in attention)


def test_only_the_batch_invariant_kernels_fail_the_check(capsys):
    from vericache_lab.bench.gpu_check import not_identical

    report = {"identity": [{"kernels": "torch", "identical_to_full": False}, {"kernels": "triton", "identical_to_full": True}],
              "decode": {"skipped": "out of time"}}
    assert not_identical(report) == []
    report["identity"][1]["identical_to_full"] = False
    assert not_identical(report) == [report["identity"][1]] and "NOT IDENTICAL" in capsys.readouterr().err


def test_a_part_that_raises_is_recorded_and_fails_the_check_without_stopping_it(tmp_path, monkeypatch):
    """One run on a lent device: a part that raises (an out-of-memory, a kernel that does not compile)
    is written into the report, the parts after it still run, and the exit status is 1."""
    from vericache_lab.bench import gpu_check, gpu_parts

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel for you")

    monkeypatch.setattr(gpu_parts, "attention_rate", broken)
    monkeypatch.setattr(gpu_parts, "decode_rows", lambda loaded, kernels, *a, **k: (
        broken() if kernels == "triton" else [{"kernels": kernels, "mode": "full", "identical_to_full": None}]))
    monkeypatch.setattr(gpu_parts, "identity_rows", lambda *a, **k: [])
    report = gpu_check.run_check(tmp_path, dry_run=True, budget_s=60, log=lambda m: None)
    assert report["decode"][0] == {"kernels": "torch", "mode": "full", "identical_to_full": None}
    assert report["decode"][1]["kernels"] == "triton" and "no kernel for you" in report["decode"][1]["error"]
    assert [r["kernels"] for r in report["attention"]] == list(KERNEL_SETS)
    assert "llama3_8b_32k_h200" in report["cost_model"]   # the part after the failures ran
    assert json.loads((tmp_path / "gpu_check.json").read_text())["decode"][1]["error"].startswith("RuntimeError")
    assert len(gpu_check.errors(report)) == 3


def test_gpu_check_without_a_gpu_or_dry_run_says_so(monkeypatch, capsys):
    from vericache_lab.bench.gpu_check import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main([]) == 0
    assert "no CUDA device" in capsys.readouterr().out
    with pytest.raises(ValueError, match="--budget-s must be > 0, got -1"):
        main(["--budget-s", "-1"])


def test_random_model_is_seeded_shaped_and_refuses_unknown_shapes():
    a = random_model("toy", "cpu", kernels="torch", seed=5)
    b = random_model("toy", "cpu", kernels="torch", seed=5)
    c = random_model("toy", "cpu", kernels="torch", seed=6)
    wa, wb, wc = (m.model.model.layers[0].mlp.down_proj.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)
    assert wa.shape == (SHAPES["toy"]["hidden_size"], SHAPES["toy"]["intermediate_size"])
    assert 0.015 < wa.float().std().item() < 0.025
    assert a.tokenizer.decode([3, 7]).split() == ["t3", "t7"]
    with pytest.raises(ValueError, match="unknown model shape 'llama9'"):
        random_model("llama9", "cpu")


def test_one_model_switches_between_the_gpu_kernel_sets(monkeypatch):
    """The check times both kernel sets on one model: switching puts the linears on the Triton op and
    back on the modules; both forwards agree within fp32 rounding."""
    pytest.importorskip("triton")
    from vericache.kv.full import FullKVCache
    from vericache.model.loader import use_gpu_kernels

    m = random_model("toy", "cpu", kernels="torch", seed=2)
    tokens = torch.randint(0, 128, (9,), generator=torch.Generator().manual_seed(0))

    def logits() -> torch.Tensor:
        cache = FullKVCache(m.config, "cpu", torch.float32, capacity=16)
        return m.model(tokens, [0], [9], [cache])

    ref = logits()
    assert m.model.head_exact is None
    use_gpu_kernels(m.model, "triton")
    assert m.model.head_exact is not None and m.model.model.layers[1].self_attn.kernels == "triton"
    tri = logits()
    assert (tri - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()
    use_gpu_kernels(m.model, "torch")
    assert m.model.head_exact is None and torch.equal(logits(), ref)
    with pytest.raises(ValueError, match="the GPU kernels are triton or torch, got 'native'"):
        use_gpu_kernels(m.model, "native")
