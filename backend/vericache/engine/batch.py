"""One engine step's forward: every kind of row packed into a single pass.

Prefill chunks, decode rows (full, lossy), draft rows and verification chunks of different
requests go through the model together, so the weights are read once per step whatever the mix.
Each row attends through its own cache object (``model.llama.AttentionCache``); only the rows
that are sampled from get logits (the LM head over a whole prefill chunk would be wasted work).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import torch

from vericache.engine.request import Request

class RowKind(StrEnum):
    PREFILL = "prefill"   # a chunk of a prompt into the caches
    DECODE = "decode"     # one token of a full or lossy request
    DRAFT = "draft"       # one draft token over the compressed cache
    VERIFY = "verify"     # a round's chunk [x, d1 .. dk] over the full KV


@dataclass
class Row:
    req: Request
    kind: RowKind
    tokens: list[int]
    start: int                # position of tokens[0]
    cache: object
    logits_for: str           # "last", "all" or "none"
    logits: torch.Tensor | None = None   # [1, V] ("last") or [len(tokens), V] ("all") after run()
    argmax: list[int] | None = None      # the greedy choice of each logits row (one device sync a step)


class StepBatch:
    def __init__(self) -> None:
        self.rows: list[Row] = []

    def add(self, req: Request, kind: RowKind, tokens: list[int], start: int, cache: object,
            logits_for: str = "last") -> None:
        self.rows.append(Row(req, kind, tokens, start, cache, logits_for))

    @property
    def kinds(self) -> str:
        """The kinds of work in this step, for timelines ("draft+verify")."""
        return "+".join(k for k in RowKind if any(r.kind == k for r in self.rows))

    def attention_work(self) -> tuple[int, int, int]:
        """(rows, K/V bytes read, query-key pairs per query head and layer) of this step's forward,
        from each row's cache before it runs: what the roofline charges (``sim.roofline``)."""
        rows = kv_bytes = pairs = 0
        for row in self.rows:
            cost = getattr(row.cache, "attention_cost", None)   # a cache that cannot say counts nothing
            b, p = cost(row.start, len(row.tokens)) if cost else (0, 0)
            rows, kv_bytes, pairs = rows + len(row.tokens), kv_bytes + b, pairs + p
        return rows, kv_bytes, pairs

    def of(self, kind: RowKind) -> list[Row]:
        return [r for r in self.rows if r.kind == kind]

    def run(self, model, device: torch.device, draft_weights: str = "fp32") -> None:
        """One forward over all rows; fills each row's ``logits``. With ``draft_weights`` "int8" or
        "int4" (the model's ``quantize_drafts`` copies) the draft rows go first and read them; every
        other row reads the exact weights."""
        rows = self.rows
        if draft_weights != "fp32" and self.of(RowKind.DRAFT):
            if model.draft_weights != draft_weights:  # engines sharing one model may draft on different copies
                model.quantize_drafts(draft_weights)
            rows = sorted(rows, key=lambda r: r.kind != RowKind.DRAFT)    # stable: the others keep their order
        n_draft = sum(len(r.tokens) for r in rows if r.kind == RowKind.DRAFT) if rows is not self.rows else 0
        tokens, index, offset = [], [], 0
        for row in rows:
            tokens.extend(row.tokens)
            n = len(row.tokens)
            if row.logits_for == "all":
                index.extend(range(offset, offset + n))
            elif row.logits_for == "last":
                index.append(offset + n - 1)
            offset += n
        extra = {"n_draft": n_draft} if n_draft else {}
        logits = model(torch.tensor(tokens, device=device), [r.start for r in rows],
                       [len(r.tokens) for r in rows], [r.cache for r in rows],
                       logits_index=torch.tensor(index, dtype=torch.long, device=device), **extra)   # [len(index), V]
        top = logits.argmax(dim=-1).tolist()
        at = 0
        for row in rows:
            n = {"all": len(row.tokens), "last": 1}.get(row.logits_for, 0)
            row.logits, row.argmax = (logits[at : at + n], top[at : at + n]) if n else (None, None)
            at += n
