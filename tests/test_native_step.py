"""The native step (a CPU forward step in one call: embedding, every layer, the head;
``model/native_step.py``) gives the PyTorch module's bits: for full caches (fp16 and fp32 KV), compressed ones (kept tokens and quantized
codes), a tee'd prefill, draft rows on the q8 path, in every ISA build; its row ops are the same bits in
every build and close to torch's; bad descriptions are refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vericache.compress.registry import parse_compressor
from vericache.kernels import packed_kernels
from vericache.kernels.cpu import supported_isas
from vericache.kernels.linear_op import LinearOp
from vericache.kv.compressed import CompressedKVCache
from vericache.kv.full import FullKVCache
from vericache.kv.tee import TeeCache
from vericache.model.loader import load_model
from vericache.model.native_step import NativeStep


def _forward(model, native, tokens, starts, lens, caches, n_draft=0):
    saved, model.native = model.native, native
    try:
        with torch.inference_mode():
            return model(tokens, starts, lens, caches, n_draft=n_draft)
    finally:
        model.native = saved


def _three_steps(loaded, native, make_caches, n_draft=0, lens=(7, 30, 12)):
    """A prefill of three sequences (``lens`` tokens), a decode step of one row each, a 4-row chunk
    each: every step's logits and the caches' K/V after them."""
    gen = torch.Generator().manual_seed(5)
    vocab = loaded.config.vocab_size
    caches = make_caches()
    lens, outs = list(lens), []
    toks = torch.randint(0, vocab, (sum(lens),), generator=gen)
    outs.append(_forward(loaded.model, native, toks, [0, 0, 0], lens, caches))
    for step in (1, 4):
        starts = [getattr(c, "full", c).length for c in caches]
        toks = torch.randint(0, vocab, (3 * step,), generator=gen)
        outs.append(_forward(loaded.model, native, toks, starts, [step] * 3, caches, n_draft=n_draft))
    return outs, caches


def _same(a, b):
    outs_a, caches_a = a
    outs_b, caches_b = b
    for x, y in zip(outs_a, outs_b):
        assert torch.equal(x, y), (x - y).abs().max()
    for ca, cb in zip(caches_a, caches_b):
        for name in ("k", "v"):
            full_a = getattr(getattr(ca, "full", ca), name, None)
            if full_a is not None:
                assert torch.equal(full_a, getattr(getattr(cb, "full", cb), name))
        if isinstance(ca, CompressedKVCache):
            assert torch.equal(ca.residual.k, cb.residual.k)
        draft_a, draft_b = getattr(ca, "draft", ca), getattr(cb, "draft", cb)
        if isinstance(draft_a, CompressedKVCache):   # the observation windows
            assert torch.equal(draft_a.queries, draft_b.queries) and draft_a.q_seen == draft_b.q_seen > 0


@pytest.fixture(scope="module")
def fp32_kv():
    return load_model("tiny", device="cpu", dtype="float32", kv_dtype="float32")


@pytest.fixture(scope="module")
def q8_numerics():
    """The test model in the q8 numerics (its linears as Q8_0 blocks times int8 activations)."""
    return load_model("tiny", device="cpu", dtype="float32", numerics="q8")


@pytest.mark.parametrize("kv", ["default", "float32", "default-q8"])
def test_full_caches_native_equals_module(llm, fp32_kv, q8_numerics, kv):
    loaded = {"default": llm.loaded, "float32": fp32_kv, "default-q8": q8_numerics}[kv]
    assert loaded.model.native is not None
    cfg, dt = loaded.config, loaded.kv_dtype

    def caches():
        return [FullKVCache(cfg, "cpu", dt, capacity=8) for _ in range(3)]   # they grow on the way
    _same(_three_steps(loaded, loaded.model.native, caches), _three_steps(loaded, None, caches))


@pytest.mark.parametrize("spec", ["snapkv:ratio=0.25,window=4", "kivi:bits=2", "int4:group=32,window=4"])
def test_compressed_caches_native_equals_module(llm, spec):
    loaded = llm.loaded
    cfg, dt, comp = loaded.config, loaded.kv_dtype, parse_compressor(spec)

    def caches():
        return [CompressedKVCache(comp, cfg, "cpu", dt, capacity=256) for _ in range(3)]

    def run(native):
        outs, cs = _three_steps(loaded, native, caches, lens=(90, 130, 70))
        for c in cs:   # compress what was committed, then one more step reads the store as well
            c.commit(c.length)
            assert c.count > 0
        toks = torch.arange(3) + 11
        outs.append(_forward(loaded.model, native, toks, [c.length for c in cs], [1, 1, 1], cs))
        return outs, cs
    _same(run(loaded.model.native), run(None))


def test_tee_prefill_and_q8_draft_rows_native_equal_module(smollm):
    loaded = smollm.loaded
    cfg, dt, comp = loaded.config, loaded.kv_dtype, parse_compressor("snapkv:ratio=0.25")

    def tees():
        return [TeeCache(FullKVCache(cfg, "cpu", dt, capacity=64), CompressedKVCache(comp, cfg, "cpu", dt, capacity=64))
                for _ in range(3)]
    _same(_three_steps(loaded, loaded.model.native, tees), _three_steps(loaded, None, tees))
    model = loaded.model
    kind = model.draft_weights
    try:
        model.quantize_drafts("q8")

        def fulls():
            return [FullKVCache(cfg, "cpu", dt, capacity=64) for _ in range(3)]
        native = _three_steps(loaded, model.native, fulls, n_draft=1)   # the first sequence's rows draft
        _same(native, _three_steps(loaded, None, fulls, n_draft=1))
        model.quantize_drafts("fp32")
        # q8 drafts are free numerics in the fp32 numerics; in the q8 numerics they are its own arithmetic
        same = torch.equal(native[0][-1][:4], _three_steps(loaded, None, fulls, n_draft=1)[0][-1][:4])
        assert same == loaded.linears_q8
    finally:
        model.quantize_drafts(kind)


@pytest.mark.parametrize("numerics", ["fp32", "q8"])
def test_every_build_gives_the_same_bits(llm, q8_numerics, numerics):
    loaded = llm.loaded if numerics == "fp32" else q8_numerics
    assert loaded.numerics == numerics
    cfg, dt = loaded.config, loaded.kv_dtype

    def caches():
        return [FullKVCache(cfg, "cpu", dt, capacity=64) for _ in range(3)]
    ref = _three_steps(loaded, None, caches)
    for isa in supported_isas():
        _same(_three_steps(loaded, NativeStep(loaded.model, LinearOp(isa)), caches), ref)


def test_row_ops_are_the_same_bits_in_every_build_and_close_to_torch():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 200, generator=gen) * 3          # 200: a last step of 8 past whole 16-lane steps
    w = torch.randn(200, generator=gen)
    gu = torch.randn(5, 2 * 100, generator=gen) * 8
    gu[0, :4] = torch.tensor([0.0, -0.0, 90.0, -90.0])
    ref_norm = packed_kernels("portable").rms_norm(x, w, 1e-5)
    ref_act = packed_kernels("portable").silu_mul(gu)
    for isa in supported_isas():
        k = packed_kernels(isa)
        assert torch.equal(k.rms_norm(x, w, 1e-5), ref_norm), isa
        assert torch.equal(k.silu_mul(gu), ref_act), isa
        assert torch.equal(k.rms_norm(x[2:3], w, 1e-5), ref_norm[2:3])   # a row alone: the same bits
    torch.testing.assert_close(ref_norm, w * F.rms_norm(x, (200,), eps=1e-5), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ref_act, F.silu(gu[:, :100]) * gu[:, 100:], rtol=1e-6, atol=1e-6)


def test_bad_descriptions_are_refused(llm):
    loaded = llm.loaded
    native, cfg = loaded.model.native, loaded.config
    k = native.kernels
    with pytest.raises(RuntimeError, match="4 linears"):
        native.weights.add_layer(torch.ones(cfg.hidden_size), torch.ones(cfg.hidden_size), [])
    cache = FullKVCache(cfg, "cpu", loaded.kv_dtype, capacity=4)
    cache.begin(0, 2)
    plan = native.plan([cache], [2])
    toks, cs = torch.zeros(2, dtype=torch.long), torch.zeros(2, cfg.head_dim)
    with pytest.raises(RuntimeError, match="seq_lens sum to 3"):
        native.run(toks, cs, cs, [3], plan, 0, False)
    with pytest.raises(RuntimeError, match=f"token {cfg.vocab_size} out of"):
        native.run(torch.tensor([0, cfg.vocab_size]), cs, cs, [2], plan, 0, False)
    with pytest.raises(RuntimeError, match="logits_rows must ascend"):
        native.run(toks, cs, cs, [2], plan, 0, False, logits_index=torch.tensor([1, 0]))
    with pytest.raises(RuntimeError, match="rms_norm: fp32"):
        k.rms_norm(cs, torch.ones(3), 1e-5)
    assert cache.length == 2 and not cache.k.any()   # refused before anything was written
