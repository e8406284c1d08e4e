"""``vericache eval-numerics``: the integer numerics' quality against fp32's on one model, measured.

Perplexity of a held-out text (a file no test or training set uses) in each numerics, teacher-forced
in chunks through the engine's own attention (a full KV cache, so q8qk's integer attention runs); how
often each numerics' next-token argmax agrees with fp32's along it; and greedy continuations of a few
stretches of it in each numerics, compared token by token with fp32's (the first position they part).
A numerics is a default only while its perplexity stays within 0.5% of fp32's (issue 40).
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from vericache.engine.engine import Engine
from vericache.kernels.linear_op import NUMERICS
from vericache.kv.full import FullKVCache
from vericache.model.loader import load_model
from vericache.sampling import SamplingParams

PPL_BUDGET = 0.005   # a numerics stays a default within this relative perplexity of fp32's


@torch.inference_mode()
def _chunk_logits(loaded, ids: list[int], chunk: int) -> list[torch.Tensor]:
    """Each chunk's logits [T, V]: the chunk alone through a fresh full cache (the attention the engine
    runs, in the model's numerics)."""
    out = []
    for at in range(0, len(ids) - 1, chunk):
        piece = torch.tensor(ids[at : at + chunk + 1])
        if piece.numel() < 2:
            break
        t = piece.numel() - 1
        cache = FullKVCache(loaded.config, loaded.device, loaded.kv_dtype, capacity=t, key_codes=loaded.key_codes)
        cache.begin(0, t)
        out.append(loaded.model(piece[:-1], [0], [t], [cache], logits_index=torch.arange(t)).float())
    return out


def run_numerics_quality(model: str, text: Path, tokens: int = 4096, chunk: int = 1024, prompts: int = 4,
                         new_tokens: int = 48, log=print) -> dict:
    ids = None
    logits, greedy, ppl, seconds = {}, {}, {}, {}
    order = ("fp32", *(n for n in NUMERICS if n != "fp32"))   # fp32 first: the others are held against it
    for numerics in order:
        loaded = load_model(model, device="cpu", dtype="float32", numerics=numerics)
        ids = ids or loaded.tokenizer.encode(Path(text).read_text())[:tokens]
        t0 = time.perf_counter()
        logits[numerics] = _chunk_logits(loaded, ids, chunk)
        nll, count = 0.0, 0
        for i, lg in enumerate(logits[numerics]):
            target = torch.tensor(ids[i * chunk + 1 : i * chunk + 1 + lg.shape[0]])
            nll += torch.nn.functional.cross_entropy(lg, target, reduction="sum").item()
            count += target.numel()
        ppl[numerics] = math.exp(nll / count)
        engine = Engine(loaded, mode="full")
        step = max(1, (len(ids) - 512) // prompts)
        seqs = [engine.new_sequence(j, ids[j * step : j * step + 512], SamplingParams(max_tokens=new_tokens))
                for j in range(prompts)]
        greedy[numerics] = [o.token_ids for o in engine.generate(seqs)]
        seconds[numerics] = time.perf_counter() - t0
        log(f"{numerics}: perplexity {ppl[numerics]:.4f} over {count} tokens ({seconds[numerics]:.0f} s)")
    total = sum(a.shape[0] for a in logits["fp32"])

    def parted(a: list[int], b: list[int]) -> int:
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    others = order[1:]
    rel = {n: ppl[n] / ppl["fp32"] - 1 for n in others}
    agree = {n: sum((a.argmax(-1) == b.argmax(-1)).sum().item() for a, b in zip(logits["fp32"], logits[n])) / total
             for n in others}
    from vericache_lab.bench.common import cpu_model

    return {"model": model, "cpu": cpu_model(), "text": str(text), "tokens": total + len(logits["fp32"]),
            "chunk": chunk, "perplexity": {k: round(v, 4) for k, v in ppl.items()},
            "over_fp32_perplexity": {n: round(r, 5) for n, r in rel.items()},
            "within_budget": {n: abs(r) <= PPL_BUDGET for n, r in rel.items()},
            "top1_agreement": {n: round(a, 4) for n, a in agree.items()},
            "greedy_tokens_identical_before_parting": {n: [parted(a, b) for a, b in zip(greedy["fp32"], greedy[n])]
                                                       for n in others},
            "greedy_new_tokens": new_tokens}
