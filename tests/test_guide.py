"""Verification-guided selection (``drafting.guide``): the store trades its least attended tokens for the
most attended ones it lacks, stored as it stores tokens, within its size; outputs never change."""

from __future__ import annotations

import math

import pytest
import torch

from vericache import SamplingParams
from vericache.compress.registry import parse_compressor
from vericache.drafting.guide import guide_store, select_trades_torch
from vericache.engine.engine import Engine
from vericache.kernels import packed_kernels
from vericache.kv.compressed import CompressedKVCache, KeptTokens
from vericache.kv.full import FullKVCache

N = 400   # committed positions


def _caches(llm, spec: str) -> tuple[CompressedKVCache, FullKVCache]:
    cfg = llm.loaded.config
    full = FullKVCache(cfg, "cpu", torch.float32, capacity=N + 8)
    full.begin(0, N)
    g = torch.Generator().manual_seed(3)
    full.k[:, :, :N] = torch.randn(full.k[:, :, :N].shape, generator=g)
    full.v[:, :, :N] = torch.randn(full.v[:, :, :N].shape, generator=g)
    draft = CompressedKVCache(parse_compressor(spec), cfg, "cpu", torch.float32, capacity=N + 8)
    draft.queries.normal_(generator=g)
    draft.q_seen = draft.window
    draft.commit(N, source=full)
    return draft, full


def _seen_favouring(draft: CompressedKVCache, wanted: torch.Tensor) -> torch.Tensor:
    """A verification's record in which every query head attended strongly to positions ``wanted``."""
    cfg = draft.cfg
    seen = torch.full((cfg.num_hidden_layers, cfg.num_attention_heads, N), -20.0)    # log-attention estimates
    seen[:, :, wanted] = -2.0
    return seen


@pytest.mark.parametrize("spec", ["snapkv:ratio=0.25,guided=true", "h2o:ratio=0.25,guided=true",
                                  "snapkv:ratio=0.25,guided=true+kivi:bits=2", "kvzip:ratio=0.25,guided=true+int4",
                                  "streaming:ratio=0.25,guided=true+fp8"])
def test_attended_missing_tokens_replace_the_least_attended(llm, spec):
    draft, full = _caches(llm, spec)
    count, before = draft.count, draft.kept().pos[:, :, : draft.count].clone()
    held = torch.zeros(N, dtype=torch.bool)
    held[before[0, 0].long()] = True
    wanted = (~held[: draft.res_start]).nonzero()[:5, 0]          # 5 positions layer 0, head 0 lacks
    sinks = draft.kept().scores[:, :, :count] == float("inf")
    swapped = guide_store(draft, full, _seen_favouring(draft, wanted), N, swaps=3, kernels=packed_kernels())
    assert draft.count == count                                     # the store keeps its size
    pos = draft.kept().pos[0, 0, :count].long()
    got = [int(p) in set(pos.tolist()) for p in wanted]
    assert sum(got) == 3                                            # ``swaps`` a head: 3 of the 5
    assert 0 < swapped <= 3 * draft.cfg.num_hidden_layers * draft.cfg.num_key_value_heads
    assert torch.equal(draft.kept().pos[:, :, :count][sinks], before[sinks])   # sinks stay
    assert len(set(pos.tolist())) == count                          # no position twice
    # the incoming tokens are stored as the store stores tokens (their exact K/V, encoded as single
    # tokens; KIVI keys with their position group's tables)
    k, v = draft.dequantized(0)
    for p in wanted[torch.tensor(got)]:
        slot = int((pos == p).nonzero()[0, 0])
        for x, stored, layout, name in zip((full.k, full.v), (k, v), draft.layouts or (None, None), "kv"):
            ref = x[0, 0, p]
            if layout is not None:
                grp = {f.split(".")[2]: t[0, 0, p // layout.group][None]
                       for f, t in draft.fields.items() if f.startswith(f"{name}.grp.")}
                tok = layout.encode_tokens(ref[None], grp, p[None])
                ref = layout.decode({f: y[None] for f, y in tok.items()}, {f: t[None] for f, t in grp.items()},
                                    ref.shape[-1], torch.zeros(1, 1, dtype=torch.int32))[0, 0]
            assert torch.equal(stored[0, slot], ref), name


def test_nothing_is_traded_when_the_store_already_holds_what_was_attended(llm):
    draft, full = _caches(llm, "snapkv:ratio=0.25,guided=true")
    before = draft.kept().pos.clone()
    seen = torch.full((draft.cfg.num_hidden_layers, draft.cfg.num_attention_heads, N), -math.log(N))   # uniform
    assert guide_store(draft, full, seen, N, swaps=8) == 0
    assert torch.equal(draft.kept().pos, before)


def test_a_kivi_key_encoded_alone_has_the_codes_of_its_group():
    from vericache.kv.quantized import CHANNEL_GROUPS, Layout

    layout = Layout(CHANNEL_GROUPS, 2, 32)
    x = torch.randn(3, 64, 64)                                      # [heads, positions, D]
    tok, grp = layout.encode(x)
    pos = torch.tensor([5, 40, 63])
    alone = layout.encode_tokens(x[1, pos], {f: t[1, pos // 32] for f, t in grp.items()}, pos)
    assert torch.equal(alone["codes"], tok["codes"][1, pos])


def test_the_native_choice_is_the_torch_one(llm):
    """``guide_select.cpp`` against its torch twin (distinct values, so ties cannot differ): the same
    trades and the same memory, round after round."""
    draft, full = _caches(llm, "h2o:ratio=0.25,guided=true")
    kept = draft.kept()
    g = torch.Generator().manual_seed(5)
    native_memory, torch_memory = kept.memory.clone(), kept.memory.clone()
    for swaps in (1, 7, 64, 10_000):
        seen = torch.randn(draft.cfg.num_hidden_layers, draft.cfg.num_attention_heads, N, generator=g) * 3 - math.log(N)
        native = packed_kernels().guide_select(seen, N, kept.pos, kept.scores, native_memory, kept.count,
                                               kept.res_start, swaps, 0.1)
        twin = select_trades_torch(seen, N, KeptTokens(kept.pos, kept.scores, torch_memory, kept.count, kept.res_start),
                                   swaps, 0.1)
        assert len(native) > 0 and torch.equal(native, twin), swaps
        assert torch.equal(native_memory, torch_memory), swaps
    with pytest.raises(RuntimeError, match="outside"):   # positions past the limit
        packed_kernels().guide_select(seen, N, kept.pos, kept.scores, native_memory, kept.count, 10, 8, 0.1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_native_trade_is_the_choice_then_the_torch_trade(llm, dtype):
    """``guide_trade`` (choose and trade in one call, a plain store) leaves the store as ``guide_select``
    followed by ``CompressedKVCache.trade`` does: the same K/V rows, positions, scores and memory, round
    after round, with sinks (inf scores) in the store and the lower of two middle scores as the median (torch's)."""
    stores = []
    for _ in range(2):
        draft, full = _caches(llm, "snapkv:ratio=0.25,guided=true")
        full.k, full.v = full.k.to(dtype), full.v.to(dtype)
        draft.fields = {name: x.to(dtype) for name, x in draft.fields.items()}
        scores = draft.kept().scores[:, :, : draft.count]                  # an even count: two middle scores
        scores.copy_(torch.rand(scores.shape, generator=torch.Generator().manual_seed(9)))
        scores[:, :, :8] = float("inf")                                    # sinks: never traded
        stores.append((draft, full))
    assert stores[0][0].count % 2 == 0
    g = torch.Generator().manual_seed(7)
    kernels = packed_kernels()
    cfg = stores[0][0].cfg
    for swaps in (3, 64, 10_000):
        seen = torch.randn(cfg.num_hidden_layers, cfg.num_attention_heads, N, generator=g) * 3 - math.log(N)
        (native, full), (twin, twin_full) = stores
        kept, ref = native.kept(), twin.kept()
        rows = native.fields["k.tok.x"], native.fields["v.tok.x"]
        traded = kernels.guide_trade(seen, N, kept.pos, kept.scores, kept.memory, kept.count, kept.res_start, swaps,
                                     0.1, full.k, full.v, *rows)
        trades = kernels.guide_select(seen, N, ref.pos, ref.scores, ref.memory, ref.count, ref.res_start, swaps, 0.1)
        twin.trade(trades, twin_full)
        assert len(traded) > 0 and torch.equal(traded, trades), swaps
        for name in ("pos", "scores", "memory"):
            assert torch.equal(getattr(kept, name), getattr(ref, name)), (swaps, name)
        for name in ("k.tok.x", "v.tok.x"):
            assert torch.equal(native.fields[name], twin.fields[name]), (swaps, name)
    # and guide_store takes that path for a plain store: the same trades again
    assert guide_store(native, full, seen, N, 16, kernels) == guide_store(twin, twin_full, seen, N, 16)
    assert torch.equal(native.fields["k.tok.x"], twin.fields["k.tok.x"])
    with pytest.raises(RuntimeError, match="one dtype"):               # a store of another element type
        kernels.guide_trade(seen, N, kept.pos, kept.scores, kept.memory, kept.count, kept.res_start, 8, 0.1,
                            full.k, full.v, rows[0].double(), rows[1])


def test_what_a_recent_round_attended_is_remembered(llm):
    """A kept token the last round attended strongly is not traded for one this round attends a little
    more than it attends the kept token now: its memory (decayed) still beats it."""
    draft, full = _caches(llm, "snapkv:ratio=0.25,guided=true")
    kept = draft.kept()
    held = kept.pos[0, 0, 0].long()
    missing = next(p for p in range(draft.res_start) if p not in set(kept.pos[0, 0, : kept.count].tolist()))
    first = _seen_favouring(draft, torch.tensor([held]))
    guide_store(draft, full, first, N, swaps=4)
    assert kept.memory[0, 0, 0] == pytest.approx(-2.0)
    second = torch.full_like(first, -20.0)
    second[:, :, missing] = -2.5                                     # attended now, less than remembered
    guide_store(draft, full, second, N, swaps=4)
    assert held.item() in set(draft.kept().pos[0, 0, : draft.count].tolist())
    assert missing in set(draft.kept().pos[0, 0, : draft.count].tolist())   # it came in for a forgotten token


@pytest.mark.parametrize("bad", ["snapkv:guided=maybe", "snapkv:swaps=0", "h2o:swaps=1.5"])
def test_bad_guidance_options_are_refused(bad):
    with pytest.raises(ValueError, match="guided|swaps"):
        parse_compressor(bad)


def test_guided_drafting_keeps_the_output_and_counts_its_swaps(llm, code_prompts):
    """Guided selection changes only what the drafter holds: the output is full decoding's, the stats
    count the swaps, and the drafts follow the verifier at least as well as unguided ones on a long
    code prompt (tiny model; the real model's figures are in docs/BENCHMARKS.md)."""
    prompt = llm.tokenizer.encode(code_prompts["long"])
    params = SamplingParams(max_tokens=48)
    full = Engine(llm.loaded, mode="full")
    ref = full.generate([full.new_sequence(0, prompt, params)])[0].token_ids
    stats = {}
    for guided in ("false", "true"):
        eng = Engine(llm.loaded, mode="vericache", compressor=f"snapkv:ratio=0.1,guided={guided}", draft_len=8)
        out = eng.generate([eng.new_sequence(0, prompt, params)])[0]
        assert out.token_ids == ref
        stats[guided] = out.stats
    assert stats["false"]["guided_swaps"] == 0 and stats["true"]["guided_swaps"] > 0
    assert stats["true"]["compressor"].endswith("guided=True,swaps=64,kernel=7")


def test_a_guided_request_keeps_one_seen_record_for_all_its_verifications(llm, code_prompts, monkeypatch):
    """Each verification of a guided request records into the same [L, Hq, capacity] buffer (a fresh one
    a verification cost ~10,500 page faults at 32K, 8-12 ms), counted in what the request needs and holds
    and dropped with its caches; an unguided request has none."""
    import vericache.engine.scheduler as scheduler

    prompt = llm.tokenizer.encode(code_prompts["long"])
    cfg = llm.loaded.config
    eng = Engine(llm.loaded, mode="vericache", compressor="snapkv:ratio=0.1,guided=true", draft_len=4)
    records = []
    real = scheduler.guide_store
    monkeypatch.setattr(scheduler, "guide_store",
                        lambda draft, full, seen, *a: records.append(seen) or real(draft, full, seen, *a))
    rid = eng.add_request(prompt, SamplingParams(max_tokens=24))
    req = eng.loop.requests[rid]
    memory = eng.loop.scheduler.memory
    eng.step()   # admitted and allocated
    seen = req.kv.seen
    assert seen is not None and seen.shape == (cfg.num_hidden_layers, cfg.num_attention_heads, req.seq.capacity)
    assert memory.seen_bytes(req) == seen.nbytes > 0
    assert memory.device_bytes(req) >= seen.nbytes and req.kv.resident_bytes() >= seen.nbytes
    while eng.has_unfinished():
        eng.step()
    assert len(records) >= 2
    assert all(r.untyped_storage().data_ptr() == seen.untyped_storage().data_ptr() for r in records)
    assert req.kv.seen is None   # freed with its caches

    plain = Engine(llm.loaded, mode="vericache", compressor="snapkv:ratio=0.1,guided=false", draft_len=4)
    rid = plain.add_request(prompt, SamplingParams(max_tokens=4))
    plain.step()
    assert plain.loop.requests[rid].kv.seen is None and plain.loop.scheduler.memory.seen_bytes(plain.loop.requests[rid]) == 0


def test_swaps_are_a_metric():
    from vericache.serving.metrics import Metrics, metrics_sink

    m = Metrics("tiny", "vericache", "snapkv")
    sink = metrics_sink(m)
    value = lambda: m.registry.get_sample_value("vericache_guided_swaps_total", m.labels)   # noqa: E731
    assert value() == 0                                             # exported before the first round
    sink("round", {"drafted": 4, "accepted": 3, "swapped": 17})
    sink("round", {"drafted": 4, "accepted": 1, "swapped": 0})
    assert value() == 17
