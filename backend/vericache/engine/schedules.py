"""P1: when each complete draft's full KV goes on the link (offloaded vericache only). All lossless.

- ``naive``: everyone drafts, then every request is transferred and verified (the control; its
  verification still reads layer i while layer i+1 is in flight).
- ``staggered``: a request whose draft is complete queues its transfer at once and the others keep
  drafting; with ``draft_len="auto"`` a new draft is stretched to cover the link's measured backlog,
  so requests fall into phase-shifted groups of one.
- ``grouped``: explicit phase groups, ``G`` planned from the measured link rate and draft-step time
  (``engine.stagger.group_count``, re-planned every round); one group at a time is on the link and
  its members start their transfers together, so each group is verified in one batch; a member
  waiting for its group's turn drafts on while its drafts are mostly accepted (P2).

A schedule reads the engine (requests, measured rates) and calls ``loop.start_transfer(req)``.
"""

from __future__ import annotations

from vericache.engine.request import Request, State
from vericache.engine.stagger import group_count

SCHEDULERS = ("naive", "staggered", "grouped")


class Naive:
    name = "naive"
    verifies_in_turn = True   # nothing else runs meanwhile: verify layer by layer, one request at a time

    def may_draft(self, loop, req: Request) -> bool:
        """Naive: nobody drafts while verifications are pending (all draft, then all verify)."""
        return not loop.memory.is_offloaded(req) or not loop.requests.in_state(State.TRANSFERRING)

    def new_round(self, loop, req: Request, k: int) -> int:
        return k

    def start_transfers(self, loop, drafting: list[Request]) -> None:
        complete = [r for r in drafting if r.round.complete]
        if complete and len(complete) == len(drafting) and not loop.requests.in_state(State.TRANSFERRING):
            for r in complete:
                loop.start_transfer(r)


class Staggered(Naive):
    name = "staggered"
    verifies_in_turn = False

    def may_draft(self, loop, req: Request) -> bool:
        return True

    def new_round(self, loop, req: Request, k: int) -> int:
        policy = req.opts.policy
        if k and policy.fixed is None:
            k = max(k, min(self.draft_to_cover_link(loop), policy.max_len, req.seq.remaining - 1))
        return k

    def start_transfers(self, loop, drafting: list[Request]) -> None:
        for r in drafting:  # the link works (and queues) while the others keep drafting
            if r.round.complete:
                loop.start_transfer(r)

    @staticmethod
    def draft_to_cover_link(loop) -> int:
        """Draft steps that fit in the link's current backlog: a request that would only wait for the
        link drafts meanwhile, so its next transfer buys more tokens."""
        rates = loop.measured_rates()
        if rates is None:
            return 0
        rate, step_s = rates
        queued = sum(loop.memory.verify_buffer_bytes(r) for r in loop.requests.in_state(State.TRANSFERRING)
                     if not r.transfer.ready())
        return int(queued / rate / step_s)


class Grouped(Staggered):
    name = "grouped"

    def __init__(self) -> None:
        self.groups, self.turn = 2, 0
        self.plans = [0, 0]   # (sum of planned group counts, plans): ``mean_groups``

    @property
    def mean_groups(self) -> float:
        total, plans = self.plans
        return total / plans if plans else 0.0

    def new_round(self, loop, req: Request, k: int) -> int:
        k = super().new_round(loop, req, k)
        req.group = req.id % self._plan(loop, k)
        return k

    def start_transfers(self, loop, drafting: list[Request]) -> None:
        """Put the next group whose drafts are all complete on the link, unless another group's
        transfers are still in flight (one group on the link while the others draft)."""
        for r in drafting:  # waiting for its group's turn, drafts mostly accepted: draft on (P2)
            policy, rs = r.opts.policy, r.round
            if rs.k and rs.complete and policy.fixed is None and r.policy_state.ema_accepted >= 0.75 * rs.k:
                rs.k = min(rs.k + 1, policy.max_len, max(r.seq.remaining - 1, rs.k))
        on_link = {r.group for r in loop.requests.in_state(State.TRANSFERRING) if not r.transfer.ready()}
        groups: dict[int, list[Request]] = {}
        for r in drafting:
            groups.setdefault(r.group, []).append(r)
        for g in sorted(groups, key=lambda g: (g - self.turn) % max(self.groups, g + 1)):  # round robin
            if on_link - {g}:
                return
            if all(r.round.complete for r in groups[g]):
                for r in groups[g]:
                    loop.start_transfer(r)
                self.turn = g + 1
                on_link.add(g)

    def _plan(self, loop, draft_len: int) -> int:
        """Re-plan the group count from the measured link rate and draft-step time."""
        rates = loop.measured_rates()
        vc = loop.requests.in_state(State.DRAFTING, State.TRANSFERRING)
        if rates is not None and vc:
            rate, step_s = rates
            per_request_s = sum(loop.memory.streamed(r.full.nbytes()) for r in vc) / len(vc) / rate
            self.groups = group_count(len(vc), per_request_s, step_s, draft_len)
        self.plans[0] += self.groups
        self.plans[1] += 1
        return self.groups


def make_schedule(name: str):
    if name not in SCHEDULERS:
        raise ValueError(f"scheduler must be one of {', '.join(SCHEDULERS)}, got {name!r}")
    return {"naive": Naive, "staggered": Staggered, "grouped": Grouped}[name]()
