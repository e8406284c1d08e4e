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
