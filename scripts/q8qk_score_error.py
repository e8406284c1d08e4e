"""How much of the q8qk numerics' attention error each way of coding the scores leaves, on real queries,
keys and values: the code model's forward over 1024 tokens of difflib.py (q8 numerics, the module path,
its attention inputs captured per layer), then each layer's causal attention in torch with fp32 scores
against scores from coded queries and keys: per token (q8qk today), per token after taking off a
per-channel key offset mu (the keys' mean; each row's scores given back q . mu), per 16-channel group,
both, and the offset with only one side coded. Prints the relative error of each layer's output (every
4th layer) and the mean over layers. The value pass is fp32 here: its coding measured no loss.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/q8qk_score_error.py
"""

from __future__ import annotations

import collections
import math
from pathlib import Path

import torch

import vericache.model.llama as llama
from vericache.kv.full import FullKVCache
from vericache.model.loader import load_model


def code(x: torch.Tensor) -> torch.Tensor:
    """x's rows coded as int8 with one scale each (q8's rule), decoded again."""
    d = x.abs().amax(-1, keepdim=True) / 127
    return torch.round(x / torch.where(d > 0, d, torch.ones_like(d))) * d


def g16(x: torch.Tensor) -> torch.Tensor:
    """Coded per group of 16 channels."""
    return code(x.reshape(x.shape[:-1] + (x.shape[-1] // 16, 16))).reshape(x.shape)


def smoothed(a: torch.Tensor, b: torch.Tensor, alpha: float, hkv: int, pow2: bool = False,
             fit: int = 0, keys_only: bool = False) -> torch.Tensor:
    """Scores from coded a * s and b / s, s per channel and KV head (shared by its query heads):
    SmoothQuant's balance of the channels' ranges between queries and keys, alpha the keys' share.
    a, b [Hq, T, D] (b repeated over each KV head's query heads)."""
    hq, t, d = a.shape
    n = fit or t   # the scales from the first ``fit`` tokens only (a held-out measurement)
    a_max = a[:, :n].abs().reshape(hkv, -1, d).amax(1).clamp_min(1e-6)                 # [Hkv, D]
    if keys_only:   # the queries' ranges taken as flat
        a_max = torch.ones_like(a_max)
    b_max = b[:, :n].abs().reshape(hkv, -1, d).amax(1).clamp_min(1e-6)
    s = (b_max ** alpha / a_max ** (1 - alpha)).repeat_interleave(hq // hkv, 0)[:, None]   # [Hq, 1, D]
    if pow2:
        s = torch.exp2(torch.round(torch.log2(s)))
    return code(a * s) @ code(b / s).transpose(1, 2)


def attn(q, k, v, scores_fn):
    hq, t, d = q.shape
    g = hq // k.shape[0]
    kk, vv = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)
    s = scores_fn(q / math.sqrt(d), kk)
    mask = torch.ones(t, t, dtype=torch.bool).tril()
    return torch.softmax(s.masked_fill(~mask, -1e30), -1) @ vv


def capture(model: str, text: Path, n: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Each layer's (q [Hq, T, D], k, v [Hkv, T, D]) of one forward over the text's first n tokens."""
    loaded = load_model(model, device="cpu", dtype="float32", numerics="q8")
    ids = loaded.tokenizer.encode(text.read_text())[:n]
    captured = []
    real = llama.attend_packed

    def spy(q, seq_lens, parts, n_kv, kernels="auto", score_unit=0, key_offset=None):
        k, v = parts[0][0].dense()
        keys = parts[0][0].n
        captured.append((q.clone(), k[:, :keys].float().clone(), v[:, :keys].float().clone()))
        return real(q, seq_lens, parts, n_kv, kernels, score_unit, key_offset)

    llama.attend_packed = spy
    loaded.model.native = None   # the module path, where each layer's attention call can be seen
    cache = FullKVCache(loaded.config, "cpu", loaded.kv_dtype, capacity=len(ids))
    cache.begin(0, len(ids))
    with torch.inference_mode():
        loaded.model(torch.tensor(ids), [0], [len(ids)], [cache])
    llama.attend_packed = real
    return captured


def main() -> None:
    captured = capture("qwen2.5-coder-0.5b", Path("/usr/lib/python3.11/difflib.py"), 1024)
    tot: collections.Counter = collections.Counter()
    for layer, (q, k, v) in enumerate(captured):
        hkv = k.shape[0]
        ref = attn(q, k, v, lambda a, b: a @ b.transpose(1, 2))
        mu = k.mean(dim=1, keepdim=True).repeat_interleave(q.shape[0] // k.shape[0], 0)   # [Hq, 1, D]
        ways = {
            "per token": lambda a, b: code(a) @ code(b).transpose(1, 2),
            "offset": lambda a, b: code(a) @ code(b - mu).transpose(1, 2) + a @ mu.transpose(1, 2),
            "group16": lambda a, b: g16(a) @ g16(b).transpose(1, 2),
            "offset+group16": lambda a, b: g16(a) @ g16(b - mu).transpose(1, 2) + a @ mu.transpose(1, 2),
            "offset+smooth": lambda a, b: smoothed(a, b - mu, 0.5, hkv) + a @ mu.transpose(1, 2),
            "offset+smooth.75": lambda a, b: smoothed(a, b - mu, 0.75, hkv) + a @ mu.transpose(1, 2),
            "offset+smooth.25": lambda a, b: smoothed(a, b - mu, 0.25, hkv) + a @ mu.transpose(1, 2),
            "offset+smooth pow2": lambda a, b: smoothed(a, b - mu, 0.5, hkv, True) + a @ mu.transpose(1, 2),
            "held-out 256: offset": lambda a, b: code(a) @ code(b - mu256).transpose(1, 2) + a @ mu256.transpose(1, 2),
            "held-out 256: offset+smooth pow2": lambda a, b: smoothed(a, b - mu256, 0.5, hkv, True, 256)
            + a @ mu256.transpose(1, 2),
            "held-out 256: offset+smooth pow2 keys only": lambda a, b: smoothed(a, b - mu256, 0.5, hkv, True, 256,
                                                                                 True) + a @ mu256.transpose(1, 2),
            "offset, q exact": lambda a, b: a @ code(b - mu).transpose(1, 2) + a @ mu.transpose(1, 2),
            "offset, k exact": lambda a, b: code(a) @ (b - mu).transpose(1, 2) + a @ mu.transpose(1, 2),
        }
        mu256 = k[:, :256].mean(dim=1, keepdim=True).repeat_interleave(q.shape[0] // k.shape[0], 0)
        errs = {name: ((attn(q, k, v, fn) - ref).norm() / ref.norm()).item() for name, fn in ways.items()}
        tot.update(errs)
        if layer % 4 == 0:
            print(layer, {name: round(e, 4) for name, e in errs.items()}, "max |k|", round(k.abs().max().item(), 1))
    print("mean relative error over layers:", {name: round(e / len(captured), 5) for name, e in tot.items()})


if __name__ == "__main__":
    main()
