"""The q8qk numerics' key offsets (``kernels/int_scores.h``): for each layer and KV head, the mean of the
model's keys over a fixed text. Each key is coded after its head's offset is taken off, and each row of
scores gets its share back (q . mu), so attention is unchanged but a channel the model biases (Qwen2's
keys carry a bias: one channel of layer 8 of the 0.5B code model sits near 212) no longer spends every
key's 8 bits: on that model's real attention inputs the scores' error halves (5.65% -> 2.99%,
``scripts/q8qk_score_error.py``). Measured once at load, one forward of ``TEXT``, and rounded to bf16 so
the last bits of a sum cannot differ between machines.
"""

from __future__ import annotations

import torch

from vericache.config import ModelConfig
from vericache.kv.full import FullKVCache
from vericache.model.llama import Transformer
from vericache.model.tokenizer import Tokenizer

# Code and prose, as the models meet both: the keys' mean is a property of the model, not of this text
TEXT = '''
def merge_intervals(intervals):
    """Merge overlapping [start, end] intervals; returns them sorted."""
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


class LRUCache:
    def __init__(self, capacity: int) -> None:
        self.capacity, self.items = capacity, {}

    def get(self, key):
        if key not in self.items:
            return None
        value = self.items.pop(key)
        self.items[key] = value
        return value

The library keeps the most recently used entries and drops the oldest one when it is full. Each call
returns in constant time, and the tests below check both the order of eviction and the values returned.
A reader new to the code can start with the cache, then the interval merge, which the scheduler uses to
combine the time windows of requests that arrive while a batch is running.
'''
MAX_TOKENS = 512


@torch.inference_mode()
def measure_key_offsets(model: Transformer, tokenizer: Tokenizer, cfg: ModelConfig,
                        device: torch.device) -> torch.Tensor:
    """The keys' mean over ``TEXT`` for each layer and KV head: [L, Hkv, D] fp32 (bf16 values)."""
    ids = tokenizer.encode(TEXT)[:MAX_TOKENS]
    cache = FullKVCache(cfg, device, torch.float32, capacity=len(ids))
    cache.begin(0, len(ids))
    model(torch.tensor(ids, device=device), [0], [len(ids)], [cache], logits_index=torch.tensor([len(ids) - 1], device=device))
    keys, _ = cache.views(0, len(ids))                                               # [L, Hkv, n, D]
    return keys.double().mean(dim=2).to(torch.bfloat16).float()


def set_key_offsets(model: Transformer, tokenizer: Tokenizer, cfg: ModelConfig, device: torch.device) -> None:
    """Measure a q8qk model's key offsets and put them where its attention reads them (in place: the
    native step holds the same tensors)."""
    offsets = measure_key_offsets(model, tokenizer, cfg, device)
    for layer, block in enumerate(model.model.blocks()):
        target = block.self_attn.key_offset
        if target is None:
            raise ValueError("key offsets belong to a model prepared for the q8qk numerics")
        target.copy_(offsets[layer])
