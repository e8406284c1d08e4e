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
That rate is measured two ways: the drafter's checks, and, for free, every output token committed
(``extend``): whether it is what a proposal at that point would have offered (while the cost model
declines rounds, plain full steps still show whether the text copies its context, so the first round
can be priced at the rate the text shows, not at a prior: the code model at 8K on a context that
repeats, 0.99x full with rounds declined, 1.27x drafted from the proposals the output showed it follows).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import overload

NGRAMS = (3, 2)   # the tail lengths matched, longest first


class Joined(Sequence[int]):
    """``head`` then ``tail`` as one read-only sequence, neither copied: a request's committed tokens
    (prompt, then output) asked for several times a step, where joining a 32K prompt to its output
    copied 32K references each time (~0.04 ms)."""

    def __init__(self, head: Sequence[int], tail: Sequence[int]) -> None:
        self.head, self.tail = head, tail

    def __len__(self) -> int:
        return len(self.head) + len(self.tail)

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> list[int]: ...

    def __getitem__(self, i: int | slice) -> int | list[int]:
        n = len(self.head)
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self))
            if step != 1:
                raise ValueError(f"Joined slices take step 1, got {step}")
            return list(self.head[start : min(stop, n)]) + list(self.tail[max(start - n, 0) : max(stop - n, 0)])
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self.head[i] if i < n else self.tail[i - n]


@dataclass
class LookupIndex:
    """The latest start of each 3- and 2-gram of a request's committed tokens (prompt, then output)
    that has a next token; extended as tokens are committed, so a lookup is one dict probe."""
    latest: dict[tuple[int, ...], int] = field(default_factory=dict)
    indexed: int = 0          # tokens indexed so far
    proposed: int = 0         # proposal tokens checked by the drafter (all rounds)
    kept: int = 0             # of them, the drafter agreed with
    misses: int = 0           # proposals the drafter left before their end
    followed: int = 0         # output tokens a proposal at their place would have offered first ...
    diverged: int = 0         # ... and those where it offered another

    def extend(self, tokens: Sequence[int], observe_from: int | None = None) -> None:
        """Index the n-grams of ``tokens`` (all committed tokens so far) whose next token is new; each new
        token at or past ``observe_from`` (the prompt's length: output tokens) is first checked against
        the proposal the index held just before it (``followed`` / ``diverged``)."""
        n, latest = len(tokens), self.latest
        observe = n if observe_from is None else observe_from
        lo = max(self.indexed - max(NGRAMS), 0)
        new = list(tokens[lo:n])   # the new tokens and the n-grams ending at them, one slice: new[j] = tokens[lo + j]
        for i in range(max(self.indexed, 1), n):   # token i: its n-grams' starts i - g end just before it
            j = i - lo
            if i >= observe:
                starts = [latest.get(tuple(new[j - g : j])) for g in NGRAMS if i >= g]
                s, g = next(((s, g) for s, g in zip(starts, NGRAMS) if s is not None), (None, 0))
                if s is not None:
                    if tokens[s + g] == new[j]:
                        self.followed += 1
                    else:
                        self.diverged += 1
            for g in NGRAMS:
                if i >= g:
                    latest[tuple(new[j - g : j])] = i - g
        self.indexed = max(self.indexed, n)

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
        """Per-token chance a proposal token is kept (Laplace-smoothed geometric estimate): from the
        drafter's checks and the committed output tokens a proposal would have offered."""
        agreed = self.kept + self.followed
        return (agreed + 1) / (agreed + self.misses + self.diverged + 2)

    def evidence(self) -> int:
        """Proposal tokens the keep rate rests on: the drafter's checks and the observed output tokens."""
        return self.kept + self.misses + self.followed + self.diverged

    def record(self, proposed: int, kept: int) -> None:
        self.proposed, self.kept, self.misses = self.proposed + proposed, self.kept + kept, self.misses + (kept < proposed)
