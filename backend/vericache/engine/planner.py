"""The one owner of every draft length: a new round's, a lookup proposal's, a waiting draft's (P2).

The policy (``drafting.round.DraftLengthPolicy``) adapts a request's length to its acceptance; the step
costs (``drafting.cost``) and the link's backlog (``engine.offload``) decide where each applies.
"""

from __future__ import annotations

from collections.abc import Callable

from vericache.drafting.cost import Calibrated, DraftCost
from vericache.drafting.round import draft_position
from vericache.engine.offload import Offload
from vericache.engine.requests import Instruments, Request


class DraftPlanner:
    """The one owner of a round's draft length. The scheduler asks it when a round starts
    (``new_round``) and, for the grouped link schedule, whether a complete draft waiting for its
    group's turn may draft on (``extend_waiting``); nothing else sets a length. In this order:
    1. the request's policy (``DraftLengthPolicy``): a fixed length, or "auto"'s length adapted to the
       request's acceptance (0 while it cools down after failed rounds: plain full steps);
    2. "auto" with the full KV here (in place): the fitted step costs (``drafting.cost``), the k that
       maximises tokens per second at this acceptance, this many requests and these caches;
    3. "auto" with the full KV behind a link (tiered): the link's backlog (``engine.offload``'s
       staggered and grouped schedules): a request that would only wait for the link drafts meanwhile,
       so its transfer buys more tokens; a grouped request whose complete draft waits for its group's
       turn drafts on while its drafts are mostly accepted (P2)."""

    def __init__(self, offload: Offload, n_active: Callable[[], int],
                 instruments: Instruments, calibrate: Callable[[], Calibrated] | None = None) -> None:
        """``offload``: the engine's ``Offload`` (for requests whose placement is offloaded: full KV behind the link);
        ``n_active()``: requests drafting or decoding now; ``instruments``: the measured steps;
        ``calibrate``: the model's timed forwards (``drafting.calibrate.Calibration``), asked once at the first choice."""
        self.offload, self.n_active, self.instruments = offload, n_active, instruments
        self.cost = DraftCost(calibrate=calibrate)   # draft lengths from this engine's step costs

    def new_round(self, r: Request) -> int:
        """The draft length of ``r``'s next round (0: a plain full-KV step)."""
        policy = r.opts.policy
        k = policy.next_len(r.drafting.policy_state, r.seq.remaining)
        if r.placement.offloaded:
            if k and policy.fixed is None and self.offload.stretches:
                k = max(k, min(self.offload.draft_to_cover_link(), policy.max_len, r.seq.remaining - 1))
            self.offload.on_new_round(r, k)
        elif k > 0 and policy.fixed is None and r.placement.verifies_in_place:
            k = self._cost_len(r, k)   # full KV here: the local step costs decide
        return k

    def proposal(self, r: Request) -> list[int]:
        """Lookup proposal tokens for ``r``'s next draft step (``drafting.lookup``), [] for a single row:
        where its committed tokens hold the last 3 (or 2) tokens earlier, what followed them, as many
        as the round has room for beyond the step's own draft and the fitted costs find worth checking."""
        if r.drafting.lookup is None:
            return []
        rs, seq = r.drafting.round, r.seq
        room = rs.k - len(rs.drafts) - 1
        if room < 1:
            return []
        tokens = seq.prompt_ids + seq.output_ids
        r.drafting.lookup.extend(tokens)
        proposal = r.drafting.lookup.propose(tokens, (tokens[-3:] + rs.drafts)[-3:], room)
        if not proposal:
            return []
        pos = r.position + len(rs.drafts)
        self.cost.refit(self.instruments.steps, self.instruments.n_steps)
        n = self.cost.proposal_len(r.drafting.lookup.keep_rate(), self.n_active(),
                                   lambda rows: r.kv.draft_kv().attention_cost(pos, rows), len(proposal))
        return proposal[:n]

    def extend_waiting(self, r: Request) -> None:
        """A complete draft waiting for its group's turn on the link: one more token while its drafts are
        mostly accepted (P2; "auto" only, within the policy's maximum and the request's budget)."""
        policy, rs = r.opts.policy, r.drafting.round
        if rs.k and rs.complete and policy.fixed is None and r.drafting.policy_state.ema_accepted >= 0.75 * rs.k:
            rs.k = min(rs.k + 1, policy.max_len, max(r.seq.remaining - 1, rs.k))

    def _cost_len(self, r: Request, k: int) -> int:
        """The draft length the step costs call for (``DraftCost``: calibrated on the model, then fitted
        to the engine's own forwards); the policy's ``k`` when no costs exist. Where they find plain full
        steps faster than any round at the request's acceptance, the request decodes full steps (the same
        tokens either way: ``cooldown`` of them, doubling up to 16x while the costs keep saying so), then
        asks again as a probe. A probe, and a request's first round, is priced at an optimistic acceptance
        (``DraftState.acceptance``): where a round may pay at it, the request drafts the policy's ``k`` (one
        request at 8K: a long first round measures a high acceptance at once); where even then no round
        pays, it drafts nothing and decodes full steps as above, so a request whose rounds cannot pay runs
        as full mode does (8 x 8K of the 0.5B code model on AMX: a verified row's fp32 attention costs
        two thirds of a full row, and short probe rounds there cost 12%: "never slower than full"). Until
        the engine's own fit exists the calibration only vetoes rounds (timed on random K/V it prices
        attention above real steps' cost: ~60 vs ~42 ms a row at 8K on a Zen 2), so the policy sizes the
        rounds it lets through. The draft row is priced at the drafter's last commit (``draft_position``)."""
        st, policy = r.drafting.policy_state, r.opts.policy
        probing = st.probe or not st.measured
        pos, k_max, n = r.position, min(policy.max_len, r.seq.remaining - 1), self.n_active()
        self.cost.refit(self.instruments.steps, self.instruments.n_steps)
        choice = self.cost.choose(st.acceptance(optimistic=probing), n,
                                  r.kv.draft_kv().attention_cost(draft_position(r.kv.draft_kv(), pos), 1),
                                  lambda j: r.kv.full_kv().attention_cost(pos, j + 1), k_max)
        if choice is None:
            return k
        if choice == 0:   # no round pays (probing: not even at the optimistic acceptance): full steps a while
            st.backoff = min(2 * st.backoff, 16 * policy.cooldown) if st.backoff else policy.cooldown
            st.cooldown, st.probe = st.backoff, True
            st.cost_fallbacks += 1
            return 0
        st.backoff = 0
        if probing:   # explore at the policy's length: a long first round measures a high acceptance at once
            st.probe = False
            return k
        if self.cost.source != "fitted":
            return k   # the calibration may veto rounds; until the engine's own fit, the policy sizes them
        return choice
