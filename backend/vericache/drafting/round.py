"""One VeriCache round, in one place: draft, verify, accept, commit.

A round for a request whose last token x (at position n) is not yet in any cache:
  draft   x, d1 .. d(k-1) through the compressed cache -> d1 .. dk          (k cheap steps)
  verify  [x, d1 .. dk] at positions n .. n+k through the full cache -> p0 .. pk   (one forward)
  accept  d(i+1) while it equals p_i's choice; then append p_m's choice (a correction, or a
          bonus token when all k matched). Under sampling: accept with min(1, p/q), else resample
          from normalise(max(p - q, 0)) (Leviathan et al.), so outputs are distributed as full-KV.
  commit  the full cache keeps n .. n+m; the compressed cache drops its speculative tail and takes
          the full-KV K/V of the accepted positions, so the drafter tracks the full model.

The engine (``engine.step_loop``) decides *when* each step of a round runs (and packs the rows of
many requests into one forward); this module decides *what* a step does to one request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from vericache.engine.sequence import Sequence
from vericache.kv.compressed import CompressedKVCache
from vericache.kv.full import FullKVCache
from vericache.sampling import (
    choose_token,
    probs_from_logits,
    sample_token,
    speculative_accept,
)


@dataclass
class RoundState:
    """A request's draft in progress and its acceptance record."""
    started: bool = False                        # k is chosen for the current round
    k: int = 0                                   # tokens to draft this round (0: a plain full-KV step)
    drafts: list[int] = field(default_factory=list)
    qs: list[torch.Tensor | None] = field(default_factory=list)   # the drafter's distributions (sampling)
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def start(self, k: int) -> None:
        self.started, self.k, self.drafts, self.qs = True, k, [], []

    @property
    def complete(self) -> bool:
        """The round's draft is done: it can be verified."""
        return self.started and len(self.drafts) >= self.k

    def reset(self) -> None:
        self.started, self.k, self.drafts, self.qs = False, 0, [], []


def draft_token(seq: Sequence, logits: torch.Tensor, argmax: int | None = None) -> tuple[int, torch.Tensor | None]:
    """The drafter's choice from logits [V]: argmax when greedy (``argmax`` if already known), else a
    draw (with its distribution q)."""
    if seq.params.greedy:
        return (int(logits.argmax()) if argmax is None else argmax), None
    q = probs_from_logits(logits[None], seq.params)[0]
    return sample_token(q, seq.generator), q


def add_draft(seq: Sequence, rs: RoundState, logits: torch.Tensor, argmax: int | None = None) -> None:
    """One draft step's result for this request: logits [V] at its newest draft position."""
    token, q = draft_token(seq, logits, argmax)
    rs.drafts.append(token)
    rs.qs.append(q)


def greedy_accepted(targets: list[int], draft: list[int]) -> int:
    """How many leading draft tokens the verifier's greedy choices ``targets`` (one per verified
    row: the last token's, then each draft token's) agree with."""
    m = 0
    while m < len(draft) and targets[m] == draft[m]:
        m += 1
    return m


def accept_draft(seq: Sequence, target_logits: torch.Tensor, draft: list[int], q: list,
                 targets: list[int] | None = None) -> int:
    """Append accepted draft tokens and the verifier's token; returns m, the accepted draft count.

    target_logits: [k+1, V], the verifier's logits at the last token and at each draft token;
    ``targets``: their argmax, when already known.
    """
    params = seq.params
    if params.greedy and targets is None:  # one argmax over the chunk: no per-row device sync
        targets = target_logits.argmax(dim=-1).tolist()
    for i, d in enumerate(draft):
        if params.greedy:
            ok, replacement = targets[i] == d, targets[i]
        else:
            p = probs_from_logits(target_logits[i][None], params)[0]
            ok, replacement = speculative_accept(p, q[i], d, seq.generator)
        if not ok:
            seq.append(replacement)
            return i
        if seq.append(d):
            return i + 1
    seq.append(targets[len(draft)] if params.greedy else
               choose_token(target_logits[len(draft)], params, seq.generator))  # the bonus token
    return len(draft)


def finish_round(seq: Sequence, rs: RoundState, target_logits: torch.Tensor, start: int,
                 full: FullKVCache, draft: CompressedKVCache,
                 write_back: Callable[[int, int], None] | None = None, targets: list[int] | None = None) -> int:
    """Accept against the verifier's logits [k+1, V] for the chunk at ``start``, then commit both
    caches to the accepted positions. ``write_back(start, keep)``, when given, first copies the
    verified positions from the buffer the verification wrote (a device buffer) into ``full``
    (their home tier). Returns m, the accepted count."""
    m = accept_draft(seq, target_logits, rs.drafts, rs.qs, targets)
    keep = start + 1 + m
    if write_back is not None:
        write_back(start, keep)
    full.truncate(keep)
    draft.commit(keep, source=full)
    record_round(rs, len(rs.drafts), m)
    return m


def record_round(rs: RoundState, k: int, m: int) -> None:
    """Count a verified round of ``k`` drafted tokens with ``m`` accepted."""
    rs.rounds, rs.drafted, rs.accepted = rs.rounds + 1, rs.drafted + k, rs.accepted + m
    while len(rs.accepted_per_pos) < k:
        rs.accepted_per_pos.append(0)
    for i in range(m):
        rs.accepted_per_pos[i] += 1
