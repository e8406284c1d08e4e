"""Draft weights: int8 or int4 copies for draft rows only; every other row reads the exact weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vericache import LLM, SamplingParams
from vericache.engine.config import EXACT_FULL
from vericache.engine.runner import ModelRunner
from vericache.model.draft_weights import Int4Linear, Int8Linear, mixed_linear


@pytest.mark.parametrize("cls, tolerance", [(Int8Linear, 0.02), (Int4Linear, 0.12)])
def test_quantized_linear_is_close_to_the_exact_linear_but_not_equal(cls, tolerance):
    g = torch.Generator().manual_seed(0)
    w, b, x = torch.randn(96, 64, generator=g), torch.randn(96, generator=g), torch.randn(5, 64, generator=g)
    ref, y = F.linear(x, w, b), cls(w, b)(x)
    assert y.shape == ref.shape and y.dtype == torch.float32 and not torch.equal(y, ref)
    assert (y - ref).norm() / ref.norm() < tolerance


def test_int8_copies_keep_7_bit_activations_where_fbgemm_would_saturate():
    """Without VNNI fbgemm's u8 x s8 pair sums saturate int16 (AVX2's vpmaddubsw), so Int8Linear asks
    for 7-bit activations there; forced on here, whatever this CPU has, the error stays in bounds."""
    from vericache.kernels.cpu import cpu_flags

    g = torch.Generator().manual_seed(0)
    w, b, x = torch.randn(96, 64, generator=g), torch.randn(96, generator=g), torch.randn(5, 64, generator=g)
    lin = Int8Linear(w, b)
    assert lin.reduce_range == (not ({"avx512_vnni", "avx_vnni", "amx_int8"} & cpu_flags()))
    lin.reduce_range = True
    ref = F.linear(x, w, b)
    assert (lin(x) - ref).norm() / ref.norm() < 0.03


def test_int4_linear_computes_its_own_dequantized_weight():
    """The kernel's product is x times the weight the codes describe (min-max per 32 inputs), not another."""
    g = torch.Generator().manual_seed(2)
    w, x = torch.randn(64, 96, generator=g), torch.randn(3, 96, generator=g)
    lin = Int4Linear(w)
    wg = w.view(64, 3, 32)
    lo, hi = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)
    scale = ((hi - lo) / 15).clamp_min(1e-8)
    deq = (((wg - lo) / scale).round().clamp(0, 15) * scale + lo).view(64, 96)
    want = x.bfloat16().float() @ deq.t()
    assert (lin(x) - want).norm() / want.norm() < 0.01   # bf16 scales and activations
    assert (lin(x) - x @ w.t()).norm() / (x @ w.t()).norm() > 0.02   # and it is 4-bit, not exact
    with pytest.raises(ValueError, match="100"):
        Int4Linear(torch.randn(8, 100))


def test_mixed_linear_sends_only_the_first_rows_to_the_draft_weights():
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(32, 16, generator=g), torch.randn(7, 16, generator=g)
    draft = Int8Linear(w)
    out = mixed_linear(x, 3, lambda t: F.linear(t, w), draft)
    assert torch.equal(out[3:], F.linear(x[3:], w)) and torch.equal(out[:3], draft(x[:3]))
    assert torch.equal(mixed_linear(x, 0, lambda t: F.linear(t, w), draft), F.linear(x, w))


def test_draft_rows_read_int8_and_the_rest_the_exact_weights(llm):
    runner = ModelRunner(llm.loaded, EXACT_FULL.replace(draft_weights="int8"))
    assert runner.draft_kind(6) == "int8" and runner.draft_kind(0) == "fp32"   # built on the first draft rows
    model = runner.model
    model.quantize_drafts("int8")
    tokens = torch.tensor(llm.tokenizer.encode("def add(a, b):\n    return a + b\n")[:12])
    exact = model(tokens, [0, 0], [6, 6])
    mixed = model(tokens, [0, 0], [6, 6], n_draft=6)
    # the second sequence reads the exact weights: the same bits (the linear op is batch-invariant:
    # 6 rows or 12 in the call), while the int8 copies change the first
    assert torch.equal(mixed[6:], exact[6:])
    assert (mixed[:6] - exact[:6]).abs().max() > 1e-3
    assert (mixed[:6].argmax(-1) == exact[:6].argmax(-1)).float().mean() > 0.5


def test_engines_on_one_model_draft_on_their_own_copies(llm):
    """An int4 engine and an int8 engine share the model; each step's draft rows read its engine's copies."""
    e8, e4 = (ModelRunner(llm.loaded, EXACT_FULL.replace(draft_weights=kind)) for kind in ("int8", "int4"))
    model = e8.model
    tokens = torch.tensor(llm.tokenizer.encode("def add(a, b):\n    return a + b\n")[:6])
    outs = {}
    for kind in ("int8", "int4", "int8"):
        model.quantize_drafts(kind)
        outs.setdefault(kind, []).append(model(tokens, [0], [6], n_draft=6))
    assert torch.equal(outs["int8"][0], outs["int8"][1]) and not torch.equal(outs["int8"][0], outs["int4"][0])
    # (other engines on this shared model may have built their own sets too)
    assert {"int8", "int4"} <= set(model.draft_sets) and e4.draft_weights == "int4"


@pytest.fixture(scope="module")
def smollm_fp32():
    """SmolLM2 in the fp32 numerics (exact dequantization; the session's model runs its default, q8)."""
    from vericache.model.loader import load_model

    return load_model("smollm2-135m", numerics="fp32")


@pytest.mark.parametrize("numerics", ["fp32", "q8"])
def test_q8_drafts_read_the_stored_blocks_without_a_copy(smollm, smollm_fp32, numerics):
    """On the GGUF model q8 draft rows take integer dots on the very blocks the exact rows read: no new
    weight memory; in the fp32 numerics logits close to the exact ones, the exact rows of the same
    forward unchanged; in the q8 numerics the drafts are the verifier's own arithmetic (equal)."""
    from vericache.model.exact_linear import resident_weight_bytes

    loaded = smollm_fp32 if numerics == "fp32" else smollm.loaded   # the default: q8's linears (q8 or q8qk)
    assert loaded.linears_q8 == (numerics == "q8")
    model = loaded.model
    before = resident_weight_bytes(model)
    runner = ModelRunner(loaded, EXACT_FULL.replace(draft_weights="q8"))
    assert runner.draft_kind(3) == "q8"
    model.quantize_drafts("q8")
    try:
        copies, head = model.draft_sets["q8"]
        assert head is None and copies[0][0].exact is model.model.layers[0].self_attn.qkv_exact   # exact head
        tokens = torch.tensor(loaded.tokenizer.encode("def add(a, b):\n    return a + b\n")[:12])
        exact = model(tokens, [0, 0], [6, 6])
        mixed = model(tokens, [0, 0], [6, 6], n_draft=6)
        assert torch.equal(mixed[6:], exact[6:])
        assert torch.equal(mixed[:6], exact[:6]) == loaded.linears_q8
        assert (mixed[:6].argmax(-1) == exact[:6].argmax(-1)).float().mean() >= 0.5
    finally:
        model.quantize_drafts("fp32")
    assert resident_weight_bytes(model) == before


def test_bad_draft_weights_are_refused():
    with pytest.raises(ValueError, match="'int3'"):
        LLM("tiny", draft_weights="int3")


def test_auto_draft_weights_measure_and_pick_per_step(llm):
    """auto: the exact weights and the q8 dots (no copies), timed at engine start; each row count gets
    the kind measured fastest for it (copies other engines built are not candidates)."""
    from vericache.model.draft_weights import DraftChoice

    runner = ModelRunner(llm.loaded, EXACT_FULL.replace(mode="vericache", draft_weights="auto"))
    runner.build_drafts()   # what a serving Engine does at start
    choice = runner.model.draft_choice
    assert set(choice.seconds) >= {"q8", "fp32"} and all(len(v) == len(choice.rows) for v in choice.seconds.values())
    assert all(t > 0 for v in choice.seconds.values() for t in v)
    for n in (1, 3, 16, 64, 200):
        assert runner.draft_kind(n) == min(("q8", "fp32"), key=lambda k: choice.seconds_at(k, n))
    # the choice follows the measurements, whichever they are
    fake = DraftChoice((1, 16), {"int8": [2.0, 3.0], "int4": [1.0, 5.0]})
    assert fake.kind_for(1) == "int4" and fake.kind_for(4) == "int4"          # 1.8 < 2.2 between the two
    assert fake.kind_for(12) == "int8" and fake.kind_for(100) == "int8"
    assert ModelRunner(llm.loaded, EXACT_FULL.replace(draft_weights="fp32")).draft_kind(4) == "fp32"


def test_auto_in_the_q8_numerics_times_the_exact_weights_once():
    """A q8 model's exact rows already run the q8 dots: "auto" builds and times no "q8" set beside them
    (the same op twice), and every draft row runs the exact weights."""
    from vericache.model.loader import load_model

    loaded = load_model("smollm2-135m")   # its own: other tests build sets on the session's model
    runner = ModelRunner(loaded, EXACT_FULL.replace(mode="vericache", draft_weights="auto"))
    assert loaded.linears_q8 and runner.auto_draft_kinds() == ()
    runner.build_drafts()
    assert loaded.model.draft_sets == {} and set(loaded.model.draft_choice.seconds) == {"fp32"}
    assert runner.draft_kind(1) == runner.draft_kind(64) == "fp32"
    q8qk = ModelRunner(load_model("tiny", numerics="q8qk"), EXACT_FULL.replace(mode="vericache", draft_weights="auto"))
    assert "q8" not in q8qk.auto_draft_kinds()                    # q8qk's linears are q8's too


def test_drafts_are_built_at_a_serving_engines_start_and_an_llms_first_draft_step():
    """A server (``Engine``) times its draft weights before any request; the offline ``LLM`` leaves them
    to the first draft step, so a script's first token never waits for them."""
    from vericache.engine.engine import Engine
    from vericache.model.loader import load_model

    llm = LLM("tiny", mode="vericache", draft_weights="auto", draft_len=4)   # a model of its own; rounds whatever the costs
    assert llm.loaded.model.draft_choice is None
    out = llm.generate("def add(a, b):", SamplingParams(max_tokens=12, ignore_eos=True))[0]
    assert out.stats["rounds"] >= 1 and llm.loaded.model.draft_choice is not None
    served = Engine(load_model("tiny"), mode="vericache", draft_weights="auto")
    assert served.loaded.model.draft_choice is not None
