"""What one decode step runs, traced (``sys.setprofile``) and checked against DESIGN.md's list: the
library modules whose Python code runs in a full decode step, a lossy decode step, a VeriCache draft
step and a VeriCache verification step on the CPU (tiny model, SnapKV 1/4, draft length 4)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from conftest import bare_loop
from vericache import SamplingParams
from vericache.engine.step_loop import StepLoop

DESIGN = Path(__file__).resolve().parent.parent / "docs" / "DESIGN.md"
KINDS = {"full decode": ("full", "decode"), "lossy decode": ("lossy", "decode"),
         "vericache draft": ("vericache", "draft"), "vericache verification": ("vericache", "verify")}


def traced(call):
    """``call()``'s result and the library modules it ran code in (this thread)."""
    modules: set[str] = set()

    def profile(frame, event, arg) -> None:
        if event == "call":
            name = frame.f_globals.get("__name__", "")
            if name.startswith("vericache."):
                modules.add(name.removeprefix("vericache."))
    sys.setprofile(profile)
    try:
        return call(), modules
    finally:
        sys.setprofile(None)


def traced_step(loop: StepLoop) -> tuple[str, set[str]]:
    """One ``loop.step()``: its kinds (the instruments' record) and the library modules it ran code in."""
    _, modules = traced(loop.step)
    return loop.instruments.steps[-1].kinds, modules


@pytest.fixture(scope="module")
def step_modules(llm) -> dict[str, set[str]]:
    ids = llm.tokenizer.encode("def add(a, b):\n    return a + b\n" * 20)
    found: dict[str, set[str]] = {}
    for label, (mode, kind) in KINDS.items():
        loop = bare_loop(llm.loaded, mode=mode, compressor="snapkv:ratio=0.25", draft_len=4, tiered=False)
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
    """At most 10 modules in a full decode step, 12 in a draft step, 13 in a verification (issue 31), plus
    ``drafting.guide`` in a guided store's verification (issue 42)."""
    limits = {"full decode": 10, "vericache draft": 12, "vericache verification": 14}
    assert {k: len(step_modules[k]) for k in limits} == {k: min(len(step_modules[k]), n) for k, n in limits.items()}


def test_the_server_verifies_on_the_native_path():
    """Through the real gateway over real HTTP, built as ``vericache serve`` builds it (``build_service``
    with the config's defaults but the test's model and round length): a VeriCache request's
    verification step runs the same modules as the library's, the native step among them, and no
    link is made (the full KV stays where the CPU reads it)."""
    import threading
    import time

    import httpx
    import uvicorn

    from vericache.engine.config import EngineConfig
    from vericache.serving.build import build_service
    from vericache_gateway.app import create_app

    service = build_service(EngineConfig(model="tiny", device="cpu", dtype="float32", draft_len=4,
                                         compressor="snapkv:ratio=0.25"))
    engine, steps = service.engine, []
    loop, plain_step = engine.loop, engine.loop.step

    def server_step() -> list:   # runs in the server's engine thread, so it is traced there
        n = loop.instruments.n_steps
        outs, modules = traced(plain_step)
        if loop.instruments.n_steps > n:    # it ran a forward
            steps.append((loop.instruments.steps[-1].kinds, modules))
        return outs

    assert engine.config.mode == "vericache" and not engine.config.is_tiered(engine.loaded.device.type)
    server = uvicorn.Server(uvicorn.Config(create_app(service, model_name="tiny"), host="127.0.0.1", port=0,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    try:
        loop.step = server_step
        thread.start()
        while not server.started:
            time.sleep(0.05)
        port = server.servers[0].sockets[0].getsockname()[1]
        prompt = "def add(a, b):\n    return a + b\n" * 20
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                       json={"model": "tiny", "prompt": prompt, "max_tokens": 30, "temperature": 0})
        assert r.status_code == 200 and r.json()["vericache"]["rounds"] >= 1
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        service.shutdown(drain_timeout=5)
    verifies = [mods for kinds, mods in steps if kinds == "verify"]
    assert verifies, [k for k, _ in steps]
    assert loop.link is None
    assert all(mods == design_lists()["vericache verification"] for mods in verifies), verifies[0]
    assert all("model.native_step" in mods for mods in verifies)

