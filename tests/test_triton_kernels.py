"""The GPU twins in Triton, run on CPU tensors by Triton's interpreter (``TRITON_INTERPRET=1``): against
the CPU op within a stated tolerance, a row alone = the same row in a batch = in a chunk bit for bit
(within the interpreter), bad shapes refused. No GPU needed (issue 33)."""

from __future__ import annotations

import os

import pytest
import torch

from test_linear_op import weight_and_reference
from vericache.kernels.linear_op import LinearOp

FMTS = ["F16", "BF16", "Q8_0", "Q4_1"]
RTOL = 2e-5   # fp32 accumulation in another order than the CPU op's: relative to the output's scale


@pytest.fixture(scope="module")
def tlin():
    """``kernels.triton_linear``; on a machine without CUDA under the interpreter (conftest sets
    ``TRITON_INTERPRET=1`` before triton is imported)."""
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        assert os.environ.get("TRITON_INTERPRET") == "1"
    import vericache.kernels.triton_linear as mod
    return mod


@pytest.mark.parametrize("fmt", FMTS)
def test_triton_linear_matches_the_cpu_op_and_is_batch_invariant(tlin, fmt):
    n, k = 40, 96
    w, ref_w = weight_and_reference(fmt, n, k, seed=3)
    x = torch.randn(37, k, generator=torch.Generator().manual_seed(1))      # 3 row tiles, the last one partial
    y = tlin.linear(x, w)
    cpu = LinearOp()(x, w)
    assert y.shape == (37, n) and y.dtype == torch.float32
    scale = cpu.abs().max().item()
    assert (y - cpu).abs().max().item() <= RTOL * scale, (fmt, (y - cpu).abs().max().item(), scale)
    assert torch.allclose(y, x.double().matmul(ref_w.double().T).float(), rtol=0, atol=RTOL * scale)
    for i in (0, 16, 36):   # a row alone, in a batch of 37, in a chunk of 5: the same bits
        assert torch.equal(tlin.linear(x[i : i + 1], w), y[i : i + 1]), (fmt, i)
        assert torch.equal(tlin.linear(x[max(i - 2, 0) : i + 3], w)[min(i, 2)], y[i]), (fmt, i)


def test_triton_linear_refuses_bad_shapes(tlin):
    w, _ = weight_and_reference("Q8_0", 8, 64)
    with pytest.raises(ValueError, match=r"x must be fp32 \[M, 64\], got torch.float32 \[2, 32\]"):
        tlin.linear(torch.zeros(2, 32), w)
    with pytest.raises(ValueError, match="got torch.float64"):
        tlin.linear(torch.zeros(2, 64, dtype=torch.float64), w)
    q6, _ = weight_and_reference("Q6_K", 8, 256)
    with pytest.raises(ValueError, match="'Q6_K'"):
        tlin.linear(torch.zeros(1, 256), q6)
    assert tlin.linear(torch.zeros(0, 64), w).shape == (0, 8)


def _parts(kind: str, dtype: torch.dtype, t: int, seed: int):
    """One sequence's dense parts for ``t`` query rows: "full" (a causal full cache: a 70-key prefix and
    the chunk's own keys) or "compressed" (40 kept tokens, then a causal residual of 3 + t)."""
    from vericache.kv.packed import KeyPart

    gen = torch.Generator().manual_seed(seed)

    def kv(n):
        return torch.randn(2, n + 5, 64, generator=gen).to(dtype), torch.randn(2, n + 5, 64, generator=gen).to(dtype)
    if kind == "full":
        return [KeyPart(*kv(70 + t), n=70 + t, diag=70)]
    return [KeyPart(*kv(40), n=40), KeyPart(*kv(3 + t), n=3 + t, diag=3)]


@pytest.fixture(scope="module")
def tatt():
    pytest.importorskip("triton")
    import vericache.kernels.triton_attention as mod
    return mod


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_triton_attention_matches_the_cpu_op_and_is_batch_invariant(tatt, dtype):
    """Two sequences (a full cache's chunk of 5, a compressed cache's chunk of 4), GQA 6 over 2 heads:
    against the CPU op within 1e-5 of the output's scale (fp32 softmax in another order and with
    Triton's exp); each sequence alone = packed together, and a row alone = inside its chunk, bit for bit."""
    from vericache.kv.packed import KeyPart, attend_packed

    q = torch.randn(6, 9, 64, generator=torch.Generator().manual_seed(7))
    parts = [_parts("full", dtype, 5, 1), _parts("compressed", dtype, 4, 2)]
    out = tatt.attend_packed(q, [5, 4], parts, 2)
    cpu = attend_packed(q, [5, 4], parts, 2)
    assert out.shape == (9, 6, 64)
    assert (out - cpu).abs().max().item() <= 1e-5 * cpu.abs().max().item()
    assert torch.equal(tatt.attend_packed(q[:, :5], [5], parts[:1], 2), out[:5])
    assert torch.equal(tatt.attend_packed(q[:, 5:], [4], parts[1:], 2), out[5:])
    full = parts[0][0]
    for i in range(5):   # row i of the chunk at 70, alone: the keys up to 70 + i, causal at its own position
        alone = KeyPart(full.k, full.v, n=71 + i, diag=70 + i)
        assert torch.equal(tatt.attend_packed(q[:, i : i + 1], [1], [[alone]], 2), out[i : i + 1]), i


def test_triton_attention_refuses_what_it_cannot_run(tatt):
    from vericache.kv.packed import KeyPart

    q = torch.randn(6, 2, 64)
    good = _parts("full", torch.float32, 2, 0)
    with pytest.raises(ValueError, match="fp32, fp16 or bf16"):
        tatt.attend_packed(q, [2], [[KeyPart(good[0].k.double(), good[0].v, n=72, diag=70)]], 2)
    with pytest.raises(ValueError, match="seq_lens"):
        tatt.attend_packed(q, [1], [good], 2)
    with pytest.raises(ValueError, match="multiple of 4 KV heads"):
        tatt.attend_packed(q, [2], [good], 4)
    from test_quant_kernels import LAYOUTS, _encoded

    kp, vp = _encoded(LAYOUTS["int4"], torch.randn(2, 8, 64), torch.randn(2, 8, 64))
    with pytest.raises(ValueError, match=r"codes \[2, >= 9, w\]"):
        tatt.attend_packed(q, [2], [[KeyPart(kp, vp, n=9, layouts=LAYOUTS["int4"])]], 2)


@pytest.mark.parametrize("name", ["kivi2", "kivi4", "int4", "int8-g16", "fp8"])
@pytest.mark.parametrize("n, t", [(33, 1), (130, 3)])
def test_triton_attention_reads_quantized_parts_as_stored(tatt, name, n, t):
    """Codes and scales as ``kv.quantized`` stores them (token groups, channel groups, fp8), beside a
    causal residual, against the CPU op reading the same; under eviction (kept positions) as well."""
    from test_quant_kernels import LAYOUTS, _encoded
    from vericache.kv.packed import KeyPart, attend_packed

    layouts, g = LAYOUTS[name], torch.Generator().manual_seed(n + t)
    k, v = torch.randn(2, 192, 64, generator=g) * 2, torch.randn(2, 192, 64, generator=g)
    k[:, :, 5] += 8.0
    kp, vp = _encoded(layouts, k, v)
    res = torch.randn(2, 8, 64, generator=g), torch.randn(2, 8, 64, generator=g)
    parts = [KeyPart(kp, vp, n=n, layouts=layouts), KeyPart(*res, n=2 + t, diag=2)]
    q = torch.randn(6, t, 64, generator=g)
    cpu = attend_packed(q, [t], [parts], 2)
    out = tatt.attend_packed(q, [t], [parts], 2)
    assert (out - cpu).abs().max().item() <= 1e-5 * cpu.abs().max().item(), name
    pos = torch.stack([torch.randperm(192, generator=g)[:n].sort().values for _ in range(2)]).int()
    idx = pos.long()[..., None]
    kept = [{"tok": {f: x.gather(1, idx.expand(-1, -1, x.shape[2])) for f, x in side["tok"].items()},
             "grp": side["grp"]} for side in (kp, vp)]
    evicted = [KeyPart(*kept, n=n, layouts=layouts, pos=pos)]
    cpu = attend_packed(q, [t], [evicted], 2)
    assert (tatt.attend_packed(q, [t], [evicted], 2) - cpu).abs().max().item() <= 1e-5 * cpu.abs().max().item()


def test_a_forward_on_the_triton_kernels_is_batch_invariant_and_close_to_the_native_one(tlin, tatt):
    """A small random Llama (2 layers, 4 query heads over 2 KV heads) prepared for kernels="triton" (the
    GPU path's linears and attention, here in the interpreter): a sequence's logits alone, in chunks and
    inside a batch are the same bits, and within 1e-4 of the scale of the native CPU forward's."""
    from types import SimpleNamespace

    from test_linear_op import _logits_three_ways
    from vericache.config import ModelConfig
    from vericache.model.llama import Transformer
    from vericache.model.loader import prepare

    cfg = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    weights = Transformer(cfg).state_dict()
    models = {}
    for kernels in ("triton", "native"):
        m = Transformer(cfg)
        m.load_state_dict(weights)
        models[kernels] = SimpleNamespace(model=prepare(m.eval(), torch.device("cpu"), torch.float32, kernels),
                                          config=cfg, kv_dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 128, (n,), generator=gen) for n in (11, 5, 8)]
    alone, chunked, batched = _logits_three_ways(models["triton"], prompts, 4)
    assert torch.equal(chunked, alone) and torch.equal(batched, alone)
    native = _logits_three_ways(models["native"], prompts, 4)[0]
    assert (alone - native).abs().max().item() <= 1e-4 * native.abs().max().item()


def test_kernel_choice_is_checked(monkeypatch):
    from vericache.model.loader import parse_kernels

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert parse_kernels(None, cpu) == "native" and parse_kernels("torch", cuda) == "torch"
    with pytest.raises(ValueError, match="one of auto, native, triton, torch, got 'cublas'"):
        parse_kernels("cublas", cpu)
    with pytest.raises(ValueError, match="native kernels run on the CPU"):
        parse_kernels("native", cuda)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        parse_kernels("triton", cpu)
    monkeypatch.setenv("VERICACHE_KERNELS", "torch")
    assert parse_kernels(None, cpu) == "torch"
