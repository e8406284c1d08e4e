"""Where a request lives (``engine.placement``): the decision's table, and an engine that allocates,
charges and moves each request exactly as its placement says."""

from __future__ import annotations

import pytest

from conftest import bare_loop
from vericache import SamplingParams
from vericache.engine.options import RequestOptions
from vericache.engine.placement import Home, Placement, place
from vericache.engine.requests import State


@pytest.mark.parametrize("mode, offload, remote, session, home", [
    ("full", True, False, False, Home.DEVICE),        # full mode's KV is never offloaded
    ("lossy", True, True, False, Home.DEVICE),
    ("vericache", False, False, False, Home.DEVICE),
    ("vericache", True, False, False, Home.HOST),
    ("vericache", True, True, False, Home.REMOTE),    # a drafter's full KV is at the verifier, offload or not
    ("full", False, False, True, Home.SESSION),
])
def test_place_decides_the_home_once(mode, offload, remote, session, home):
    assert place(mode, offload=offload, remote=remote, session=session) == Placement(mode, home)


def test_what_each_placement_holds_and_needs():
    full, draft, resident, prompt, streamed = 1000, 150, 250, 40, 750
    rows = {  # placement: (full here, draft here, bytes at its longest, transient bytes, state after prefill)
        Placement("full", Home.DEVICE): (True, False, full, 0, "decoding"),
        Placement("lossy", Home.DEVICE): (False, True, draft, prompt, "decoding"),
        Placement("vericache", Home.DEVICE): (True, True, draft + full, 0, "drafting"),
        Placement("vericache", Home.HOST): (True, True, draft + resident, streamed, "drafting"),
        Placement("vericache", Home.REMOTE): (False, True, draft, prompt, "drafting"),
        Placement("full", Home.SESSION): (True, False, full, 0, "serving"),
    }
    for p, (full_here, draft_here, needed, transient, after) in rows.items():
        assert (p.full_here, p.draft_here) == (full_here, draft_here), p
        assert p.device_bytes_needed(full, draft if draft_here else 0, resident) == needed, p
        assert p.transient_bytes(prompt, streamed) == transient, p
        assert p.state_after_prefill() == after, p
    assert [p.verifies_in_place for p in rows] == [False, False, True, False, False, False]
    assert [p.loads_stored_prefix for p in rows] == [True, True, False, False, True, True]


@pytest.mark.parametrize("bad", [dict(mode="vericache", session=True), dict(mode="fast")])
def test_a_placement_that_cannot_be_is_refused(bad):
    with pytest.raises(ValueError, match="vericache|fast"):
        place(bad["mode"], offload=False, remote=False, session=bad.get("session", False))


@pytest.mark.parametrize("mode, offload", [("full", True), ("lossy", False), ("vericache", False),
                                           ("vericache", True)])
def test_the_engine_allocates_and_moves_a_request_as_placed(llm, mode, offload):
    """After its prefill a request holds the caches its placement names, on its tiers, charged to them,
    and is in the state its placement leads to; released, every block goes back."""
    loop = bare_loop(llm.loaded, mode=mode, compressor="snapkv:ratio=0.25", draft_len=4, tiered=offload)
    ids = llm.tokenizer.encode("def fibonacci(n):\n    if n < 2:\n        return n\n" * 8)
    rid = loop.add_request(ids, SamplingParams(max_tokens=6, ignore_eos=True), RequestOptions(mode=mode))
    req = loop.requests.get(rid)
    assert req.placement == place(mode, offload=offload, remote=False)
    while req.state in (State.WAITING, State.PREFILL):
        loop.step()
    where = req.placement
    assert (req.kv.full is not None, req.kv.draft is not None) == (where.full_here, where.draft_here)
    assert req.state == State(where.state_after_prefill())
    if where.offloaded:
        assert req.kv.full.device.type == "cpu" and loop.memory.host.used_bytes >= req.kv.full.nbytes()
    else:
        assert loop.memory.host.used_bytes == 0
    assert loop.memory.device.used_bytes >= loop.memory.device_bytes(req) > 0
    while loop.has_unfinished():
        loop.step()
    assert len(req.seq.output_ids) == 6
    assert loop.memory.device.used_bytes == loop.memory.host.used_bytes == 0
