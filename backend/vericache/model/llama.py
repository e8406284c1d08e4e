"""A Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) in plain PyTorch.

The forward is *packed*: the tokens of several sequences are concatenated into
one flat batch ``tokens: [N]``; sequence i contributes ``seq_lens[i]`` tokens
at the explicit positions ``starts[i] .. starts[i] + seq_lens[i] - 1``.
Attention is the only place where sequences are kept apart: each sequence's KV cache says what
its queries attend (``cache.parts``), and one ``attend_packed`` call per layer attends them all.
That single seam lets one forward serve a prefill chunk, a one-token decode step and a k-token
verification chunk, over a full cache or a compressed one, with no globals and no hooks.

Shapes: N = total tokens, Hq = query heads, Hkv = KV heads, D = head dim.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from vericache.config import ModelConfig
from vericache.kv.packed import KeyPart, attend_packed
from vericache.kv.protocol import KVCache
from vericache.model.draft_weights import (
    QUANTIZERS,
    DraftChoice,
    DraftLinear,
    VocabPrefixHead,
    check_draft_weights,
    mixed_linear,
    weight_matrices,
)
from vericache.model.exact_linear import ExactLinear
from vericache.model.native_step import NATIVE_DRAFT_WEIGHTS

if TYPE_CHECKING:
    from vericache.model.native_step import NativeStep


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.row_op = None   # the CPU's batch-invariant row op (``native_step.install``)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.row_op is not None and _row_ops_apply(x):
            return self.row_op(x.reshape(-1, x.shape[-1]), self.weight.detach(), self.eps).view(x.shape)
        # Normalise in fp32 as the reference implementations do, then cast back (one fused kernel).
        return self.weight * F.rms_norm(x.float(), x.shape[-1:], eps=self.eps).to(x.dtype)


def _row_ops_apply(x: torch.Tensor) -> bool:
    """Inference on fp32 CPU rows: where the native row ops (``kernels/row_ops.h``) replace torch's."""
    return x.dtype == torch.float32 and x.device.type == "cpu" and not torch.is_grad_enabled()


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [D/2] with linear or llama3 scaling applied."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = cfg.rope_scaling or {}
    if cfg.rope_type == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif cfg.rope_type == "freq_factors":
        inv_freq = inv_freq / torch.tensor(scaling["freq_factors"], dtype=torch.float32)
    elif cfg.rope_type == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(is_mid, mid, scaled)
    return inv_freq


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [H, N, D]; cos, sin: [N, D]. Half-split rotation (the Hugging Face layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        h, b = cfg.hidden_size, cfg.attention_bias
        self.q_proj = nn.Linear(h, self.n_heads * self.head_dim, bias=b)
        self.k_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=b)
        self.v_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=b)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, h, bias=False)
        # Qwen3: each head's query and key RMS-normalised (over D) before RoPE
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.qkv: tuple[torch.Tensor, torch.Tensor | None] | None = None  # fused weights (``fuse``)
        self.qkv_draft: DraftLinear | None = None   # draft rows' weights (``Transformer.quantize_drafts``)
        self.o_draft: DraftLinear | None = None
        self.qkv_exact: ExactLinear | None = None   # the batch-invariant op (``exact_linear.install``)
        self.o_exact: ExactLinear | None = None
        self.kernels = "auto"   # what attend_packed runs on (``loader.parse_kernels``)
        self.score_unit = 0     # its scores: 0 fp32, else integer dots on that unit (``linear_op.score_unit``)
        self.key_coding: torch.Tensor | None = None   # q8qk's key coding [2, Hkv, D] (``model.key_coding``)

    def fuse(self) -> None:
        """One [Hq*D + 2*Hkv*D, hidden] matmul instead of three (inference): q/k/v_proj become views
        of the fused weight, so memory and the state dict are unchanged."""
        projs = (self.q_proj, self.k_proj, self.v_proj)
        if not self.q_proj.weight.numel():
            return   # no data here: the weights are stored blocks (``exact_linear``)
        w = torch.cat([p.weight.detach() for p in projs])
        b = torch.cat([p.bias.detach() for p in projs]) if self.q_proj.bias is not None else None
        at = 0
        for p in projs:
            n = p.weight.shape[0]
            p.weight = nn.Parameter(w[at : at + n], requires_grad=False)
            if b is not None:
                p.bias = nn.Parameter(b[at : at + n], requires_grad=False)
            at += n
        self.qkv = (w, b)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int,
                seq_lens: Sequence[int],
                caches: Sequence[KVCache] | None, n_draft: int = 0) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.project(x, cos, sin, n_draft)
        if caches is None:
            out = self._causal_no_cache(q, k, v, seq_lens).transpose(0, 1)
        else:
            out = self._attend_caches(q, k, v, layer, seq_lens, caches)
        # out: [N, Hq, D] -> [N, Hq*D]
        return mixed_linear(out.reshape(n, -1).to(x.dtype), n_draft, self.o_exact or self.o_proj, self.o_draft)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                n_draft: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [N, hidden] -> q: [Hq, N, D], k, v: [Hkv, N, D], after the norms and RoPE (what attention
        reads); rows :n_draft are drafts (draft weights)."""
        n, dq, dkv = x.shape[0], self.n_heads * self.head_dim, self.n_kv * self.head_dim
        q, k, v = mixed_linear(x, n_draft, self._qkv_exact, self.qkv_draft).split([dq, dkv, dkv], dim=-1)
        q = q.reshape(n, self.n_heads, self.head_dim).transpose(0, 1)
        k = k.reshape(n, self.n_kv, self.head_dim).transpose(0, 1)
        v = v.reshape(n, self.n_kv, self.head_dim).transpose(0, 1)
        # attention (and the KV it stores) runs in cos.dtype: fp32 under bf16 weights on CPU
        q, k, v = q.to(cos.dtype), k.to(cos.dtype), v.to(cos.dtype)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def _qkv_exact(self, x: torch.Tensor) -> torch.Tensor:
        if self.qkv_exact is not None:
            return self.qkv_exact(x)
        if self.qkv is not None:
            return F.linear(x, *self.qkv)
        return torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)

    def _attend_caches(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                       seq_lens: Sequence[int], caches: Sequence[KVCache]) -> torch.Tensor:
        """Every sequence over its cache in one ``attend_packed`` call -> [N, Hq, D]."""
        bounds = list(zip(itertools.accumulate(seq_lens, initial=0), seq_lens))
        if not any(c.computes_attention for c in caches):
            parts = [c.parts(layer, q[:, s : s + t], k[:, s : s + t], v[:, s : s + t]) for c, (s, t) in zip(caches, bounds)]
            return attend_packed(q, seq_lens, parts, self.n_kv, self.kernels, self.score_unit, self.key_coding)
        outs = []  # a cache computing its own attention (KVzip's scoring pass) is in the step
        for c, (s, t) in zip(caches, bounds):
            qs, ks, vs = q[:, s : s + t], k[:, s : s + t], v[:, s : s + t]
            if not c.computes_attention:
                outs.append(attend_packed(qs, [t], [c.parts(layer, qs, ks, vs)], self.n_kv, self.kernels,
                                            self.score_unit, self.key_coding))
            else:
                outs.append(c.attend(layer, qs, ks, vs, self.attend_parts).transpose(0, 1))
        return torch.cat(outs)

    def attend_parts(self, q: torch.Tensor, parts: Sequence[KeyPart], lse: torch.Tensor | None = None,
                     row_lse: torch.Tensor | None = None) -> torch.Tensor:
        """One sequence's q [Hq, T, D] over ``parts`` on this layer's op and numerics -> [T, Hq, D]
        (``kv.packed.PartsAttention``: what a cache computing its own attention runs its parts on)."""
        return attend_packed(q, [q.shape[1]], [parts], self.n_kv, self.kernels, self.score_unit, self.key_coding, lse,
                             row_lse)

    def _causal_no_cache(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         seq_lens: Sequence[int]) -> torch.Tensor:
        """Training / scoring path: each sequence attends causally to itself only."""
        groups = self.n_heads // self.n_kv
        if len(set(seq_lens)) == 1:  # equal lengths: one batched kernel call
            b, t = len(seq_lens), seq_lens[0]
            qb = q.view(self.n_heads, b, t, -1).transpose(0, 1)   # [B, Hq, T, D]
            kb = k.view(self.n_kv, b, t, -1).transpose(0, 1).repeat_interleave(groups, dim=1)
            vb = v.view(self.n_kv, b, t, -1).transpose(0, 1).repeat_interleave(groups, dim=1)
            out = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True)
            return out.transpose(0, 1).reshape(self.n_heads, b * t, -1)
        outs, start = [], 0
        for t in seq_lens:
            sl = slice(start, start + t)
            kk = k[:, sl].repeat_interleave(groups, dim=0)
            vv = v[:, sl].repeat_interleave(groups, dim=0)
            outs.append(F.scaled_dot_product_attention(q[:, sl], kk, vv, is_causal=True))
            start += t
        return torch.cat(outs, dim=1)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up: torch.Tensor | None = None  # fused weights (``fuse``)
        self.gate_up_draft: DraftLinear | None = None   # draft rows' weights
        self.down_draft: DraftLinear | None = None
        self.gate_up_exact: ExactLinear | None = None   # the batch-invariant op
        self.down_exact: ExactLinear | None = None
        self.act_op = None   # SiLU(gate) x up as the CPU's row op (``native_step.install``)

    def fuse(self) -> None:
        """One matmul for gate and up (inference); the two projections become views of it."""
        if not self.gate_proj.weight.numel():
            return
        w = torch.cat([self.gate_proj.weight.detach(), self.up_proj.weight.detach()])
        n = self.gate_proj.weight.shape[0]
        self.gate_proj.weight = nn.Parameter(w[:n], requires_grad=False)
        self.up_proj.weight = nn.Parameter(w[n:], requires_grad=False)
        self.gate_up = w

    def forward(self, x: torch.Tensor, n_draft: int = 0) -> torch.Tensor:
        gate_up = mixed_linear(x, n_draft, self._gate_up_exact, self.gate_up_draft)
        if self.act_op is not None and _row_ops_apply(gate_up):
            act = self.act_op(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.silu(gate) * up
        return mixed_linear(act, n_draft, self.down_exact or self.down_proj, self.down_draft)

    def _gate_up_exact(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_exact is not None:
            return self.gate_up_exact(x)
        if self.gate_up is not None:
            return F.linear(x, self.gate_up)
        return torch.cat([self.gate_proj(x), self.up_proj(x)], dim=-1)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DecoderStack(nn.Module):
    """``model.*`` of the Hugging Face names: the embedding, the layers and the final norm."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        # given its weight, nn.Embedding skips its normal_ init: on the meta device (``load_model`` builds
        # there) that init imports torch._dynamo, 2 s of a first load; a real model (training) still gets it
        embed = torch.empty(cfg.vocab_size, cfg.hidden_size)
        if not embed.is_meta:
            nn.init.normal_(embed)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=embed)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def blocks(self) -> Sequence[DecoderLayer]:
        """The layers in order, typed (a ``ModuleList`` yields plain modules); the list itself, no copy (the
        module path's forward asks for it every step)."""
        return cast("Sequence[DecoderLayer]", self.layers)


class Transformer(nn.Module):
    """Parameter names follow Hugging Face (``model.layers.0.self_attn.q_proj``) so checkpoints load as-is."""

    inv_freq: torch.Tensor   # [D/2], a buffer (registered in __init__)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderStack(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        # dtype of attention and of the KV caches; None = the weights' dtype. On CPU bf16 weights
        # run on AMX while attention stays fp32 (this CPU's bf16 attention kernels are ~10x slower).
        self.attn_dtype: torch.dtype | None = None
        self.draft_weights = "fp32"                      # the draft copies draft rows read (``quantize_drafts``)
        self.draft_sets: dict[str, tuple] = {}           # kind -> (per-layer copies, lm_head copy)
        self.draft_choice: DraftChoice | None = None     # once measured ("auto")
        self.lm_head_draft: DraftLinear | None = None
        self.draft_vocab: int | None = None             # drafts' logits: the first n tokens (``set_draft_vocab``)
        self.vocab_head: VocabPrefixHead | None = None   # their head off the native step
        self.first_rows: dict[int, ExactLinear] = {}     # n -> the head's first n rows (with panels)
        self.head_exact: ExactLinear | None = None      # the batch-invariant op (``exact_linear.install``)
        self.embed_exact: ExactLinear | None = None     # stored embedding rows (a GGUF model's)
        self.native: NativeStep | None = None          # the whole CPU step in one native call (``native_step``)

    def fuse_projections(self) -> None:
        """Fuse q/k/v and gate/up matmuls (inference only: the fused weights are not trained)."""
        for layer in self.model.blocks():
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def quantize_drafts(self, kind: str = "int8") -> None:
        """Make the ``n_draft`` rows of a forward read ``kind`` copies of every linear layer (int8 or
        int4, built once per kind and kept; "q8": integer dots on the stored weights, no copy; "fp32":
        the exact weights); the exact weights stay for every other row. Inference only, CPU."""
        if check_draft_weights(kind) == "q8" and kind not in self.draft_sets:
            if self.head_exact is None:
                raise ValueError("draft_weights='q8' needs the linear op (a model loaded on the CPU)")
            from vericache.model.draft_weights import Q8Linear

            q8 = [tuple(Q8Linear(lin) for lin in (l.self_attn.qkv_exact, l.self_attn.o_exact, l.mlp.gate_up_exact,
                                                  l.mlp.down_exact)) for l in self.model.blocks()]
            # the LM head stays exact: on SmolLM2 at 8K, q8 layers with an exact head kept every draft
            # token (acceptance 1.0, as fp32 drafts), a q8 head too dropped it to 0.72 (argmax near-ties)
            self.draft_sets[kind] = (q8, None)
        if kind not in self.draft_sets and kind != "fp32":
            q, ws = QUANTIZERS[kind], weight_matrices(self)   # per layer: qkv, o, gate_up, down; then lm_head
            copies = []
            for i, layer in enumerate(self.model.blocks()):
                a = layer.self_attn
                bias = torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]) if a.q_proj.bias is not None else None
                qkv, o, gate_up, down = ws[4 * i : 4 * i + 4]
                copies.append((q(qkv, bias), q(o), q(gate_up), q(down)))
            self.draft_sets[kind] = (copies, q(ws[-1]))
        copies, head = self.draft_sets.get(kind, ([(None,) * 4] * len(self.model.layers), None))
        for layer, (qkv, o, gate_up, down) in zip(self.model.blocks(), copies):
            layer.self_attn.qkv_draft, layer.self_attn.o_draft = qkv, o
            layer.mlp.gate_up_draft, layer.mlp.down_draft = gate_up, down
        self.lm_head_draft = head
        self.draft_weights = kind

    def set_draft_vocab(self, n: int | None) -> None:
        """Give the draft-vocabulary rows of a forward (``n_vocab``) logits for the first ``n`` tokens only,
        -inf past them (``draft_weights.VocabPrefixHead``); None: the whole head, as every other row.
        The head's first n rows in the model's own numerics (its logit j's bits are the head's)."""
        vocab = self.config.vocab_size
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= vocab):
            raise ValueError(f"draft vocabulary must be None or in [1, {vocab}], got {n!r}")
        exact, weight, first = self.head_exact, self.lm_head.weight, None
        if n is None:
            self.vocab_head = None
        elif exact is not None:
            if n not in self.first_rows:   # kept: engines may switch
                self.first_rows[n] = exact.first_rows(n)
            first = self.first_rows[n]
            self.vocab_head = VocabPrefixHead(first, n, vocab, exact.rows)
        else:
            self.vocab_head = VocabPrefixHead(lambda x: F.linear(x, weight[:n]), n, vocab,
                                              lambda ids: lambda x: F.linear(x, weight[ids]))
        if self.native is not None:
            self.native.set_draft_head(first)
        self.draft_vocab = n

    def _native_plans(self, tokens: torch.Tensor, caches, seq_lens: Sequence[int], n_draft: int,
                      adt: torch.dtype) -> list | None:
        """Each cache's description for the native step, or None where the module runs the step: no
        native step (CUDA, training), fp32 not throughout, int8/int4 draft copies, a cache that cannot
        describe itself for all layers at once."""
        if self.native is None or caches is None or tokens.device.type != "cpu" or torch.is_grad_enabled() or \
                adt != torch.float32 or self.model.norm.weight.dtype != torch.float32 or \
                (n_draft and self.draft_weights not in NATIVE_DRAFT_WEIGHTS):
            return None
        return self.native.plan(caches, seq_lens)

    def forward(self, tokens: torch.Tensor, starts: Sequence[int], seq_lens: Sequence[int],
                caches: Sequence[KVCache] | None = None,
                logits_index: torch.Tensor | None = None, n_draft: int = 0, n_vocab: int = 0,
                vocab_extra: torch.Tensor | None = None) -> torch.Tensor:
        """tokens: [N] (packed sequences); returns logits [N, V] (or [M, V] with ``logits_index``).

        ``logits_index`` ([M] indices into N) restricts the LM head to the rows
        that are sampled from (the last prefill token, say), which saves a
        [N, V] matmul on long prefills. The first ``n_draft`` rows are draft rows: with
        ``quantize_drafts`` they read the quantized copies (sequences must not straddle that boundary);
        of them the first ``n_vocab`` take their logits from the draft vocabulary (``set_draft_vocab``) and
        the tokens ``vocab_extra`` (int64 [E] past it: their requests' rare tokens, ``Drafting.vocab``).
        """
        if sum(seq_lens) != tokens.shape[0]:
            raise ValueError(f"seq_lens sum to {sum(seq_lens)} but there are {tokens.shape[0]} tokens")
        if not 0 <= n_vocab <= n_draft <= tokens.shape[0]:
            raise ValueError(f"need 0 <= n_vocab <= n_draft <= rows, got {n_vocab}, {n_draft}, {tokens.shape[0]}")
        if self.vocab_head is None:
            n_vocab, vocab_extra = 0, None
        if caches is not None:
            for cache, s, t in zip(caches, starts, seq_lens):
                cache.begin(s, t)
        positions = torch.cat([torch.arange(s, s + t) for s, t in zip(starts, seq_lens)]).to(tokens.device)
        freqs = positions.to(self.inv_freq.dtype)[:, None] * self.inv_freq[None, :]  # [N, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        adt = self.attn_dtype or self.model.norm.weight.dtype
        cos, sin = emb.cos().to(adt), emb.sin().to(adt)                   # [N, D]
        plans = self._native_plans(tokens, caches, seq_lens, n_draft, adt)
        if plans is not None and self.native is not None:   # the same operations in one native call (native_step)
            extra = None if vocab_extra is None or not n_vocab or self.head_exact is None else \
                (self.head_exact.rows(vocab_extra), vocab_extra)
            return self.native.run(tokens, cos, sin, seq_lens, plans, n_draft, self.draft_weights == "q8", n_vocab,
                                   logits_index, extra)
        if self.embed_exact is not None:                                   # [N, hidden]
            x = self.embed_exact.op.dequantize(self.embed_exact.weight, tokens)
        else:
            x = self.model.embed_tokens(tokens)
        for i, layer in enumerate(self.model.blocks()):
            x = x + layer.self_attn(layer.input_layernorm(x), cos, sin, i, seq_lens, caches, n_draft)
            x = x + layer.mlp(layer.post_attention_layernorm(x), n_draft)
        if logits_index is not None:   # indices ascend: the draft rows' logits come first
            n_draft, n_vocab = (int((logits_index < n).sum()) if n else 0 for n in (n_draft, n_vocab))
            x = x[logits_index]
        head, x = self.head_exact or self.lm_head, self.model.norm(x)
        if n_vocab and self.vocab_head is not None:
            rest = mixed_linear(x[n_vocab:], n_draft - n_vocab, head, self.lm_head_draft).float()
            return torch.cat([self.vocab_head(x[:n_vocab], vocab_extra), rest])
        return mixed_linear(x, n_draft, head, self.lm_head_draft).float()
