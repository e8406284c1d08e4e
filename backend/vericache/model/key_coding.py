"""The q8qk numerics' key coding (``kernels/int_scores.h``): for each layer and KV head, an offset mu and
a channel scale s [D], model constants measured once at load over a fixed text. Each key is coded as
(k - mu) / s and each query as q * s, and each row of scores gets its offset's share back (q . mu), so
attention's product is unchanged but
- a channel the model biases (Qwen2's keys carry a bias: one channel of layer 8 of the 0.5B code model
  sits near 212) no longer spends every key's 8 bits (mu: the keys' mean), and
- a channel whose keys range far wider than its queries (or the reverse) gives part of its range to the
  other side (s = sqrt(key range / query range), SmoothQuant's balance), so neither side's outlier
  channel takes the other channels' bits.
On that model's real attention inputs (``scripts/q8qk_score_error.py``, the coding measured on 256 tokens
and used on 1024) the attention output's error over fp32 scores: per-token codes 5.65%, with the offset
2.98%, with the offset and the scale 1.62%. mu is rounded to bf16 and s to a power of two (exact to
multiply and divide by), so the last bits of a sum rarely decide them.
"""

from __future__ import annotations

import torch

from vericache.config import ModelConfig
from vericache.kv.full import FullKVCache
from vericache.model.llama import Attention, Transformer
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
def measure_key_coding(model: Transformer, tokenizer: Tokenizer, cfg: ModelConfig,
                       device: torch.device) -> torch.Tensor:
    """The key coding over ``TEXT``: [L, 2, Hkv, D] fp32, for each layer its offsets (the keys' mean, bf16
    values) and channel scales (powers of two)."""
    ids = tokenizer.encode(TEXT)[:MAX_TOKENS]
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []   # per layer: q [Hq, n, D], k [Hkv, n, D]

    def capture(attn: Attention, args: tuple) -> None:
        x, cos, sin = args[:3]
        q, k, _ = attn.project(x, cos, sin)
        seen.append((q, k))

    hooks = [block.self_attn.register_forward_pre_hook(capture) for block in model.model.blocks()]
    native, model.native = model.native, None   # the module path, where each layer's inputs can be seen
    try:
        cache = FullKVCache(cfg, device, torch.float32, capacity=len(ids))
        cache.begin(0, len(ids))
        model(torch.tensor(ids, device=device), [0], [len(ids)], [cache],
              logits_index=torch.tensor([len(ids) - 1], device=device))
    finally:
        model.native = native
        for hook in hooks:
            hook.remove()
    return torch.stack([_coding(q, k) for q, k in seen])


def _coding(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """One layer's coding from its queries q [Hq, n, D] and keys k [Hkv, n, D] -> [2, Hkv, D]."""
    hkv, _, d = k.shape
    mu = k.double().mean(dim=1).to(torch.bfloat16).double()                     # [Hkv, D]
    k_range = (k.double() - mu[:, None]).abs().amax(dim=1)
    q_range = q.double().abs().reshape(hkv, -1, d).amax(dim=1)                  # over each KV head's query heads
    ratio = torch.where((k_range > 0) & (q_range > 0), k_range / q_range, torch.ones_like(k_range))
    scale = torch.exp2(torch.round(0.5 * torch.log2(ratio)).clamp(-30, 30))
    return torch.stack([mu, scale]).float()


def set_key_coding(model: Transformer, tokenizer: Tokenizer, cfg: ModelConfig, device: torch.device) -> None:
    """Measure a q8qk model's key coding and put it where its attention reads it (in place: the native
    step holds the same tensors)."""
    coding = measure_key_coding(model, tokenizer, cfg, device)
    for layer, block in enumerate(model.model.blocks()):
        target = block.self_attn.key_coding
        if target is None:
            raise ValueError("a key coding belongs to a model prepared for the q8qk numerics")
        target.copy_(coding[layer])
