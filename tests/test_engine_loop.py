"""The one step loop: a seeded random workload of add / abort / step under tight budgets on every
schedule, failures that stay with the requests they concern, and the forward packing."""

from __future__ import annotations

import random

import pytest
import torch
from vericache import SamplingParams
from vericache.engine import serving as S
from vericache.engine.engine import Engine
from vericache.engine.options import RequestOptions
from vericache.kv.full import FullKVCache
from vericache.kv.link import EmulatedLink

RUNNING = (S.PREFILL, S.DECODING, S.DRAFTING, S.TRANSFERRING)


@pytest.fixture(scope="module")
def pool(llm):
    from vericache.bench.common import code_prompt

    ids = code_prompt(llm.tokenizer, 2400)
    return [ids[i : i + n] for i, n in zip(range(0, 2400, 300), (60, 250, 120, 300, 90, 200, 160, 280))]


@pytest.fixture(scope="module")
def reference(llm):
    """Full-KV output of (prompt, max_tokens), computed on demand and kept."""
    memo: dict = {}

    def ref(prompt: list[int], max_tokens: int) -> list[int]:
        key = (tuple(prompt), max_tokens)
        if key not in memo:
            eng = llm.engine
            seq = eng.new_sequence(0, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            memo[key] = eng.generate([seq], "full")[0].token_ids
        return memo[key]
    return ref


def _kv_bytes(llm, n: int) -> int:
    return n * FullKVCache(llm.loaded.config, "cpu", torch.float32, 1).nbytes_per_position()


@pytest.mark.parametrize("scheduler, offload, seed", [("naive", True, 0), ("staggered", True, 1),
                                                      ("grouped", True, 2), ("staggered", False, 3)])
def test_random_add_abort_step(llm, pool, reference, scheduler, offload, seed):
    rng = random.Random(seed)
    link = EmulatedLink(gbps=8) if offload else None
    srv = S.ServingEngine(Engine(llm.loaded, mode="full", compressor="snapkv:ratio=0.25"),
                          device_budget=_kv_bytes(llm, 900), scheduler=scheduler, link=link,
                          prefill_chunk=128, offload=offload)
    added: dict[int, tuple[list[int], int]] = {}
    aborted: set[int] = set()
    for _ in range(400):
        action = rng.random()
        if action < 0.12 and len(added) < 14:
            prompt, max_tokens = rng.choice(pool), rng.randint(2, 12)
            mode = rng.choice(["full", "lossy", "vericache", "vericache"])
            rid = srv.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                  RequestOptions(mode=mode, draft_len=rng.choice([2, 5, "auto"])))
            added[rid] = (prompt, max_tokens)
        elif action < 0.17:
            live = [r.id for r in srv.requests.values() if not r.done]
            if live:
                rid = rng.choice(live)
                srv.abort(rid)
                aborted.add(rid)
                assert srv.requests[rid].state == S.ABORTED
                assert ("kv", rid) not in srv.device.owners() and ("verify", rid) not in srv.device.owners()
        else:
            srv.step()
        assert 0 <= srv.device.used_blocks <= srv.device.total_blocks
        for r in srv.requests.values():
            if r.seq.finished:  # finished requests are never drafted, transferred or preempted again
                assert r.state in S.DONE and r.full is None and r.draft is None and r.transfer is None
    for _ in range(3000):
        if not srv.has_unfinished():
            break
        srv.step()
    assert not srv.has_unfinished()
    assert srv.device.used_blocks == 0 and srv.host.used_blocks == 0  # blocks conserved
    finished = [r for r in srv.requests.values() if r.state == S.FINISHED]
    assert len(finished) >= 3
    for r in finished:
        assert r.id not in aborted and not r.error
        if r.opts.mode != "lossy":
            assert r.seq.output_ids == reference(*added[r.id]), (r.id, r.opts.mode)
    if link is not None:
        link.close()


def test_a_failing_request_fails_alone(llm, pool, reference):
    """An exception inside one request's attention fails the requests of that step's forward only:
    they end with finish_reason "error" and their KV is freed; a later request is served."""
    srv = S.ServingEngine(Engine(llm.loaded, mode="vericache", compressor="snapkv:ratio=0.25"), offload=False)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    bad = srv.add_request(pool[1], params)
    srv.step()  # prefill
    req = srv.requests[bad]

    def broken(*args, **kwargs):
        raise RuntimeError("injected fault")
    req.draft.parts = broken
    outs = []
    while srv.has_unfinished():
        outs += srv.step()
    final = [o for o in outs if o.request_id == bad and o.finished]
    assert final and final[0].finish_reason == "error" and "injected fault" in final[0].error
    assert req.state == S.FAILED and srv.instruments.failures == 1
    assert srv.device.used_blocks == 0
    good = srv.add_request(pool[2], params)
    while srv.has_unfinished():
        srv.step()
    assert srv.requests[good].seq.output_ids == reference(pool[2], 8)


def test_an_error_in_postprocessing_fails_only_its_request(llm, pool, reference, monkeypatch):
    srv = S.ServingEngine(Engine(llm.loaded, mode="full"), offload=False)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    a, b = srv.add_request(pool[0], params), srv.add_request(pool[4], params)
    srv.step()
    original = srv.requests[a].seq.append

    def explode(token):
        raise ValueError("bad token")
    monkeypatch.setattr(srv.requests[a].seq, "append", explode)
    while srv.has_unfinished():
        srv.step()
    assert srv.requests[a].state == S.FAILED and "bad token" in srv.requests[a].error
    assert srv.requests[b].state == S.FINISHED and srv.requests[b].seq.output_ids == reference(pool[4], 6)
    assert original is not None and srv.device.used_blocks == 0


def test_one_forward_per_step_packs_every_kind(llm, pool, monkeypatch):
    """A step with a prefill, decode rows, draft rows and a verification runs the model once."""
    srv = S.ServingEngine(Engine(llm.loaded, mode="full"), offload=False, prefill_chunk=64)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    srv.add_request(pool[0], params)
    srv.add_request(pool[4], params, RequestOptions(mode="vericache", draft_len=3))
    srv.add_request(pool[2], params, RequestOptions(mode="lossy"))
    calls, kinds = [], set()
    forward = srv.eng.model.forward
    monkeypatch.setattr(srv.eng.model, "forward", lambda *a, **k: calls.append(1) or forward(*a, **k))
    for _ in range(12):
        before = len(calls)
        srv.step()
        assert len(calls) - before <= 1
        kinds |= set(srv.instruments.intervals[-1][2].split("+"))
    assert {"prefill", "decode", "draft", "verify"} <= kinds
