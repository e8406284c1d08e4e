"""The cost-chosen draft length: the fit of step costs, and the k it calls for."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from vericache.drafting.calibrate import Calibration
from vericache.drafting.cost import CostsAt, DraftCost, StepCosts, best_draft_len, expected_tokens
from vericache.drafting.round import DraftLengthPolicy, SharedAcceptance
from vericache.engine.requests import StepRecord
from vericache_lab.predict import predict_offloaded


def test_expected_tokens_counts_the_bonus_token():
    assert expected_tokens(1.0, 4) == 5 and expected_tokens(0.0, 4) == 1
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_compute_bound_verification_calls_for_short_drafts_and_cheap_for_long():
    # verification grows with its rows (a CPU batch): short drafts
    short = best_draft_len(0.93, draft_s=0.3, verify_s=lambda k: 0.3 + 0.1 * (k + 1), k_max=48)
    # verification costs one step whatever its rows (memory-bound): drafts as long as acceptance allows
    long = best_draft_len(0.97, draft_s=0.05, verify_s=lambda k: 0.4, k_max=48)
    assert 1 <= short <= 6 and long >= 12
    assert best_draft_len(0.1, 0.05, lambda k: 0.4, 48) <= 2      # a poor drafter: hardly worth drafting
    with pytest.raises(ValueError, match="k_max must be >= 1, got 0"):
        best_draft_len(0.9, 0.1, lambda k: 0.1, 0)


def _steps(t0, t_row, t_byte, t_pair):
    out, t = [], 0.0
    for i in range(30):   # draft and verification steps of several sizes (requests at several lengths)
        verify, n = i % 3 == 0, 4 + i % 13
        keys = 2000 + 500 * (i % 7)
        rows, kv, pairs = (n * (1 + i % 5), n * keys * 7e4, n * (1 + i % 5) * keys) if verify else (n, n * 1e7, n * 900)
        dt = t0 + rows * t_row + kv * t_byte + pairs * t_pair
        out.append(StepRecord(t, t + dt, "draft+verify" if verify else "draft", 16, rows, kv, pairs))
        t += dt
    return out


def test_the_fit_recovers_the_step_costs_and_waits_for_enough_steps():
    true = (0.02, 0.002, 5e-11, 4e-9)
    fit = StepCosts.fit(_steps(*true))
    assert fit is not None
    for got, want in zip((fit.c0, fit.t_row, fit.t_byte, fit.t_pair), true):
        assert got == pytest.approx(want, rel=1e-3)
    degenerate = [StepRecord(0, 0.5, "draft", 16, 16, 8e8, 16000)] * 10 + [
        StepRecord(0, 0.9 + 0.1 * r, "draft+verify", 16, 16 * r, 6e9, 16 * r * 8000) for r in range(1, 6)]
    rough = StepCosts.fit(degenerate)          # fewer distinct steps than unknowns: it still predicts them
    assert all(rough.seconds(s.rows, s.kv_bytes, s.pairs) == pytest.approx(s.end - s.start, rel=0.05)
               for s in degenerate)
    assert StepCosts.fit(_steps(*true)[:5]) is None                       # too few
    assert StepCosts.fit([s for s in _steps(*true) if "verify" not in s.kinds]) is None


def test_the_fit_prices_a_steps_update_with_its_forward():
    """A round's accept, commits and compression moves run after its forward (``StepRecord.post``): the
    fit prices them with the forward, so steps whose updates cost per pair are priced dearer per pair."""
    true = (0.02, 0.002, 5e-11, 4e-9)
    plain = StepCosts.fit(_steps(*true))
    steps = _steps(*true)
    for s in steps:
        s.post = s.pairs * 1e-9   # an update that grows with the rows' pairs
    fit = StepCosts.fit(steps)
    assert fit.t_pair == pytest.approx(true[3] + 1e-9, rel=1e-3) and plain.t_pair == pytest.approx(true[3], rel=1e-3)


def test_the_drafted_rounds_updates_leave_the_fit_for_their_own_price():
    """A drafted round's update (``StepRecord.round_post``, inside ``post``) is priced per round
    (``DraftCost.round_s``), not fitted with the forward: the fit is the same with or without it."""
    true = (0.02, 0.002, 5e-11, 4e-9)
    plain = StepCosts.fit(_steps(*true))
    steps = _steps(*true)
    for s in steps:
        s.round_post = 0.01 * s.rows if "verify" in s.kinds else 0.0   # a costly update, one per verified row
        s.post += s.round_post
    assert StepCosts.fit(steps).to_dict() == pytest.approx(plain.to_dict(), rel=1e-6)
    for s in steps:
        s.round_post = 0.0   # broken: the updates fitted as the forward's
    assert StepCosts.fit(steps).to_dict() != pytest.approx(plain.to_dict(), rel=1e-3)


def test_a_rounds_update_is_priced_into_every_drafted_round():
    """Where rounds pay on their rows alone, an update dearer than what they save makes full steps win;
    ``round_s`` is the mean of the latest measured updates."""
    cost = DraftCost(fitted=StepCosts(c0=0.001, t_byte=1e-9), source="fitted")
    full_row, draft_row = lambda k: (1e6, 0), (0.1e6, 0)   # noqa: E731 - a full step costs 2 ms
    assert cost.choose(0.8, 1, draft_row, full_row, 8) >= 2
    cost.refit([], 0, [0.02, 0.04])   # each drafted round's update: 30 ms on average
    assert cost.round_s == pytest.approx(0.03)
    assert cost.choose(0.8, 1, draft_row, full_row, 8) == 0


def test_a_requests_acceptance_starts_from_its_neighbours_rounds():
    """``SharedAcceptance``: rounds pooled across requests are a new request's prior (so a batch does not
    pay every request's failed first round), counted as at most ``weight`` observations, so the request's
    own rounds soon decide; the pool keeps about ``window`` observations."""
    policy, pool = DraftLengthPolicy(), SharedAcceptance()
    first, later, alone = policy.new_state(), policy.new_state(), policy.new_state()
    first.pool = later.pool = pool
    assert not later.measured and later.acceptance() == alone.acceptance() == 0.5
    for _ in range(6):
        policy.update(first, 8, 0)        # the neighbour's drafts all rejected
    assert later.measured and not alone.measured
    assert later.acceptance() == pytest.approx(1 / 8)                 # 6 pooled rejections, its own none
    assert later.acceptance(optimistic=True) < alone.acceptance(optimistic=True)
    for _ in range(6):
        policy.update(later, 8, 8)        # its own drafts all accepted: they outweigh the pool
    assert later.acceptance() > 0.95
    for _ in range(100):
        pool.add(3, True)
    assert pool.accepted + pool.rejections == pytest.approx(pool.window)
    assert pool.accepted / pool.rejections == pytest.approx(3.0, rel=0.05)   # the old rounds faded


def test_the_planner_pools_acceptance_per_compressor(llm, monkeypatch):
    """One pool per compressor in an engine, given at admission: requests with the same compressor share
    one, another compressor's requests have their own; the engine keeps the latest ``MAX_POOLS``."""
    import vericache.engine.scheduler as scheduler
    from vericache import Engine, SamplingParams
    from vericache.engine.options import RequestOptions

    engine = Engine(llm.loaded, mode="vericache", compressor="snapkv:ratio=0.25", draft_len="auto")
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    prompt = llm.tokenizer.encode("def f(x):\n    return x\n" * 8)
    for options in (None, None, RequestOptions(compressor="streaming:ratio=0.25")):
        engine.add_request(prompt, params, options)
    a, b, c = (r.drafting.policy_state.pool for r in engine.loop.requests)
    assert a is b and c is not a and c is not None
    monkeypatch.setattr(scheduler, "MAX_POOLS", 2)
    engine.add_request(prompt, params, RequestOptions(compressor="h2o:ratio=0.25"))   # a third spec: the oldest goes
    pools = engine.loop.scheduler.planner.pools
    assert len(pools) == 2 and all(p is not a for p in pools.values()) and any(p is c for p in pools.values())


def test_a_probe_round_drafts_what_the_costs_call_for_within_the_policy(llm, monkeypatch):
    """A request's first round (a probe, at the optimistic acceptance) drafts the length the costs call
    for there, at most the policy's: a short probe where rounds barely pay (a batch's failed probes
    each cost a step), the policy's start (8) where longer ones would."""
    from vericache import Engine, SamplingParams

    for chosen, first in ((3, 3), (20, 8)):
        monkeypatch.setattr(DraftCost, "choose", lambda self, *args, c=chosen: c)
        engine = Engine(llm.loaded, mode="vericache", compressor="snapkv:ratio=0.25", draft_len="auto")
        engine.add_request(llm.tokenizer.encode("def f(x):\n    return x\n" * 8),
                           SamplingParams(max_tokens=24, ignore_eos=True))
        while not engine.instruments.round_log:
            engine.step()
        assert engine.instruments.round_log[0][1] == first
        # the drafted round's update was timed, and that time left its step's fit for the round's price
        updates = engine.instruments.round_updates
        assert len(updates) == 1 and sum(s.round_post for s in engine.instruments.steps) == pytest.approx(updates[0])


def test_draft_cost_chooses_nothing_until_fitted_then_a_k_within_bounds():
    cost = DraftCost(every=4)
    assert cost.choose(0.9, 16, (1e6, 1000), lambda k: (4e8, (k + 1) * 8000), 48) is None
    steps = _steps(0.02, 0.002, 5e-11, 4e-9)
    for i in range(len(steps)):
        cost.refit(steps[: i + 1], i + 1)
    k = cost.choose(0.9, 16, (1e6, 1000), lambda k: (4e8, (k + 1) * 8000), 48)
    assert k is not None and 1 <= k <= 48


def test_acceptance_estimate_follows_the_rounds():
    policy = DraftLengthPolicy()
    st = policy.new_state()
    assert st.acceptance() == 0.5
    for _ in range(5):
        policy.update(st, 8, 8)          # all accepted
    high = st.acceptance()
    policy.update(st, 8, 2)
    assert high > 0.95 and st.acceptance() < high and st.rejections == 1


def test_a_fully_accepted_probe_prices_the_next_round_as_a_probe():
    """From a uniform prior one accepted draft leaves the mean acceptance at 0.67: at 32K of the code model
    (a draft step 41 ms, a full step 57, a verified row 10) no round pays below ~0.95, so a probe's success
    used to end drafting with the backoff doubled. A probe fully accepted prices the next round at the
    optimistic acceptance again and forgets its backoff; a probe with a rejection, or a round priced at
    the mean, does not."""
    policy = DraftLengthPolicy()
    st = policy.new_state()
    st.probing, st.backoff = True, 64
    policy.update(st, 1, 1)
    assert st.probe and not st.probing and st.backoff == 0
    assert st.acceptance() < 0.7 < 0.9 < st.acceptance(optimistic=True)
    st.probe, st.probing, st.backoff = False, True, 64
    policy.update(st, 4, 2)
    assert not st.probe and not st.probing and st.backoff == 64
    policy.update(st, 4, 4)                     # priced at the mean: fully accepted, still no probe
    assert not st.probe


def test_the_backoff_doubles_only_while_rounds_fail_between_fallbacks():
    """Declines with no round between rest on the same evidence: each waits the same cool-down (asking
    again costs a price, not a step); a round that failed since the last decline doubles it (16x at most)."""
    policy = DraftLengthPolicy()
    st = policy.new_state()
    waits = []
    for failed_between in (False, False, True, True, False, True, True, True, True):
        if failed_between:
            st.probing = True
            policy.update(st, 2, 0)
        st.fall_back(policy.cooldown, 1.0)
        waits.append(st.cooldown)
    assert waits == [16, 16, 32, 64, 64, 128, 256, 256, 256] and st.cost_fallbacks == 9
    st.probing = True
    policy.update(st, 3, 3)                     # a probe fully accepted: the backoff starts over
    st.fall_back(policy.cooldown, 1.0)
    assert st.cooldown == 16


def test_one_model_prices_every_row_kind_and_the_offloaded_modes():
    """``CostsAt``: the same terms price a full row, a draft row and a verification chunk (read once,
    r x the pairs); ``predict_offloaded``: the budget limits full, drafts beat full, and P1 (max) beats
    naive (sum) when the link is slow."""
    c = StepCosts(c0=0.01, t_row=0.001, t_seq=0.0005, t_byte=1e-10, t_pair=1e-8)
    at = CostsAt(c, full_row=(1e8, 4000), draft_row=(1.25e7, 500))
    assert at.full == pytest.approx(0.0005 + 0.01 + 4e-5)
    assert at.draft < at.full < at.verify(4) < at.verify(8)
    assert at.verify(1) == pytest.approx(at.full)
    assert c.seconds(3, 2e8, 8000, seqs=2) == pytest.approx(0.01 + 0.003 + 0.001 + 0.02 + 8e-5)
    args = dict(n=8, context=4000, kv_bytes_per_position=25000, link_bytes_per_s=1e9, kept=0.125, window=32,
                acceptance=6.0, draft_len=8.0)
    assert predict_offloaded(c, "full", budget_bytes=2e8, **args) < predict_offloaded(c, "full", budget_bytes=1e12, **args)
    assert predict_offloaded(c, "lossy", budget_bytes=2e8, **args) > predict_offloaded(c, "full", budget_bytes=2e8, **args)
    slow = {**args, "link_bytes_per_s": 1e8}
    assert predict_offloaded(c, "vericache-staggered", budget_bytes=2e8, **slow) > predict_offloaded(
        c, "vericache-naive", budget_bytes=2e8, **slow)
    assert StepCosts(**c.to_dict()) == c


def test_a_measured_weights_curve_prices_the_rows_and_the_rest_is_fitted():
    """Integer matmuls on a CPU grow with rows along no line through one row's cost (the 0.5B code model
    on AVX2: 57 ms at 1 row, 75 at 2, 280 at 16): with the measured curve the fit recovers the other
    terms exactly and prices a 9-row verification as the curve does; a line through the same steps
    misprices it."""
    curve = lambda rows: 0.057 if rows <= 1 else 0.057 + 0.018 * (rows - 1) ** 0.9   # noqa: E731
    true_c0, true_byte, true_pair = 0.004, 5e-11, 4e-9
    steps, t = [], 0.0
    for i in range(30):
        verify = i % 3 == 0
        rows = 2 + i % 15 if verify else 1
        kv, pairs = (1e8 + 1e7 * (i % 5), rows * (2000 + 100 * i)) if verify else (1.3e7 + 1e6 * (i % 4), 256 + 8 * i)
        dt = true_c0 + curve(rows) + kv * true_byte + pairs * true_pair
        steps.append(StepRecord(t, t + dt, "verify" if verify else "draft", 1, rows, kv, pairs))
        t += dt
    fit = StepCosts.fit(steps, curve)
    assert fit.matmuls is curve and fit.usable()
    for got, want in ((fit.c0, true_c0), (fit.t_byte, true_byte), (fit.t_pair, true_pair)):
        assert got == pytest.approx(want, rel=1e-6)
    chunk = (1.2e8, 9 * 3000)
    truth = true_c0 + curve(9) + chunk[0] * true_byte + chunk[1] * true_pair
    assert fit.seconds(9, *chunk) == pytest.approx(truth, rel=1e-6)
    line = StepCosts.fit(steps)
    errors = [abs(line.seconds(rows, *chunk) / (true_c0 + curve(rows) + chunk[0] * true_byte + chunk[1] * true_pair) - 1)
              for rows in (1, 2, 9, 32)]
    assert max(errors) > 0.03   # a line through the same steps misprices some row counts
    cost = DraftCost(calibrate=lambda: Calibration(np.zeros((0, 5)), np.zeros(0), fit))
    cost.refit([], 0)
    assert cost.matmuls is curve and cost.source == "calibrated"     # the engine's own fits take the curve


def test_a_draft_costs_its_step_over_the_drafts_a_step_gives():
    """A draft step that checks a lookup proposal carries more rows and may give several drafts: where
    single-row drafting does not pay, drafts at 1.5 a step of 1.5 rows do (their step's fixed cost and
    weights shared among more drafts); the measured yield is the request's own."""
    from vericache.drafting.round import MIN_YIELD_STEPS, RoundState, draft_step_yield

    costs = StepCosts(c0=0.004, t_byte=1e-9, t_pair=1e-7, matmuls=lambda rows: 0.010 + 0.0005 * rows)
    cost = DraftCost(fitted=costs, source="fitted")
    full_kv = lambda k: (4e6, (k + 1) * 4000)   # noqa: E731 - a chunk reads the full KV once
    draft_row = (0.5e6, 500)
    assert cost.choose(0.8, 1, draft_row, full_kv, 16) == 0
    assert cost.choose(0.8, 1, draft_row, full_kv, 16, draft_yield=(1.5, 1.5)) >= 1
    # more rows for no more drafts only costs more
    assert cost.choose(0.8, 1, draft_row, full_kv, 16, draft_yield=(1.0, 3.0)) == 0
    rs = RoundState()
    assert draft_step_yield(rs, proposed=0) == (1.0, 1.0)            # nothing measured yet
    # ... but a proposal on offer: a step of 1 + 3 rows, its tokens kept at 0.5 each: 1 + .5 + .25 + .125
    assert draft_step_yield(rs, proposed=0, proposal=3, keep=0.5) == pytest.approx((1.875, 4.0))
    rs.draft_steps, rs.drafted = MIN_YIELD_STEPS * 10, MIN_YIELD_STEPS * 15
    assert draft_step_yield(rs, proposed=MIN_YIELD_STEPS * 8) == pytest.approx((1.5, 1.8))


def test_a_round_is_drafted_only_where_it_beats_full_steps_by_the_margin(monkeypatch):
    """The fitted prices carry a few percent of error, so a round must beat plain full steps by more than
    ``MARGIN``: at the acceptances where the best round gains less, full steps; elsewhere the same
    choice as without the margin."""
    from vericache.drafting import cost as cost_module

    cost = DraftCost(fitted=StepCosts(c0=0.001, t_byte=1e-9), source="fitted")   # a full step: 2 ms
    full_row, draft_row = lambda k: (1e6, 0), (0.1e6, 0)                         # noqa: E731
    alphas = [a / 200 for a in range(1, 200)]
    with_margin, margin = [cost.choose(a, 1, draft_row, full_row, 8) for a in alphas], cost_module.MARGIN
    monkeypatch.setattr(cost_module, "MARGIN", 0.0)
    without = [cost.choose(a, 1, draft_row, full_row, 8) for a in alphas]
    marginal = [(a, k) for a, w, k in zip(alphas, with_margin, without) if w != k]
    assert marginal and all(w == 0 for a, w, k in zip(alphas, with_margin, without) if w != k)
    for a, k in marginal:   # the round it declined: faster than full steps, by less than the margin
        gain = expected_tokens(a, k) / (k * 0.0011 + 0.002) / (1 / 0.002)
        assert 1.0 < gain <= 1.0 + margin


def test_draft_cost_chooses_full_steps_where_no_round_pays():
    cost = DraftCost(fitted=StepCosts(c0=0.001, t_byte=1e-9))          # a step's fixed cost plus its bytes
    full_row = lambda k: (1e6, 0)                                       # noqa: E731 - a chunk reads the full KV once
    # a drafter that reads 0.9 of the full KV and is seldom right: a full step (2 ms a token) wins
    assert cost.choose(0.1, 1, (0.9e6, 0), full_row, 8) == 0
    # one that reads a tenth and is mostly right: a round of several drafts wins
    assert cost.choose(0.95, 1, (0.1e6, 0), full_row, 8) >= 4


def test_in_a_batch_a_request_pays_its_share_of_the_weights():
    """A CPU's integer matmuls hardly grow with rows (30 ms at one row, +1 ms a row): alone, a request's
    draft row costs nearly what its full row does and no round pays; among 8 the weights are shared, a
    draft row costs its attention and a round pays. Drafts and verification read bytes only here."""
    costs = StepCosts(t_byte=1e-9, matmuls=lambda rows: 0.030 + 0.001 * (rows - 1))
    full_kv, draft_row = lambda k: (1e7, 0), (1.25e6, 0)   # noqa: E731 - a chunk reads the full KV once
    cost = DraftCost(fitted=costs, source="fitted")
    assert cost.choose(0.8, 1, draft_row, full_kv, 16) == 0
    assert cost.choose(0.8, 8, draft_row, full_kv, 16) >= 2


def _decode_at_fixed_costs(llm, costs: StepCosts, lookup: bool = True) -> tuple[list[int], list[int], dict]:
    """One request of 64 tokens, VeriCache with "auto" draft lengths, its planner deciding on ``costs``
    (fitted, never refitted): (its tokens, full decoding's, its stats)."""
    from vericache import Engine, SamplingParams

    text = "def add(a, b):\n    return a + b\n" * 10
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    full = llm.generate([text], params)[0].token_ids
    engine = Engine(llm.loaded, mode="vericache", compressor="snapkv:ratio=0.25", draft_len="auto", lookup=lookup)
    cost = engine.loop.scheduler.planner.cost
    cost.fitted, cost.source, cost.every = costs, "fitted", 10 ** 9
    rid = engine.add_request(llm.tokenizer.encode(text), params)
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == rid]
    return [t for o in outs for t in o.token_ids], full, outs[-1].stats


def test_a_request_whose_probes_are_accepted_keeps_drafting(llm, monkeypatch):
    """Costs under which a 1-draft probe pays at the prior's optimistic acceptance (0.79) and longer rounds
    only above 0.9 (the code model at 32K: a draft step 41 ms against a full step's 57). This text's drafts
    are all accepted: each probe's success prices the next round as a probe, so the request drafts from
    its first round to its last (no fallback). Broken control: a probe's success forgotten (the next round
    priced at the mean, 0.67 after 1 of 1) falls back to plain full steps after the first probe."""
    from vericache.drafting.round import DraftLengthPolicy

    monkeypatch.setattr(DraftCost, "choose", lambda self, alpha, *a, **kw: 1 if 0.78 < alpha < 0.8 else 4 * (alpha > 0.9))
    tokens, full, stats = _decode_at_fixed_costs(llm, StepCosts(t_row=1.0), lookup=False)
    assert tokens == full and stats["drafted_tokens"] == stats["accepted_tokens"] > 32
    assert stats["cost_fallbacks"] == 0 and stats["full_step_tokens"] <= 1
    real = DraftLengthPolicy.update

    def forgetful(self, st, drafted, accepted):
        st.probing = False
        real(self, st, drafted, accepted)

    monkeypatch.setattr(DraftLengthPolicy, "update", forgetful)
    tokens, full, stats = _decode_at_fixed_costs(llm, StepCosts(t_row=1.0), lookup=False)
    assert tokens == full and stats["cost_fallbacks"] >= 1 and stats["full_step_tokens"] >= 16


def test_a_request_whose_drafts_cannot_pay_decodes_full_steps_and_asks_again(llm):
    """Every row costs the same (a forward of n rows n times one row's): no round can beat a full step,
    not even at the optimistic acceptance a first round is priced at nor with lookup proposals checked in
    a step, so the request drafts nothing (no losing probe rounds: "never slower than full"): 16 full
    steps, asks again (no round ran between: the same evidence, the same 16 steps), again and again: 4
    fallbacks in 63 tokens."""
    tokens, full, stats = _decode_at_fixed_costs(llm, StepCosts(t_row=1.0))
    assert tokens == full                                                  # the same tokens either way
    assert stats["cost_fallbacks"] == 4 and stats["drafted_tokens"] == 0
    assert stats["full_step_tokens"] == 63                                 # the first token came from prefill


def test_a_request_whose_rounds_may_pay_drafts_them(llm):
    """The positive control: where reads decide (a draft row reads a quarter of the KV, a verification
    reads the full KV once for all its rows), rounds pay at the optimistic acceptance: the request drafts."""
    tokens, full, stats = _decode_at_fixed_costs(llm, StepCosts(c0=1e-4, t_byte=1e-9))
    assert tokens == full
    assert stats["drafted_tokens"] > 0 and stats["round_tokens"] > 0
    assert stats["full_step_tokens"] + stats["round_tokens"] == 63


def test_text_that_copies_its_context_is_drafted_from_proposals_the_full_steps_showed_it_follows(llm, monkeypatch):
    """A forward's rows cost little beside its weights (a row 1/10 of a one-row step: the code model on AMX):
    single-row drafts never pay, and a step checking a lookup proposal pays only if most of its tokens
    are kept. The committed output of the plain full steps shows the text follows the proposals (this
    prompt repeats and its continuation copies it), so the next ask prices a proposal step at that keep
    rate and the request drafts (the same tokens). Broken control: without the output's observations
    (the drafter's checks only, none yet) proposals are priced at the prior keep rate (1/2), and the
    request never drafts."""
    from vericache.drafting.lookup import LookupIndex

    rows_cheap = StepCosts(matmuls=lambda rows: 1.0 + 0.1 * (rows - 1))
    tokens, full, stats = _decode_at_fixed_costs(llm, rows_cheap)
    assert tokens == full and stats["drafted_tokens"] > 0 and stats["lookup_proposed_tokens"] > 0
    real = LookupIndex.extend
    monkeypatch.setattr(LookupIndex, "extend", lambda self, tokens, observe_from=None: real(self, tokens))
    tokens, full, stats = _decode_at_fixed_costs(llm, rows_cheap)
    assert tokens == full and stats["drafted_tokens"] == 0


def test_draft_sources_sum_each_way():
    from vericache_lab.report import draft_sources

    stats = [{"rounds": 10, "drafted_tokens": 20, "accepted_tokens": 15, "full_step_tokens": 4, "round_tokens": 30,
              "lookup_proposed_tokens": 9, "lookup_kept_tokens": 4, "guided_swaps": 120},
             {"rounds": 2, "drafted_tokens": 0, "accepted_tokens": 0, "full_step_tokens": 2, "round_tokens": 0}]
    assert draft_sources(stats) == {"acceptance_per_draft": 0.75, "tokens_per_drafted_round": 5.0, "full_step_tokens": 6,
                                    "lookup_kept_of_proposed": "4/9", "guided_swaps_per_round": 20.0}
    assert draft_sources([{"rounds": 3, "full_step_tokens": 3}])["acceptance_per_draft"] is None


def test_a_full_step_counts_as_a_full_step_token_not_a_verification_round():
    from vericache.serving.metrics import Metrics, metrics_sink

    m = Metrics("tiny", "vericache", "snapkv")
    sink = metrics_sink(m)
    sink("round", {"drafted": 0, "accepted": 0})      # a plain full step (a fallback or a cool-down)
    sink("round", {"drafted": 4, "accepted": 3})      # a verified round of drafts
    value = lambda name: m.registry.get_sample_value(name, m.labels)   # noqa: E731
    assert value("vericache_full_step_tokens_total") == 1
    assert value("vericache_spec_decode_num_drafts_total") == 1 and value("vericache_spec_decode_num_draft_tokens_total") == 4


def test_a_collapsed_fit_never_decides_and_the_calibration_stands():
    """Steps too fast for the clock fit every term to 0.0 (seen with ``tiny`` on a quiet Zen 5): such a
    fit prices every choice at nothing, so it never replaces the costs in hand, and alone it decides nothing."""
    instant = [StepRecord(1.0, 1.0, "draft+verify" if i % 3 == 0 else "draft", 8, 8 + i, 1e8 + i * 1e6, 9000 * i)
               for i in range(20)]
    collapsed = StepCosts.fit(instant)
    assert collapsed is not None and collapsed.to_dict() == dict.fromkeys(collapsed.to_dict(), 0.0)
    assert not collapsed.usable() and not StepCosts(c0=float("nan")).usable() and StepCosts(c0=0.01).usable()
    row, chunk = (1e6, 1000), lambda k: (4e8, (k + 1) * 8000)   # noqa: E731
    assert DraftCost(fitted=collapsed).choose(0.9, 8, row, chunk, 16) is None

    prior, calls = StepCosts(c0=0.01, t_row=0.001, t_byte=1e-10, t_pair=1e-8), []
    calibration = Calibration(np.zeros((0, 5)), np.zeros(0), prior)   # its costs only
    cost = DraftCost(every=1, calibrate=lambda: calls.append(1) or calibration)
    assert cost.source == "none"
    cost.refit(instant, len(instant))
    assert cost.fitted is prior and cost.source == "calibrated" and calls == [1]   # the collapsed fit is dropped
    assert cost.choose(0.9, 8, row, chunk, 16) is not None
    true = (0.02, 0.002, 5e-11, 4e-9)
    cost.refit(_steps(*true), 40)                                                  # a real fit replaces the prior
    assert cost.source == "fitted" and calls == [1]
    assert cost.fitted.c0 == pytest.approx(0.02, rel=1e-3) and cost.fitted.t_pair == pytest.approx(4e-9, rel=1e-3)


def test_calibration_times_the_model_itself(llm):
    """``drafting.calibrate``: timed forwards of the real model give usable costs before any step (the
    weights' curve from whole forwards at the short context, attention's shapes at the long one). What
    the prices come to is the fit's (``test_the_calibration_fit_recovers_attention_beyond_the_weights_curve``,
    on known terms): timings on a shared 2-core host are not asserted here (an ordering of two prices
    failed under load)."""
    from vericache.drafting.calibrate import CURVE_ROWS, SHAPES, calibrate

    calibration = calibrate(llm.loaded)
    costs = calibration.costs
    assert costs is not None and costs.usable()
    assert len(calibration.x) == len(calibration.seconds) == len(CURVE_ROWS) + len(SHAPES)
    assert (calibration.seconds > 0).all() and np.isfinite(calibration.seconds).all()
    curve, shapes = calibration.x[: len(CURVE_ROWS)], calibration.x[len(CURVE_ROWS):]
    assert list(curve[:, 1]) == list(CURVE_ROWS) and (curve[:, 0] == 1).all()     # one sequence, 1 .. 64 rows
    assert [(n, n * r) for n, r in SHAPES] == [(int(a), int(b)) for a, b in shapes[:, :2]]
    assert shapes[:, 4].min() > curve[:, 4].max()                                 # attention at the long context


def test_a_calibration_timed_through_a_stall_is_timed_again(llm, monkeypatch):
    """``calibrate``: timings taken through a stall of the host fit no usable costs (replayed here as
    recorded: ``tiny``'s forwards of 32 and 64 rows and at 4096 positions took 0.2-0.5 s against 2-10 ms,
    1 calibration in 60 beside a running eval; the forwards still run, their times are replaced); the
    calibration times its forwards once more and fits the second timings. The control, one attempt, gives
    no costs: without the second timing the stall decides."""
    import vericache.drafting.calibrate as cal

    stalled = [0.00186, 0.00106, 0.00107, 0.00127, 0.00183, 0.488, 0.491, 0.289, 0.227, 0.491]
    quiet = [0.00220, 0.00162, 0.00128, 0.00165, 0.00205, 0.00706, 0.00904, 0.00160, 0.00828, 0.00961]

    def replay(attempts: int):
        timings = iter(stalled + quiet)
        monkeypatch.setattr(cal, "best_seconds", lambda run, repeats: (run(), next(timings))[1])
        return cal.calibrate(llm.loaded, attempts=attempts)

    calibration = replay(2)
    assert calibration.costs is not None and calibration.costs.usable()
    assert list(calibration.seconds) == quiet
    assert replay(1).costs is None
    with pytest.raises(ValueError, match="attempts"):
        cal.calibrate(llm.loaded, attempts=0)


def test_the_calibration_fit_recovers_attention_beyond_the_weights_curve():
    """``fit_calibration`` on forwards made of known terms: a weights curve along no line, a sequence's
    own work, K/V bytes and query-key pairs. The long forwards less the curve's recover t_seq, t_byte and
    t_pair, and the fitted costs price a 17-row chunk at 32K and a decode row at 8K as the terms do.
    Fitting the long forwards against matmuls timed apart, which cost more than the forwards, prices
    attention at nothing (the mistake this fit replaced)."""
    from vericache.drafting.calibrate import CURVE_ROWS, SHAPES, fit_calibration

    weights = lambda rows: 0.030 + 0.012 * (rows - 1) ** 0.8      # noqa: E731
    t_seq, t_byte, t_pair, per_pos = 0.004, 3e-12, 1.2e-6, 4e4
    cost = lambda ctx, rows: (per_pos * (ctx + rows), rows * ctx + rows * (rows + 1) // 2)   # noqa: E731

    def forward(n, rows, ctx):
        kv_bytes, pairs = (n * c for c in cost(ctx, rows))
        return [n, n * rows, kv_bytes, pairs, ctx], weights(n * rows) + n * t_seq + kv_bytes * t_byte + pairs * t_pair

    samples = [forward(1, r, 256) for r in CURVE_ROWS] + [forward(n, r, 4096) for n, r in SHAPES]
    x, y = np.array([s[0] for s in samples], dtype=float), np.array([s[1] for s in samples])
    fit = fit_calibration(x, y, lambda rows: cost(256, rows))
    assert fit.t_seq == pytest.approx(t_seq, rel=0.05) and fit.t_pair == pytest.approx(t_pair, rel=0.05)
    for n, rows, ctx in ((1, 17, 32000), (1, 1, 8000), (4, 1, 8000)):
        (_, _, kv_bytes, pairs, _), truth = forward(n, rows, ctx)
        assert fit.seconds(n * rows, kv_bytes, pairs, n) == pytest.approx(truth, rel=0.05)
    apart = lambda rows: 1.5 * weights(rows)                       # noqa: E731
    long = x[len(CURVE_ROWS):]
    wrong = StepCosts.from_samples(long[:, :4] * [0, 1, 1, 1] + [1, 0, 0, 0], y[len(CURVE_ROWS):], apart)
    assert wrong.t_pair < 0.5 * t_pair


def test_the_first_round_is_priced_before_any_step(llm):
    """With costs from the first step (the calibration), the first rounds, of a batch or of one request,
    are priced at an optimistic acceptance: where even then no round pays they draft nothing (a plain
    full step, not a losing probe round of ``min_len`` nor the policy's start of 8)."""
    from vericache import Engine, SamplingParams

    for n, first in ((2, 0), (1, 0)):
        engine = Engine(llm.loaded, mode="vericache", compressor="snapkv:ratio=0.25", draft_len="auto")
        planner = engine.loop.scheduler.planner
        # every forward costs the same: no round pays
        planner.cost.calibrate = lambda: Calibration(np.zeros((0, 5)), np.zeros(0), StepCosts(c0=1.0))
        for i in range(n):
            engine.add_request(llm.tokenizer.encode(f"def f{i}(x):\n    return x\n" * 8),
                               SamplingParams(max_tokens=24, ignore_eos=True))
        while not engine.instruments.round_log:
            engine.step()
        assert planner.cost.source == "calibrated"
        assert engine.instruments.round_log[0][1] == first
        assert all(r.drafting.policy_state.cost_fallbacks == 1 for r in engine.loop.requests)


def test_engines_over_one_model_share_one_calibration_made_at_load(monkeypatch):
    """A VeriCache engine times its model once when it is built (not in its first request's path), and
    every engine over that model takes the same costs; a full-mode engine times nothing. (The forwards
    are timed for real; their fit is replaced by fixed costs: on a loaded host tiny's timings can fit
    to unusable terms, and what is tested here is who calibrates and who shares, not the fit.)"""
    from vericache import Engine
    from vericache.drafting import calibrate as cal
    from vericache.model.loader import load_model

    real, fixed = cal.calibrate, StepCosts(c0=1e-3, t_row=1e-3, t_byte=1e-9)

    def timed_then_fixed(loaded) -> cal.Calibration:
        timed = real(loaded)
        return cal.Calibration(timed.x, timed.seconds, fixed)

    monkeypatch.setattr(cal, "calibrate", timed_then_fixed)
    loaded = load_model("tiny", device="cpu", dtype="float32")
    Engine(loaded, mode="full")
    assert loaded.calibration == []
    first = Engine(loaded, mode="vericache", draft_len="auto")
    assert len(loaded.calibration) == 1 and loaded.calibration[0].costs.usable()
    second = Engine(loaded, mode="vericache", draft_len="auto")
    for engine in (first, second):
        cost = engine.loop.scheduler.planner.cost
        cost.refit([], 0)
        assert cost.fitted is loaded.calibration[0].costs and cost.source == "calibrated"
    assert len(loaded.calibration) == 1


def test_calibrated_costs_veto_rounds_and_leave_their_length_to_the_policy(llm):
    """Until the engine's own fit, costs from the calibration (random K/V) decide whether rounds pay, in
    a batch and for one request alone: where none pays, plain full steps (no probe round); where rounds
    pay, the policy's length (a probe is cut to the costs' choice only where that is shorter)."""
    from vericache import Engine, SamplingParams

    def second_rounds(n: int, costs: StepCosts) -> list[int]:
        engine = Engine(llm.loaded, mode="vericache", compressor="snapkv:ratio=0.25", draft_len="auto")
        planner = engine.loop.scheduler.planner
        planner.cost.calibrate = lambda: Calibration(np.zeros((0, 5)), np.zeros(0), costs)
        planner.cost.every = 10 ** 9   # no online fit in this test: the calibration's costs throughout
        for i in range(n):
            engine.add_request(llm.tokenizer.encode(f"def f{i}(x):\n    return x\n" * 8),
                               SamplingParams(max_tokens=24, ignore_eos=True))
        while engine.has_unfinished() and len(engine.instruments.round_log) < 2 * n:
            engine.step()
        log = list(engine.instruments.round_log)
        return [next(d for rid, d, *_ in log[n:] if rid == r) if any(x[0] == r for x in log[n:]) else None
                for r in sorted({x[0] for x in log[:n]})]

    same_cost = StepCosts(c0=1.0)                    # every forward costs the same: no round pays
    assert all(d == 0 for d in second_rounds(3, same_cost))     # a batch: full steps
    assert second_rounds(1, same_cost) == [0]                    # one request too
    bytes_bound = StepCosts(c0=1e-6, t_byte=1e-9)   # a step costs the bytes it reads: drafts pay
    assert second_rounds(1, bytes_bound)[0] >= 4                 # the policy's round


def test_nothing_is_timed_under_tritons_interpreter(llm, monkeypatch):
    """The Triton kernels on a CPU run in Triton's interpreter (gpu-check's dry run): a calibration there
    would take minutes and describe no machine, so none is made and the policy decides as before a fit."""
    from dataclasses import replace

    from vericache.drafting import calibrate as cal

    interpreted = replace(llm.loaded, kernels="triton", calibration=[])
    monkeypatch.setattr(cal, "best_seconds", lambda *a: pytest.fail("a forward was timed"))
    assert cal.calibrate(interpreted).costs is None and len(cal.calibrate(interpreted).x) == 0
    assert cal.model_calibration(interpreted).costs is None


def test_rounds_declined_before_the_copying_showed_are_priced_again_once_it_shows(llm, monkeypatch):
    """The first ask comes before the output showed whether the text copies (no keep rate yet): the round
    is declined and the request cools down for 16 full steps. Once 8 output tokens showed it follows the
    proposals, the proposal on offer beats the price of that decline by a draft a step or more
    (``OFFER_GAIN``) and the next full step asks again: the request drafts sooner (fewer tokens from plain
    full steps), the same tokens. Broken control: no early ask (an infinite gain) waits out the cool-down."""
    import vericache.engine.scheduler as scheduler

    rows_cheap = StepCosts(matmuls=lambda rows: 1.0 + 0.1 * (rows - 1))
    tokens, full, asked = _decode_at_fixed_costs(llm, rows_cheap)
    monkeypatch.setattr(scheduler, "OFFER_GAIN", float("inf"))
    waited_tokens, _, waited = _decode_at_fixed_costs(llm, rows_cheap)
    assert tokens == waited_tokens == full
    assert asked["full_step_tokens"] < waited["full_step_tokens"]
    assert asked["drafted_tokens"] > waited["drafted_tokens"]


def test_a_closed_batch_prices_a_request_s_steps_at_what_its_rows_add():
    """Eight requests whose step is mostly the weights (30 ms, +0.5 ms a row), a lookup proposal letting a
    draft step give 4 drafts: with requests queued for admission a round pays (finishing sooner lets one
    in: a step is worth its eighth of the weights); in a closed batch it does not (the others step on
    until their own ends: a step of its own is worth only its row), and one alone is priced at its
    whole step either way."""
    f = StepCosts(t_pair=2e-3 / 8000, matmuls=lambda rows: 0.030 + 0.0005 * rows)
    cost = DraftCost(fitted=f, source="fitted")
    draft_row, full_kv = (0, 1000), lambda k: (0, (k + 1) * 8000)
    args = (0.95, 8, draft_row, full_kv, 8, (4.0, 5.0))
    assert cost.choose(*args, queued=True) >= 1
    assert cost.choose(*args, queued=False) == 0
    alone = (0.95, 1, draft_row, full_kv, 8, (4.0, 5.0))
    assert cost.choose(*alone, queued=False) == cost.choose(*alone, queued=True) >= 1
    # proposals sized the same way: worth checking with a queue, not in a closed batch of this shape
    assert cost.proposal_len(0.95, 8, lambda rows: (0, rows * 1000), 6, queued=True) >= 1


def test_a_closed_batch_prices_the_steps_a_round_falls_behind_at_the_batch_s_end():
    """A closed batch ends with its last request, and a round of single-row drafts takes k + 1 steps for
    E(k) <= k + 1 tokens. Eight requests whose full KV read is most of a row's cost (5 ms, a draft row
    0.65): priced at its rows alone a round pays; the steps it falls behind at a lower acceptance (0.8)
    are steps of its own at the batch's end (a fixed 5 ms and one row's weights), and with no slack (the
    others' outputs as long as its own) that declines it. Where the others have twice its output to go
    the same round costs nothing at the end, and with requests queued the step shares price it as before."""
    f = StepCosts(c0=0.005, t_byte=5e-3 / 8e6, t_pair=0.2e-3 / 8000, matmuls=lambda rows: 0.010 + 0.0005 * rows)
    cost = DraftCost(fitted=f, source="fitted")
    draft_row, full_kv = (1_000_000, 1000), lambda k: (8_000_000, (k + 1) * 8000)
    args = (0.9, 8, draft_row, full_kv, 8)
    assert cost.choose(*args, queued=False, slack=0.0, behind_alpha=0.8) == 0
    assert cost.choose(*args, queued=False, slack=1.0, behind_alpha=0.8) >= 1
    assert cost.choose(*args, queued=True, slack=0.0, behind_alpha=0.8) >= 1


def test_a_short_round_takes_a_draft_step_however_many_drafts_a_step_gives():
    """A request whose draft steps give 4 drafts (lookup proposals) still takes a whole draft step and the
    verification for a 1-draft round: in a closed batch with no slack, 2 steps for E(1) < 2 tokens, the
    step lost priced at the batch's end (counted as a quarter step, this 1-draft probe would pass)."""
    f = StepCosts(c0=0.005, t_byte=5e-3 / 8e6, t_pair=0.2e-3 / 8000, matmuls=lambda rows: 0.010 + 0.0005 * rows)
    cost = DraftCost(fitted=f, source="fitted")
    draft_row, full_kv = (1_000_000, 1000), lambda k: (8_000_000, (k + 1) * 8000)
    args = (0.9, 8, draft_row, full_kv, 1, (4.0, 5.0))
    assert cost.choose(*args, queued=False, slack=0.0, behind_alpha=0.3) == 0
    assert cost.choose(*args, queued=False, slack=1.0, behind_alpha=0.3) == 1


def test_draft_vocabulary_rows_are_fitted_at_the_whole_heads_price_and_their_saving_priced_into_drafts():
    """A draft row on the draft vocabulary's head saves ``vocab_share`` of its part of the weights
    (``StepCosts``): the fit adds it back (steps that saved it fit as the same steps without it, and the
    result keeps it), and a draft is priced that share cheaper: alone, rounds that do not pay on the whole
    head pay on the vocabulary's; in a closed batch a row's part is its margin, and the saving with it."""
    curve = lambda rows: 0.030 + 0.001 * (rows - 1)   # noqa: E731 - the weights' seconds at a row count
    steps = _steps(0.02, 0.0, 5e-11, 4e-9)
    for s in steps:
        s.end += curve(s.rows)   # the weights on the curve
    plain = StepCosts.fit(steps, curve)
    for s in steps:
        if "verify" not in s.kinds:
            s.vocab_rows = s.rows
            s.end -= 0.2 * curve(s.rows)   # the draft rows' logits on the vocabulary's head: a fifth less
    fit = StepCosts.fit(steps, curve, vocab_share=0.2)
    assert fit.to_dict() == pytest.approx(plain.to_dict(), rel=1e-6) and fit.vocab_share == 0.2
    assert StepCosts.fit(steps, curve).to_dict() != pytest.approx(plain.to_dict(), rel=1e-3)   # not added back
    # alone, the weights (30 ms) price a draft row near a full row: no round pays ...
    costs = StepCosts(t_byte=1e-9, matmuls=curve)
    full_kv, draft_row = lambda k: (1e7, 0), (1.25e6, 0)   # noqa: E731 - a chunk reads the full KV once
    assert DraftCost(fitted=costs, source="fitted").choose(0.8, 1, draft_row, full_kv, 16) == 0
    # ... a draft whose head is a quarter of its weights cheaper does
    cheap = DraftCost(fitted=dataclasses.replace(costs, vocab_share=0.25), source="fitted")
    assert cheap.choose(0.8, 1, draft_row, full_kv, 16) >= 1
    # in a closed batch of 8 a row's part of the weights is its margin (1 ms): the share of that changes
    # no choice (priced as a lone row's 7.5 ms, it made every draft look free)
    for alpha in (0.3, 0.5, 0.8):
        assert cheap.choose(alpha, 8, draft_row, full_kv, 16, queued=False) == \
            DraftCost(fitted=costs, source="fitted").choose(alpha, 8, draft_row, full_kv, 16, queued=False)
