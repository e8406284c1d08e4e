"""KVzip's context-reconstruction pass: score context tokens by the attention they get
while the model re-reads the context after a repeat prompt."""

from __future__ import annotations

import math

import torch

from vericache.kv.full import FullKVCache
from vericache.kv.protocol import KVCache


class ReconstructionScoringCache(KVCache):
    """Attends over a read-only context (a full cache's first P positions) plus its own tokens,
    with explicit probabilities so the context's share can be recorded: scores[layer]: [Hkv, P]."""

    computes_attention = True

    def __init__(self, context: FullKVCache, n_layers: int) -> None:
        self.ctx = context
        self.p = context.length
        self.own_k: list[torch.Tensor | None] = [None] * n_layers
        self.own_v: list[torch.Tensor | None] = [None] * n_layers
        self.scores: dict[int, torch.Tensor] = {}
        self._start = self.p

    def begin(self, start: int, count: int) -> None:
        self._start = start

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [Hq, T, D]; k, v: [Hkv, T, D] at positions start..start+T-1 (all >= P)
        own_k, own_v = self.own_k[layer], self.own_v[layer]
        if own_k is None or own_v is None:
            own_k, own_v = k, v
        else:
            own_k, own_v = torch.cat([own_k, k], dim=1), torch.cat([own_v, v], dim=1)
        self.own_k[layer], self.own_v[layer] = own_k, own_v
        ctx_k, ctx_v = self.ctx.layer_views(layer, self.p)                               # [Hkv, P, D]
        keys = torch.cat([ctx_k, own_k], dim=1)                                          # [Hkv, S, D]
        vals = torch.cat([ctx_v, own_v], dim=1)
        hq, t, d = q.shape
        hkv, s, _ = keys.shape
        qg = q.view(hkv, hq // hkv, t, d)
        logits = torch.einsum("hgtd,hsd->hgts", qg, keys) / math.sqrt(d)
        qpos = torch.arange(self._start, self._start + t)
        kpos = torch.arange(s)
        logits = logits.masked_fill(kpos[None, :] > qpos[:, None], float("-inf"))
        probs = torch.softmax(logits.float(), dim=-1)
        ctx_max = probs[..., : self.p].amax(dim=(1, 2))                                 # [Hkv, P]
        prev = self.scores.get(layer)
        self.scores[layer] = ctx_max if prev is None else torch.maximum(prev, ctx_max)
        out = torch.einsum("hgts,hsd->hgtd", probs.to(vals.dtype), vals)
        return out.reshape(hq, t, d)


@torch.inference_mode()
def reconstruction_scores(model, full_cache: FullKVCache, prompt_ids: list[int], repeat_ids: list[int],
                          chunk: int = 512) -> dict[int, torch.Tensor]:
    """Per-layer [Hkv, P] importance of the P context tokens held in ``full_cache``."""
    scorer = ReconstructionScoringCache(full_cache, model.config.num_hidden_layers)
    ids = list(repeat_ids) + list(prompt_ids)
    device = full_cache.device
    pos = full_cache.length
    for s in range(0, len(ids), chunk):
        part = ids[s : s + chunk]
        model(torch.tensor(part, device=device), [pos], [len(part)], [scorer],
              logits_index=torch.tensor([len(part) - 1], device=device))
        pos += len(part)
    return scorer.scores
