"""The ``vericache`` command line, run as a real subprocess."""

from __future__ import annotations

import json
import subprocess
import sys


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vericache.cli", *args], capture_output=True, text=True,
                          timeout=300)


def test_generate_json_runs_the_default_real_model(smollm):
    r = run("generate", "--prompt", "def add(a, b):", "--max-tokens", "6", "--json", "--device", "cpu",
            "--dtype", "float32")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out) >= {"text", "token_ids", "prompt_tokens", "finish_reason", "stats"}
    api = smollm.generate("def add(a, b):", __import__("vericache").SamplingParams(max_tokens=6))[0]
    assert out["token_ids"] == api.token_ids
    assert out["prompt_tokens"] == len(api.prompt_token_ids)


def test_errors_are_one_line_without_traceback(tmp_path, capsys):
    """Bad input: exit 2 and one line on stderr, before any model loads (a process, then the same entry
    point in-process for the rest: each is the same ``main``)."""
    from vericache.cli import main

    r = run("generate", "--prompt", "x", "--max-tokens", "0")
    assert r.returncode == 2 and "Traceback" not in r.stderr and "max_tokens must be >= 1" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    for args, needle in [
        (("generate", "--prompt", "x", "--temperature", "-1"), "temperature must be >= 0"),
        (("generate", "--prompt", ""), "empty"),
        (("generate", "--prompt", "x", "--model", str(tmp_path / "nope")), "nope"),
        (("generate", "--prompt", "x", "--top-p", "2"), "top_p"),
    ]:
        capsys.readouterr()
        assert main(list(args)) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and needle in err and len(err.strip().splitlines()) == 1, err


def test_prompt_file(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("import os\n")
    r = run("generate", "--prompt-file", str(f), "--max-tokens", "3", "--json", "--model", "tiny")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["prompt_tokens"] > 0


def test_demo_runs_three_modes_and_vericache_equals_full(capsys):
    from vericache.cli import main

    assert main(["demo", "--model", "tiny", "--context", "600", "--compressor", "snapkv:ratio=0.125"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines() if line.split()[:1] in (["full"], ["lossy"], ["vericache"])}
    assert set(rows) == {"full", "lossy", "vericache"}
    assert "identical to full" in rows["vericache"] and "tokens/round" in rows["vericache"]
    assert "task 2, vericache completion (== full KV)" in out
    assert "task 3: HumanEval/2 (`truncate_number`)" in out and "task 3, vericache completion (== full KV)" in out
    assert all(("passes its test" in row) != ("FAILS its test" in row) for row in rows.values())   # each row's verdict
    assert main(["demo", "--model", "tiny", "--context", "600", "--problem", "HumanEval/999"]) == 2
    from vericache.kernels.cpu import best_isa

    assert f"(kernels: {best_isa()} build)" in out.splitlines()[0]   # the header names the build that runs


def test_a_long_prompt_reports_its_prefill_and_the_kv_it_holds(capsys):
    """``LLM.generate(progress=)`` hears (done, total) after every step that prefilled, ``prefill_chunk``
    tokens a step; ``vericache generate`` prints that on stderr for a slow prefill, and the KV's bytes."""
    import vericache
    from vericache import SamplingParams
    from vericache.cli import main, prefill_progress_printer

    llm = vericache.LLM("tiny", mode="vericache", prefill_chunk=64)
    prompt = "def f(x):\n    return x + 1\n" * 40
    total = len(llm.tokenizer.encode(prompt))
    seen = []
    out = llm.generate(prompt, SamplingParams(max_tokens=4), progress=lambda d, t: seen.append((d, t)))[0]
    assert total > 3 * 64 and seen[-1] == (total, total) and len(seen) == -(-total // 64)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen) and out.token_ids
    show = prefill_progress_printer(0.0, every_s=0.0)
    show(64, total)
    show(total, total)
    assert capsys.readouterr().err.splitlines()[-1].startswith(f"prefill {total}/{total} tokens")
    assert main(["generate", "--model", "tiny", "--prompt", "def f(x):", "--max-tokens", "3"]) == 0
    assert "KV " in capsys.readouterr().err


def test_generate_hands_every_engine_flag_to_the_engine(monkeypatch):
    """The mode group's flags (draft vocabulary, lookup, acceptance among them) reach ``LLM`` as given."""
    import vericache
    from vericache.cli import main

    seen = {}

    def fake(**kwargs):
        seen.update(kwargs)
        raise ValueError("stopped before loading")

    monkeypatch.setattr(vericache, "LLM", fake)
    assert main(["generate", "--prompt", "x", "--model", "tiny", "--mode", "vericache", "--draft-vocab", "64",
                 "--no-lookup", "--acceptance", "rejection", "--draft-len", "3"]) == 2
    assert seen["draft_vocab"] == 64 and seen["lookup"] is False and seen["acceptance"] == "rejection"
    assert seen["draft_len"] == 3 and seen["model"] == "tiny" and seen["mode"] == "vericache"
