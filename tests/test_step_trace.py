"""What one decode step runs, traced (``sys.setprofile``) and checked against DESIGN.md's list: the
library modules whose Python code runs in a full decode step, a lossy decode step, a VeriCache draft
step and a VeriCache verification step on the CPU (tiny model, SnapKV 1/4, draft length 4)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from vericache import SamplingParams
from vericache.engine.runner import ModelRunner
from vericache.engine.step_loop import StepLoop

DESIGN = Path(__file__).resolve().parent.parent / "docs" / "DESIGN.md"
KINDS = {"full decode": ("full", "decode"), "lossy decode": ("lossy", "decode"),
         "vericache draft": ("vericache", "draft"), "vericache verification": ("vericache", "verify")}


def traced_step(loop: StepLoop) -> tuple[str, set[str]]:
    """One ``loop.step()``: its kinds (the instruments' record) and the library modules it ran code in."""
    modules: set[str] = set()

    def profile(frame, event, arg) -> None:
        if event == "call":
            name = frame.f_globals.get("__name__", "")
            if name.startswith("vericache."):
                modules.add(name.removeprefix("vericache."))
    sys.setprofile(profile)
    try:
        loop.step()
    finally:
        sys.setprofile(None)
    return loop.instruments.steps[-1].kinds, modules


@pytest.fixture(scope="module")
def step_modules(llm) -> dict[str, set[str]]:
    ids = llm.tokenizer.encode("def add(a, b):\n    return a + b\n" * 20)
    found: dict[str, set[str]] = {}
    for label, (mode, kind) in KINDS.items():
        loop = StepLoop(ModelRunner(llm.loaded, mode=mode, compressor="snapkv:ratio=0.25", draft_len=4), offload=False)
        loop.add_request(ids, SamplingParams(max_tokens=30, ignore_eos=True))
        loop.step()                                                        # the prefill
        for _ in range(12):
            kinds, modules = traced_step(loop)
            if kinds == kind and label not in found:
                found[label] = modules
    return found


def design_lists() -> dict[str, set[str]]:
    """DESIGN.md's "Modules a step runs" table: step kind -> modules."""
    section = DESIGN.read_text().split("## Modules a step runs", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| ([a-z ]+) \| \d+ \| (.+) \|$", section, flags=re.M)
    return {kind: set(re.findall(r"`([\w.]+)`", mods)) for kind, mods in rows}


def test_design_lists_exactly_the_modules_each_step_kind_runs(step_modules):
    assert set(step_modules) == set(KINDS)      # every kind was seen within 12 steps
    listed = design_lists()
    for label, modules in step_modules.items():
        assert listed.get(label) == modules, (label, sorted(modules ^ listed.get(label, set())))
    counts = re.findall(r"^\| ([a-z ]+) \| (\d+) \|", DESIGN.read_text().split("## Modules a step runs", 1)[1],
                        flags=re.M)
    assert all(int(n) == len(step_modules[k]) for k, n in counts if k in step_modules)
    # the forward's share: on the CPU every layer runs in one native call, none of the module's per-layer code
    assert all("model.native_step" in m for m in step_modules.values())


def test_issue_31_module_targets_hold(step_modules):
    """At most 10 modules in a full decode step, 12 in a draft step, 13 in a verification."""
    limits = {"full decode": 10, "vericache draft": 12, "vericache verification": 13}
    assert {k: len(step_modules[k]) for k in limits} == {k: min(len(step_modules[k]), n) for k, n in limits.items()}
