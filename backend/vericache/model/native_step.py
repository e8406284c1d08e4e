"""A CPU forward step in one native call (``kernels/step.cpp``): embedding, every layer, the head.

The PyTorch module runs a layer as a dozen small torch calls; over 30 layers that Python was most of
a short-context decode step. ``NativeStep`` hands the whole step to C++ instead: the model's stored
weights described once (``StepWeights``), and per step each sequence's cache as plain data
(``LayeredParts``: where its chunk's K/V go and the parts its queries attend, tensors with a leading
layer dim). The native loop runs the module's CPU operations in the module's order (the linear op,
the row ops the module's CPU path also calls, ATen copies into the caches), so a row's bits are the
same whichever path its step takes; the module stays the reference and the path for everything the
native step does not take (training, CUDA, caches that compute their own attention, int8/int4 draft
copies).

Shapes: N packed rows, H hidden, D head dim, L layers.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import replace

import torch

from vericache.kernels import packed_kernels
from vericache.kernels.linear_op import FORMATS, LinearOp, StoredWeight
from vericache.kv.packed import LayeredParts, op_args
from vericache.model.exact_linear import ExactLinear

NATIVE_DRAFT_WEIGHTS = ("fp32", "q8")   # what draft rows may read in the native step


def _linear_spec(lin, op: LinearOp) -> tuple:
    """An ``ExactLinear`` as step.cpp's LinearSpec: formats, stored tensors, row bytes, rows, K, bias,
    whether it runs the q8 numerics, and each weight's packed panels (or None) in the layout of ``op``'s
    build, which reads them (panels another build packed are packed again for it)."""
    ws = [_own_panels(w, op) for w in lin.weights]
    bias = None if lin.bias is None else lin.bias.detach().float().contiguous()
    return ([FORMATS[w.fmt] for w in ws], [w.data for w in ws], [w.row_bytes for w in ws], [w.n for w in ws],
            lin.in_features, bias, lin.numerics == "q8", [w.panels for w in ws])


def _own_panels(w: StoredWeight, op: LinearOp) -> StoredWeight:
    """``w`` with panels in ``op``'s layout: its own where they are (a model's linears are packed by the op
    the step runs), else packed again (a test stepping one model through every build), none where the
    build reads the blocks."""
    if w.panels is None or w.panels.numel() == op.panel_bytes(w):
        return w
    return op.pack(replace(w, panels=None))


class NativeStep:
    """The decoder stack of ``model`` (installed exact linears) as one native call per step."""

    def __init__(self, model, op: LinearOp, score_unit: int = 0) -> None:
        """Each linear runs the numerics its ``ExactLinear`` was installed in (``_linear_spec``); attention
        scores on ``score_unit`` (``linear_op.score_unit``: 0 fp32)."""
        cfg = model.config
        self.op, self.kernels = op, packed_kernels(op.isa)
        self.head_dim = cfg.head_dim
        fp32, q8, dequant = (ctypes.cast(f, ctypes.c_void_p).value
                             for f in (op.lib.vc_linear, op.lib.vc_linear_q8_packed, op.lib.vc_dequant_rows))
        self.weights = self.kernels.StepWeights(q8, fp32, dequant, cfg.rms_norm_eps, cfg.num_attention_heads,
                                                cfg.num_key_value_heads, cfg.head_dim, score_unit)
        for layer in model.model.blocks():
            a, mlp = layer.self_attn, layer.mlp
            norms = [n.weight.detach().float().contiguous() for n in (layer.input_layernorm, layer.post_attention_layernorm)]
            qk = [n.weight.detach().float().contiguous() if n is not None else None for n in (a.q_norm, a.k_norm)]
            self.weights.add_layer(*norms, [_linear_spec(x, op) for x in (a.qkv_exact, a.o_exact, mlp.gate_up_exact,
                                                                       mlp.down_exact)], *qk, a.key_coding)
        # the embedding as stored (a GGUF model's blocks; else the fp32 table as it is) and the head
        embed = model.embed_exact or ExactLinear([StoredWeight.from_tensor(model.model.embed_tokens.weight)], None, op)
        self.weights.set_ends(_linear_spec(embed, op), model.model.norm.weight.detach().float().contiguous(),
                              _linear_spec(model.head_exact, op))

    @staticmethod
    def supports(model) -> bool:
        """Whether ``model``'s layers can run natively: every linear on the op, widths divisible by 16."""
        layers = model.model.blocks()
        return all(l.self_attn.qkv_exact is not None and l.self_attn.o_exact is not None and
                   l.mlp.gate_up_exact is not None and l.mlp.down_exact is not None for l in layers) and \
            model.head_exact is not None and (model.embed_exact is None or len(model.embed_exact.weights) == 1) and \
            model.config.hidden_size % 16 == 0 and model.config.intermediate_size % 16 == 0 and \
            (model.config.num_attention_heads * model.config.head_dim) % 16 == 0

    def plan(self, caches: Sequence, seq_lens: Sequence[int]) -> list[LayeredParts] | None:
        """Each cache's ``LayeredParts``, or None when one cannot describe itself so (the module runs)."""
        plans = []
        for cache, t in zip(caches, seq_lens):
            lp = cache.layered_parts(t)
            if lp is None:
                return None
            plans.append(lp)
        return plans

    def set_draft_head(self, head: ExactLinear | None) -> None:
        """The head draft-vocabulary rows take their logits from (the LM head's first rows:
        ``ExactLinear.first_rows``), or None: every row the whole head."""
        self.weights.set_draft_head(None if head is None else _linear_spec(head, self.op))

    def run(self, tokens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seq_lens: Sequence[int],
            plans: list[LayeredParts], n_draft: int, draft_q8: bool, n_vocab: int = 0,
            logits_index: torch.Tensor | None = None,
            vocab_extra: tuple[ExactLinear, torch.Tensor] | None = None) -> torch.Tensor:
        """tokens: [N] -> logits [M, V] of the rows ``logits_index`` (all when None). Rows :n_draft are
        draft rows: through the q8 linears when ``draft_q8``; rows :n_vocab (of them) take logits from the
        draft head (``set_draft_head``; -inf past its tokens) and, with ``vocab_extra`` (the head's rows for
        some tokens past it, and those tokens' ids), those tokens' too; the head runs the model's numerics
        for every row, as in the module."""
        rows = torch.arange(tokens.shape[0]) if logits_index is None else logits_index.to(torch.int64)
        ints: list[int] = []
        tensors: list[torch.Tensor | None] = []
        for seq, lp in enumerate(plans):
            ints += [lp.slot, len(lp.parts)]
            tensors += [lp.k, lp.v, lp.queries]
            for p in lp.parts:
                i, ts = op_args(seq, p, self.head_dim)
                ints += i
                tensors += ts
        out = self.kernels.forward_step(self.weights, tokens.to(torch.int64).contiguous(), cos.contiguous(),
                                        sin.contiguous(), list(seq_lens), n_draft, draft_q8, n_vocab,
                                        None if vocab_extra is None else _linear_spec(vocab_extra[0], self.op),
                                        None if vocab_extra is None else vocab_extra[1].contiguous(),
                                        rows.contiguous(), ints, tensors)
        for lp, t in zip(plans, seq_lens):
            if lp.observer is not None:
                lp.observer.observed(t)
        return out


def install(model, op: LinearOp, score_unit: int = 0) -> None:
    """Give a CPU model (its exact linears installed) the row ops and, where it fits, the native step
    (each linear in the numerics it was installed in, attention scores on ``score_unit``)."""
    kernels = packed_kernels(op.isa)
    for layer in model.model.blocks():
        layer.input_layernorm.row_op = layer.post_attention_layernorm.row_op = kernels.rms_norm
        layer.mlp.act_op = kernels.silu_mul
        if layer.self_attn.q_norm is not None:
            layer.self_attn.q_norm.row_op = layer.self_attn.k_norm.row_op = kernels.rms_norm
    model.model.norm.row_op = kernels.rms_norm
    model.native = NativeStep(model, op, score_unit) if NativeStep.supports(model) else None
