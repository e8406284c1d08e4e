"""The offload policy (offloaded VeriCache: full KV in the host tier): when each complete draft's full
KV goes on the link, when its verification may start, and how long drafts run meanwhile. One object
(``Offload``) the scheduler asks (``may_draft``, ``can_verify``), the draft planner tells of new rounds
(``on_new_round``) and the loop tells to move (``start_transfers``); it reads the requests and the
measured rates, never the loop. The draft lengths are the planner's (``engine.scheduler.DraftPlanner``). All lossless.

The link schedules (P1):
- ``naive``: everyone drafts, then every request is transferred and verified (the control; its
  verification still reads layer i while layer i+1 is in flight).
- ``staggered``: a request whose draft is complete queues its transfer at once and the others keep
  drafting; with ``draft_len="auto"`` the planner stretches a new draft to cover the link's measured
  backlog (``stretches``), so requests fall into phase-shifted groups of one.
- ``grouped``: explicit phase groups, ``G`` planned from the measured link rate and draft-step time
  (``group_count``, re-planned every round); one group at a time is on the link and its members start
  their transfers together, so each group is verified in one batch; a member waiting for its group's
  turn drafts on while its drafts are mostly accepted (P2: the planner's ``extend_waiting``).

How many groups (``group_count``): the link moves one group's full KV while compute runs the other
groups' draft steps. With ``n`` requests in ``G`` groups, one group's transfer takes ``(n / G) * t_x``
and meanwhile the others run draft steps of ``t_d`` each; the link is hidden when one group's transfer
fits in one draft round of ``k`` steps: ``G >= n * t_x / (k * t_d)``. Fewer groups mean bigger
verification batches, so the plan takes the smallest such G: at least 2 (one group drafts while
another verifies), at most n; 2 before anything is measured.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from vericache.engine.memory import KVMemory
from vericache.engine.requests import Instruments, Request, RequestTable, State
from vericache.kv.full import FullKVCache
from vericache.kv.link import CudaLink, EmulatedLink, Link
from vericache.model.loader import LoadedModel

SCHEDULERS = ("naive", "staggered", "grouped")
MakeRoom = Callable[[int, tuple[str, int], Request], None]   # (bytes, device key, for whom): preempts to fit
Extend = Callable[[Request], None]                 # the draft planner's ``extend_waiting``


def group_count(n: int, transfer_s: float, draft_step_s: float, draft_len: int) -> int:
    """Groups for ``n`` requests whose full KV takes ``transfer_s`` each to move, with draft steps of
    ``draft_step_s`` and rounds of ``draft_len`` tokens."""
    if n < 0 or draft_len < 0:
        raise ValueError(f"n and draft_len must be >= 0, got n={n}, draft_len={draft_len}")
    if n <= 1:
        return 1
    if transfer_s <= 0 or draft_step_s <= 0 or draft_len == 0:
        return 2  # nothing measured yet: the two-phase ping-pong
    need = math.ceil(n * transfer_s / (draft_len * draft_step_s))
    return max(2, min(n, need))


class Offload:
    def __init__(self, schedule: str, loaded: LoadedModel, memory: KVMemory, requests: RequestTable,
                 instruments: Instruments, make_room: MakeRoom, extend: Extend, link: Link | None = None) -> None:
        if schedule not in SCHEDULERS:
            raise ValueError(f"scheduler must be one of {', '.join(SCHEDULERS)}, got {schedule!r}")
        self.schedule = {"naive": Naive, "staggered": Staggered, "grouped": Grouped}[schedule]()
        self.cfg, self.loaded = loaded.config, loaded
        self.memory, self.requests, self.instruments, self.make_room = memory, requests, instruments, make_room
        self.extend = extend
        self.link = link  # made on first use when None (``ensure_link``)

    def ensure_link(self) -> Link:
        """The first offloaded request needs a link: the device's copy engine, or an emulated one."""
        if self.link is None:
            dev = self.loaded.device
            self.link = CudaLink(dev) if dev.type == "cuda" else EmulatedLink(gbps=32)
        return self.link

    # ------------------------------------------------------------------ what the scheduler asks
    @property
    def stretches(self) -> bool:
        """Whether a new "auto" draft is stretched to cover the link's backlog (not under naive)."""
        return self.schedule.stretches

    def on_new_round(self, req: Request, k: int) -> None:
        """An offloaded request starts a round of ``k`` drafts (the grouped schedule assigns its group)."""
        self.schedule.on_new_round(self, req, k)

    def may_draft(self, req: Request) -> bool:
        return self.schedule.may_draft(self, req)

    def can_verify(self, req: Request) -> bool:
        """Start verifying before the last layers land when, at the measured rates, they will land
        before the forward reaches them: r layers still in flight take r * t_link_layer, the forward
        spends (L - r) * t_verify_layer on the layers already there."""
        streamed = req.drafting.on_link().dst.layers
        done = req.drafting.on_link().layers_done()
        if done == streamed:
            return True
        if self.schedule.verifies_in_turn:
            return req is min(self.requests.in_state(State.TRANSFERRING), key=lambda r: r.id)
        ahead = self.memory.resident_layers + done  # layers the forward can do without waiting
        rates = self.measured_rates()
        if rates is None or self.instruments.verify_layer_s <= 0 or ahead == 0:
            return False
        link_layer_s = req.kv.full_kv().nbytes() / self.cfg.num_hidden_layers / rates[0]
        return (streamed - done) * link_layer_s <= ahead * self.instruments.verify_layer_s

    # ------------------------------------------------------------------ what the loop tells it
    def start_transfers(self) -> None:
        """After a step: put complete drafts' full KV on the link, as the schedule says."""
        self.schedule.start_transfers(self, self.requests.in_state(State.DRAFTING))

    def start_transfer(self, req: Request) -> bool:
        """Reserve a device buffer for the request's full KV and queue it on the link."""
        if req.state != State.DRAFTING or not req.drafting.round.complete:
            return False
        nbytes = self.memory.verify_buffer_bytes(req)
        key = ("verify", req.id)
        if not self.memory.device.can_fit(nbytes, key):
            if not self.requests.in_state(State.TRANSFERRING):  # no buffer will come back by itself
                self.make_room(nbytes, key, req)
            if not self.memory.device.can_fit(nbytes, key):
                if not [o for o in self.memory.device.owners() if o[1] != req.id]:
                    # nothing else holds the device, so nothing will make room: waiting would never end
                    self.requests.fail(req, f"the verification buffer ({nbytes} bytes) does not fit the device "
                                            f"budget ({self.memory.device.capacity_bytes} bytes) beside this "
                                            f"request's own KV ({self.memory.device.used_bytes} bytes)")
                return False  # no room for the buffer now; retry next step
        self.memory.device.resize(key, nbytes)
        first = self.memory.resident_layers
        buf = FullKVCache(self.cfg, self.loaded.device, self.loaded.kv_dtype, capacity=req.kv.full_kv().length + req.drafting.round.k + 1,
                          layers=self.cfg.num_hidden_layers - first)
        req.drafting.transfer = self.ensure_link().submit(req.kv.full_kv(), req.kv.full_kv().length, buf, first_layer=first)
        self.requests.set_state(req, State.TRANSFERRING)
        return True

    def wait_if_idle(self) -> None:
        """Nothing to compute until a transfer lands (no prefill, decode or unfinished draft): block
        on the oldest one rather than spin."""
        in_flight = self.requests.in_state(State.TRANSFERRING)
        if in_flight and not self.requests.in_state(State.PREFILL, State.DECODING) and not any(
                not r.drafting.round.complete for r in self.requests.in_state(State.DRAFTING)):
            min(in_flight, key=lambda r: r.id).drafting.on_link().wait_all()

    # ------------------------------------------------------------------ measured
    def measured_rates(self) -> tuple[float, float] | None:
        """(link bytes per second, seconds per draft step), measured so far; None before both exist."""
        stats = self.link.stats if self.link is not None else None
        step_s = self.instruments.draft_step_s()
        if stats is None or stats.busy_s <= 0 or step_s is None:
            return None
        return stats.bytes_moved / stats.busy_s, step_s

    def draft_to_cover_link(self) -> int:
        """Draft steps that fit in the link's current backlog: a request that would only wait for the
        link drafts meanwhile, so its next transfer buys more tokens."""
        rates = self.measured_rates()
        if rates is None:
            return 0
        rate, step_s = rates
        queued = sum(self.memory.verify_buffer_bytes(r) for r in self.requests.in_state(State.TRANSFERRING)
                     if not r.drafting.on_link().ready())
        return int(queued / rate / step_s)

    @property
    def mean_groups(self) -> float:
        """The grouped schedule's mean planned group count (0 for the others)."""
        return self.schedule.mean_groups


class Naive:
    verifies_in_turn = True   # nothing else runs meanwhile: verify layer by layer, one request at a time
    stretches = False

    @property
    def mean_groups(self) -> float:
        """Planned verification groups (``Grouped`` plans them; none here)."""
        return 0.0

    def may_draft(self, off: Offload, req: Request) -> bool:
        """Naive: nobody drafts while verifications are pending (all draft, then all verify)."""
        return not off.requests.in_state(State.TRANSFERRING)

    def on_new_round(self, off: Offload, req: Request, k: int) -> None:
        pass

    def start_transfers(self, off: Offload, drafting: list[Request]) -> None:
        complete = [r for r in drafting if r.drafting.round.complete]
        if complete and len(complete) == len(drafting) and not off.requests.in_state(State.TRANSFERRING):
            for r in complete:
                off.start_transfer(r)


class Staggered(Naive):
    verifies_in_turn = False
    stretches = True

    def may_draft(self, off: Offload, req: Request) -> bool:
        return True

    def start_transfers(self, off: Offload, drafting: list[Request]) -> None:
        for r in drafting:  # the link works (and queues) while the others keep drafting
            if r.drafting.round.complete:
                off.start_transfer(r)


class Grouped(Staggered):
    def __init__(self) -> None:
        self.groups, self.turn = 2, 0
        self.plans = [0, 0]   # (sum of planned group counts, plans): ``mean_groups``

    @property
    def mean_groups(self) -> float:
        total, plans = self.plans
        return total / plans if plans else 0.0

    def on_new_round(self, off: Offload, req: Request, k: int) -> None:
        req.drafting.group = req.id % self._plan(off, k)

    def start_transfers(self, off: Offload, drafting: list[Request]) -> None:
        """Put the next group whose drafts are all complete on the link, unless another group's
        transfers are still in flight (one group on the link while the others draft)."""
        for r in drafting:  # waiting for its group's turn, drafts mostly accepted: draft on (P2)
            off.extend(r)
        on_link = {r.drafting.group for r in off.requests.in_state(State.TRANSFERRING) if not r.drafting.on_link().ready()}
        groups: dict[int, list[Request]] = {}
        for r in drafting:
            groups.setdefault(r.drafting.group, []).append(r)
        for g in sorted(groups, key=lambda g: (g - self.turn) % max(self.groups, g + 1)):  # round robin
            if on_link - {g}:
                return
            if all(r.drafting.round.complete for r in groups[g]):
                for r in groups[g]:
                    off.start_transfer(r)
                self.turn = g + 1
                on_link.add(g)

    def _plan(self, off: Offload, draft_len: int) -> int:
        """Re-plan the group count from the measured link rate and draft-step time."""
        rates = off.measured_rates()
        vc = off.requests.in_state(State.DRAFTING, State.TRANSFERRING)
        if rates is not None and vc:
            rate, step_s = rates
            per_request_s = sum(off.memory.streamed(r.kv.full_kv().nbytes()) for r in vc) / len(vc) / rate
            self.groups = group_count(len(vc), per_request_s, step_s, draft_len)
        self.plans[0] += self.groups
        self.plans[1] += 1
        return self.groups
