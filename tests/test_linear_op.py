"""The batch-invariant linear op: the gguf package's values, the same bits whatever shares a call, in
every build (portable, AVX2, AVX-512 where this CPU runs it), and a forward built on it that gives a
sequence the same logits alone, in a batch and in chunks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vericache.kernels.cpu import supported_isas
from vericache.kernels.linear_op import BLOCK, FORMATS, Q8_FORMATS, LinearOp, StoredWeight
from vericache.kv.full import FullKVCache

QUANTIZED = [f for f in FORMATS if BLOCK[f][1] > 1]
DENSE = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


@pytest.fixture(scope="module")
def ops() -> dict[str, LinearOp]:
    """Every build this CPU runs (each compiled here: a few seconds)."""
    return {isa: LinearOp(isa) for isa in supported_isas()}


def random_blocks(fmt: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """n rows of random ``fmt`` blocks (random codes and scale bytes; the fp16 scales set to small
    finite values so the weights look like a layer's)."""
    rng = np.random.default_rng(seed)
    size, elems = BLOCK[fmt]
    raw = rng.integers(0, 256, size=(n, k // elems * size), dtype=np.uint8)
    b = raw.reshape(n, -1, size)

    def halves() -> np.ndarray:
        return rng.normal(0, 0.02, size=b.shape[:2]).astype(np.float16).view(np.uint8).reshape(*b.shape[:2], 2)

    offsets = {"Q6_K": [208], "Q4_1": [0, 2], "Q5_1": [0, 2], "Q4_K": [0, 2], "Q5_K": [0, 2]}.get(fmt, [0])
    for at in offsets:
        b[..., at : at + 2] = halves()
    return raw


def weight_and_reference(fmt: str, n: int, k: int, seed: int = 0) -> tuple[StoredWeight, torch.Tensor]:
    """A stored weight and its values as the ``gguf`` package dequantizes them (fp32 [n, k])."""
    if fmt in DENSE:
        w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).to(DENSE[fmt])
        return StoredWeight.from_tensor(w), w.float()
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    raw = random_blocks(fmt, n, k, seed)
    ref = np.array(dequantize(raw, getattr(GGMLQuantizationType, fmt)), dtype=np.float32).reshape(n, k)
    return StoredWeight(fmt, torch.from_numpy(raw), n, k), torch.from_numpy(ref)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_dequantized_values_are_the_gguf_package_values(ops, fmt):
    w, ref = weight_and_reference(fmt, 24, 512)
    for isa, op in ops.items():
        assert torch.equal(bits(op.dequantize(w)), bits(ref)), isa
        rows = torch.tensor([5, 0, 23, 5])
        assert torch.equal(bits(op.dequantize(w, rows)), bits(ref[rows])), isa


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_a_row_is_the_same_bits_in_every_call_every_thread_count_and_every_build(ops, fmt):
    """Row i of x W^T alone, inside calls of 1-64 rows (every tile remainder), with 1 and 2 threads,
    in every build: one result. And it is x W^T (fp32 accumulation of the gguf values)."""
    n, k = 52, 256 if fmt not in DENSE else 200   # 200: a dense width that is not a multiple of 16
    w, ref = weight_and_reference(fmt, n, k, seed=1)
    bias = torch.randn(n)
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(2))
    first = None
    for isa, op in ops.items():
        full = op(x, w, bias)
        first = full if first is None else first
        assert torch.equal(bits(full), bits(first)), f"{isa} differs from {next(iter(ops))}"
        for m in (1, 2, 3, 4, 5, 7, 16, 17, 33, 63, 64):
            for threads in (1, 2):
                assert torch.equal(bits(op(x[:m], w, bias, threads=threads)), bits(full[:m])), (isa, m, threads)
        for i in (0, 9, 63):   # a row alone, wherever it sat
            assert torch.equal(bits(op(x[i : i + 1], w, bias)), bits(full[i : i + 1])), (isa, i)
    exact = x.double() @ ref.double().T + bias.double()
    assert torch.allclose(first.double(), exact, rtol=1e-4, atol=1e-4)


def test_bad_inputs_get_clear_errors(ops):
    op = next(iter(ops.values()))
    w, _ = weight_and_reference("Q4_1", 8, 64)
    with pytest.raises(ValueError, match=r"x must be \[M, 64\]"):
        op(torch.randn(3, 32), w)
    with pytest.raises(ValueError, match=r"bias must be \[8\]"):
        op(torch.randn(3, 64), w, torch.randn(7))
    with pytest.raises(ValueError, match="unknown weight format 'Q3_X'"):
        StoredWeight("Q3_X", w.data, 8, 64)
    with pytest.raises(ValueError, match="Q4_1 rows need k divisible by 32, got k=48"):
        StoredWeight("Q4_1", torch.zeros(8, 30, dtype=torch.uint8), 8, 48)
    with pytest.raises(ValueError, match="needs 8 rows of 40 bytes"):
        StoredWeight("Q4_1", torch.zeros(8, 41, dtype=torch.uint8), 8, 64)
    with pytest.raises(ValueError, match="row index out of range"):
        op.dequantize(w, torch.tensor([8]))
    with pytest.raises(TypeError, match="2-D fp32/fp16/bf16"):
        StoredWeight.from_tensor(torch.zeros(4, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="cannot stack weights of formats"):
        StoredWeight.cat([w, StoredWeight.from_tensor(torch.zeros(2, 64))])


def _logits_three_ways(loaded, prompts: list[torch.Tensor], chunk: int) -> tuple:
    """Sequence 0's logits: alone in one forward, in chunks of ``chunk``, and inside a batch."""
    model, cfg = loaded.model, loaded.config

    def cache() -> FullKVCache:
        return FullKVCache(cfg, "cpu", loaded.kv_dtype)

    p0 = prompts[0]
    with torch.inference_mode():
        alone = model(p0, [0], [len(p0)], [cache()])
        c, parts = cache(), []
        for s in range(0, len(p0), chunk):
            t = min(chunk, len(p0) - s)
            parts.append(model(p0[s : s + t], [s], [t], [c]))
        order = prompts[1:] + [p0]   # sequence 0 last, after the others' rows
        batched = model(torch.cat(order), [0] * len(order), [len(p) for p in order], [cache() for _ in order])
    return alone, torch.cat(parts), batched[-len(p0) :]


@pytest.mark.parametrize("batch,chunk", [(1, 1), (4, 5), (16, 32)])
def test_the_forward_gives_a_sequence_the_same_logits_alone_in_chunks_and_in_a_batch(llm, batch, chunk):
    gen = torch.Generator().manual_seed(batch)
    vocab = llm.loaded.config.vocab_size
    prompts = [torch.randint(0, vocab, (int(n),), generator=gen) for n in torch.randint(3, 40, (batch,), generator=gen)]
    alone, chunked, batched = _logits_three_ways(llm.loaded, prompts, chunk)
    assert torch.equal(bits(chunked), bits(alone))
    assert torch.equal(bits(batched), bits(alone))


def test_the_real_model_keeps_its_blocks_and_is_batch_invariant(smollm):
    """SmolLM2's matrices stay Q4_1/Q8_0 blocks (about the file's size, not 540 MB of fp32) plus, where
    the build has a panel path, their panels (~1.1-1.3 bytes a code; the VNNI build packs them to
    ~0.75-1.06), and its logits are the same bits alone and batched."""
    from vericache.model.exact_linear import exact_linears, resident_weight_bytes

    model = smollm.loaded.model
    fmts = {lin.weight.fmt for lin in exact_linears(model)}
    assert fmts == {"Q4_1", "Q8_0"}
    assert model.embed_exact is not None and model.embed_exact.weight.data is model.head_exact.weight.data
    codes = sum(lin.weight.n * lin.weight.k for lin in exact_linears(model))
    panels = sum(lin.weight.panels.numel() for lin in exact_linears(model) if lin.weight.panels is not None)
    assert panels == 0 if smollm.loaded.model.head_exact.op.isa == "portable" else 0.7 < panels / codes < 1.4
    assert resident_weight_bytes(model) - panels < 110e6
    vocab = smollm.loaded.config.vocab_size
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, vocab, (n,), generator=gen) for n in (9, 4, 13)]
    alone, chunked, batched = _logits_three_ways(smollm.loaded, prompts, 4)
    assert torch.equal(bits(chunked), bits(alone)) and torch.equal(bits(batched), bits(alone))


def test_empty_calls_return_empty_results(ops):
    """A step whose rows are all drafts hands the exact op zero rows (and the reverse): no read at all."""
    w, _ = weight_and_reference("Q4_1", 8, 64)
    for op in ops.values():
        for fn in (op, op.q8):
            assert fn(torch.empty(0, 64), w).shape == (0, 8)


def q8_reference(x: torch.Tensor, w: StoredWeight) -> torch.Tensor:
    """The q8 numerics' contract (``linear_q8.cpp``'s header) in numpy, written apart from the kernels:
    int8 activations per block of 32, exact integer block sums, then per output one fma chain over the
    blocks in order (float32 products and sums, rounded once per fma as the C code's std::fma)."""
    xs = x.double().numpy().astype(np.float32)
    m, k = xs.shape
    nb = k // 32
    xb = xs.reshape(m, nb, 32)
    amax = np.abs(xb).max(-1)
    dx = (amax / np.float32(127)).astype(np.float32)
    inv = np.where(dx > 0, np.float32(1) / np.where(dx > 0, dx, 1), 0).astype(np.float32)
    a = np.rint((xb * inv[..., None]).astype(np.float32)).astype(np.int64)            # [m, nb, 32]
    sa = a.sum(-1)
    ds = (dx * sa.astype(np.float32)).astype(np.float32)
    raw = w.data.numpy().reshape(w.n, nb, -1)
    d = raw[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)                 # [n, nb]
    if w.fmt == "Q8_0":
        c, wm = raw[..., 2:].view(np.int8).astype(np.int64), None
    elif w.fmt in ("Q4_0", "Q4_1"):
        qs = raw[..., 4:] if w.fmt == "Q4_1" else raw[..., 2:]
        c = np.concatenate([qs & 0x0F, qs >> 4], -1).astype(np.int64) - (8 if w.fmt == "Q4_0" else 0)
        wm = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if w.fmt == "Q4_1" else None
    else:
        raise ValueError(w.fmt)
    s = np.einsum("nbe,mbe->mnb", c, a).astype(np.float32)                              # exact integers
    y = np.zeros((m, w.n), np.float32)
    def fma(p, q, acc):   # one rounding: the product is exact in float64
        return (p.astype(np.float64) * q + acc).astype(np.float32)

    for b in range(nb):
        y = fma(s[:, :, b], (d[None, :, b] * dx[:, None, b]).astype(np.float32), y)
        if wm is not None:
            y = fma(wm[None, :, b], ds[:, None, b], y)
    return torch.from_numpy(y)


@pytest.mark.parametrize("fmt", Q8_FORMATS)
def test_q8_numerics_give_a_row_the_same_bits_in_every_call_thread_count_and_build(ops, fmt):
    """The q8 numerics: row i alone, inside calls of 1-512 rows (the direct few-row path and the panel
    path, its panels decoded in the call or packed once by the build; every remainder a tile of 8 rows
    leaves), 1 and 2 threads, every build this CPU runs: one result, within 2% of x W^T."""
    w, ref = weight_and_reference(fmt, 52, 512, seed=4)
    x = torch.randn(512, 512, generator=torch.Generator().manual_seed(5))
    bias = torch.randn(52)
    packed = {isa: op.pack(w) for isa, op in ops.items()}
    first = None
    for isa, op in ops.items():
        y = op.q8(x, w, bias)
        first = y if first is None else first
        assert torch.equal(bits(y), bits(first)), f"{isa} differs from {next(iter(ops))}"
        for weight in (w, packed[isa]):
            for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 14, 15, 17, 64, 511):   # every tile remainder
                for threads in (1, 2):
                    assert torch.equal(bits(op.q8(x[:m], weight, bias, threads=threads)), bits(y[:m])), (isa, m, threads)
        for i in (0, 9, 300, 511):
            assert torch.equal(bits(op.q8(x[i : i + 1], w, bias)), bits(y[i : i + 1])), (isa, i)
    exact = x @ ref.T
    err = ((first - bias - exact).norm() / exact.norm()).item()
    assert 0 < err < 0.02, err


def test_packed_panels_are_what_many_row_calls_read(ops):
    """A build with a panel path packs a weight's codes once (~0.7-1.3 bytes a code); calls of more than
    three rows read those bytes, so panels that disagree with the blocks change the result (the check
    above would catch a wrong packing); calls of one row read the blocks themselves, except in the VNNI
    build, whose packed panels are the blocks' size and whose tiles read them fastest at every row count."""
    w, _ = weight_and_reference("Q5_0", 32, 256, seed=3)
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(2))
    for isa, op in ops.items():
        p = op.pack(w)
        if isa == "portable":   # its scalar loop reads the blocks: nothing to pack
            assert p.panels is None
            continue
        assert 0.6 < p.panels.numel() / (32 * 256) < 1.4, p.panels.numel()
        broken = StoredWeight(w.fmt, w.data, w.n, w.k, panels=p.panels.clone())
        broken.panels[:64] ^= 0x05                            # a few codes of the first outputs' first block
        assert not torch.equal(bits(op.q8(x, broken)), bits(op.q8(x, w))), isa
        one_row_reads_panels = isa == "avx512vnni"
        assert torch.equal(bits(op.q8(x[:1], broken)), bits(op.q8(x[:1], w))) != one_row_reads_panels, isa
    with pytest.raises(ValueError, match="panels"):
        StoredWeight(w.fmt, w.data, w.n, w.k, panels=torch.zeros(4, dtype=torch.int32))


@pytest.mark.parametrize("fmt", ["Q5_0", "Q4_K", "Q6_K", "Q8_0"])
def test_a_build_reads_only_panels_of_its_own_layout(ops, fmt):
    """The VNNI build keeps its panels near the blocks' size (codes of up to 6 bits packed, the blocks'
    fp16 scales), so another build's panels are refused with a clear error, never read as garbage, and
    it refuses theirs; the portable build reads no panels and ignores them."""
    w, _ = weight_and_reference(fmt, 48, 256, seed=9)
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(4))
    packed = {isa: op.pack(w) for isa, op in ops.items()}
    if "avx512vnni" not in ops:
        pytest.skip("this CPU has no AVX-512 VNNI: every build it runs reads the same panel layout")
    vnni = packed["avx512vnni"]
    assert vnni.panels.numel() < (1.07 if fmt == "Q8_0" else 0.95) * w.n * w.k
    want = ops["avx512vnni"].q8(x, w)
    for isa, op in ops.items():
        if isa in ("portable", "avx512vnni"):
            assert torch.equal(bits(op.q8(x, vnni)), bits(want)), isa
            continue
        with pytest.raises(ValueError, match="layout"):
            op.q8(x, vnni)
        with pytest.raises(ValueError, match="layout"):
            ops["avx512vnni"].q8(x, packed[isa])


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q8_0"])
def test_q8_numerics_are_the_contract_computed_apart(ops, fmt):
    """Every build's q8 output equals the contract computed in numpy, bit for bit: the integer sums
    and the fixed fp32 chain are the whole definition, whichever unit computes them."""
    w, _ = weight_and_reference(fmt, 24, 256, seed=6)
    x = torch.randn(7, 256, generator=torch.Generator().manual_seed(7))
    want = q8_reference(x, w)
    for isa, op in ops.items():
        for rows in (x[:1], x):
            assert torch.equal(bits(op.q8(rows, w)), bits(want[: rows.shape[0]])), isa


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_0", "Q4_1"])
def test_q8_extremes_never_saturate_maddubs(ops, fmt):
    """The largest codes times the largest activations (AVX2's ``maddubs`` sums a pair into a saturating
    int16): weights at their extreme codes (Q8_0: -128 and 127; 4-bit: 0 and 15), activations at
    +-127 (one large value a block makes the others round to +-127 or 0): every build equals the
    contract computed in numpy, where nothing saturates."""
    w, _ = weight_and_reference(fmt, 16, 256, seed=8)
    raw = w.data.numpy().reshape(16, 8, -1)
    codes = slice(2, None) if fmt != "Q4_1" else slice(4, None)
    raw[:8, :, codes] = 0x80 if fmt == "Q8_0" else 0xFF      # -128 / the nibbles 15
    raw[8:, :, codes] = 0x7F if fmt == "Q8_0" else 0x00      # 127 / 0
    x = torch.full((4, 256), -1.0)
    x[1] = 1.0
    x[2, ::2], x[2, 1::2] = 1.0, -1.0
    x[3] = torch.where(torch.arange(256) % 3 == 0, 1.0, -1.0)
    want = q8_reference(x, w)
    for isa, op in ops.items():
        assert torch.equal(bits(op.q8(x, w)), bits(want)), isa
        assert torch.equal(bits(op.q8(x[:1], w)), bits(want[:1])), isa


@pytest.mark.parametrize("fmt", list(DENSE))
def test_q8_numerics_run_float_weights_on_the_fp32_op(ops, fmt):
    w, _ = weight_and_reference(fmt, 20, 64, seed=9)
    x = torch.randn(5, 64)
    for op in ops.values():
        assert torch.equal(op.q8(x, w), op(x, w))
        assert op.numerics("fp32") == op and op.numerics("q8") == op.q8
    with pytest.raises(ValueError, match="numerics must be one of q8, q8qk, fp32, got 'int3'"):
        op.numerics("int3")


def test_a_float_weight_quantizes_to_the_gguf_q8_0_blocks():
    w = torch.randn(12, 64, generator=torch.Generator().manual_seed(3))
    q = StoredWeight.q8_0(w)
    assert (q.fmt, q.n, q.k, q.row_bytes) == ("Q8_0", 12, 64, 68)
    back = LinearOp().dequantize(q)
    assert ((back - w).abs() <= w.abs().amax() / 127).all()
    with pytest.raises(ValueError, match=r"k divisible by 32, got \(4, 48\)"):
        StoredWeight.q8_0(torch.randn(4, 48))


def test_the_amx_build_is_offered_only_where_linux_grants_the_tiles(monkeypatch):
    """AMX tiles need the kernel's leave (arch_prctl): where it is refused the amx build is not offered
    and asking for it is a clear error, so the avx512vnni build runs instead."""
    from vericache.kernels import cpu

    with monkeypatch.context() as refused:
        refused.setattr(cpu, "amx_permitted", lambda: False)
        assert "amx" not in cpu.supported_isas()
        with pytest.raises(RuntimeError, match="AMX"):
            LinearOp("amx")
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx2", "fma", "f16c"}))
    cpu.amx_permitted.cache_clear()
    try:
        assert cpu.amx_permitted() is False        # no tiles on this CPU: nothing asked of the kernel
    finally:
        cpu.amx_permitted.cache_clear()


def test_bench_linear_gives_each_build_its_own_panels():
    """`vericache bench linear` on a GGUF model compares every build on one forward's matmuls: each reads
    panels packed in its own layout (a panel of another build's layout is refused, so one model's
    panels handed to every build would stop the bench), and every build gives the same bits."""
    from vericache_lab.bench.linear import run_linear

    isas = [i for i in supported_isas() if i != "portable"]
    res = run_linear("smollm2-135m", [1, 5], isas=isas, repeats=1, log=lambda *_: None)
    assert res["identical_across_builds"]
    assert {r["contender"] for r in res["rows"]} >= {f"q8-{isa}" for isa in isas}
