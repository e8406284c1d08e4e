"""Prompt-lookup proposals (``drafting.lookup``): found where the context repeats, checked by the drafter
in one multi-row step, never changing the drafts (so never the output), priced by the cost model."""

from __future__ import annotations

import pytest
import torch

from vericache import SamplingParams
from vericache.drafting.cost import DraftCost, StepCosts
from vericache.drafting.lookup import Joined, LookupIndex
from vericache.drafting.round import RoundState, add_checked_proposal
from vericache.engine.engine import Engine
from vericache.engine.options import InvalidOption, RequestOptions, resolve_options


def test_the_latest_earlier_occurrence_is_proposed():
    tokens = [5, 6, 7, 1, 2, 5, 6, 7, 3, 4, 9, 5, 6, 7]
    idx = LookupIndex()
    idx.extend(tokens)
    assert idx.propose(tokens, tokens[-3:], 4) == [3, 4, 9, 5]          # after the 2nd [5 6 7], not the 1st
    assert idx.propose(tokens, [0, 6, 7], 2) == [3, 4]                 # no 3-gram [0 6 7]: the 2-gram [6 7]
    assert idx.propose(tokens, [8, 8, 8], 4) == [] and idx.propose(tokens, tokens[-3:], 0) == []
    # the tail itself (at the end, with no next token) is never its own match
    assert LookupIndex().propose([1, 2, 3], [1, 2, 3], 4) == []


def test_extending_as_tokens_commit_equals_indexing_at_once():
    tokens = [int(x) for x in torch.randint(0, 6, (300,), generator=torch.Generator().manual_seed(1))]
    whole, grown = LookupIndex(), LookupIndex()
    whole.extend(tokens)
    for end in range(0, 301, 7):
        grown.extend(tokens[:end])
    grown.extend(tokens)
    assert grown.latest == whole.latest


def test_a_prompt_and_its_output_joined_read_as_one_list_and_index_alike():
    """``Joined``: a request's prompt then output without copying either: every index and slice is the
    joined list's, and an index extended over it (token by token, as output commits) is the list's."""
    prompt = [int(x) for x in torch.randint(0, 5, (40,), generator=torch.Generator().manual_seed(2))]
    output = [3, 1, 4, 1, 5]
    joined, whole = Joined(prompt, output), prompt + output
    assert len(joined) == len(whole) and list(joined) == whole
    assert all(joined[i] == whole[i] for i in range(-len(whole), len(whole)))
    assert all(joined[a:b] == whole[a:b] for a in (-50, -3, 0, 38, 44) for b in (None, -1, 2, 41, 100))
    with pytest.raises(IndexError):
        joined[len(whole)]
    with pytest.raises(ValueError, match="step 1"):
        joined[::2]
    grown, at_once, out = LookupIndex(), LookupIndex(), []
    for t in output:
        out.append(t)
        grown.extend(Joined(prompt, out), observe_from=len(prompt))
    at_once.extend(whole, observe_from=len(prompt))
    assert grown.latest == at_once.latest and (grown.followed, grown.diverged) == (at_once.followed, at_once.diverged)


def test_committed_output_shows_whether_the_text_follows_the_proposals():
    """Each output token (past ``observe_from``) is checked against the proposal the index held just
    before it: followed, or diverged; the prompt's tokens are not counted. Observed in one call or as
    tokens commit, the counts are the same; they move the keep rate the cost model prices proposals at."""
    prompt, output = [1, 2, 3, 4, 5, 1, 2, 3], [4, 5, 9, 8]
    idx = LookupIndex()
    idx.extend(prompt + output, observe_from=len(prompt))
    # 4 after [1 2 3] and 5 after [2 3 4] followed; 9 after [3 4 5] (offered 1) diverged; 8 after [4 5 9]
    # (no 3-gram; the 2-gram [5 9] none) offered nothing
    assert (idx.followed, idx.diverged) == (2, 1) and idx.evidence() == 3
    assert idx.keep_rate() == pytest.approx(3 / 5)
    grown = LookupIndex()
    for end in range(len(prompt), len(prompt + output) + 1):
        grown.extend((prompt + output)[:end], observe_from=len(prompt))
    assert (grown.followed, grown.diverged, grown.latest) == (2, 1, idx.latest)
    plain = LookupIndex()
    plain.extend(prompt + output)                       # no observe_from: nothing observed
    assert (plain.followed, plain.diverged) == (0, 0) and plain.keep_rate() == 0.5


def test_a_checked_proposal_keeps_what_the_drafter_would_draft():
    """Rows [t, p1, p2, p3]: row i's choice is a draft; the next row counts while it equals p(i+1)."""
    from vericache.sampling import Sequence

    seq = Sequence(0, [1, 2], SamplingParams(max_tokens=8), None, ())
    logits = torch.zeros(4, 10)
    for row, choice in enumerate([4, 5, 9, 2]):
        logits[row, choice] = 1.0
    rs = RoundState()
    rs.start(8)
    kept = add_checked_proposal(seq, rs, [4, 5, 6], logits, logits.argmax(-1).tolist())
    assert kept == 2 and rs.drafts == [4, 5, 9]                          # p3 = 6 but the drafter chose 9
    assert (rs.proposed, rs.kept) == (3, 2)
    rs.start(8)
    assert add_checked_proposal(seq, rs, [4, 5, 9], logits, logits.argmax(-1).tolist()) == 3
    assert rs.drafts == [4, 5, 9, 2]                                     # all kept: the last row's own draft too


def test_the_cost_model_prices_a_proposal_step():
    cost = DraftCost()
    assert cost.proposal_len(0.9, 1, lambda rows: (0, 0), 6) == 6       # before the fit: as much as fits
    # rows as dear as steps, but only calibrated (random K/V, a linear row cost): it never sizes a step
    cost.fitted, cost.source = StepCosts(c0=0.0, t_row=0.010), "calibrated"
    assert cost.proposal_len(0.9, 1, lambda rows: (0, 0), 6) == 6
    # fitted to the engine's steps: 10 ms of weights plus 1 ms a row: rows are cheap, a likely proposal pays in full
    cost.fitted, cost.source = StepCosts(c0=0.010, t_row=0.001), "fitted"
    assert cost.proposal_len(0.9, 1, lambda rows: (0, 0), 6) == 6
    # rows as dear as steps (a compute-bound CPU): no proposal pays
    cost.fitted = StepCosts(c0=0.0, t_row=0.010)
    assert cost.proposal_len(0.9, 1, lambda rows: (0, 0), 6) == 0
    assert cost.proposal_len(0.9, 1, lambda rows: (0, 0), 0) == 0
    # a fit that prices steps at nothing (every term 0.0: a quiet, fast machine) sizes nothing: as much as fits
    cost.fitted = StepCosts()
    assert cost.proposal_len(0.9, 1, lambda rows: (0, 0), 6) == 6


def test_the_option_is_checked():
    from vericache.compress.registry import parse_compressor
    from vericache.drafting.round import DraftLengthPolicy
    from vericache.engine.options import ResolvedOptions

    base = ResolvedOptions("vericache", parse_compressor("snapkv"), DraftLengthPolicy(), True)
    assert resolve_options(RequestOptions(lookup=False), base).lookup is False
    assert resolve_options(RequestOptions(), base).lookup is True
    with pytest.raises(InvalidOption, match="'yes'") as exc:
        resolve_options(RequestOptions(lookup="yes"), base)
    assert exc.value.field == "lookup"


@pytest.fixture(scope="module")
def copy_prompt(llm, code_prompts) -> list[int]:
    """A prompt whose answer copies its context: code, then the start of the same code again."""
    code = llm.tokenizer.encode(code_prompts["long"])[:600]
    return code + code[:40]


def test_lookup_changes_how_drafts_are_made_not_which(llm, copy_prompt):
    """Greedy, fixed draft length, exact draft weights: with and without lookup, the same rounds with
    the same drafts and acceptances (a row's bits do not depend on its chunk), the same output as full
    decoding; with lookup, fewer draft steps, and proposals counted."""
    params = SamplingParams(max_tokens=40)
    full = Engine(llm.loaded, mode="full")
    ref = full.generate([full.new_sequence(0, copy_prompt, params)])[0].token_ids
    runs = {}
    for lookup in (False, True):
        eng = Engine(llm.loaded, mode="vericache", compressor="snapkv:ratio=0.1", draft_len=8,
                     draft_weights="fp32", lookup=lookup)
        cost = eng.loop.scheduler.planner.cost       # rows priced cheap, whatever this machine's load
        cost.fitted, cost.every = StepCosts(c0=0.010, t_row=0.0001), 10 ** 9
        out = eng.generate([eng.new_sequence(0, copy_prompt, params)])[0]
        assert out.token_ids == ref
        draft_steps = sum(1 for s in eng.instruments.steps if "draft" in s.kinds)
        runs[lookup] = (out.stats, draft_steps)
    (off, steps_off), (on, steps_on) = runs[False], runs[True]
    for key in ("rounds", "drafted_tokens", "accepted_tokens", "accepted_per_position"):
        assert on[key] == off[key], key
    assert off["lookup_proposed_tokens"] == 0 and on["lookup_kept_tokens"] > 0
    assert on["lookup_kept_tokens"] <= on["lookup_proposed_tokens"]
    assert steps_on < steps_off


def test_lookup_under_sampling_keeps_the_output_distribution_rule(llm, copy_prompt):
    """Sampled drafts from a checked proposal are draws from the drafter's distributions in the order
    single-row drafting draws them: the same seed gives the same text with and without lookup."""
    params = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=7)
    texts = []
    for lookup in (False, True):
        eng = Engine(llm.loaded, mode="vericache", compressor="snapkv:ratio=0.1", draft_len=8,
                     draft_weights="fp32", lookup=lookup)
        texts.append(eng.generate([eng.new_sequence(0, copy_prompt, params)])[0].token_ids)
    assert texts[0] == texts[1]


def test_lookup_counts_are_metrics():
    from vericache.serving.metrics import Metrics, metrics_sink

    m = Metrics("tiny", "vericache", "snapkv")
    sink = metrics_sink(m)
    value = lambda name: m.registry.get_sample_value(name, m.labels)   # noqa: E731
    assert value("vericache_lookup_proposed_tokens_total") == 0
    sink("round", {"drafted": 8, "accepted": 6, "proposed": 5, "kept": 3})
    assert value("vericache_lookup_proposed_tokens_total") == 5 and value("vericache_lookup_kept_tokens_total") == 3
