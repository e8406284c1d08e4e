"""KVzip's context-reconstruction pass: score context tokens by the attention they get
while the model re-reads the context after a repeat prompt.

A context key's score is the largest probability any query of its KV group gives it. The pass
never forms the [Hq, T, S] probabilities: attention runs on the layer's own op (the packed attention,
in the model's numerics: under q8qk integer scores, 3.5x torch's fp32 flash attention over an 8K
context), which also returns each row's log-sum-exp; a second, scores-only call of the op then takes,
for each key, the max over the rows of score - lse (``attend_packed``'s ``row_lse``): the same scores
the attention normalised, so no probability passes 1, and each row's share is its own, so the scores do
not depend on how the pass is chunked."""

from __future__ import annotations

from typing import ClassVar

import torch

from vericache.kv.full import FullKVCache
from vericache.kv.packed import KeyPart, PartsAttention
from vericache.kv.protocol import KVCache


class ReconstructionScoringCache(KVCache):
    """Attends over a read-only context (a full cache's first P positions) plus up to ``own`` tokens
    of its own, in order, recording the context's largest probabilities: scores[layer]: [Hkv, P]."""

    computes_attention = True
    # the pass's tokens a forward, fixed: the engine's steps (``RowKind.PREFILL_SCORE``) and the prefix
    # store's ingest run the same chunks whatever an engine's prefill chunk
    chunk: ClassVar[int] = 512

    def __init__(self, context: FullKVCache, n_layers: int, own: int) -> None:
        self.ctx = context
        self.p = context.length
        self.own = own
        # per layer K, V [Hkv, P + own, D]: the context copied once, then each chunk written after it,
        # so a chunk attends through a view (no concatenation over S per layer and chunk)
        self.keys: list[torch.Tensor | None] = [None] * n_layers
        self.values: list[torch.Tensor | None] = [None] * n_layers
        self.scores: dict[int, torch.Tensor] = {}
        self._start = self._end = self.p

    def begin(self, start: int, count: int) -> None:
        if start != self._end:
            raise ValueError(f"the scoring pass runs in order: expected position {self._end}, got {start}")
        if start + count > self.p + self.own:
            raise ValueError(f"positions {start}..{start + count - 1} exceed the {self.own} this pass holds "
                             f"after its {self.p}-token context")
        self._start, self._end = start, start + count

    def _layer_buffers(self, layer: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.keys[layer], self.values[layer]
        if keys is None or values is None:
            ctx_k, ctx_v = self.ctx.layer_views(layer, self.p)                          # [Hkv, P, D]
            shape = (ctx_k.shape[0], self.p + self.own, ctx_k.shape[2])
            # in the forward's dtype (a cache may hold fp16 or bf16 K/V for fp32 activations)
            keys, values = ctx_k.new_empty(shape, dtype=dtype), ctx_v.new_empty(shape, dtype=dtype)
            keys[:, : self.p], values[:, : self.p] = ctx_k, ctx_v
            self.keys[layer], self.values[layer] = keys, values
        return keys, values

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               attention: PartsAttention) -> torch.Tensor:
        # q: [Hq, T, D]; k, v: [Hkv, T, D] at positions start..start+T-1 (all >= P)
        hq, t, _ = q.shape
        hkv = k.shape[0]
        keys, values = self._layer_buffers(layer, q.dtype)
        keys[:, self._start : self._end], values[:, self._start : self._end] = k, v
        # one causal part: row i sees the context and the pass's keys up to its own (0 .. start + i)
        lse = torch.empty(hq, t, dtype=torch.float32, device=q.device)
        out = attention(q, [KeyPart(keys, values, n=self._end, diag=self._start)], lse)    # [T, Hq, D]
        # then each context key's largest log-probability over the rows (every row sees the whole context:
        # one part over it alone, not the pass's own keys), each group's max in its first head
        seen = torch.empty(hq, self.p, dtype=torch.float32, device=q.device)              # [Hq, P]
        attention(q, [KeyPart(keys, values, n=self.p, seen=seen)], row_lse=lse)
        ctx_max = seen[:: hq // hkv].exp()                                                 # [Hkv, P]
        prev = self.scores.get(layer)
        self.scores[layer] = ctx_max if prev is None else torch.maximum(prev, ctx_max)
        return out.transpose(0, 1)


@torch.inference_mode()
def run_scoring_pass(model, scorer: ReconstructionScoringCache, ids: list[int]) -> dict[int, torch.Tensor]:
    """The whole pass in one call, ``scorer.chunk`` tokens a forward (the prefix store's ingest, benches;
    the engine runs it a chunk a step instead: ``RowKind.PREFILL_SCORE``): per-layer [Hkv, P] scores."""
    device, pos = scorer.ctx.device, scorer.p
    for s in range(0, len(ids), scorer.chunk):
        part = ids[s : s + scorer.chunk]
        model(torch.tensor(part, device=device), [pos], [len(part)], [scorer],
              logits_index=torch.tensor([len(part) - 1], device=device))
        pos += len(part)
    return scorer.scores


def reconstruction_scores(model, full_cache: FullKVCache, prompt_ids: list[int],
                          repeat_ids: list[int]) -> dict[int, torch.Tensor]:
    """Per-layer [Hkv, P] importance of the P context tokens held in ``full_cache``."""
    ids = list(repeat_ids) + list(prompt_ids)
    scorer = ReconstructionScoringCache(full_cache, model.config.num_hidden_layers, own=len(ids))
    return run_scoring_pass(model, scorer, ids)
