"""One exact prefill of a prompt, made once and loaded by every request that asks for it
(``ModelRunner.shared_prefill``; evaluation grids and benches compare modes on one prefill)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from vericache.kv.full import FullKVCache
from vericache.sampling import Sequence


@dataclass
class SharedPrefill:
    """One exact prefill of a prompt, reused by every mode and compressor (evaluation grids).

    A request decodes in ``full`` itself, writing past the prompt; ``reset()`` drops those positions for
    the next one. So one request at a time holds it (``Engine`` refuses a second); requests that run
    together each take a ``copy()``.
    """
    full: FullKVCache            # the prompt's K/V, capacity for prompt + max_tokens + 1
    queries: list[torch.Tensor | None]  # per layer, the last queries [Hq, W, D] (eviction scorers read them)
    logits: torch.Tensor         # [V], the next-token logits after the prompt
    prompt_len: int
    seconds: float
    prompt_ids: tuple[int, ...] = ()   # what was prefilled (a later prefill may extend it: ``prefix``)
    # a scoring compressor's prompt scores by its spec: its pass (KVzip's) runs once per prefill
    scores: dict[str, dict[int, torch.Tensor]] = field(default_factory=dict)

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update({"scores": {}, **state})   # a prefill pickled before scores were kept has none

    def check(self, seq: Sequence) -> None:
        if len(seq.prompt_ids) != self.prompt_len:
            raise ValueError(f"request {seq.request_id} has a {len(seq.prompt_ids)}-token prompt; "
                             f"this prefill is of {self.prompt_len} tokens")
        if self.full.capacity < seq.capacity:
            raise ValueError(f"this prefill has room for {self.full.capacity} positions; request "
                             f"{seq.request_id} needs {seq.capacity}")

    def reset(self, seq: Sequence) -> FullKVCache:
        """The full cache, back at the end of the prompt, for ``seq`` (which must have this prompt)."""
        self.check(seq)
        self.full.truncate(self.prompt_len)
        return self.full

    def copy(self) -> SharedPrefill:
        """The same prefill in a cache of its own: a request decoding in it leaves this one untouched."""
        full = FullKVCache(self.full.cfg, self.full.device, self.full.dtype, capacity=self.full.capacity,
                           key_codes=self.full.codes is not None)
        full.load(self.full, self.prompt_len)
        return replace(self, full=full)
