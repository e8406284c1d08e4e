"""The engine loop: continuous batching of full, lossy and VeriCache requests, one forward per step.

``step()`` = schedule -> run -> postprocess:
- schedule (``engine.scheduler``): admit waiting requests while their KV fits the device budget
  (``engine.memory``), then pick this step's rows (``engine.batch``): prefill chunks, decode rows,
  draft rows and verification chunks, a request in at most one row;
- run: one forward over every row, so the weights are read once a step;
- postprocess (``engine.postprocess``): each row's result through ``drafting.round`` (accept,
  commit), finish, free, charge; with ``offload``, the link schedule (``engine.schedules``, P1) puts
  complete drafts on the link (``engine.transfers``). The remote half is ``engine.remote_rounds``.
The requests and their lifecycle (states, release, fail, charge) are the request table's
(``engine.requests``); this file is the loop around them.

This is the only generation loop: ``ModelRunner.generate`` (the library), the server and every bench
drive it. An exception in a step fails only the requests it concerns (their KV is freed, their
final output says "error"); the loop goes on.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from vericache.drafting.cost import DraftCost
from vericache.engine import remote_rounds, transfers
from vericache.engine.batch import RowKind, StepBatch
from vericache.engine.instruments import Instruments, StepRecord
from vericache.engine.memory import KVMemory
from vericache.engine.options import RequestOptions, ResolvedOptions
from vericache.engine.request import Request, State, StepOutput
from vericache.engine.requests import RequestTable
from vericache.engine.postprocess import postprocess
from vericache.engine.scheduler import Scheduler
from vericache.engine.schedules import SCHEDULERS, make_schedule
from vericache.engine.sequence import Sequence
from vericache.kv.link import CudaLink, EmulatedLink, StreamedKV
from vericache.sampling import SamplingParams

__all__ = ["SCHEDULERS", "StepLoop", "StepOutput"]
log = logging.getLogger("vericache.engine")


class StepLoop:
    def __init__(self, runner, device_budget: int | None = None, host_budget: int | None = None,
                 scheduler: str = "staggered", link=None, prefill_chunk: int = 512, max_running: int = 64,
                 resident_layers: int = 0, offload: bool = True, prefix=None, verifier=None) -> None:
        n_layers = runner.cfg.num_hidden_layers
        if isinstance(resident_layers, bool) or not isinstance(resident_layers, int) or not (
                0 <= resident_layers <= n_layers):
            raise ValueError(f"resident_layers must be an integer in [0, {n_layers}], got {resident_layers!r}")
        if not isinstance(prefill_chunk, int) or prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be an integer >= 1, got {prefill_chunk!r}")
        self.runner = runner
        self.draft_cost = DraftCost()  # draft lengths from this engine's fitted step costs
        self.scheduler = Scheduler(self)           # admission, planning, preemption
        self.schedule = make_schedule(scheduler)   # P1: when complete drafts' full KV goes on the link
        # offload: vericache full KV in the host tier, brought over ``link`` for each verification;
        # the first ``resident_layers`` layers of it stay on the device (fewer bytes cross)
        self.memory = KVMemory(runner.cfg, runner.loaded.device, runner.loaded.kv_dtype, device_budget,
                               host_budget, offload, resident_layers, remote=verifier is not None)
        # the remote scenario (engine.remote_rounds): a prefix store's fetcher, a verifier elsewhere
        self.prefix, self.verifier = prefix, verifier
        self.wake = threading.Event()  # set when a fetch or a verifier reply lands
        for part in (prefix, verifier):
            if part is not None:
                part.wake = self.wake
        self.device, self.host = self.memory.device, self.memory.host
        self.link = link  # made on first use when None: the first offloaded vericache request needs it
        self.prefill_chunk, self.max_running = prefill_chunk, max_running
        self.instruments = Instruments()
        self.requests = RequestTable(self.memory, self.instruments, self.scheduler.make_room)

    # ------------------------------------------------------------------ public API
    def add_request(self, prompt_ids: list[int], params: SamplingParams,
                    options: RequestOptions | ResolvedOptions | None = None, prefill=None, checked: bool = False) -> int:
        """Queue a request; ``options`` override the engine's mode, compressor and draft length;
        ``prefill`` (a ``ModelRunner.shared_prefill`` of this prompt) is loaded instead of recomputed;
        ``checked``: the caller validated the input (``ModelRunner.check_request``) already."""
        seq = self.runner.new_sequence(-1, prompt_ids, params, checked)
        seq.request_id = rid = self._add(seq, options, prefill)   # our own sequence: it takes the id
        return rid

    def add_sequence(self, seq: Sequence, options: RequestOptions | ResolvedOptions | None = None,
                     prefill=None) -> int:
        """``add_request`` for a ``Sequence`` made by the caller (who reads its output from it)."""
        self.runner.check_request(seq.prompt_ids, seq.params)
        return self._add(seq, options, prefill)

    def _add(self, seq: Sequence, options, prefill) -> int:
        opts = options if isinstance(options, ResolvedOptions) else self.runner.resolve(options)
        req = Request(-1, seq, opts, policy_state=opts.policy.new_state(), prefill=prefill)
        prompt_ids, params = seq.prompt_ids, seq.params
        if prefill is not None:
            prefill.check(seq)
        if self.memory.is_remote(req) and not seq.params.greedy:
            raise ValueError(f"a remote verifier verifies greedy drafts only: temperature must be 0, "
                             f"got {seq.params.temperature}")
        need = self.memory.needed(req) + self.memory.transient(req)
        if self.device.blocks_for(need) > self.device.total_blocks:
            raise ValueError(f"request needs {need} bytes of device KV (prompt {len(prompt_ids)} + max_tokens "
                             f"{params.max_tokens}) but the whole device budget is {self.device.capacity_bytes} bytes")
        if self.memory.is_offloaded(req) and self.link is None:
            dev = self.runner.loaded.device
            self.link = CudaLink(dev) if dev.type == "cuda" else EmulatedLink(gbps=32)
        return self.requests.add(req)

    def abort(self, rid: int) -> None:
        req = self.requests.get(rid)
        if req is not None and not req.done:
            self.requests.release(req, State.ABORTED)

    def has_unfinished(self) -> bool:
        return self.requests.has_unfinished()

    def collect_outputs(self) -> list[StepOutput]:
        """Tokens not yet reported, and each request's end (once)."""
        return self.requests.collect_outputs()

    def fail_unfinished(self, error: str) -> list[StepOutput]:
        """Fail every request not yet done (the step loop itself broke) and report them."""
        self.requests.fail_unfinished(error)
        return self.requests.collect_outputs()

    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        """schedule -> run -> postprocess, around the remote replies and the link's transfers."""
        self.scheduler.admit()
        if self.verifier is not None:   # drafter role: apply the verifier's replies
            remote_rounds.poll(self)
        batch = self.scheduler.plan()
        if batch.rows and self._run(batch):
            t0 = time.perf_counter()
            postprocess(self, batch)
            self.instruments.steps[-1].post = time.perf_counter() - t0
        if self.verifier is not None:   # drafter role: complete rounds go to the verifier
            remote_rounds.send_verifies(self)
        if self.link is not None:
            self.schedule.start_transfers(self, self.requests.in_state(State.DRAFTING))
        if self.link is not None or self.prefix is not None or self.verifier is not None:
            self._wait_if_idle(batch)
        return self.collect_outputs()

    # ------------------------------------------------------------------ run
    def _run(self, batch: StepBatch) -> bool:
        """One forward; on an exception every request in the batch fails (and the loop goes on)."""
        for row in batch.of(RowKind.VERIFY):
            if isinstance(row.cache, StreamedKV) and not row.req.transfer.ready():
                self.instruments.early_verifies += 1
        work = batch.attention_work()
        t0 = time.perf_counter()
        try:
            n_draft = sum(len(r.tokens) for r in batch.of(RowKind.DRAFT))
            batch.run(self.runner.model, self.runner.loaded.device, draft_weights=self.runner.draft_kind(n_draft))
        except Exception as exc:  # noqa: BLE001 - whatever broke, the other requests go on
            log.exception("step forward failed for requests %s", [r.req.id for r in batch.rows])
            for row in batch.rows:
                self.requests.fail(row.req, f"{type(exc).__name__}: {exc}")
            return False
        t1 = time.perf_counter()
        self.instruments.note_interval(t0, t1, batch.kinds)
        self.instruments.steps.append(StepRecord(t0, t1, batch.kinds, len(batch.rows), *work))
        self.draft_cost.tick(self.instruments.steps)
        if batch.of(RowKind.VERIFY) and batch.kinds == RowKind.VERIFY:  # a clean measurement of the verification
            self.instruments.note_verify(t1 - t0, self.runner.cfg.num_hidden_layers)
        return True

    # ------------------------------------------------------------------ the link (offloaded vericache)
    def start_transfer(self, req: Request) -> bool:
        """Queue the request's full KV on the link (``engine.transfers``; the link schedules call it)."""
        return transfers.start_transfer(self, req)

    def measured_rates(self) -> tuple[float, float] | None:
        """(link bytes per second, seconds per draft step), measured so far; None before both exist."""
        return transfers.measured_rates(self)

    def _wait_if_idle(self, batch: StepBatch) -> None:
        """Nothing to compute until a transfer lands: block on it rather than spin."""
        if not batch.rows and remote_rounds.waiting_on_remote(self):
            self.wake.wait(0.05)  # a fetch or a verifier reply wakes it
            self.wake.clear()
            return
        in_flight = self.requests.in_state(State.TRANSFERRING)
        if in_flight and not batch.rows and not self.requests.in_state(State.PREFILL, State.DECODING) and not any(
                not r.round.complete for r in self.requests.in_state(State.DRAFTING)):
            min(in_flight, key=lambda r: r.id).transfer.wait_all()
