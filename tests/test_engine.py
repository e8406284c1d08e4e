"""``Engine``, the one door (issue 39): what a front end sees of a request is plain data from ``step``
(tokens, text deltas, the finish, stats) and ``take_events``; bad input changes nothing."""

from __future__ import annotations

import pytest

from vericache import Engine, SamplingParams


@pytest.fixture(scope="module")
def engine(llm) -> Engine:
    return Engine(llm.loaded, mode="vericache", compressor="snapkv:ratio=0.25", draft_len=4)


def test_outputs_carry_the_text_and_every_round_event_its_labels(engine, llm):
    prompt = llm.tokenizer.encode("def add(a, b):\n    return a + b\n" * 10)
    rid = engine.add_request(prompt, SamplingParams(max_tokens=24, ignore_eos=True))
    outs, rounds = [], []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == rid]
        rounds += engine.take_events()["rounds"]
    final = outs[-1]
    assert final.finished and final.finish_reason == "length" and sum(len(o.token_ids) for o in outs) == 24
    ids = [t for o in outs for t in o.token_ids]
    assert "".join(o.text for o in outs) == llm.tokenizer.decode(ids)
    # the last round ended the request in the step that forgot it: its event keeps the request's labels
    assert len(rounds) == final.stats["rounds"] >= 2
    assert all(labels == {"mode": "vericache", "compressor": "snapkv:window=32,ratio=0.25,guided=True,swaps=64,kernel=7"}
               for labels, *_ in rounds), rounds
    assert engine.counts() == (0, 0) and engine.stats()["kv_device"] == 0


def test_bad_input_is_refused_and_changes_nothing(engine):
    before = engine.stats()
    for bad in ([], [10 ** 9], [5] * (engine.max_context + 1)):
        with pytest.raises(ValueError):
            engine.add_request(bad, SamplingParams(max_tokens=4))
    assert engine.stats() == before and not engine.has_unfinished()


def test_an_abort_ends_the_request_at_once_and_frees_its_kv(engine, llm):
    rid = engine.add_request(llm.tokenizer.encode("import os\n" * 20), SamplingParams(max_tokens=50))
    engine.step()
    assert engine.stats()["kv_device"] > 0
    engine.abort(rid)
    (out,) = [o for o in engine.collect() if o.request_id == rid]
    assert out.finished and out.finish_reason == "abort"
    assert engine.stats()["kv_device"] == 0 and not engine.has_unfinished()


def test_describe_names_a_compressor_object_by_its_spec(llm):
    """``describe`` (``/v1/models``, bench JSON) prints the spec of a ``Compressor`` passed as an object (it
    printed a bound method: issue 54)."""
    from vericache.compress.registry import parse_compressor

    comp = parse_compressor("h2o:ratio=0.25")
    described = Engine(llm.loaded, mode="vericache", compressor=comp, draft_len=4).describe()
    assert described["compressor"] == comp.spec() and described["compressor"].startswith("h2o:")
