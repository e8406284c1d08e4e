"""The compressor interface.

A compressor is a small dataclass. It never touches the model: the compressed
cache (``vericache.kv.compressed``) calls it when a batch of committed tokens
leaves the full-precision recent window (the KIVI residual idea), so it works
during decoding, not only at prefill.

- Eviction methods rank tokens: they write only ``score`` (higher = keep); the cache keeps the
  top ``ratio`` of all tokens seen, per KV head. A move scores only the tokens entering the store:
  kept tokens carry the score they entered with, so scores from different moves must compare
  (``observed_attention`` is relative to uniform attention, whatever the number of candidates).
  A method that updates its kept tokens' scores (H2O) sets ``rescores_kept`` and is shown them.
- Quantization methods write ``layouts``: how K and V are stored (``kv.quantized.Layout``: codes
  and scales; its encode, its reference dequantization and its attention-kernel format). The
  draft attention reads the codes as stored.
- ``a+b`` composes one eviction and one quantization method (``Composed``): the kept tokens are
  stored quantized.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, ClassVar

import torch

from vericache.kv.compressed import ScoreInputs

if TYPE_CHECKING:
    from vericache.compress.kvzip_scoring import ReconstructionScoringCache
    from vericache.kv.full import FullKVCache


SCORE_CHUNK = 1 << 23   # logits an ``observed_attention`` call forms at once (32 MB fp32)


def observed_attention(inp: ScoreInputs) -> torch.Tensor:
    """Attention of the observed queries over the candidates relative to uniform (probability x S, so
    1.0 = an average candidate, whatever S), summed over each KV head's query heads: [Hkv, W, S]."""
    hq, w, d = inp.queries.shape
    hkv, s, _ = inp.keys.shape
    q = inp.queries.view(hkv, hq // hkv, w, d).float()              # [Hkv, G, W, D]
    out = q.new_empty(hkv, w, s)
    # (layer, KV head)s in chunks of <= SCORE_CHUNK logits, scaled in place: every one's [G, W, S] logits and
    # probabilities at once (the 0.5B code model at 32K: 1.4 GB each, fresh pages) faulted in ~4 GB over a 32K
    # prompt, 1.9 s; a head's 29 MB are reused (0.8 s), and a decode move's few candidates stay one call
    # (the same bits either way: each head's matmul, softmax and sum are its own)
    per = max(1, SCORE_CHUNK // (hq // hkv * w * s))
    for h in range(0, hkv, per):
        logits = torch.einsum("hgwd,hsd->hgws", q[h : h + per], inp.keys[h : h + per].float()).div_(math.sqrt(d))
        torch.sum(torch.softmax(logits, dim=-1), dim=1, out=out[h : h + per])
    return out.mul_(s)                                               # [Hkv, W, S]


@dataclass
class Compressor:
    """Base of every method. ``window`` recent tokens always stay in full precision."""

    name: ClassVar[str] = ""
    kind: ClassVar[str] = ""  # "eviction" or "quantization"
    rescores_kept: ClassVar[bool] = False  # eviction: score kept tokens again at every move (H2O)
    window: int = 32

    def __post_init__(self) -> None:
        if not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"{self.name}: window must be an integer >= 1, got {self.window!r}")

    # -- eviction ---------------------------------------------------------------------------
    @property
    def evicts(self) -> bool:
        return self.kind == "eviction"

    @property
    def quantizes(self) -> bool:
        return self.kind == "quantization"

    @property
    def guided(self) -> bool:
        """Verification-guided trades into the store (``drafting.guide``): an eviction method's field."""
        return False

    @property
    def swaps(self) -> int:
        """Tokens a KV head a guided store may trade a round: an eviction method's field (0 here)."""
        return 0

    def keep_budget(self, total_tokens: int) -> int | None:
        """How many tokens (per KV head) to keep of ``total_tokens``; None = keep all."""
        return None

    def score(self, inp: ScoreInputs) -> torch.Tensor:
        """[Hkv, S] importance of each candidate; higher is kept."""
        raise NotImplementedError

    def nominal_ratio(self, elem_bytes: int, head_dim: int = 64) -> float:
        """Stored/full bytes per token (the cost model's figure; admission uses the exact layout)."""
        if not self.quantizes:
            return getattr(self, "ratio", 1.0)
        stored = sum(layout.bytes_per_token(head_dim) for layout in self.layouts())
        return stored / (2 * head_dim * elem_bytes)

    def layouts(self):
        """(K layout, V layout) of a quantization method; None when tokens stay in full precision."""
        return None

    @property
    def align(self) -> int:
        """Tokens move into the store in multiples of this (whole position groups of the K layout)."""
        return max(layout.align for layout in self.layouts()) if self.quantizes else 1

    @property
    def needs_whole_prompt(self) -> bool:
        """True when scoring needs the whole prompt before anything is compressed (KVzip)."""
        return False

    def scoring_ids(self, prompt_ids: list[int], tokenizer) -> list[int]:
        """The tokens of a pass this compressor scores a prompt by once it is prefilled (KVzip: a repeat
        prompt, then the prompt again), run after the prompt's positions; [] for none (the default)."""
        return []

    def scoring_cache(self, context: FullKVCache, n_layers: int, own: int) -> ReconstructionScoringCache:
        """What that pass's rows attend through: ``context``'s first P positions (read-only) and the
        pass's own ``own`` tokens; it records the per-layer [Hkv, P] prompt scores. The engine runs the
        pass a chunk a step (``RowKind.PREFILL_SCORE``); ``prompt_scores`` below in one call."""
        raise NotImplementedError(f"{self.spec()} runs no scoring pass (its scoring_ids are empty)")

    def spec(self) -> str:
        params = ",".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self) if f.init)
        return f"{self.name}:{params}" if params else self.name


def prompt_scores(comp: Compressor, model, context: FullKVCache, prompt_ids: list[int],
                  tokenizer) -> dict[int, torch.Tensor] | None:
    """A compressor's per-layer [Hkv, P] scores of the P-token prompt in ``context`` from its scoring pass
    (``Compressor.scoring_ids``), in one call; None where it runs none (it scores by recent queries)."""
    ids = comp.scoring_ids(prompt_ids, tokenizer)
    if not ids:
        return None
    from vericache.compress.kvzip_scoring import run_scoring_pass

    return run_scoring_pass(model, comp.scoring_cache(context, model.config.num_hidden_layers, len(ids)), ids)


@dataclass
class EvictionCompressor(Compressor):
    """Keeps ``ratio`` of the tokens seen so far (at least the recent window). ``guided``: after each
    verification the store trades up to ``swaps`` tokens a KV head for ones the verifier attended to
    that it lacks (``drafting.guide``; the drafter's cache only, so outputs do not change)."""

    kind: ClassVar[str] = "eviction"
    ratio: float = 0.25
    guided: bool = True
    swaps: int = 64

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.ratio, (int, float)) or not 0 < self.ratio <= 1:
            raise ValueError(f"{self.name}: ratio must be in (0, 1], got {self.ratio!r}")
        if not isinstance(self.guided, bool):
            raise ValueError(f"{self.name}: guided must be true or false, got {self.guided!r}")
        if isinstance(self.swaps, bool) or not isinstance(self.swaps, int) or self.swaps < 1:
            raise ValueError(f"{self.name}: swaps must be an integer >= 1, got {self.swaps!r}")

    def keep_budget(self, total_tokens: int) -> int:
        return max(math.ceil(self.ratio * total_tokens), 1)


@dataclass
class QuantCompressor(Compressor):
    kind: ClassVar[str] = "quantization"


@dataclass
class Composed(Compressor):
    """Eviction then quantization: ``snapkv:ratio=0.25+kivi:bits=4``."""

    evictor: EvictionCompressor = field(default=None)  # type: ignore[assignment]
    quantizer: QuantCompressor = field(default=None)  # type: ignore[assignment]
    name: ClassVar[str] = "composed"
    kind: ClassVar[str] = "composed"

    def __post_init__(self) -> None:
        if not isinstance(self.evictor, EvictionCompressor) or not isinstance(self.quantizer, QuantCompressor):
            raise ValueError("a composition is one eviction method followed by one quantization method, "
                             f"got {type(self.evictor).__name__} + {type(self.quantizer).__name__}")
        self.window = max(self.evictor.window, self.quantizer.window)

    evicts = property(lambda self: True)
    quantizes = property(lambda self: True)
    rescores_kept = property(lambda self: self.evictor.rescores_kept)
    guided = property(lambda self: self.evictor.guided)
    swaps = property(lambda self: self.evictor.swaps)

    def keep_budget(self, total_tokens: int) -> int:
        return self.evictor.keep_budget(total_tokens)

    def nominal_ratio(self, elem_bytes: int, head_dim: int = 64) -> float:
        return self.evictor.nominal_ratio(elem_bytes) * self.quantizer.nominal_ratio(elem_bytes, head_dim)

    def layouts(self):
        return self.quantizer.layouts()

    def score(self, inp: ScoreInputs) -> torch.Tensor:
        return self.evictor.score(inp)

    @property
    def needs_whole_prompt(self) -> bool:
        return self.evictor.needs_whole_prompt

    def scoring_ids(self, prompt_ids: list[int], tokenizer) -> list[int]:
        return self.evictor.scoring_ids(prompt_ids, tokenizer)

    def scoring_cache(self, context: FullKVCache, n_layers: int, own: int) -> ReconstructionScoringCache:
        return self.evictor.scoring_cache(context, n_layers, own)

    def spec(self) -> str:
        return f"{self.evictor.spec()}+{self.quantizer.spec()}"
