"""Quality of a (bundled) model: held-out code loss, retrieval and tool-call exact match.

Used by ``vericache eval-model`` and by the trainer's periodic evaluation.
Retrieval and tool-call prompts use the *held-out* layouts of
``vericache_lab.data.tasks`` by default, so the score measures copying from far
back rather than memorised formats.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vericache.kv.full import FullKVCache
from vericache.model.llama import Transformer
from vericache.model.tokenizer import Tokenizer
from vericache_lab.data.tasks import Task, retrieval_task, tool_call_task


@torch.no_grad()
def heldout_loss(model: Transformer, token_stream: list[int], window: int = 1024,
                 max_windows: int = 16) -> float:
    """Mean next-token cross-entropy (nats/token) over non-overlapping windows of held-out code."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for i in range(0, min(len(token_stream) - 1, window * max_windows), window):
        chunk = torch.tensor(token_stream[i : i + window + 1], device=device)
        if chunk.numel() < 2:
            break
        logits = model(chunk[:-1], [0], [chunk.numel() - 1])
        total += F.cross_entropy(logits, chunk[1:], reduction="sum").item()
        count += chunk.numel() - 1
    return total / max(count, 1)


@torch.no_grad()
def greedy_continue(model: Transformer, prompt_ids: list[int], max_new: int, stop_id: int | None) -> list[int]:
    """Greedy continuation with a full KV cache (a minimal loop; the engine has the full one)."""
    p = next(model.parameters())
    cache = FullKVCache(model.config, p.device, p.dtype, capacity=len(prompt_ids) + max_new)
    ids = torch.tensor(prompt_ids, device=p.device)
    logits = model(ids, [0], [len(prompt_ids)], [cache], logits_index=torch.tensor([len(prompt_ids) - 1]))
    out: list[int] = []
    pos = len(prompt_ids)
    for _ in range(max_new):
        nxt = int(logits[-1].argmax())
        out.append(nxt)
        if nxt == stop_id:
            break
        logits = model(torch.tensor([nxt], device=p.device), [pos], [1], [cache])
        pos += 1
    return out


def build_prompt(tok: Tokenizer, task: Task, filler: list[int], context_tokens: int,
                 rng: random.Random) -> tuple[list[int], str]:
    """Context literal, then code filler up to ``context_tokens``, then the (first) query."""
    prompt, answer = task.queries[0]
    head = tok.encode(task.context + "\n")
    tail = tok.encode("\n\n" + prompt)
    room = max(context_tokens - len(head) - len(tail), 0)
    start = rng.randrange(max(len(filler) - room, 1))
    return head + filler[start : start + room] + tail, answer


def _n_entries_for(context_tokens: int, rng: random.Random) -> int:
    return rng.randint(8, max(9, context_tokens // 40))


@dataclass
class TaskScore:
    exact_match: float
    n: int


def retrieval_exact_match(model: Transformer, tok: Tokenizer, filler: list[int], n: int = 20,
                          context_tokens: int = 1536, heldout: bool = True, seed: int = 1234) -> TaskScore:
    rng = random.Random(seed)
    newline = tok.encode("\n")
    hits = 0
    for _ in range(n):
        task = retrieval_task(rng, _n_entries_for(context_tokens, rng), heldout=heldout)
        ids, answer = build_prompt(tok, task, filler, context_tokens, rng)
        out = greedy_continue(model, ids, max_new=len(tok.encode(answer)) + 2,
                              stop_id=newline[0] if len(newline) == 1 else None)
        hits += tok.decode(out).split("\n")[0].strip() == answer.strip()
    return TaskScore(hits / n, n)


def _parse_args(text: str) -> dict | None:
    try:
        obj, _ = json.JSONDecoder().raw_decode(text)
        return obj if isinstance(obj, dict) else None
    except json.JSONDecodeError:
        return None


def toolcall_exact_match(model: Transformer, tok: Tokenizer, filler: list[int], n: int = 20,
                         context_tokens: int = 1024, heldout: bool = True, seed: int = 4321) -> TaskScore:
    """Share of calls whose generated ``arguments`` object equals the expected one exactly."""
    rng = random.Random(seed)
    hits = 0
    for _ in range(n):
        task = tool_call_task(rng, n_events=rng.randint(6, 20), heldout=heldout)
        ids, answer = build_prompt(tok, task, filler, context_tokens, rng)
        out = greedy_continue(model, ids, max_new=len(tok.encode(answer)) + 4, stop_id=None)
        got = _parse_args(tok.decode(out))
        hits += got is not None and got == json.loads(answer.rsplit("}", 1)[0])
    return TaskScore(hits / n, n)

