"""Continuous batching over tiered KV memory: identity under batching and a tight budget,
state transitions, exact block accounting on finish, abort and preemption, the link."""

from __future__ import annotations

import pytest
import torch

from conftest import bare_loop
from vericache import SamplingParams
from vericache.engine.engine import Engine
from vericache.engine.memory import BlockPool, OutOfBlocks
from vericache.engine.requests import ALLOWED, State
from vericache.kv.full import FullKVCache
from vericache.kv.link import EmulatedLink

MAX_TOKENS = 20


@pytest.fixture(scope="session")
def serving_prompts(llm):
    from vericache_lab.bench.common import code_prompt

    ids = code_prompt(llm.tokenizer, 3000)
    return [ids[:700], ids[700:1000], ids[1000:1900], ids[1900:2100], ids[2100:2900]]


@pytest.fixture(scope="session")
def serving_reference(llm, serving_prompts):
    runner = llm.engine
    p = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    return [runner.generate([runner.new_sequence(i, ids, p)], "full")[0].token_ids for i, ids in enumerate(serving_prompts)]


def _full_kv_bytes(llm, n_tokens: int) -> int:
    return n_tokens * FullKVCache(llm.loaded.config, "cpu", torch.float32, 1).nbytes_per_position()


def _serve(llm, mode, prompts, budget, scheduler="staggered", spec="snapkv:ratio=0.125", link=None, steps=None):
    loop = bare_loop(llm.loaded, mode=mode, compressor=spec, device_budget=budget, scheduler=scheduler, link=link,
                     prefill_chunk=256)
    ids = [loop.add_request(p, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)) for p in prompts]
    seen_states, n = set(), 0
    while loop.has_unfinished():
        loop.step()
        seen_states |= {r.state for r in loop.requests}
        n += 1
        assert n < 5000, "engine did not finish"
    return loop, [loop.requests[i].seq.output_ids for i in ids], seen_states


@pytest.mark.parametrize("mode, scheduler", [("full", "staggered"), ("lossy", "staggered"),
                                             ("vericache", "naive"), ("vericache", "staggered"),
                                             ("vericache", "grouped")])
def test_tight_budget_batching(llm, serving_prompts, serving_reference, mode, scheduler):
    total_full = sum(_full_kv_bytes(llm, len(p) + MAX_TOKENS + 1) for p in serving_prompts)
    loop, outs, states = _serve(llm, mode, serving_prompts, total_full // 2, scheduler,
                               link=EmulatedLink(gbps=8) if mode == "vericache" else None)
    if mode != "lossy":
        assert outs == serving_reference  # lossless under batching and a quarter-ish budget
    assert loop.device.used_blocks == 0 and loop.host.used_blocks == 0  # every block came back
    assert all(r.state == State.FINISHED for r in loop.requests)
    if mode == "vericache":
        assert {State.PREFILL, State.DRAFTING, State.FINISHED} <= states
        assert loop.link.stats.bytes_moved > 0 and all(r.drafting.round.rounds > 0 for r in loop.requests)
        if scheduler != "naive":  # transfers outlive a step while others draft (naive waits inside it)
            assert State.TRANSFERRING in states
        else:  # naive verifies layer by layer as the transfer lands
            assert loop.instruments.early_verifies > 0
    if mode == "full":  # the budget holds only some requests' full KV: the rest waited
        assert State.WAITING in states


def test_abort_frees_at_once_and_outputs_stream(llm, serving_prompts):
    loop = bare_loop(llm.loaded, mode="vericache", compressor="h2o:ratio=0.2", device_budget=1 << 30,
                     link=EmulatedLink(gbps=8))
    a = loop.add_request(serving_prompts[0], SamplingParams(max_tokens=50, ignore_eos=True))
    b = loop.add_request(serving_prompts[1], SamplingParams(max_tokens=8, ignore_eos=True))
    streamed = {a: [], b: []}
    finals = {}
    for _ in range(6):
        for o in loop.step():
            streamed[o.request_id] += o.new_token_ids
    loop.abort(a)
    assert loop.requests[a].state == State.ABORTED
    assert ("kv", a) not in loop.device.owners() and ("full", a) not in loop.host.owners()
    while loop.has_unfinished():
        for o in loop.step():
            streamed[o.request_id] += o.new_token_ids
            if o.finished:
                finals[o.request_id] = o.finish_reason
    for o in loop.step():  # the abort is reported once
        finals.setdefault(o.request_id, o.finish_reason)
    assert streamed[b] == loop.requests[b].seq.output_ids and finals[b] == "length"
    assert loop.device.used_blocks == 0 and loop.host.used_blocks == 0


def test_preemption_returns_blocks_and_keeps_identity(llm, serving_prompts, serving_reference):
    """A budget that the compressed caches outgrow forces preemption and recomputation."""
    loop = bare_loop(llm.loaded, mode="lossy", compressor="streaming:ratio=1.0",
                     device_budget=_full_kv_bytes(llm, 1200), prefill_chunk=256)
    loop.memory.needed = loop.memory.transient = lambda req: 1  # admit everything: growth must be handled by preemption
    ids = [loop.add_request(p, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)) for p in serving_prompts[:3]]
    states = set()
    for _ in range(3000):
        if not loop.has_unfinished():
            break
        loop.step()
        states |= {r.state for r in loop.requests}
        assert 0 <= loop.device.used_blocks <= loop.device.total_blocks
    # streaming at ratio 1.0 keeps everything: lossy == full, so recomputation must be exact
    assert [loop.requests[i].seq.output_ids for i in ids] == serving_reference[:3]
    assert State.WAITING in states and loop.device.used_blocks == 0


def test_request_larger_than_budget_is_refused(llm, serving_prompts):
    loop = bare_loop(llm.loaded, mode="full", device_budget=_full_kv_bytes(llm, 100))
    with pytest.raises(ValueError, match="whole device budget"):
        loop.add_request(serving_prompts[0], SamplingParams(max_tokens=5))
    assert not loop.requests


def test_illegal_transitions_are_refused(llm):
    loop = bare_loop(llm.loaded, mode="full", device_budget=1 << 30)
    rid = loop.add_request([1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="waiting -> drafting"):
        loop.requests.set_state(loop.requests[rid], State.DRAFTING)
    for src, dsts in ALLOWED.items():
        assert State.ABORTED in dsts and src not in (State.FINISHED, State.ABORTED)


def test_the_callers_sequence_keeps_its_id_and_the_table_owns_the_lifecycle(llm):
    """A caller's Sequence is the caller's: the loop gives the request its own id and writes only the
    output into it; every state the request passes through comes from the table's transitions."""
    loop = bare_loop(llm.loaded, mode="vericache", compressor="snapkv:ratio=0.125", tiered=False)
    loop.add_request([9, 9, 9], SamplingParams(max_tokens=2))          # takes id 0
    seq = loop.runner.new_sequence(41, [5, 6, 7, 8] * 8, SamplingParams(max_tokens=6, ignore_eos=True))
    rid, seen = loop.add_sequence(seq), []
    while loop.has_unfinished():
        loop.step()
        seen.append(loop.requests[rid].state)
    assert rid == 1 and seq.request_id == 41 and len(seq.output_ids) == 6
    assert seen[-1] == State.FINISHED and State.DRAFTING in seen
    assert all(b in ALLOWED[a] for a, b in zip(seen, seen[1:]) if a != b)
    assert [o.request_id for o in loop.collect_outputs()] == []      # everything was reported once


def test_block_pool_accounting():
    pool = BlockPool("device", 10 * 1024, block_bytes=1024)
    pool.resize("a", 2500)
    assert pool.used_blocks == 3
    pool.resize("a", 100)
    assert pool.used_blocks == 1
    with pytest.raises(OutOfBlocks):
        pool.resize("b", 20 * 1024)
    assert pool.used_blocks == 1  # a refused request changes nothing
    pool.free("a")
    pool.free("a")
    assert pool.used_blocks == 0 and pool.free_blocks == 10
    with pytest.raises(ValueError, match="smaller than one block"):
        BlockPool("x", 10, block_bytes=1024)


def test_emulated_link_moves_real_bytes_layer_by_layer(llm):
    cfg = llm.loaded.config
    src = FullKVCache(cfg, "cpu", torch.float32, 300)
    src.begin(0, 300)
    src.k.normal_()
    src.v.normal_()
    dst = FullKVCache(cfg, "cpu", torch.float32, 300)
    link = EmulatedLink(gbps=1.0)
    t = link.submit(src, 300, dst)
    t.wait_layer(0)
    t.wait_all()
    assert torch.equal(dst.k[:, :, :300], src.k[:, :, :300]) and torch.equal(dst.v[:, :, :300], src.v[:, :, :300])
    assert link.stats.bytes_moved == src.nbytes()
    assert len(link.stats.intervals) == cfg.num_hidden_layers
    assert all(e >= s for s, e in link.stats.intervals)
    link.close()
    with pytest.raises(ValueError, match="bandwidth"):
        EmulatedLink(gbps=0)


def test_staggered_drafts_stretch_to_cover_the_link_backlog(llm, serving_prompts):
    link = EmulatedLink(gbps=1)
    loop = bare_loop(llm.loaded, mode="vericache", compressor="snapkv:ratio=0.125", device_budget=1 << 30, link=link)
    assert loop.offload.draft_to_cover_link() == 0  # nothing measured yet
    link.stats.add(1_000_000, 0.0, 0.01)     # measured: 100 MB/s
    loop.instruments.intervals += [(0.0, 0.002, "draft")] * 4  # measured: 2 ms per draft step
    rid = loop.add_request(serving_prompts[0], SamplingParams(max_tokens=5))
    req = loop.requests[rid]
    req.state, req.kv.full = State.TRANSFERRING, FullKVCache(llm.loaded.config, "cpu", torch.float32, 1000)
    req.kv.full.begin(0, 999)

    class Pending:
        cuda_events = None

        def ready(self):
            return False

    req.drafting.transfer = Pending()
    backlog_s = loop.memory.verify_buffer_bytes(req) / 100e6
    assert loop.offload.draft_to_cover_link() == int(backlog_s / 0.002)
    link.close()


def test_per_request_options_run_side_by_side(llm, serving_prompts, serving_reference):
    """One engine, four requests with their own mode, compressor and draft length, under a budget
    that forces some to wait: full and vericache requests equal full-KV decoding; blocks all return."""
    from vericache.engine.options import RequestOptions

    loop = bare_loop(llm.loaded, mode="full", prefill_chunk=256,
                     device_budget=sum(_full_kv_bytes(llm, len(p) + MAX_TOKENS + 1) for p in serving_prompts) // 2)
    assert loop.link is None  # a full-mode server makes its link only when a vericache request comes
    options = [RequestOptions(mode="vericache", compressor="kivi:bits=2", draft_len=4),
               None,
               RequestOptions(mode="vericache", compressor="h2o:ratio=0.2"),
               RequestOptions(mode="lossy", compressor="streaming:ratio=0.25"),
               RequestOptions(mode="vericache", draft_len="auto")]
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    ids = [loop.add_request(p, params, o) for p, o in zip(serving_prompts, options)]
    for _ in range(5000):
        if not loop.has_unfinished():
            break
        loop.step()
    reqs = [loop.requests[i] for i in ids]
    assert [r.opts.mode for r in reqs] == ["vericache", "full", "vericache", "lossy", "vericache"]
    assert reqs[0].opts.compressor.spec().startswith("kivi") and reqs[0].opts.policy.fixed == 4
    assert reqs[4].opts.compressor.spec() == loop.runner.compressor.spec()  # unset fields: the server's
    for i in (0, 1, 2, 4):
        assert reqs[i].seq.output_ids == serving_reference[i], i
    assert reqs[1].drafting.round.rounds == 0 and reqs[3].drafting.round.rounds == 0 and all(reqs[i].drafting.round.rounds > 0 for i in (0, 2, 4))
    assert reqs[0].drafting.round.drafted <= 4 * reqs[0].drafting.round.rounds
    assert loop.link is not None and loop.link.stats.bytes_moved > 0
    assert loop.device.used_blocks == 0 and loop.host.used_blocks == 0


@pytest.mark.parametrize("options, field, needle", [
    ({"mode": "turbo"}, "mode", "unknown mode 'turbo'"),
    ({"compressor": "zip:ratio=0.5"}, "compressor", "unknown compressor"),
    ({"compressor": 3}, "compressor", "got 3"),
    ({"draft_len": 0}, "draft_len", "got 0"),
    ({"draft_len": "long"}, "draft_len", "'long'"),
])
def test_bad_request_options_are_refused_and_change_nothing(llm, options, field, needle):
    from vericache.engine.options import InvalidOption, RequestOptions

    loop = bare_loop(llm.loaded, mode="vericache", device_budget=1 << 30)
    with pytest.raises(InvalidOption, match=needle) as err:
        loop.add_request([1, 2, 3], SamplingParams(max_tokens=2), RequestOptions(**options))
    assert err.value.field == field
    assert not loop.requests and loop.device.used_blocks == 0


def test_group_count_follows_measured_rates():
    from vericache.engine.offload import group_count

    assert group_count(1, 1.0, 0.01, 8) == 1
    assert group_count(12, 0.0, 0.0, 8) == 2                 # nothing measured yet: ping-pong
    assert group_count(12, 0.001, 0.01, 16) == 2             # fast link: two big groups
    assert group_count(12, 0.05, 0.01, 16) == 4             # 12 * 0.05 / (16 * 0.01) = 3.75
    assert group_count(12, 1.0, 0.01, 16) == 12              # slow link: one request per group
    with pytest.raises(ValueError, match="n=-1"):
        group_count(-1, 1.0, 0.01, 8)


def test_grouped_schedule_takes_turns_on_the_link(llm, serving_prompts, serving_reference):
    """Under the grouped schedule at most one group has transfers in flight at any step, several
    groups are planned, and outputs stay identical to full-KV decoding."""
    loop = bare_loop(llm.loaded, mode="vericache", compressor="snapkv:ratio=0.125", device_budget=1 << 30,
                     link=EmulatedLink(gbps=2), prefill_chunk=256, scheduler="grouped")
    ids = [loop.add_request(p, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)) for p in serving_prompts]
    groups_seen = set()
    while loop.has_unfinished():
        loop.step()
        flying = {r.drafting.group for r in loop.requests if r.state == State.TRANSFERRING and not r.drafting.transfer.ready()}
        assert len(flying) <= 1, flying
        groups_seen |= {r.drafting.group for r in loop.requests if r.state == State.TRANSFERRING}
    assert [loop.requests[i].seq.output_ids for i in ids] == serving_reference
    assert len(groups_seen) >= 2 and loop.offload.mean_groups > 1


@pytest.mark.parametrize("resident", [3, 6])
def test_resident_layers_move_fewer_bytes_and_stay_identical(llm, serving_prompts, serving_reference, resident):
    """With the first layers of every full KV kept on the device, only the rest crosses the link
    (all of it stays when every layer is resident); outputs equal full-KV decoding, blocks return."""
    n_layers = llm.loaded.config.num_hidden_layers
    moved = {}
    for r in (0, resident):
        loop = bare_loop(llm.loaded, mode="vericache", compressor="snapkv:ratio=0.125", draft_len=4,
                         device_budget=1 << 30, link=EmulatedLink(gbps=8), prefill_chunk=256, resident_layers=r)
        ids = [loop.add_request(p, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)) for p in serving_prompts[:3]]
        while loop.has_unfinished():
            loop.step()
        assert [loop.requests[i].seq.output_ids for i in ids] == serving_reference[:3]
        assert loop.device.used_blocks == 0 and loop.host.used_blocks == 0
        rounds = sum(loop.requests[i].drafting.round.rounds for i in ids)
        moved[r] = loop.link.stats.bytes_moved / rounds
        loop.link.close()
    if resident == n_layers:
        assert moved[resident] == 0
    else:  # per round, about (L - R) / L of the bytes
        assert moved[resident] < moved[0] * (n_layers - resident + 0.5) / n_layers


def test_resident_layers_are_validated(llm):
    with pytest.raises(ValueError, match=r"resident_layers must be an integer in \[0, 6\], got 7"):
        bare_loop(llm.loaded, mode="vericache", device_budget=1 << 30, resident_layers=7)
    from vericache.kv.link import StreamedKV, Transfer

    cache = FullKVCache(llm.loaded.config, "cpu", torch.float32, 4)
    with pytest.raises(ValueError, match="resident cache"):
        StreamedKV(Transfer(cache, 0, cache, first_layer=2))


def test_the_server_reports_phases_without_emptying_the_engines_rates(llm, serving_prompts, tmp_path):
    """Under BackgroundService the metrics get every phase once, and the engine keeps the history its
    schedules' measured rates read (it used to be emptied after every step); a trace file beside the
    metrics (``serve --trace``) gets each phase with its wall-clock end."""
    import time

    from vericache.serving.service import BackgroundService
    from vericache.serving.trace import TraceFile, read_trace, tee

    events, trace, t0 = [], TraceFile(str(tmp_path / "trace.jsonl")), time.time()
    svc = BackgroundService(Engine(llm.loaded, mode="vericache", compressor="snapkv:ratio=0.25", device_budget_gb=1,
                                   tiered=True), metrics=tee(lambda e, f: events.append((e, f)), trace))
    try:
        stream = svc.submit(serving_prompts[0], SamplingParams(max_tokens=12, ignore_eos=True))
        while not stream.get(timeout=60).finished:
            pass
        inst = svc.engine.instruments
        phases = [f for e, f in events if e == "phase"]
        assert inst.draft_step_s() is not None and len(inst.intervals) > 0
        assert len(phases) == len(inst.intervals)   # each forward reported once
        assert inst.take_events() == ([], [], [])   # the loop took them all
        traced = [r for r in read_trace(trace.path) if r["event"] == "phase"]
        assert len(traced) == len(phases) and all(t0 <= r["end"] <= time.time() for r in traced)
        assert [r["seconds"] for r in traced] == [f["seconds"] for f in phases]
        assert all(a["end"] <= b["end"] for a, b in zip(traced, traced[1:]))
    finally:
        svc.shutdown()
        trace.close()
