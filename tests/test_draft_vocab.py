"""The draft vocabulary (``model/draft_weights.py``): draft rows take logits for the first n tokens and
their requests' prompts' rare tokens only, on the native step and the module alike; every other row keeps
the whole head. Identity with it: tests/test_identity.py."""

from __future__ import annotations

import re

import pytest
import torch

from vericache.engine.config import DEFAULTS, EngineConfig
from vericache.kv.full import FullKVCache
from vericache.model.draft_weights import DRAFT_VOCAB, draft_vocab_size
from vericache.model.loader import load_model

N = 256   # the test model's draft vocabulary here (of 4,096)


def test_the_draft_vocabulary_size_and_a_prompts_rare_tokens():
    assert draft_vocab_size("auto", 151_936) == DRAFT_VOCAB == 32768   # the code model's 151,936: a quarter
    assert draft_vocab_size("auto", 49_152) is None                     # SmolLM2's: the whole head
    assert draft_vocab_size(0, 151_936) is None and draft_vocab_size(200_000, 151_936) is None
    assert draft_vocab_size(1000, 151_936) == 1000
    for bad in (-1, "all", 2.5, True):
        with pytest.raises(ValueError, match=re.escape(repr(bad))):
            draft_vocab_size(bad, 151_936)
    from vericache.engine.requests import Drafting

    d = Drafting(policy_state=None)
    for ids, n in (([3, 200], N), ([900], None), ([], N)):
        d.take_rare_tokens(ids, n)
        assert d.vocab is None
    d.take_rare_tokens([3, 900, 300, 900, 255, 256], N)
    assert d.vocab.tolist() == [256, 300, 900]                                       # past n, once each, ascending
    d.take_rare_tokens([12, 4000, 300], N)
    assert d.vocab.tolist() == [256, 300, 900, 4000]                                 # the output's joined
    prompt = d.vocab
    d.take_rare_tokens([12], N)
    assert d.vocab is prompt


@pytest.fixture(scope="module")
def loaded():
    """The test model of its own (these tests set its draft vocabulary)."""
    return load_model("tiny", device="cpu", dtype="float32")


def _step(model, caches, tokens, n_draft, n_vocab, extra):
    with torch.inference_mode():
        return model(tokens, [c.length for c in caches], [1, 1], caches, n_draft=n_draft, n_vocab=n_vocab,
                     vocab_extra=extra)


@pytest.mark.parametrize("path", ["native", "module"])
def test_draft_vocabulary_rows_take_the_heads_first_tokens_and_their_extra_ones(loaded, path, monkeypatch):
    """A step of two one-token rows over their full caches, the first a draft-vocabulary row: its logits
    are the whole head's bits below n and at its extra tokens, -inf elsewhere; the second row's are the
    whole head's, as without a draft vocabulary. On the native step and on the module."""
    model, cfg = loaded.model, loaded.config
    if path == "module":
        monkeypatch.setattr(model, "native", None)
    elif model.native is None:
        pytest.skip("no native step on this build")
    gen = torch.Generator().manual_seed(3)
    caches = []
    for length in (40, 25):
        cache = FullKVCache(cfg, "cpu", loaded.kv_dtype, capacity=64, key_codes=loaded.key_codes)
        with torch.inference_mode():
            model(torch.randint(0, cfg.vocab_size, (length,), generator=gen), [0], [length], [cache])
        caches.append(cache)
    tokens, extra = torch.randint(0, cfg.vocab_size, (2,), generator=gen), torch.tensor([300, 1234, 4095])
    lengths = [c.length for c in caches]
    model.set_draft_vocab(None)
    whole = _step(model, caches, tokens, 1, 1, extra)       # no draft vocabulary: the whole head for both
    for c, n in zip(caches, lengths):
        c.begin(n, 0)   # the next step writes the same positions again
    try:
        model.set_draft_vocab(N)
        got = _step(model, caches, tokens, 1, 1, extra)
    finally:
        model.set_draft_vocab(None)
    assert torch.isfinite(whole).all()
    assert torch.equal(got[1], whole[1])                                      # the other row: the whole head's
    assert torch.equal(got[0, :N], whole[0, :N]) and torch.equal(got[0, extra], whole[0, extra])
    rest = torch.ones(cfg.vocab_size, dtype=torch.bool)
    rest[:N], rest[extra] = False, False
    assert torch.isneginf(got[0, rest]).all() and int(rest.sum()) == cfg.vocab_size - N - len(extra)


def test_bad_draft_vocabulary_calls_are_refused(loaded):
    model, cfg = loaded.model, loaded.config
    for bad in (0, cfg.vocab_size + 1, 2.0):
        with pytest.raises(ValueError, match=re.escape(repr(bad))):
            model.set_draft_vocab(bad)
    cache = FullKVCache(cfg, "cpu", loaded.kv_dtype, capacity=8, key_codes=loaded.key_codes)
    with pytest.raises(ValueError, match="n_vocab <= n_draft"):
        with torch.inference_mode():
            model(torch.zeros(2, dtype=torch.long), [0], [2], [cache], n_draft=1, n_vocab=2)
    assert cache.length == 0   # refused before anything was written


def test_the_setting_reaches_the_engine_from_each_way_in():
    """``draft_vocab``: "auto", 0 or a count, from keywords, Triton's parameters and the flag alike; bad
    values name themselves."""
    import argparse

    from vericache.engine.config import add_engine_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert DEFAULTS.draft_vocab == "auto" and EngineConfig.from_parameters({"draft_vocab": "auto"}) == DEFAULTS
    assert EngineConfig.from_parameters({"draft_vocab": "512"}) == DEFAULTS.replace(draft_vocab=512) == \
        EngineConfig.from_args(p.parse_args(["--draft-vocab", "512"]))
    assert EngineConfig.from_args(p.parse_args(["--draft-vocab", "0"])).draft_vocab == 0
    for bad in (-1, "all", True):
        with pytest.raises(ValueError, match=re.escape(repr(bad))):
            EngineConfig(draft_vocab=bad)
