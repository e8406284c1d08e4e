"""The eval and bench commands run end to end (small sizes: figures come from the real commands)."""

from __future__ import annotations

import json

import pytest

from vericache.cli import main
from vericache_lab.eval.long_tasks import function_parses


def test_function_parses_judges_the_function_only():
    head = "def f(x):\n    y = x + 1\n"
    assert function_parses(head, "    return y\n\ndef g(:\n")
    assert not function_parses(head, "    return (y\n\n")
    assert function_parses(head, "    return y\n    if x")  # an unfinished last line is not judged


def test_eval_command_shows_vericache_equals_full(tmp_path, capsys):
    rc = main(["eval", "--model", "tiny", "--compressors", "snapkv:ratio=0.125", "--n", "2", "--context-min", "400",
               "--context-max", "600", "--json", "--plot", str(tmp_path / "q.png"), "--record", str(tmp_path / "B.md"),
               "--checkpoint", str(tmp_path / "rows.jsonl")])
    assert rc == 0
    rows = {r["config"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    veri, lossy = rows["vericache snapkv:ratio=0.125"], rows["lossy snapkv:ratio=0.125"]
    assert veri["identical_to_full"] == 1.0 and veri["code_match_full"] == 1.0
    for metric in ("needle_accuracy", "tool_json_valid", "code_parse_rate"):
        assert veri[metric] == rows["full"][metric]
    assert lossy["kv_kept"] < 0.5 and veri["mean_acceptance_length"] >= 1
    # each source: drafted rounds (acceptance per drafted token) and plain full steps, where the tiny
    # model's costs make drafting pointless (a draft row costs what a full row does)
    assert veri["full_step_tokens"] > 0 or 0 <= veri["acceptance_per_draft"] <= 1, veri
    assert (tmp_path / "q.png").stat().st_size > 1000
    assert "Command: `vericache eval" in (tmp_path / "B.md").read_text()
    assert len((tmp_path / "rows.jsonl").read_text().splitlines()) == 3  # (batch, config) records: resumable
    assert main(["eval", "--model", "tiny", "--compressors", "snapkv:ratio=0.125", "--n", "2", "--context-min", "400",
                 "--context-max", "600", "--json", "--checkpoint", str(tmp_path / "rows.jsonl")]) == 0
    again = {r["config"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert again == rows and len((tmp_path / "rows.jsonl").read_text().splitlines()) == 3  # nothing rerun


def test_eval_samples_with_both_acceptance_rules(tmp_path, capsys):
    """``--temperature`` seeds task i with seed + i in every mode: the coupled row is full decoding's
    text; the rejection rule's row is there beside it, with its own acceptance."""
    assert main(["eval", "--model", "tiny", "--compressors", "snapkv:ratio=0.125", "--n", "1", "--context-min", "400",
                 "--context-max", "500", "--json", "--temperature", "0.7", "--top-p", "0.9", "--draft-len", "4",
                 "--acceptance", "coupled,rejection"]) == 0
    rows = {r["config"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    coupled, rejection = rows["vericache snapkv:ratio=0.125"], rows["vericache/rejection snapkv:ratio=0.125"]
    assert coupled["identical_to_full"] == 1.0 and coupled["acceptance"] == "coupled"
    assert rejection["acceptance"] == "rejection" and 0 <= rejection["acceptance_per_draft"] <= 1
    with pytest.raises(SystemExit):
        main(["eval", "--model", "tiny", "--acceptance", "coupled,maybe"])


def test_bench_decode_command(tmp_path, capsys):
    # a fixed draft length: with "auto" the cost model may find no round paying for tiny here (a machine's call)
    rc = main(["bench", "decode", "--model", "tiny", "--modes", "full,lossy,vericache", "--compressor", "snapkv:ratio=0.125",
               "--context", "600", "--max-tokens", "12", "--draft-len", "4", "--json", "--no-transformers", "--plot", str(tmp_path / "d.png"),
               "--roofline-plot", str(tmp_path / "r.png"), "--repeat", "2"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    rows = {r["mode"]: r for r in out["rows"]}
    assert set(rows) == {"full", "lossy", "vericache"}  # tiny has no GGUF: no llama.cpp row
    # --repeat 2: one row a mode, both runs' figures beside it
    assert len(out["rows"]) == 3 and all(len(r["tokens_per_s_runs"]) == 2 for r in rows.values())
    assert len(rows["vericache"]["ratio_to_full_runs"]) == 2 and rows["full"]["ratio_to_full_runs"] == [1.0, 1.0]
    assert rows["vericache"]["identical_to_full"] is True and rows["full"]["ratio_to_full"] == 1.0
    assert rows["vericache"]["tokens_per_s"] > 0 and (tmp_path / "d.png").exists()
    # every decode step of every mode against its roofline: the kinds each mode runs, and only those
    kinds = {(r["mode"], r["step_kind"]): r for r in out["roofline_rows"]}
    assert set(kinds) == {("full", "full"), ("lossy", "draft"), ("vericache", "draft"), ("vericache", "verification")}
    assert kinds[("full", "full")]["steps"] == 11  # 12 tokens: the first comes from the prefill
    assert all(r["step_ms"] > 0 and r["roofline_ms"] > 0 and r["x_roofline"] > 0 for r in kinds.values())
    assert out["roofline"]["read_bytes_per_s"] > 1e9 and (tmp_path / "r.png").stat().st_size > 1000
    # the cost model's step costs measured in this run: every row beside its prediction
    assert all(r["predicted_tokens_per_s"] > 0 and r["measured_over_predicted"] > 0 for r in rows.values())


def test_bench_labels_name_the_mode_the_draft_weights_the_draft_vocabulary_and_the_compressor():
    from vericache_lab.bench.common import label_parts, mode_labels

    assert label_parts("vericache") == ("vericache", "fp32", None, None)
    assert label_parts("vericache+int8+vocab=0@snapkv:ratio=0.1+kivi:bits=2") == \
        ("vericache", "int8", "snapkv:ratio=0.1+kivi:bits=2", 0)
    assert label_parts("vericache+vocab=4096") == ("vericache", "fp32", None, 4096)
    assert label_parts("vericache+vocab=auto") == ("vericache", "fp32", None, "auto")
    assert mode_labels("full,vericache+vocab=0,vericache") == ["full", "vericache+vocab=0", "vericache"]
    with pytest.raises(ValueError, match="vericache\\+int8\\+int4"):
        label_parts("vericache+int8+int4")


def test_repeated_decode_runs_give_each_mode_its_median_run_and_the_median_of_paired_ratios():
    """A mode run in several repeats: its row is its median run by tokens/s, its ratio to full the median of
    each repeat's own ratio (the host drifts between repeats, not within one), identical only if every
    repeat was. A ratio of the medians (2.0 / 1.0 here) would be wrong by the drift."""
    from vericache_lab.bench.decode import median_of_repeats

    def row(mode, tps, ratio, same=True):
        return {"context": 8, "mode": mode, "tokens_per_s": tps, "ratio_to_full": ratio, "identical_to_full": same}
    rows = [row("full", 1.0, 1.0), row("vericache", 1.1, 1.1),        # a slow stretch of the host
            row("full", 2.0, 1.0), row("vericache", 1.6, 0.8, False),  # a fast one for full alone
            row("full", 1.0, 1.0), row("vericache", 2.0, 2.0)]
    out = {r["mode"]: r for r in median_of_repeats(rows)}
    assert out["vericache"]["tokens_per_s"] == 1.6 and out["vericache"]["tokens_per_s_runs"] == [1.1, 1.6, 2.0]
    assert out["vericache"]["ratio_to_full"] == 1.1 and out["vericache"]["ratio_to_full_runs"] == [1.1, 0.8, 2.0]
    assert out["vericache"]["identical_to_full"] is False and out["full"]["ratio_to_full"] == 1.0
    assert median_of_repeats(rows[:2]) == rows[:2]   # one repeat: the rows as they were


def test_bench_batch_command(tmp_path, capsys):
    rc = main(["bench", "batch", "--model", "tiny", "--requests", "3", "--context", "300", "--max-tokens", "12",
               "--compressor", "snapkv:ratio=0.25", "--draft-len", "4", "--modes", "full,lossy,vericache,vericache+int4@kivi:bits=2",
               "--json", "--record", str(tmp_path / "B.md"),
               "--plot", str(tmp_path / "r.png")])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    steps = {(r["mode"], r["step_kind"]): r["steps"] for r in out["roofline_rows"]}
    assert steps[("full", "full")] == out["rows"][0]["steps"] and ("vericache", "verification") in steps
    assert (tmp_path / "r.png").stat().st_size > 1000 and out["cpu"]
    rows = {r["mode"]: r for r in out["rows"]}
    assert set(rows) == {"full", "lossy", "vericache", "vericache+int4@kivi:bits=2"}
    assert rows["vericache"]["identical_to_full"] and rows["full"]["identical_to_full"]
    # a label's own compressor and draft weights: still identical
    assert rows["vericache+int4@kivi:bits=2"]["identical_to_full"]
    assert rows["vericache+int4@kivi:bits=2"]["compressor"].startswith("kivi:") and rows["vericache"]["compressor"].startswith("snapkv")
    assert rows["vericache"]["mean_acceptance_length"] >= 1 and rows["full"]["mean_acceptance_length"] is None
    # each source's share: acceptance per drafted token, and tokens from plain full steps (none here)
    veri = rows["vericache"]
    assert 0 <= veri["acceptance_per_draft"] <= 1 and veri["full_step_tokens"] >= 0
    assert veri["tokens_per_drafted_round"] >= 1 and "acceptance_per_draft" not in rows["full"]
    assert all(r["tokens_per_s"] > 0 and r["kv_resident_bytes"] > 0 for r in rows.values())
    # vericache holds the full KV and the compressed one: more resident bytes than full alone
    assert rows["vericache"]["kv_resident_bytes"] > rows["full"]["kv_resident_bytes"]
    assert "bench batch" in (tmp_path / "B.md").read_text()
    # the stall figure: lossy and vericache draft; the slowest step includes postprocess (commits)
    stalls = {r["mode"]: r for r in out["stalls"]}
    assert set(stalls) == {"lossy", "vericache", "vericache+int4@kivi:bits=2"}
    for r in stalls.values():
        assert r["slowest_ms"] >= r["slowest_draft_ms"] >= r["median_draft_ms"] > 0
    assert "median draft step" in (tmp_path / "B.md").read_text()
    # every row beside the cost model's figure (step costs, draft copies and moves measured in the run)
    for r in rows.values():
        assert r["predicted_tokens_per_s"] > 0
        assert r["measured_over_predicted"] == round(r["tokens_per_s"] / r["predicted_tokens_per_s"], 2)


def test_bench_throughput_command(tmp_path, capsys):
    cal = tmp_path / "cal.json"
    assert main(["sim", "--calibrate", "--calib-model", "tiny", "--calib-out", str(cal), "--json"]) == 0
    stored = json.loads(capsys.readouterr().out)
    costs = stored["costs"]   # the cost model's terms (drafting.cost.StepCosts)
    assert all(costs[t] >= 0 for t in ("c0", "t_row", "t_seq", "t_byte", "t_pair")) and costs["t_byte"] > 0
    # a step costs something; any one slope may clamp to 0 on a busy host (the tiny model's rows: microseconds)
    assert costs["c0"] + costs["t_row"] + costs["t_seq"] > 0
    assert 0 < stored["link_efficiency"] <= 1.2   # what the emulated link reached: 0.4 with the cores shared
    roof = stored["roofline"]  # measured in the same process: bandwidth, weights by rows, the op's peak
    assert roof["read_bytes_per_s"] > 1e9 and roof["attn_flops_per_s"] > 1e9 and roof["weight_rows"][0] == 1
    assert len(roof["weight_s"]) == len(roof["weight_rows"]) and roof["weight_s"][-1] > roof["weight_s"][0]
    rc = main(["bench", "throughput", "--model", "tiny", "--requests", "4", "--context", "300", "--max-tokens", "10",
               "--device-budget", "0.6", "--link-gbps", "8", "--resident-layers", "3", "--json",
               "--calibration", str(cal), "--plot", str(tmp_path / "t.png")])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert all(r["predicted_tokens_per_s"] > 0 for r in out["rows"] if r["mode"] != "vericache-resident")
    rows = {r["mode"]: r for r in out["rows"]}
    assert set(rows) == {"full", "lossy", "vericache-naive", "vericache-staggered", "vericache-grouped",
                         "vericache-resident"}
    assert rows["vericache-resident"]["identical_to_full"]
    per_round = {m: rows[m]["link_bytes"] / rows[m]["rounds"] for m in ("vericache-staggered", "vericache-resident")}
    assert 0 < per_round["vericache-resident"] < 0.75 * per_round["vericache-staggered"]  # 3 of 6 layers stay
    assert out["link"] == "emulated"
    assert all(rows[m]["identical_to_full"] for m in ("vericache-naive", "vericache-staggered", "vericache-grouped"))
    assert rows["vericache-grouped"]["mean_groups"] >= 1 and rows["vericache-staggered"]["mean_groups"] is None
    assert rows["vericache-staggered"]["link_utilization"] > 0 and rows["full"]["link_utilization"] == 0
    assert 0 < rows["full"]["compute_utilization"] <= 1 and (tmp_path / "t.png").stat().st_size > 1000


def test_bench_attention_op_command(tmp_path, capsys):
    rc = main(["bench", "attention-op", "--context", "256", "--caches", "full,fp8,kivi2", "--rows", "1,3",
               "--repeats", "1", "--json", "--record", str(tmp_path / "B.md")])
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    assert [(r["cache"], r["rows"]) for r in res["rows"]] == [(c, t) for c in ("full", "fp8", "kivi2") for t in (1, 3)]
    full, fp8 = res["rows"][0], res["rows"][2]
    assert full["MB"] > fp8["MB"] > 0 and all(r["ms"] > 0 for r in res["rows"])   # fp16: 2 bytes a channel, fp8: 1
    assert "Command: `vericache bench attention-op" in (tmp_path / "B.md").read_text()
    assert main(["bench", "attention-op", "--caches", "full,nope", "--context", "256"]) != 0


def test_bench_attention_op_times_the_code_models_integer_verification(capsys):
    """q8qk: the op on the code model's heads (2 KV heads of 7) over kept key codes, on this CPU's unit."""
    from vericache.kernels.cpu import best_isa
    from vericache.kernels.linear_op import score_unit

    rc = main(["bench", "attention-op", "--context", "256", "--caches", "full", "--rows", "1,9", "--repeats", "1",
               "--shape", "qwen2.5-coder-0.5b", "--numerics", "q8qk", "--json"])
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    assert res["score_unit"] == score_unit("q8qk", best_isa()) > 0 and res["shape"] == "qwen2.5-coder-0.5b"
    # what a coded step reads: 24 layers x 2 heads x 256 keys of codes (a key and a value code a channel, and
    # 12 bytes of scales and sums a key), not the fp16 K/V
    assert res["rows"][0]["MB"] == round(24 * 2 * 256 * (64 * 2 + 12) / 1e6, 1)
    assert [r["rows"] for r in res["rows"]] == [1, 9] and all(r["ms"] > 0 for r in res["rows"])
    for bad in (["--numerics", "q4"], ["--shape", "llama"], ["--numerics", "q8qk", "--caches", "full,kivi2"]):
        assert main(["bench", "attention-op", "--context", "256", "--rows", "1", *bad]) != 0


def test_repeated_modes_keep_each_modes_median_run():
    """``bench batch --repeat``: alternating runs of each mode, the median one as its row, every run listed."""
    from vericache_lab.bench.batch import median_rows, run_batch

    runs = [{"mode": m, "tokens_per_s": t, "steps": i} for i, (m, t) in enumerate(
        [("full", 40.0), ("vericache", 41.0), ("full", 44.0), ("vericache", 30.0), ("full", 42.0), ("vericache", 35.0)])]
    rows = median_rows(runs)
    assert [(r["mode"], r["tokens_per_s"], r["steps"]) for r in rows] == [("full", 42.0, 4), ("vericache", 35.0, 5)]
    assert rows[0]["tokens_per_s_runs"] == [40.0, 44.0, 42.0] and rows[1]["tokens_per_s_runs"] == [41.0, 30.0, 35.0]
    assert median_rows(runs[:2]) == runs[:2]                      # run once: the rows as they were
    with pytest.raises(ValueError, match="repeats must be an integer >= 1, got 0"):
        run_batch("tiny", 1, 10, 2, ["full"], "snapkv", repeats=0)


def test_a_prefill_kept_in_the_cache_folder_comes_back_equal_and_each_prompt_has_its_own(llm, tmp_path, monkeypatch):
    """``$VERICACHE_PREFILL_CACHE``: the first run stores the exact prefill, the next loads it (same K/V,
    logits and queries, no forward run), and another prompt is not answered from it."""
    import torch

    from vericache import SamplingParams
    from vericache.engine.engine import Engine
    from vericache_lab.bench.common import cached_prefill

    monkeypatch.setenv("VERICACHE_PREFILL_CACHE", str(tmp_path))
    base = Engine(llm.loaded, mode="full", device_budget_gb=None)
    ids = llm.tokenizer.encode("def add(a, b):\n    return a + b\n" * 8)
    first = cached_prefill(base, base.new_sequence(0, ids, SamplingParams(max_tokens=4)))
    assert len(list(tmp_path.glob("prefill-*.pt"))) == 1 and list(tmp_path.glob("*.tmp")) == []   # renamed whole
    monkeypatch.setattr(base, "shared_prefill", lambda seq, **kw: pytest.fail("ran a prefill the cache holds"))
    again = cached_prefill(base, base.new_sequence(0, ids, SamplingParams(max_tokens=4)))
    n = first.prompt_len
    assert again.prompt_len == n and torch.equal(again.logits, first.logits)
    assert torch.equal(again.full.k[:, :, :n], first.full.k[:, :, :n])
    monkeypatch.undo()
    monkeypatch.setenv("VERICACHE_PREFILL_CACHE", str(tmp_path))
    other = cached_prefill(base, base.new_sequence(0, ids[:-3], SamplingParams(max_tokens=4)))
    assert other.prompt_len == n - 3 and len(list(tmp_path.glob("prefill-*.pt"))) == 2


def test_a_kept_q8qk_prefill_is_keyed_by_the_key_coding_its_codes_were_made_under(tmp_path, monkeypatch):
    """q8qk's full caches keep key codes made in the model's key coding (measured at load): a prefill kept
    under one coding is not answered to a model with another (its codes would give other bits)."""
    from vericache import LLM, SamplingParams
    from vericache.engine.engine import Engine
    from vericache_lab.bench.common import cached_prefill

    monkeypatch.setenv("VERICACHE_PREFILL_CACHE", str(tmp_path))
    loaded = LLM("tiny", numerics="q8qk").loaded
    base = Engine(loaded, mode="full", device_budget_gb=None)
    ids = loaded.tokenizer.encode("def add(a, b):\n    return a + b\n" * 8)
    cached_prefill(base, base.new_sequence(0, ids, SamplingParams(max_tokens=4)))
    before = loaded.numerics_id
    coding = next(iter(loaded.model.model.blocks())).self_attn.key_coding
    assert coding is not None and before.startswith("q8qk:")
    coding[1, 0, 0] *= 2.0                                       # another coding (a scale doubled)
    assert loaded.numerics_id != before
    cached_prefill(base, base.new_sequence(0, ids, SamplingParams(max_tokens=4)))
    assert len(list(tmp_path.glob("prefill-*.pt"))) == 2
