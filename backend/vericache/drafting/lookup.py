"""Prompt-lookup proposals, composed with the compressed-KV drafter.

Text that copies its context (code being edited, retrieved passages, chat history) need not be drafted
token by token: when the last 3 (else 2) tokens of the request occurred earlier in its prompt or
output, the tokens that followed their latest earlier occurrence are *proposed*. The drafter checks a
proposal in one multi-row step over its compressed cache, rows [t, p1 .. pL] (several tokens for one
weight read, like a verification chunk), and keeps the drafts it would have made anyway: row i's own
choice (argmax, or a draw from its distribution when sampling) is a draft, and row i + 1 counts only
while that choice was p(i+1). A row's bits do not depend on the rows beside it, so the drafts are the
ones single-row drafting gives, only more of them per step; the full verification checks the round
as always (the output cannot change).

Whether a proposal is worth its rows is the cost model's call (``DraftCost.proposal_len``): a step
of L + 1 rows against L + 1 single-row steps, at the request's measured rate of kept proposal tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

NGRAMS = (3, 2)   # the tail lengths matched, longest first


@dataclass
class LookupIndex:
    """The latest start of each 3- and 2-gram of a request's committed tokens (prompt, then output)
    that has a next token; extended as tokens are committed, so a lookup is one dict probe."""
    latest: dict[tuple[int, ...], int] = field(default_factory=dict)
    indexed: int = 0          # tokens indexed so far
    proposed: int = 0         # proposal tokens checked by the drafter (all rounds)
    kept: int = 0             # of them, the drafter agreed with
    misses: int = 0           # proposals the drafter left before their end

    def extend(self, tokens: Sequence[int]) -> None:
        """Index the n-grams of ``tokens`` (all committed tokens so far) whose next token is new."""
        n = len(tokens)
        for g in NGRAMS:
            for s in range(max(self.indexed - g, 0), n - g):
                self.latest[tuple(tokens[s : s + g])] = s
        self.indexed = n

    def propose(self, tokens: Sequence[int], tail: Sequence[int], max_len: int) -> list[int]:
        """Up to ``max_len`` tokens that followed the latest earlier occurrence of ``tail``'s last 3 (or
        2) tokens in ``tokens`` (the committed ones, indexed); [] when there is none."""
        if max_len < 1:
            return []
        for g in NGRAMS:
            if len(tail) >= g:
                s = self.latest.get(tuple(tail[-g:]))
                if s is not None:
                    return list(tokens[s + g : s + g + max_len])
        return []

    def keep_rate(self) -> float:
        """Per-token chance the drafter agrees with a proposal token (Laplace-smoothed geometric estimate)."""
        return (self.kept + 1) / (self.kept + self.misses + 2)

    def record(self, proposed: int, kept: int) -> None:
        self.proposed, self.kept, self.misses = self.proposed + proposed, self.kept + kept, self.misses + (kept < proposed)
