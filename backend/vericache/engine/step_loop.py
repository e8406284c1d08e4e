"""The engine loop: continuous batching of full, lossy and VeriCache requests, one forward per step.

``step()`` = schedule -> run -> update, the stages joined by plain data (vLLM v1's shape):
- schedule (``engine.scheduler``): admit waiting requests while their KV fits the device budget
  (``engine.memory``), then ``plan()`` this step's rows: prefill chunks, decode rows, draft rows and
  verification chunks, a request in at most one row (a ``StepPlan``);
- run (``ModelRunner.execute``): one forward over every row, so the weights are read once a step; it
  returns each sampled row's logits (a ``StepResult``) and the step's ``StepRecord``;
- update (``Scheduler.update``): each row's result through ``drafting.round`` (accept, commit),
  finish, free, charge.
Around them: with ``offload``, the offload policy (``engine.offload``, P1) puts complete drafts on
the link; with a prefix store or a remote verifier, ``engine.remote_rounds`` applies replies before
the step and sends complete rounds after it. The requests and their lifecycle (states, release, fail)
are the request table's (``engine.requests``); no stage holds or receives this loop.

This is the only generation loop of a drafting engine: ``ModelRunner.generate`` (the library), the
server and every bench drive it. An exception in a step fails only the requests it concerns (their
KV is freed, their final output says "error"); the loop goes on.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from vericache.drafting.lookup import LookupIndex
from vericache.engine.config import EXACT_FULL, EngineConfig
from vericache.engine.memory import KVMemory
from vericache.engine.offload import SCHEDULERS
from vericache.engine.options import Intake, RequestOptions, ResolvedOptions
from vericache.engine.placement import place
from vericache.engine.remote_rounds import PrefixSource, VerifierSource
from vericache.engine.requests import (
    Drafting,
    Instruments,
    PrefillProgress,
    RemoteParts,
    Request,
    RequestKV,
    RequestTable,
    Served,
    State,
    StepOutput,
)
from vericache.engine.runner import ModelRunner
from vericache.engine.scheduler import Scheduler, StepPlan, StepResult
from vericache.engine.shared_prefill import SharedPrefill
from vericache.kv.full import FullKVCache
from vericache.kv.link import Link
from vericache.sampling import SamplingParams, Sequence

__all__ = ["SCHEDULERS", "StepLoop", "StepOutput"]
log = logging.getLogger("vericache.engine")


class StepLoop:
    def __init__(self, runner: ModelRunner, config: EngineConfig = EXACT_FULL, *, link: Link | None = None,
                 prefix: PrefixSource | None = None, verifier: VerifierSource | None = None) -> None:
        """``config``: the engine's, whole (validated when made): the device budget, whether the full KV
        sits in a host tier (``is_tiered``) and how many of its layers stay, the link schedule, the
        prefill chunk and the running limit. ``link``: the tiered KV's link (made when needed);
        ``prefix`` / ``verifier``: the drafter side of remote prefix caching. The host tier is unlimited."""
        n_layers = runner.cfg.num_hidden_layers
        resident_layers = config.resident_layers
        if resident_layers > n_layers:
            raise ValueError(f"resident_layers must be an integer in [0, {n_layers}], got {resident_layers!r}")
        self.runner = runner
        # offload: vericache full KV in the host tier, brought over ``link`` for each verification;
        # the first ``resident_layers`` layers of it stay on the device (fewer bytes cross)
        self.memory = KVMemory(runner.cfg, runner.loaded.device, runner.loaded.kv_dtype, config.device_budget,
                               None, config.is_tiered(runner.loaded.device.type), resident_layers,
                               remote=verifier is not None, key_codes=runner.loaded.key_codes)
        self.device, self.host = self.memory.device, self.memory.host
        self.instruments = Instruments()
        self.requests = RequestTable(self.memory.free, self.instruments)
        # admission, planning, update, preemption; it asks the offload policy (P1: when complete drafts'
        # full KV goes on the link) and the remote half (a prefix store's fetcher, a verifier elsewhere)
        self.scheduler = Scheduler(runner.loaded, self.memory, self.requests, self.instruments, config, link,
                                   prefix, verifier)
        self.offload, self.remote = self.scheduler.offload, self.scheduler.remote
        self.prefix, self.verifier = prefix, verifier   # the server drains their events
        self.wake = threading.Event()  # set when a fetch or a verifier reply lands
        for part in (prefix, verifier):
            if part is not None:
                part.wake = self.wake

    @property
    def link(self) -> Link | None:
        """The link the offloaded full KV crosses (made on the first offloaded request when not given)."""
        return self.offload.link

    # ------------------------------------------------------------------ public API
    def add_request(self, prompt_ids: list[int], params: SamplingParams,
                    options: RequestOptions | ResolvedOptions | None = None, prefill: SharedPrefill | None = None) -> int:
        """Queue a request; ``options`` override the engine's mode, compressor and draft length;
        ``prefill`` (a ``ModelRunner.shared_prefill`` of this prompt) is loaded instead of recomputed.
        ValueError / TypeError for bad input (nothing queued)."""
        return self.add(self.runner.intake(prompt_ids, params, options), prefill)

    def add(self, intake: Intake, prefill: SharedPrefill | None = None) -> int:
        """Queue a request that came in through ``ModelRunner.intake`` (checked and resolved there)."""
        seq = self.runner.sequence_of(intake, -1)
        seq.request_id = rid = self._add(seq, intake.options, prefill)   # our own sequence: it takes the id
        return rid

    def add_sequence(self, seq: Sequence, options: RequestOptions | ResolvedOptions | None = None,
                     prefill: SharedPrefill | None = None) -> int:
        """``add_request`` for a ``Sequence`` made by the caller (who reads its output from it)."""
        return self._add(seq, self.runner.intake(seq.prompt_ids, seq.params, options).options, prefill)

    def add_session(self, intake: Intake, session_id: int, full: FullKVCache, served: Served) -> int:
        """A verifier session (``remote.verifier``; ``intake``: full mode): a request whose prompt may be
        partly in ``full`` already (blocks from the prefix store); once prefilled it verifies the rounds
        queued on ``served.inbox`` instead of decoding."""
        return self._add(self.runner.sequence_of(intake, session_id), intake.options, None, served,
                         RequestKV(full=full), PrefillProgress(done_ids=full.length))

    def _add(self, seq: Sequence, opts: ResolvedOptions, prefill: SharedPrefill | None, served: Served | None = None,
             kv: RequestKV | None = None, progress: PrefillProgress | None = None) -> int:
        placement = place(opts.mode, offload=self.memory.offload, remote=self.memory.remote, session=served is not None)
        lookup = LookupIndex() if opts.lookup and placement.drafts else None
        progress = progress or PrefillProgress()
        progress.shared = prefill
        req = Request(-1, seq, opts, placement, Drafting(self.scheduler.planner.new_state(opts), lookup=lookup),
                      kv=kv or RequestKV(), prefill=progress, remote=RemoteParts(served=served))
        prompt_ids, params = seq.prompt_ids, seq.params
        if prefill is not None:
            prefill.check(seq)
            holder = next((r.id for r in self.requests if not r.done and r.prefill.shared is prefill), None)
            if holder is not None:   # it would decode in the holder's cache: its copy() is the request's own
                raise ValueError(f"this shared prefill is held by request {holder} until it finishes; "
                                 f"give request {seq.request_id} prefill.copy()")
        if placement.remote and not seq.params.greedy:
            raise ValueError(f"a remote verifier verifies greedy drafts only: temperature must be 0, "
                             f"got {seq.params.temperature}")
        need = self.memory.needed(req) + self.memory.transient(req)
        if self.device.blocks_for(need) > self.device.total_blocks:
            raise ValueError(f"request needs {need} bytes of device KV (prompt {len(prompt_ids)} + max_tokens "
                             f"{params.max_tokens}) but the whole device budget is {self.device.capacity_bytes} bytes")
        if placement.offloaded:
            self.offload.ensure_link()
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
        """schedule -> run -> update, around the remote replies and the link's transfers."""
        self.scheduler.admit()
        if self.remote is not None:   # apply the verifier's replies and landed fetches
            self.remote.poll()
        plan = self.scheduler.plan()
        if plan.rows:
            self._run(plan)
        if self.remote is not None:   # drafter role: complete rounds go to the verifier
            self.remote.send_verifies()
        if self.link is not None:
            self.offload.start_transfers()
        if not plan.rows:
            self._wait_if_idle()
        return self.collect_outputs()

    def _run(self, plan: StepPlan) -> None:
        """run -> update. If the forward raises, each row runs again alone (a row writes its cache at
        its own positions, and its bits do not depend on the batch): the rows that raise alone fail
        their requests, the others go on as if nothing happened."""
        try:
            result, record = self.runner.execute(plan)
        except Exception:  # noqa: BLE001 - find whose row it was; the others go on
            log.exception("step forward failed for requests %s; running each row alone", [r.req.id for r in plan.rows])
            plan, result = self._isolate(plan)
            # no step record: rows rerun one by one are not a step whose time the cost fits and the
            # roofline could use (and a step's record describes one forward)
            self.scheduler.update(plan, result)
            return
        self.instruments.record_step(record, self.runner.cfg.num_hidden_layers)
        self.scheduler.update(plan, result)
        record.post = time.perf_counter() - record.end
        record.round_post = self.instruments.take_round_post()

    def _isolate(self, plan: StepPlan) -> tuple[StepPlan, StepResult]:
        """The rows of a failed forward one by one: the plan and results of those that run; a row that
        raises alone fails its request (its KV freed)."""
        good, logits, argmax = StepPlan(), [], []
        for row in plan.rows:
            try:
                one, _ = self.runner.execute(StepPlan([row]))
            except Exception as exc:  # noqa: BLE001 - this row's request fails
                self.requests.fail(row.req, f"{type(exc).__name__}: {exc}")
                continue
            good.rows.append(row)
            logits += one.logits
            argmax += one.argmax
        return good, StepResult(logits, argmax)

    def _wait_if_idle(self) -> None:
        """Nothing to compute until a fetch, a verifier reply or a transfer lands: block, not spin."""
        if self.remote is not None and self.remote.waiting():
            self.wake.wait(0.05)  # a fetch or a verifier reply wakes it
            self.wake.clear()
        elif self.link is not None:
            self.offload.wait_if_idle()
