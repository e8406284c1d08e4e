"""The batch-invariant linear's GPU twin in Triton (issue 33): y[M, N] = x[M, K] @ W[N, K]^T over the weights
as GGUF stores them (F32, F16, BF16, Q8_0, Q4_1), dequantized in registers. ``TritonLinear`` is the
twin of ``kernels.linear_op.LinearOp`` (same call), which ``model.exact_linear`` installs on a CUDA
device (``model.loader``, ``kernels="triton"``).

Batch-invariant by construction, the rule the CPU op follows (``linear.cpp``): one fixed K order per
weight shape (tiles of 32 elements, one GGUF block, taken in order, fp32 accumulation, no split-K);
only the row tiling varies with M, and a row's tile is computed the same whether the other rows of
the tile are requests or padding. So a row alone and the same row inside a batch or a chunk give the
same bits. It runs on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1`` (the interpreter
CI runs it with; set before this module is imported, since ``triton.jit`` reads it then).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TRITON_FORMATS = ("F32", "F16", "BF16", "Q8_0", "Q4_1")
CODES = {"F16": 0, "BF16": 1, "Q8_0": 2, "Q4_1": 3, "F32": 4}
KT = 32                      # the K tile: one quantized block; the order of the tiles is the K order
BLOCK_M, BLOCK_N = 16, 32    # fixed tile shape: only how many tiles there are depends on M


@triton.jit
def _half(lo, hi):
    """Two bytes (little-endian) of an fp16 -> fp32."""
    return ((hi.to(tl.uint16) << 8) | lo.to(tl.uint16)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _weight_tile(w_ptr, row_bytes, offs_n, kb, n_mask, FMT: tl.constexpr):
    """The [BLOCK_N, 32] fp32 weights of rows ``offs_n``, K tile ``kb`` (elements 32 kb .. 32 kb + 31)."""
    j = tl.arange(0, 32)
    row = w_ptr + offs_n[:, None].to(tl.int64) * row_bytes
    mask = n_mask[:, None]
    if FMT == 4:                     # F32: four bytes an element
        at = row + (kb * 32 + j[None, :]) * 4
        b0 = tl.load(at, mask=mask, other=0).to(tl.uint32)
        b1 = tl.load(at + 1, mask=mask, other=0).to(tl.uint32)
        b2 = tl.load(at + 2, mask=mask, other=0).to(tl.uint32)
        b3 = tl.load(at + 3, mask=mask, other=0).to(tl.uint32)
        w = (b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)).to(tl.float32, bitcast=True)
    elif FMT == 0 or FMT == 1:       # F16 / BF16: two bytes an element
        lo = tl.load(row + (kb * 32 + j[None, :]) * 2, mask=mask, other=0)
        hi = tl.load(row + (kb * 32 + j[None, :]) * 2 + 1, mask=mask, other=0)
        bits = (hi.to(tl.uint16) << 8) | lo.to(tl.uint16)
        if FMT == 0:
            w = bits.to(tl.float16, bitcast=True).to(tl.float32)
        else:
            w = (bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    elif FMT == 2:                   # Q8_0: d (fp16), 32 x int8
        blk = row + kb * 34
        d = _half(tl.load(blk, mask=n_mask[:, None], other=0), tl.load(blk + 1, mask=n_mask[:, None], other=0))
        q = tl.load(blk + 2 + j[None, :], mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        w = d * q
    else:                            # Q4_1: d, m (fp16), 16 bytes: element j < 16 the low nibble of byte j
        blk = row + kb * 20
        d = _half(tl.load(blk, mask=mask, other=0), tl.load(blk + 1, mask=mask, other=0))
        m = _half(tl.load(blk + 2, mask=mask, other=0), tl.load(blk + 3, mask=mask, other=0))
        byte = tl.load(blk + 4 + (j[None, :] % 16), mask=mask, other=0).to(tl.int32)
        q = tl.where(j[None, :] < 16, byte & 15, byte >> 4).to(tl.float32)
        w = d * q + m
    return w


@triton.jit
def _linear_kernel(x_ptr, w_ptr, y_ptr, M, N, K, row_bytes, FMT: tl.constexpr, BM: tl.constexpr,
                   BN: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    m_mask, n_mask = offs_m < M, offs_n < N
    j = tl.arange(0, 32)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kb in range(0, K // 32):     # the fixed K order: tile after tile, never split
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * K + kb * 32 + j[None, :], mask=m_mask[:, None], other=0.0)
        w = _weight_tile(w_ptr, row_bytes, offs_n, kb, n_mask, FMT)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)   # per (row, column): 32 products summed in one order
    tl.store(y_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :], acc, mask=m_mask[:, None] & n_mask[None, :])


def linear(x: torch.Tensor, weight) -> torch.Tensor:
    """x [M, K] fp32 @ W^T for a ``kernels.linear_op.StoredWeight`` W [n, K] stored as F16, BF16, Q8_0 or
    Q4_1 (its bytes as GGUF keeps them); returns y [M, n] fp32."""
    fmt, n, k = weight.fmt, weight.n, weight.k
    if fmt not in TRITON_FORMATS:
        raise ValueError(f"the Triton linear takes {', '.join(TRITON_FORMATS)} weights, got {fmt!r}")
    if k % KT:
        raise ValueError(f"k must be a multiple of {KT}, got k={k}")
    if x.dim() != 2 or x.shape[1] != k or x.dtype != torch.float32:
        raise ValueError(f"x must be fp32 [M, {k}], got {x.dtype} {list(x.shape)}")
    if x.device != weight.data.device:
        raise ValueError(f"x on {x.device}, the weights on {weight.data.device}")
    blocks = weight.data.view(torch.uint8).reshape(n, -1)   # dense F16/BF16: their bytes
    x = x.contiguous()
    y = torch.empty(x.shape[0], n, dtype=torch.float32, device=x.device)
    if x.shape[0]:
        grid = (triton.cdiv(x.shape[0], BLOCK_M), triton.cdiv(n, BLOCK_N))
        _linear_kernel[grid](x, blocks, y, x.shape[0], n, k, blocks.shape[1], FMT=CODES[fmt], BM=BLOCK_M, BN=BLOCK_N)
    return y


class TritonLinear:
    """``LinearOp``'s interface on the Triton kernel: ``op(x, weight, bias)`` for x of any float dtype
    and leading dims (computed in fp32, returned in x's dtype)."""
    isa = "triton"

    def __call__(self, x: torch.Tensor, weight, bias: torch.Tensor | None = None, threads: int | None = None) -> torch.Tensor:
        y = linear(x.reshape(-1, x.shape[-1]).float(), weight)
        if bias is not None:
            y = y + bias.float()
        return y.reshape(*x.shape[:-1], weight.n).to(x.dtype)

    draft = __call__   # no separate draft numerics on this path: drafts read the exact weights

    def q8(self, x: torch.Tensor, weight, bias: torch.Tensor | None = None, threads: int | None = None) -> torch.Tensor:
        raise ValueError("numerics='q8' (int8 activations in integer sums) runs on the CPU's LinearOp; "
                         "the Triton kernel computes in fp32")

    def pack(self, weight, threads: int | None = None):
        """The weight as it is: the kernel dequantizes blocks in registers, no panels (``LinearOp.pack``)."""
        return weight

    def dequantize(self, weight, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The weight's rows as fp32 (a stored embedding's rows): on the CPU (the interpreter's dry run)
        through the CPU op; on a GPU the loader keeps embeddings as tensors, so none is asked for."""
        if weight.data.device.type != "cpu":
            raise ValueError("dequantizing stored blocks on the device is not needed (embeddings load as tensors)")
        from vericache.kernels.linear_op import linear_op

        return linear_op().dequantize(weight, rows)
