"""``vericache eval-numerics``: the q8 numerics' quality against fp32's on one model, measured.

Perplexity of a held-out text (a file no test or training set uses) in each numerics, teacher-forced
in chunks; how often the two numerics' next-token argmax agree along it; and greedy continuations of
a few stretches of it in each numerics, compared token by token (the first position they part).
The q8 numerics is the default only while its perplexity stays within 0.5% of fp32's (issue 40).
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from vericache.engine.engine import Engine
from vericache.model.loader import load_model
from vericache.sampling import SamplingParams

NUMERICS = ("fp32", "q8")
PPL_BUDGET = 0.005   # q8 stays the default within this relative perplexity of fp32's


@torch.inference_mode()
def _chunk_logits(loaded, ids: list[int], chunk: int) -> list[torch.Tensor]:
    """Each chunk's logits [T, V] (the module's forward over the chunk alone: causal attention)."""
    out = []
    for at in range(0, len(ids) - 1, chunk):
        piece = torch.tensor(ids[at : at + chunk + 1])
        if piece.numel() < 2:
            break
        out.append(loaded.model(piece[:-1], [0], [piece.numel() - 1]).float())
    return out


def run_numerics_quality(model: str, text: Path, tokens: int = 4096, chunk: int = 1024, prompts: int = 4,
                         new_tokens: int = 48, log=print) -> dict:
    ids = None
    logits, greedy, ppl, seconds = {}, {}, {}, {}
    for numerics in NUMERICS:
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
    agree = sum((a.argmax(-1) == b.argmax(-1)).sum().item() for a, b in zip(logits["fp32"], logits["q8"]))
    total = sum(a.shape[0] for a in logits["fp32"])

    def parted(a: list[int], b: list[int]) -> int:
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    same_prefix = [parted(a, b) for a, b in zip(greedy["fp32"], greedy["q8"])]
    rel = ppl["q8"] / ppl["fp32"] - 1
    from vericache_lab.bench.common import cpu_model

    return {"model": model, "cpu": cpu_model(), "text": str(text), "tokens": total + len(logits["fp32"]),
            "chunk": chunk, "perplexity": {k: round(v, 4) for k, v in ppl.items()},
            "q8_over_fp32_perplexity": round(rel, 5), "within_budget": abs(rel) <= PPL_BUDGET,
            "top1_agreement": round(agree / total, 4),
            "greedy_tokens_identical_before_parting": same_prefix, "greedy_new_tokens": new_tokens}
