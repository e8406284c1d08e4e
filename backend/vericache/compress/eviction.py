"""Token-eviction methods: each one only writes ``score``.

Scores are per KV head ([Hkv, S]): a GQA model keeps one token set per KV head,
chosen from the attention of all query heads of its group (GQA-aware).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F

from vericache.compress.base import EvictionCompressor, observed_attention
from vericache.kv.compressed import ScoreInputs

if TYPE_CHECKING:
    from vericache.compress.kvzip_scoring import ReconstructionScoringCache
    from vericache.kv.full import FullKVCache


@dataclass
class StreamingLLM(EvictionCompressor):
    """Attention sinks + the most recent tokens (Xiao et al., StreamingLLM)."""

    name: ClassVar[str] = "streaming"
    sinks: int = 4

    def score(self, inp: ScoreInputs) -> torch.Tensor:
        pos = inp.positions.float()
        return torch.where(inp.positions < self.sinks, torch.full_like(pos, float("inf")), pos)


@dataclass
class SnapKV(EvictionCompressor):
    """Attention of the last ``window`` queries (the observation window), pooled (Li et al., SnapKV)."""

    name: ClassVar[str] = "snapkv"
    kernel: int = 7

    def score(self, inp: ScoreInputs) -> torch.Tensor:
        att = observed_attention(inp).sum(dim=1)                                # [Hkv, S]
        if self.kernel > 1:  # pooling keeps the neighbours of important tokens (whole values, not fragments)
            att = F.max_pool1d(att[:, None], self.kernel, stride=1, padding=self.kernel // 2)[:, 0]
        return att


@dataclass
class H2O(EvictionCompressor):
    """Heavy hitters: attention accumulated over every compression event so far (Zhang et al., H2O).

    Accumulation is batched: at each event the queries observed since the last
    one add their attention to each surviving token's running total (so, unlike the
    others, a move re-scores the kept tokens: work in proportion to them).
    """

    name: ClassVar[str] = "h2o"
    rescores_kept: ClassVar[bool] = True

    def score(self, inp: ScoreInputs) -> torch.Tensor:
        att = observed_attention(inp).sum(dim=1)                                # [Hkv, S]
        if inp.carried is not None:  # kept candidates carry their total; new ones start from this event
            att[:, : inp.carried.shape[1]] += inp.carried
        return att


@dataclass
class KVzip(EvictionCompressor):
    """Query-agnostic importance: how much each context token is attended to while the model
    *reconstructs* the context (Kim et al., KVzip).

    Extra prefill cost: one more forward over a repeat prompt plus the whole
    context (about doubling prefill FLOPs). Tokens generated after the prompt
    are scored like SnapKV (the maximum attention of recent queries).
    """

    name: ClassVar[str] = "kvzip"
    repeat_prompt: ClassVar[str] = "\n\nRepeat the previous context exactly.\n"

    @property
    def needs_whole_prompt(self) -> bool:
        return True

    def scoring_ids(self, prompt_ids: list[int], tokenizer) -> list[int]:
        return list(tokenizer.encode(self.repeat_prompt)) + list(prompt_ids)

    def scoring_cache(self, context: FullKVCache, n_layers: int, own: int) -> ReconstructionScoringCache:
        from vericache.compress.kvzip_scoring import ReconstructionScoringCache

        return ReconstructionScoringCache(context, n_layers, own)

    def score(self, inp: ScoreInputs) -> torch.Tensor:
        recent = observed_attention(inp).amax(dim=1)                            # [Hkv, S]
        prompt_scores = inp.state.get("prefill_scores")
        if prompt_scores is None:
            return recent
        from_prompt = inp.positions < inp.prompt_len
        idx = inp.positions.clamp(max=prompt_scores.shape[1] - 1)
        # the reconstruction's probabilities over the P prompt tokens, made relative as ``recent`` is
        relative = prompt_scores.gather(1, idx) * prompt_scores.shape[1]
        return torch.where(from_prompt, relative, recent)
