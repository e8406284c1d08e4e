"""Quantized weights for draft rows: the drafter reads int8 weights, the verifier the exact ones.

A draft is only a proposal that verification checks against the full-KV, full-precision model, so
its matmuls may be approximate: the design card's FP8/INT4 draft engine, here int8 on the CPU.
Each linear layer gets a per-output-channel int8 copy of its weight run through fbgemm's dynamic
int8 linear (``torch.ops.quantized.linear_dynamic``: activations quantized per call), which reads
a quarter of the fp32 bytes (one forward's matmuls, SmolLM2-135M, measured on an Intel Xeon with
AVX-512, 2 threads: 3.1x faster at 1 row, 3.6x at 16, 3.4x at 64). A step's draft rows come first in its packed rows (``StepBatch``), so
every linear runs the first ``n_draft`` rows on the int8 copy and the rest on the exact weight.
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch

DRAFT_WEIGHTS = ("fp32", "int8")


class Int8Linear:
    """y = x W^T + b with W quantized per output channel to int8 (fbgemm); x, y fp32 [N, *]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        w = weight.detach().float().cpu()
        scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-8).double()
        zero = torch.zeros(w.shape[0], dtype=torch.long)
        with warnings.catch_warnings():  # PyTorch deprecates its quantized tensors (torchao succeeds
            warnings.simplefilter("ignore", UserWarning)  # them); fbgemm's kernels measure fastest here
            qw = torch.quantize_per_channel(w, scale, zero, 0, torch.qint8)
        self.packed = torch.ops.quantized.linear_prepack(qw, None if bias is None else bias.detach().float().cpu())
        self.out_features = w.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic(x.float().contiguous(), self.packed, False)


def mixed_linear(x: torch.Tensor, n_draft: int, exact: Callable[[torch.Tensor], torch.Tensor],
                 draft: Int8Linear | None) -> torch.Tensor:
    """x [N, in] -> [N, out]: rows :n_draft through ``draft`` (when there is one), the rest exact."""
    if not n_draft or draft is None:
        return exact(x)
    if n_draft == x.shape[0]:
        return draft(x).to(x.dtype)
    return torch.cat([draft(x[:n_draft]).to(x.dtype), exact(x[n_draft:])])


def check_draft_weights(kind: str) -> str:
    if kind not in DRAFT_WEIGHTS:
        raise ValueError(f"draft_weights must be one of {', '.join(DRAFT_WEIGHTS)}, got {kind!r}")
    return kind
