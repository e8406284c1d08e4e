"""A prefix's per-block stored forms, and loading the full form back (a compressed form loads
through ``CompressedKVCache.load_stored``).

Per block of ``block_tokens`` positions the store keeps
- the *full* form: K, V [L, Hkv, block, D] in the KV dtype (what the verifier attends over), and
- one *compressed* form per compressor: exactly the fields a ``CompressedKVCache`` store holds for
  those positions (quantized codes and scales, or kept full-precision K/V, with positions under
  eviction), so the drafter's cache is filled by concatenation, never recompressed.

Eviction keeps ``keep_budget(block_tokens)`` tokens of *every* block per KV head, scored over the
whole prefix (its last queries are the observation window): each block then holds the same count
per head, so any leading run of blocks (a partial hit) is a valid store on its own. (For StreamingLLM
this keeps each block's newest tokens, stripes rather than one recent window: still a valid draft.)
"""

from __future__ import annotations

import torch

from vericache.compress.base import Compressor
from vericache.kv.compressed import ScoreInputs
from vericache.kv.full import FullKVCache

Form = dict[str, torch.Tensor]


def full_forms(full: FullKVCache, n_blocks: int, block_tokens: int) -> list[Form]:
    """Block b: {"k", "v"}: [L, Hkv, block_tokens, D] of positions b*block .. (b+1)*block - 1."""
    if n_blocks * block_tokens > full.length:
        raise ValueError(f"{n_blocks} blocks of {block_tokens} need {n_blocks * block_tokens} positions; "
                         f"the cache holds {full.length}")
    return [dict(zip("kv", full.views(b * block_tokens, (b + 1) * block_tokens))) for b in range(n_blocks)]


def compressed_forms(comp: Compressor, full: FullKVCache, queries: list[torch.Tensor], n_blocks: int,
                     block_tokens: int, prefill_scores: dict[int, torch.Tensor] | None = None) -> list[Form]:
    """Each block's compressed form. ``queries``: per layer, the prefix's last queries [Hq, >=1, D]
    (eviction scores them against every key); ``prefill_scores``: KVzip's per-layer [Hkv, P]."""
    layouts = comp.layouts() if comp.quantizes else None
    for layout in layouts or ():
        if block_tokens % layout.group:
            raise ValueError(f"{comp.spec()}: quantization group {layout.group} does not divide the "
                             f"block of {block_tokens} tokens")
    n = n_blocks * block_tokens
    k, v = full.views(0, n)                                                      # [L, Hkv, N, D]
    n_l, hkv = k.shape[:2]
    keep = None
    if comp.evicts:
        per_block = min(comp.keep_budget(block_tokens) or block_tokens, block_tokens)
        positions = torch.arange(n, device=k.device).expand(n_l, hkv, n)
        w = min(q.shape[1] for q in queries)
        q = torch.stack([x[:, -w:] for x in queries]).flatten(0, 1).float()     # [L*Hq, w, D]
        state = {}
        if prefill_scores:
            state["prefill_scores"] = torch.cat([prefill_scores[i] for i in range(n_l)])[:, :n]
        scores = comp.score(ScoreInputs(k.float().flatten(0, 1), positions.flatten(0, 1), q, state, n))
        scores = scores.view(n_l, hkv, n_blocks, block_tokens)
        keep = scores.topk(per_block, dim=3).indices.sort(dim=3).values            # [L, Hkv, nb, kb]
    forms = []
    for b in range(n_blocks):
        s, e = b * block_tokens, (b + 1) * block_tokens
        tok = {"k.tok.x": k[:, :, s:e], "v.tok.x": v[:, :, s:e]}
        grp: dict[str, torch.Tensor] = {}
        if layouts is not None:
            tok = {}
            for p, layout, x in zip("kv", layouts, (k[:, :, s:e], v[:, :, s:e])):
                t, g = layout.encode(x)
                tok |= {f"{p}.tok.{f}": y for f, y in t.items()}
                grp |= {f"{p}.grp.{f}": y for f, y in g.items()}
        form = dict(grp)
        if keep is not None:
            idx = keep[:, :, b]                                                   # [L, Hkv, kb]
            for name, y in tok.items():
                form[name] = y.gather(2, idx[..., None].expand(*idx.shape, y.shape[3]))
            form["pos"] = (idx + s).to(torch.int32)
        else:
            form |= tok
        forms.append({name: x.contiguous() for name, x in form.items()})
    return forms
