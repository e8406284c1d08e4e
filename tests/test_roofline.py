"""The roofline's parts: what each cache says a step's attention costs, and how steps are charged."""

from __future__ import annotations

import pytest
import torch

from vericache.compress.registry import parse_compressor
from vericache.engine.requests import StepRecord
from vericache.kv.compressed import CompressedKVCache
from vericache.kv.full import FullKVCache
from vericache.kv.tee import TeeCache
from vericache_lab.sim.roofline import Roofline, step_kind, summarize


def test_full_cache_cost_counts_every_position_read_and_causal_pairs(llm):
    cfg = llm.loaded.config
    cache = FullKVCache(cfg, "cpu", torch.float32, capacity=64)
    per_pos = cache.nbytes_per_position()
    assert cache.attention_cost(10, 1) == (11 * per_pos, 11)           # decode: 10 cached + its own
    assert cache.attention_cost(10, 3) == (13 * per_pos, 11 + 12 + 13)   # a chunk: causal
    assert cache.attention_cost(0, 4) == (4 * per_pos, 1 + 2 + 3 + 4)


def test_compressed_cache_cost_is_its_store_plus_its_residual(llm):
    cfg, prompt = llm.loaded.config, list(range(5, 205))
    full = FullKVCache(cfg, "cpu", torch.float32, capacity=256)
    comp = parse_compressor("snapkv:ratio=0.25")
    draft = CompressedKVCache(comp, cfg, "cpu", torch.float32, capacity=256)
    llm.loaded.model(torch.tensor(prompt), [0], [len(prompt)], [TeeCache(full, draft)])
    draft.commit(len(prompt), source=full)
    n_bytes, pairs = draft.attention_cost(len(prompt), 2)
    res = draft.residual.nbytes_per_position()
    assert draft.count > 0 and pairs == 2 * draft.kept_tokens() + 1 + 2
    assert n_bytes == draft.nbytes() + 2 * res           # the two new tokens land in the residual
    assert n_bytes < full.attention_cost(len(prompt), 2)[0] / 2


def test_roofline_charges_weights_by_rows_and_the_larger_of_bytes_and_flops():
    roof = Roofline(read_bytes_per_s=1e10, attn_flops_per_s=1e11, flops_per_pair=1000,
                    weight_rows=[1, 16, 64], weight_s=[0.010, 0.020, 0.080])
    assert roof.weights_s(1) == 0.010 and roof.weights_s(16) == 0.020
    assert roof.weights_s(40) == pytest.approx(0.050) and roof.weights_s(128) == pytest.approx(0.160)
    assert roof.step_s(1, 1e8, 1) == pytest.approx(0.010 + 0.01)            # bandwidth-bound
    assert roof.step_s(16, 1e3, 1e8) == pytest.approx(0.020 + 1.0)          # compute-bound


def test_steps_are_classed_by_kind_and_prefill_is_left_out():
    assert step_kind("decode", "full") == "full" and step_kind("decode", "lossy") == "draft"
    assert step_kind("draft+verify", "vericache") == "verification" and step_kind("draft", "vericache") == "draft"
    assert step_kind("prefill+decode", "full") is None
    roof = Roofline(1e10, 1e11, 1000, [1, 64], [0.01, 0.01])
    steps = [StepRecord(0.0, 0.03, "decode", 1, 1, 1e8, 1), StepRecord(1.0, 1.05, "decode", 1, 1, 1e8, 1),
             StepRecord(2.0, 9.0, "prefill", 1, 512, 1e8, 1)]
    (row,) = summarize(steps, roof, "full")
    assert row["step_kind"] == "full" and row["steps"] == 2 and row["roofline_ms"] == pytest.approx(20.0)
    assert row["x_roofline"] == pytest.approx(0.08 / 0.04)
    assert row["fixed_ms"] == pytest.approx(20.0)   # the median of 10 and 30 ms beyond the 20 ms roofline


def test_best_of_two_measurements_keeps_each_faster_figure():
    a = Roofline(1e10, 2e11, 1000, [1, 16], [0.010, 0.030])
    b = Roofline(2e10, 1e11, 1000, [1, 16], [0.020, 0.020])
    best = a.best(b)
    assert (best.read_bytes_per_s, best.attn_flops_per_s, best.weight_s) == (2e10, 2e11, [0.010, 0.020])
    with pytest.raises(ValueError, match="different row counts"):
        a.best(Roofline(1e10, 1e11, 1000, [1, 8], [0.01, 0.02]))
