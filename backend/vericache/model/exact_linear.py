"""Every linear of the exact CPU forward through the batch-invariant op (``kernels/linear_op.py``).

``ExactLinear`` is one weight as stored (GGUF blocks, or an fp32/bf16 tensor as it is) with its op;
``install`` gives a ``Transformer`` one per fused matmul (q/k/v, o, gate/up, down, the LM head) and the
embedding's stored rows, so a row's logits are the same bits whatever else shares its forward. The
``nn.Linear`` modules stay the reference (training, transformers parity, CUDA); for a GGUF model they
hold no data (the blocks are the weights, resident at about the file's size).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from vericache.kernels.linear_op import StoredWeight


class WeightOp(Protocol):
    """What an ``ExactLinear`` runs on: the CPU's ``LinearOp`` or the GPU's ``TritonLinear``. x [M, k] ->
    [M, n] in x's dtype; ``q8``: int8 activations in integer sums with the codes (the CPU op's)."""

    def __call__(self, x: torch.Tensor, weight: StoredWeight, bias: torch.Tensor | None = None,
                 threads: int | None = None) -> torch.Tensor: ...

    def q8(self, x: torch.Tensor, weight: StoredWeight, bias: torch.Tensor | None = None,
           threads: int | None = None) -> torch.Tensor: ...

    def pack(self, weight: StoredWeight, threads: int | None = None) -> StoredWeight: ...

    def dequantize(self, weight: StoredWeight, rows: torch.Tensor | None = None) -> torch.Tensor: ...


@dataclass
class ExactLinear:
    """y[M, n] = x[M, k] W^T (+ bias) over ``weights`` as stored, their rows stacked (one weight, or
    fused projections stored in different formats); x of any float dtype, y in x's dtype."""
    weights: list[StoredWeight]
    bias: torch.Tensor | None
    op: WeightOp
    numerics: str = "fp32"     # "q8": integer dots with the codes (``LinearOp.q8``); "fp32": ``op`` itself

    @property
    def weight(self) -> StoredWeight:
        """The one stored weight (fused projections of one format are one)."""
        if len(self.weights) != 1:
            raise ValueError(f"this linear stacks {len(self.weights)} weights of formats {self.formats}")
        return self.weights[0]

    @property
    def formats(self) -> list[str]:
        return [w.fmt for w in self.weights]

    @property
    def in_features(self) -> int:
        return self.weights[0].k

    @property
    def out_features(self) -> int:
        return sum(w.n for w in self.weights)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.run(self.op.q8 if self.numerics == "q8" else self.op, x)

    def rows(self, ids: torch.Tensor) -> ExactLinear:
        """The same linear over outputs ``ids`` only (int64 [E]; one stored weight, no bias): output j's
        bits are this linear's output ids[j]. Gathered per call (a draft step's few rare tokens), no panels."""
        w = self.weight
        if self.bias is not None:
            raise ValueError("rows: a linear with a bias")
        return ExactLinear([StoredWeight(w.fmt, w.data.index_select(0, ids.to(w.data.device)), ids.numel(), w.k)],
                           None, self.op, self.numerics)

    def first_rows(self, n: int) -> ExactLinear:
        """The same linear over its first ``n`` outputs (one stored weight; rows of a stored weight are
        whole blocks, so a slice is the same codes), with its own panels: output j's bits are this
        linear's output j."""
        w = self.weight
        if not 1 <= n <= w.n:
            raise ValueError(f"first_rows: n must be in [1, {w.n}], got {n}")
        sliced = StoredWeight(w.fmt, w.data[:n], n, w.k)
        return ExactLinear([self.op.pack(sliced)], None if self.bias is None else self.bias[:n], self.op, self.numerics)

    def run(self, fn, x: torch.Tensor) -> torch.Tensor:
        """``fn(x, weight, bias)`` (the op, or its ``draft``) over each stored weight, outputs side by side."""
        if len(self.weights) == 1:
            return fn(x, self.weights[0], self.bias)
        biases = [None] * len(self.weights) if self.bias is None else self.bias.split([w.n for w in self.weights])
        return torch.cat([fn(x, w, b) for w, b in zip(self.weights, biases)], dim=-1)

    def dense(self) -> torch.Tensor:
        """The weight as fp32 [n, k] (what the draft copies quantize)."""
        return torch.cat([self.op.dequantize(w) for w in self.weights])


def _dense(w: torch.Tensor, numerics: str) -> StoredWeight:
    """A module's weight as the op reads it: as it is, or in the q8 numerics as Q8_0 blocks (integer
    codes to meet the int8 activations; k divisible by 32)."""
    if numerics == "q8" and w.shape[1] % 32 == 0:
        return StoredWeight.q8_0(w)
    return StoredWeight.from_tensor(w.detach())


def _weight(stored: dict[str, StoredWeight], name: str, module: nn.Linear, numerics: str) -> StoredWeight:
    return stored[name] if name in stored else _dense(module.weight, numerics)


def _fused(stored: dict[str, StoredWeight], names: list[str], modules: list[nn.Linear],
           fused: torch.Tensor | None, numerics: str) -> list[StoredWeight]:
    """Several projections' rows as one weight: the stored blocks stacked (one weight per run of
    projections in one format), or the modules' fused tensor."""
    if not any(f"{n}.weight" in stored for n in names) and fused is not None:
        return [_dense(fused, numerics)]
    out: list[StoredWeight] = []
    for w in [_weight(stored, f"{n}.weight", m, numerics) for n, m in zip(names, modules)]:
        out[-1:] = [StoredWeight.cat([out[-1], w])] if out and out[-1].fmt == w.fmt else out[-1:] + [w]
    return out


def install(model, op: WeightOp, stored: dict[str, StoredWeight] | None = None,
            numerics: str = "fp32") -> None:
    """Route ``model``'s (a ``Transformer``) linears and embedding through ``op`` in ``numerics``.
    ``stored``: weights as stored under their Hugging Face names (a GGUF model's blocks); the rest are
    read from the modules (in the q8 numerics quantized to Q8_0 blocks once, here)."""
    stored = stored or {}
    q = numerics

    def exact(weights: list[StoredWeight], bias: torch.Tensor | None) -> ExactLinear:
        # each block weight with its panels: verification, prefill and batched rows read them (LinearOp.pack)
        return ExactLinear([op.pack(w) for w in weights], bias, op, q)

    for i, layer in enumerate(model.model.blocks()):
        a, mlp, pre = layer.self_attn, layer.mlp, f"model.layers.{i}."
        qkv = _fused(stored, [f"{pre}self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")],
                     [a.q_proj, a.k_proj, a.v_proj], a.qkv[0] if a.qkv is not None else None, q)
        bias = torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]).detach() if a.q_proj.bias is not None else None
        a.qkv_exact = exact(qkv, bias)
        a.o_exact = exact([_weight(stored, f"{pre}self_attn.o_proj.weight", a.o_proj, q)], None)
        gate_up = _fused(stored, [f"{pre}mlp.gate_proj", f"{pre}mlp.up_proj"], [mlp.gate_proj, mlp.up_proj],
                         mlp.gate_up, q)
        mlp.gate_up_exact = exact(gate_up, None)
        mlp.down_exact = exact([_weight(stored, f"{pre}mlp.down_proj.weight", mlp.down_proj, q)], None)
    embed = stored.get("model.embed_tokens.weight")
    head = stored.get("lm_head.weight", embed if model.config.tie_word_embeddings else None)
    model.head_exact = exact([head if head is not None else _dense(model.lm_head.weight, q)], None)
    model.embed_exact = ExactLinear([embed], None, op, q) if embed is not None else None


def uninstall(model) -> None:
    """Back to the ``nn.Linear`` modules and the embedding (PyTorch's kernels read them)."""
    for layer in model.model.blocks():
        layer.self_attn.qkv_exact = layer.self_attn.o_exact = None
        layer.mlp.gate_up_exact = layer.mlp.down_exact = None
    model.head_exact = model.embed_exact = None


def exact_linears(model) -> list[ExactLinear]:
    """Every ``ExactLinear`` of one forward, in order (per layer q/k/v, o, gate/up, down; then the head)."""
    out = []
    for layer in model.model.blocks():
        out += [layer.self_attn.qkv_exact, layer.self_attn.o_exact, layer.mlp.gate_up_exact, layer.mlp.down_exact]
    out.append(model.head_exact)
    missing = sum(lin is None for lin in out)
    if missing:
        raise ValueError(f"{missing} of the model's linears have no exact op installed (exact_linear.install)")
    return [lin for lin in out if lin is not None]


def resident_weight_bytes(model) -> int:
    """Bytes of weights the model holds: parameters with data, plus stored blocks (and their panels) no
    parameter shares."""
    seen, total = set(), 0
    linears = [] if model.head_exact is None else exact_linears(model)
    linears += [model.embed_exact] if model.embed_exact is not None else []
    tensors = list(model.parameters()) + [w.data for lin in linears for w in lin.weights]
    tensors += [w.panels for lin in linears for w in lin.weights if w.panels is not None]
    for t in tensors:
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if t.numel() and key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total
