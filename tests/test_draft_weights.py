"""Draft weights: int8 copies for draft rows only; every other row reads the exact weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vericache import LLM
from vericache.engine.engine import Engine
from vericache.model.draft_weights import Int8Linear, mixed_linear


def test_int8_linear_is_close_to_the_exact_linear_but_not_equal():
    g = torch.Generator().manual_seed(0)
    w, b, x = torch.randn(96, 64, generator=g), torch.randn(96, generator=g), torch.randn(5, 64, generator=g)
    ref, y = F.linear(x, w, b), Int8Linear(w, b)(x)
    assert y.shape == ref.shape and not torch.equal(y, ref)
    assert (y - ref).norm() / ref.norm() < 0.02


def test_mixed_linear_sends_only_the_first_rows_to_the_draft_weights():
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(32, 16, generator=g), torch.randn(7, 16, generator=g)
    draft = Int8Linear(w)
    out = mixed_linear(x, 3, lambda t: F.linear(t, w), draft)
    assert torch.equal(out[3:], F.linear(x[3:], w)) and torch.equal(out[:3], draft(x[:3]))
    assert torch.equal(mixed_linear(x, 0, lambda t: F.linear(t, w), draft), F.linear(x, w))


def test_draft_rows_read_int8_and_the_rest_the_exact_weights(llm):
    eng = Engine(llm.loaded, draft_weights="int8")
    model = eng.model
    tokens = torch.tensor(llm.tokenizer.encode("def add(a, b):\n    return a + b\n")[:12])
    exact = model(tokens, [0, 0], [6, 6])
    mixed = model(tokens, [0, 0], [6, 6], n_draft=6)
    # the second sequence reads the exact weights: equal up to the matmul's row-count rounding
    # (sgemm over 6 rows instead of 12), far below what the int8 copies change in the first
    exact_err, draft_err = (mixed[6:] - exact[6:]).abs().max(), (mixed[:6] - exact[:6]).abs().max()
    assert exact_err < 1e-3 and draft_err > 100 * exact_err
    assert (mixed[:6].argmax(-1) == exact[:6].argmax(-1)).float().mean() > 0.5


def test_bad_draft_weights_are_refused():
    with pytest.raises(ValueError, match="'int3'"):
        LLM("tiny", draft_weights="int3")
