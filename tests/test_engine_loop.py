"""The one step loop: a seeded random workload of add / abort / step under tight budgets on every
schedule, failures that stay with the requests they concern, and the forward packing."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import bare_loop
from vericache import SamplingParams
from vericache.engine.options import RequestOptions
from vericache.engine.requests import DONE, State
from vericache.kv.full import FullKVCache
from vericache.kv.link import EmulatedLink

RUNNING = (State.PREFILL, State.DECODING, State.DRAFTING, State.TRANSFERRING)


@pytest.fixture(scope="module")
def pool(llm):
    from vericache_lab.bench.common import code_prompt

    ids = code_prompt(llm.tokenizer, 2400)
    return [ids[i : i + n] for i, n in zip(range(0, 2400, 300), (60, 250, 120, 300, 90, 200, 160, 280))]


@pytest.fixture(scope="module")
def reference(llm):
    """Full-KV output of (prompt, max_tokens), computed on demand and kept."""
    memo: dict = {}

    def ref(prompt: list[int], max_tokens: int) -> list[int]:
        key = (tuple(prompt), max_tokens)
        if key not in memo:
            runner = llm.engine
            seq = runner.new_sequence(0, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            memo[key] = runner.generate([seq], "full")[0].token_ids
        return memo[key]
    return ref


def _kv_bytes(llm, n: int) -> int:
    return n * FullKVCache(llm.loaded.config, "cpu", torch.float32, 1).nbytes_per_position()


@pytest.mark.parametrize("scheduler, offload, seed", [("naive", True, 0), ("staggered", True, 1),
                                                      ("grouped", True, 2), ("staggered", False, 3)])
def test_random_add_abort_step(llm, pool, reference, scheduler, offload, seed):
    rng = random.Random(seed)
    link = EmulatedLink(gbps=8) if offload else None
    loop = bare_loop(llm.loaded, mode="full", compressor="snapkv:ratio=0.25", device_budget=_kv_bytes(llm, 900),
                     scheduler=scheduler, link=link, prefill_chunk=128, tiered=offload)
    added: dict[int, tuple[list[int], int]] = {}
    aborted: set[int] = set()
    for _ in range(400):
        action = rng.random()
        if action < 0.12 and len(added) < 14:
            prompt, max_tokens = rng.choice(pool), rng.randint(2, 12)
            mode = rng.choice(["full", "lossy", "vericache", "vericache"])
            rid = loop.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                  RequestOptions(mode=mode, draft_len=rng.choice([2, 5, "auto"])))
            added[rid] = (prompt, max_tokens)
        elif action < 0.17:
            live = [r.id for r in loop.requests if not r.done]
            if live:
                rid = rng.choice(live)
                loop.abort(rid)
                aborted.add(rid)
                assert loop.requests[rid].state == State.ABORTED
                assert ("kv", rid) not in loop.device.owners() and ("verify", rid) not in loop.device.owners()
        else:
            loop.step()
        assert 0 <= loop.device.used_blocks <= loop.device.total_blocks
        for r in loop.requests:
            if r.seq.finished:  # finished requests are never drafted, transferred or preempted again
                assert r.state in DONE and r.kv.full is None and r.kv.draft is None and r.drafting.transfer is None
    for _ in range(3000):
        if not loop.has_unfinished():
            break
        loop.step()
    assert not loop.has_unfinished()
    assert loop.device.used_blocks == 0 and loop.host.used_blocks == 0  # blocks conserved
    finished = [r for r in loop.requests if r.state == State.FINISHED]
    assert len(finished) >= 3
    for r in finished:
        assert r.id not in aborted and not r.error
        if r.opts.mode != "lossy":
            assert r.seq.output_ids == reference(*added[r.id]), (r.id, r.opts.mode)
    if link is not None:
        link.close()


def test_a_failing_request_fails_alone(llm, pool, reference):
    """An exception inside one request's attention fails that request only: it ends with
    finish_reason "error" and its KV is freed; a later request is served."""
    loop = bare_loop(llm.loaded, mode="vericache", compressor="snapkv:ratio=0.25", tiered=False, draft_len=4)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    bad = loop.add_request(pool[1], params)
    loop.step()  # prefill
    req = loop.requests[bad]

    def broken(*args, **kwargs):
        raise RuntimeError("injected fault")
    req.kv.draft.parts = req.kv.draft.layered_parts = broken   # the module's path and the native step's
    outs = []
    while loop.has_unfinished():
        outs += loop.step()
    final = [o for o in outs if o.request_id == bad and o.finished]
    assert final and final[0].finish_reason == "error" and "injected fault" in final[0].error
    assert req.state == State.FAILED and loop.instruments.failures == 1
    assert loop.device.used_blocks == 0
    good = loop.add_request(pool[2], params)
    while loop.has_unfinished():
        loop.step()
    assert loop.requests[good].seq.output_ids == reference(pool[2], 8)


def test_a_bad_part_in_the_attention_op_fails_only_its_request(llm, pool, reference):
    """Three requests decode in one forward; one's full KV turns into a part the packed attention op
    refuses (float64). The op raises for the whole step; each row then runs alone: that request fails
    with the op's error naming what it got, the other two finish with the full-KV output (a row's bits
    do not depend on its batch), and every block comes back."""
    loop = bare_loop(llm.loaded, mode="full", tiered=False)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    rids = [loop.add_request(p, params) for p in pool[:3]]
    loop.step()   # the three prefills
    bad = loop.requests[rids[1]]
    bad.kv.full.k = bad.kv.full.k.to(torch.float64)   # a bad part: the op takes fp32, fp16 or bf16
    recorded, emitted = loop.instruments.n_steps, [len(loop.requests[r].seq.output_ids) for r in rids]
    loop.step()   # fails, then runs row by row: the two good rows decode, and no step is recorded
    assert loop.instruments.n_steps == recorded, "rows rerun one by one are not a step's record"
    assert [len(loop.requests[r].seq.output_ids) - e for r, e in zip(rids, emitted)] == [1, 0, 1]
    while loop.has_unfinished():
        loop.step()
    assert bad.state == State.FAILED and "Double" in bad.error and loop.instruments.failures == 1
    for i in (0, 2):
        req = loop.requests[rids[i]]
        assert req.state == State.FINISHED and req.seq.output_ids == reference(pool[i], 8), i
    assert loop.device.used_blocks == 0


def test_an_error_in_postprocessing_fails_only_its_request(llm, pool, reference, monkeypatch):
    loop = bare_loop(llm.loaded, mode="full", tiered=False)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    a, b = loop.add_request(pool[0], params), loop.add_request(pool[4], params)
    loop.step()
    original = loop.requests[a].seq.append

    def explode(token):
        raise ValueError("bad token")
    monkeypatch.setattr(loop.requests[a].seq, "append", explode)
    while loop.has_unfinished():
        loop.step()
    assert loop.requests[a].state == State.FAILED and "bad token" in loop.requests[a].error
    assert loop.requests[b].state == State.FINISHED and loop.requests[b].seq.output_ids == reference(pool[4], 6)
    assert original is not None and loop.device.used_blocks == 0


def test_one_forward_per_step_packs_every_kind(llm, pool, monkeypatch):
    """A step with a prefill, decode rows, draft rows and a verification runs the model once."""
    loop = bare_loop(llm.loaded, mode="full", tiered=False, prefill_chunk=64)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    loop.add_request(pool[0], params)
    loop.add_request(pool[4], params, RequestOptions(mode="vericache", draft_len=3))
    loop.add_request(pool[2], params, RequestOptions(mode="lossy"))
    calls, kinds = [], set()
    forward = loop.runner.model.forward
    monkeypatch.setattr(loop.runner.model, "forward", lambda *a, **k: calls.append(1) or forward(*a, **k))
    for _ in range(12):
        before = len(calls)
        loop.step()
        assert len(calls) - before <= 1
        kinds |= set(loop.instruments.intervals[-1][2].split("+"))
    assert {"prefill", "decode", "draft", "verify"} <= kinds


def test_a_verification_buffer_that_can_never_fit_fails_its_request_instead_of_waiting(llm, pool, monkeypatch):
    """An offloaded VeriCache request alone on the device whose verification buffer does not fit beside
    its own KV: nothing else holds the device, so nothing will ever make room. It fails with the sizes
    (before, it waited forever: a step with nothing to run, again and again), and frees every block."""
    link = EmulatedLink(gbps=8)
    loop = bare_loop(llm.loaded, mode="vericache", compressor="snapkv:ratio=0.25", draft_len=4,
                     device_budget=_kv_bytes(llm, 900), link=link, prefill_chunk=256)
    too_big = loop.device.capacity_bytes + 1
    monkeypatch.setattr(loop.memory, "verify_buffer_bytes", lambda req: too_big)
    rid = loop.add_request(pool[0], SamplingParams(max_tokens=8, ignore_eos=True))
    for _ in range(50):
        if not loop.has_unfinished():
            break
        loop.step()
    req = loop.requests[rid]
    assert req.state == State.FAILED and f"verification buffer ({too_big} bytes) does not fit" in req.error
    assert loop.device.used_blocks == 0 and loop.host.used_blocks == 0
    link.close()


def test_kvzip_scores_its_prompt_a_chunk_a_step_beside_the_other_requests(llm, pool, reference, monkeypatch):
    """KVzip's scoring pass (the repeat prompt and the prompt again, a second forward) runs a prefill
    chunk a step once the prompt is in, so a request decoding beside it gains a token every step meanwhile
    (it ran inside one step before: every other stream stalled for the whole pass). Its scores are the
    one-call pass's bits; the prefill's progress counts it; the request decodes as full decoding; a
    request aborted inside its pass frees everything, and a broken pass (its chunks out of order) fails."""
    from vericache.compress.base import prompt_scores
    from vericache.compress.kvzip_scoring import ReconstructionScoringCache
    from vericache.compress.registry import parse_compressor

    monkeypatch.setattr(ReconstructionScoringCache, "chunk", 48)   # the pass in several steps (its 512: one)
    kvzip = RequestOptions(mode="vericache", compressor="kvzip:ratio=0.25")
    loop = bare_loop(llm.loaded, mode="full", tiered=False, prefill_chunk=64)
    other = loop.add_request(pool[0], SamplingParams(max_tokens=60, ignore_eos=True))
    loop.step()   # its prefill
    rid = loop.add_request(pool[3], SamplingParams(max_tokens=8, ignore_eos=True), kvzip)
    req, beside = loop.requests[rid], loop.requests[other]
    progress, steps_in_pass = [], 0
    while req.state in (State.WAITING, State.PREFILL):
        made = len(beside.seq.output_ids)
        loop.step()
        progress.append((req.prefill.done_ids + req.prefill.scored, len(req.seq.prompt_ids) + len(req.prefill.scoring_ids)))
        if req.prefill.scoring is not None:   # its buffers charged while the pass runs
            assert loop.memory.scoring_bytes(req) > 0
        if "prefill_score" in loop.instruments.intervals[-1][2]:
            steps_in_pass += 1
            assert len(beside.seq.output_ids) == made + 1   # the other request decoded in the same step
    ids = parse_compressor("kvzip:ratio=0.25").scoring_ids(pool[3], llm.tokenizer)
    # a step runs a chunk of the pass's own (its scores' bits never depend on the engine's prefill chunk)
    assert len(req.prefill.scoring_ids) == len(ids) and steps_in_pass == -(-len(ids) // ReconstructionScoringCache.chunk)
    assert progress[-1] == (len(pool[3]) + len(ids),) * 2 and progress == sorted(progress)
    assert loop.memory.scoring_bytes(req) == 0 and loop.memory.scoring_bytes(beside) == 0   # over; none
    # the pass over steps gives the one-call pass's scores (``set_prefill_scores`` kept them per layer)
    full = FullKVCache(llm.loaded.config, "cpu", llm.loaded.kv_dtype, capacity=len(pool[3]))
    llm.engine.prefill(pool[3], [full])
    one_call = prompt_scores(parse_compressor("kvzip:ratio=0.25"), llm.loaded.model, full, pool[3], llm.tokenizer)
    assert one_call is not None
    kept = req.kv.draft_kv().state["prefill_scores"]
    assert torch.equal(kept, torch.cat([one_call[i] for i in range(len(one_call))]))
    while loop.has_unfinished():
        loop.step()
    assert req.seq.output_ids == reference(pool[3], 8) and beside.seq.output_ids == reference(pool[0], 60)

    rid = loop.add_request(pool[3], SamplingParams(max_tokens=8, ignore_eos=True), kvzip)
    while loop.requests[rid].prefill.scoring is None:
        loop.step()
    loop.step()   # one chunk of the pass in
    loop.abort(rid)
    req = loop.requests[rid]
    assert req.state == State.ABORTED and req.prefill.scoring is None and loop.device.used_blocks == 0
    rid = loop.add_request(pool[3], SamplingParams(max_tokens=8, ignore_eos=True), kvzip)
    while loop.requests[rid].prefill.scoring is None:
        loop.step()
    loop.requests[rid].prefill.scored += 1   # a chunk skipped: the pass refuses it, the request fails alone
    loop.step()
    assert loop.requests[rid].state == State.FAILED and "runs in order" in loop.requests[rid].error
    assert loop.device.used_blocks == 0
