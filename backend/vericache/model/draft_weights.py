"""Quantized weights for draft rows: the drafter reads int8 or int4 weights, the verifier the exact ones.

A draft is only a proposal that verification checks against the full-KV, full-precision model, so
its matmuls may be approximate: the design card's FP8/INT4 draft engine, here on the CPU:
- ``int8``: a per-output-channel int8 copy through fbgemm's dynamic int8 linear
  (``torch.ops.quantized.linear_dynamic``: activations quantized per call), a quarter of the fp32 bytes;
- ``int4``: 4-bit min-max codes in groups of 32 input channels (the GGUF Q4_1 idea) through PyTorch's
  CPU int4 kernel (``torch._weight_int4pack_mm_for_cpu``, bf16 activations), an eighth of the bytes;
- ``q8``: no copy: int8 activations in integer dot products with a GGUF model's own stored blocks
  (``Q8Linear``, ``kernels/linear_q8.cpp``: the q8 numerics' op); on float weights the exact op. The LM head stays exact
  (its argmax near-ties are where int8 activations cost acceptance).
Measured on an Intel Xeon (AVX-512, AMX), 2 threads, SmolLM2-135M's 121 matmuls of one forward
(``python scripts/draft_weights_bench.py``): fp32 28 / 32 / 74 / 136 ms at 1 / 3 / 16 / 64 rows,
int8 12 / 13 / 19 / 44, int4 8 / 12 / 45 / 169: int4 wins for one sequence's drafts, int8 for a
batch's (the int4 kernel's bf16 path has no many-row blocking here).
``auto`` measures that on the machine it runs on (``DraftChoice``, at engine start), beside the exact
weights through the batch-invariant op (``fp32``: on a GGUF model its stored blocks, often the fewest
bytes), and lets each step's draft row count pick the fastest. A step's draft rows come first in its packed rows
(``ModelRunner.execute``), so every linear runs the first ``n_draft`` rows on the draft copy and the rest on
the exact weight.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vericache.timing import best_seconds

DRAFT_WEIGHTS = ("fp32", "q8", "int8", "int4", "auto")


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
        self.in_features, self.out_features = w.shape[1], w.shape[0]
        # Without VNNI fbgemm sums u8 x s8 pairs into saturating int16 (AVX2's vpmaddubsw): 7-bit
        # activations keep the pairs in range (error 0.10 -> 0.015 on an AMD EPYC without AVX-512)
        from vericache.kernels.cpu import cpu_flags

        self.reduce_range = not ({"avx512_vnni", "avx_vnni", "amx_int8"} & cpu_flags())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic(x.float().contiguous(), self.packed, self.reduce_range)


class Int4Linear:
    """y = x W^T + b with W in 4-bit codes, min-max per ``group`` input channels; x, y fp32 [N, *].
    PyTorch's kernel dequantizes (code - 8) * scale + zero, so zero is stored as min + 8 * scale."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, group: int = 32) -> None:
        w = weight.detach().float().cpu()
        n, k = w.shape
        if k % group:
            raise ValueError(f"int4 draft weights need input width divisible by {group}, got {k}")
        wg = w.view(n, k // group, group)
        lo, hi = wg.amin(-1), wg.amax(-1)                                       # [N, K/g]
        scale = ((hi - lo) / 15).clamp_min(1e-8)
        codes = ((wg - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32).view(n, k)
        self.scales_zeros = torch.stack([scale, lo + 8 * scale], -1).transpose(0, 1).contiguous().bfloat16()
        self.packed = torch._convert_weight_to_int4pack_for_cpu(codes, 1)      # [K/g, N, 2] scales beside
        self.bias = None if bias is None else bias.detach().float().cpu()
        self.group, self.in_features, self.out_features = group, k, n

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch._weight_int4pack_mm_for_cpu(x.bfloat16().contiguous(), self.packed, self.group,
                                              self.scales_zeros).float()
        return y if self.bias is None else y + self.bias


class Q8Linear:
    """Draft rows through the linear op's integer dots on the exact linear's own stored blocks
    (``LinearOp.q8``: int8 activations per block of 32 against the integer codes, the fp32 op for
    float weights). No copy: the drafter reads the same bytes the verifier does; in the q8 numerics
    these drafts are the verifier's own arithmetic."""

    def __init__(self, exact) -> None:   # exact: an ``ExactLinear``
        self.exact, self.in_features, self.out_features = exact, exact.in_features, exact.out_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.exact.run(self.exact.op.q8, x)


# The draft vocabulary (FR-Spec, Zhao et al. 2025): a draft row takes logits for the first
# DRAFT_VOCAB tokens only, where the vocabulary is over twice that. A BPE vocabulary numbers its tokens
# in merge order, most frequent first: on the 0.5B code model's HumanEval completions at 8K, 96.7% of
# full decoding's tokens are among its first 32,768 of 151,936 (89.6% among 8,192, 98.9% among 65,536),
# and that head is 22% of the 0.5B's weight bytes a draft step reads (4.4 of ~20 ms, Zen 5). A draft
# is a proposal: verification's full head decides every token, so the output is unchanged.
DRAFT_VOCAB = 32768


def draft_vocab_size(setting: int | str, vocab: int) -> int | None:
    """The tokens draft rows take logits for: the first n token ids, or None for the whole
    vocabulary. ``setting``: "auto" (``DRAFT_VOCAB`` where the vocabulary is over twice it), 0 (the
    whole vocabulary) or n >= 1 (capped at the vocabulary)."""
    if setting == "auto":
        return DRAFT_VOCAB if vocab > 2 * DRAFT_VOCAB else None
    if isinstance(setting, bool) or not isinstance(setting, int) or setting < 0:
        raise ValueError(f"draft_vocab must be 'auto', 0 (the whole vocabulary) or a token count >= 1, got {setting!r}")
    return None if setting == 0 or setting >= vocab else setting


class VocabPrefixHead:
    """A draft head over a vocabulary's first ``n`` tokens: x [M, H] -> logits [M, vocab], ``head``'s
    ([M, n]) below n and -inf past it, so a draft never proposes a token past n (greedy or sampled:
    a sampled draft's distribution is then over the n tokens, which the rejection rule's q is)."""

    def __init__(self, head: Callable[[torch.Tensor], torch.Tensor], n: int, vocab: int,
                 rows: Callable[[torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]) -> None:
        """``rows(ids)``: the head over tokens ``ids`` only (x [M, H] -> [M, len(ids)])."""
        self.head, self.n, self.vocab, self.rows = head, n, vocab, rows

    def __call__(self, x: torch.Tensor, extra: torch.Tensor | None = None) -> torch.Tensor:
        """``extra``: tokens past n these rows take logits for too (``Drafting.vocab``; int64 [E])."""
        out = torch.full((x.shape[0], self.vocab), float("-inf"), dtype=torch.float32, device=x.device)
        out[:, : self.n] = self.head(x).float()
        if extra is not None:
            out[:, extra.to(x.device)] = self.rows(extra)(x).float()
        return out


QUANTIZERS = {"int8": Int8Linear, "int4": Int4Linear}
DraftLinear = Int8Linear | Int4Linear | Q8Linear


def mixed_linear(x: torch.Tensor, n_draft: int, exact: Callable[[torch.Tensor], torch.Tensor],
                 draft: DraftLinear | None) -> torch.Tensor:
    """x [N, in] -> [N, out]: rows :n_draft through ``draft`` (when there is one), the rest exact."""
    if not n_draft or draft is None:
        return exact(x)
    if n_draft == x.shape[0]:
        return draft(x).to(x.dtype)
    return torch.cat([draft(x[:n_draft]).to(x.dtype), exact(x[n_draft:])])


def weight_matrices(model) -> list[torch.Tensor]:
    """Every weight matrix one forward of a ``Transformer`` multiplies by, fused as the engine runs them
    (fp32; a model on the exact op dequantizes its stored weights)."""
    if model.head_exact is not None:
        from vericache.model.exact_linear import exact_linears

        return [lin.dense() for lin in exact_linears(model)]
    out = []
    for layer in model.model.blocks():
        a, mlp = layer.self_attn, layer.mlp
        out += [torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]), a.o_proj.weight,
                torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), mlp.down_proj.weight]
    return [w.detach().float() for w in out + [model.lm_head.weight]]


@dataclass
class DraftChoice:
    """Which quantized copy runs a step's draft rows fastest, by row count: seconds of one forward's
    matmuls per kind at ``rows`` (measured), linearly interpolated between them."""
    rows: tuple[int, ...]
    seconds: dict[str, list[float]]

    @classmethod
    def measure(cls, model, rows: tuple[int, ...] = (1, 4, 16, 64), repeats: int = 3) -> DraftChoice:
        """Time the copies ``model.quantize_drafts`` built (``model.draft_sets``) on random rows."""
        seconds: dict[str, list[float]] = {}
        kinds = {kind: [lin for layer in copies for lin in layer] + [head if head is not None else model.head_exact]
                 for kind, (copies, head) in model.draft_sets.items()}   # no head copy: drafts use the exact one
        if model.head_exact is not None:   # the exact weights through the linear op are a candidate too
            from vericache.model.exact_linear import exact_linears

            kinds["fp32"] = exact_linears(model)
        with torch.inference_mode():
            for kind, lins in kinds.items():
                seconds[kind] = []
                for n in rows:
                    xs = [torch.randn(n, lin.in_features) for lin in lins]
                    seconds[kind].append(best_seconds(lambda: [lin(x) for x, lin in zip(xs, lins)], repeats))
        return cls(rows, seconds)

    def kind_for(self, n_rows: int, kinds: tuple[str, ...] | None = None) -> str:
        """The kind measured fastest at ``n_rows`` among ``kinds`` (default: every measured kind)."""
        return min([k for k in self.seconds if kinds is None or k in kinds], key=lambda k: self.seconds_at(k, n_rows))

    def seconds_at(self, kind: str, n_rows: int) -> float:
        """One forward's matmuls on ``kind`` ("auto": the faster kind) at ``n_rows`` rows."""
        return interpolate_rows(self.rows, self.seconds[self.kind_for(n_rows) if kind == "auto" else kind], n_rows)


def measured_choice(model) -> DraftChoice:
    """The model's ``DraftChoice``, measured again when a copy was built after the last measurement
    (engines sharing one model share the table)."""
    if model.draft_choice is None or not set(model.draft_sets) <= set(model.draft_choice.seconds):
        model.draft_choice = DraftChoice.measure(model)
    return model.draft_choice


def interpolate_rows(xs: tuple[int, ...], ys: list[float] | tuple[float, ...], x: int) -> float:
    """Seconds at ``x`` rows from seconds ``ys`` measured at ``xs``: linear between, proportional to rows
    beyond the last (the draft choice's and the calibration's weights curve)."""
    if x <= xs[0]:
        return ys[0]
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return ys[-1] * x / xs[-1]   # beyond the last measurement: proportional to rows


def check_draft_weights(kind: str) -> str:
    if kind not in DRAFT_WEIGHTS:
        raise ValueError(f"draft_weights must be one of {', '.join(DRAFT_WEIGHTS)}, got {kind!r}")
    return kind
