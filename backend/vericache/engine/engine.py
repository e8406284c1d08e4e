"""``Engine``: the engine core, the one door every front end goes through (vLLM v1's EngineCore).

It is the only place that builds a ``ModelRunner`` (runs the model) and a ``StepLoop`` (owns the
requests); ``LLM``, the background service behind the gateway and the Triton model, the verifier
role and every bench hold an ``Engine`` and call only this API:

- ``add_request(prompt ids, params, options) -> id``, ``abort(id)``;
- ``step() -> list[EngineOutput]``: new token ids, the text they add (detokenized here, held back
  where a stop string or a partial UTF-8 character could still change it), the finish reason and,
  on the last output, the request's stats;
- ``stats()`` (gauges), ``take_events()`` (rounds, phases, round trips, prefix fetches for metrics);
- ``generate(seqs)``: run sequences to completion (the library and the benches);
- for the verifier role, its session calls (``add_session``, ``queue_verification``, ...).

Where the full KV lives follows ``EngineConfig.tiered``: by default only a CUDA device gets the host
tier and the link (P1); on the CPU the full KV is already in host memory and verification reads it in
place, so every row kind of a step runs the native step, the same path ``bench batch`` measures.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vericache.drafting.calibrate import model_calibration
from vericache.engine.config import DEFAULTS, EngineConfig
from vericache.engine.options import Intake, RequestOptions, ResolvedOptions, check_mode
from vericache.engine.placement import drafts_in_rounds
from vericache.engine.remote_rounds import PrefixSource, RemoteEvent, VerifierSource
from vericache.engine.requests import Instruments, Reply, Request, Served, State, StepOutput
from vericache.engine.runner import ModelRunner, SharedPrefill
from vericache.engine.step_loop import StepLoop
from vericache.kv.full import FullKVCache
from vericache.kv.link import Link
from vericache.model.loader import LoadedModel
from vericache.model.tokenizer import Tokenizer
from vericache.sampling import RequestOutput, SamplingParams, Sequence

__all__ = ["Engine", "EngineConfig", "EngineOutput", "Served"]


@dataclass
class EngineOutput:
    """What one step produced for one request (plain data: the front ends never see a ``Request``)."""
    request_id: int
    token_ids: list[int]
    text: str                      # the text these tokens add ("" for requests added without detokenize)
    finished: bool
    finish_reason: str | None = None   # "stop", "length", "abort" or "error"
    error: str | None = None
    error_status: int = 500        # the HTTP status an error maps to (503: a remote part is gone)
    stats: dict[str, Any] = field(default_factory=dict)   # on the last output: rounds, tokens, mode, compressor...


class Engine:
    def __init__(self, loaded: LoadedModel | None = None, config: EngineConfig | None = None, *,
                 prefix: PrefixSource | None = None, verifier: VerifierSource | None = None, link: Link | None = None,
                 time_costs_now: bool = True, **settings: Any) -> None:
        """``loaded``: a model already loaded (engines may share one), else ``config.model`` is loaded.
        ``settings`` change single fields of ``config`` (``EngineConfig`` names). ``prefix`` (a
        ``remote.fetch.PrefixFetcher``) and ``verifier`` (a ``remote.client.VerifierClient``): the
        drafter side of remote prefix caching; ``link``: the tiered KV's link (made when needed).
        ``time_costs_now``: build the draft weights and time them and the model's step costs
        (``drafting.calibrate``; 2-8 s together on 2 cores) here, so no served request pays them; False (the
        offline ``LLM``): at the first choice of a draft length and the first draft step, after the first
        token (from prefill), so a one-prompt script's first token never waits for them."""
        config = config or DEFAULTS
        self.config = config.replace(**settings) if settings else config
        c = self.config
        if loaded is not None and c.numerics not in (None, loaded.numerics):
            raise ValueError(f"numerics {c.numerics!r} asked of a model loaded in {loaded.numerics!r} numerics")
        self.loaded = loaded if loaded is not None else c.load_model()
        self.runner = ModelRunner(self.loaded, c)
        self.loop = StepLoop(self.runner, c, link=link, prefix=prefix, verifier=verifier)
        if time_costs_now and drafts_in_rounds(c.mode):   # timed now, not in a request's path
            self.runner.build_drafts()
            # the first costs of "auto" draft lengths and of lookup proposals' sizes (a fixed draft length
            # still sizes its proposals by them: timed at its first draft step, 5 s of a 16K decode)
            model_calibration(self.loaded)
        self._texts: dict[int, str] = {}    # detokenized requests: the text reported so far
        self._ended: dict[int, dict[str, str]] = {}   # labels of the requests the last step ended (its round events')

    # ------------------------------------------------------------------ what it serves
    @property
    def tokenizer(self) -> Tokenizer:
        return self.loaded.tokenizer

    @property
    def max_context(self) -> int:
        return self.runner.max_context

    @property
    def defaults(self) -> ResolvedOptions:
        """What a request that asks for nothing gets (mode, compressor, draft length policy)."""
        return self.runner.defaults

    @property
    def instruments(self) -> Instruments:
        """The loop's measurements (step records, intervals, rates): read-only, for benches and traces."""
        return self.loop.instruments

    def resolve(self, options: RequestOptions | None) -> ResolvedOptions:
        """A request's options filled from the defaults (``InvalidOption``, a ValueError, if invalid)."""
        return self.runner.resolve(options)

    def intake(self, prompt_ids: list[int], params: SamplingParams,
               options: RequestOptions | ResolvedOptions | None = None) -> Intake:
        """The one intake: the prompt and budget checked against this model, the options resolved from
        this engine's defaults (ValueError naming what is wrong, ``InvalidOption`` naming the field,
        TypeError). Front ends call it where a request arrives and hand the ``Intake`` on (``add``)."""
        return self.runner.intake(prompt_ids, params, options)

    def new_sequence(self, request_id: int, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        """A checked request's ``Sequence``, for ``add_sequence`` (ValueError / TypeError for bad input)."""
        return self.runner.new_sequence(request_id, prompt_ids, params)

    def prefill(self, ids: list[int], caches: list[FullKVCache]) -> None:
        """Run ``ids`` (positions 0..) exactly into each of ``caches`` (storing a prefix, tests)."""
        self.runner.prefill(ids, caches)

    def shared_prefill(self, seq: Sequence, prefix: SharedPrefill | None = None) -> SharedPrefill:
        """``seq``'s prompt prefilled once, exactly, for ``add_sequence(prefill=)`` in every mode; ``prefix``:
        a shared prefill of its first tokens, extended (``ModelRunner.shared_prefill``)."""
        return self.runner.shared_prefill(seq, prefix=prefix)

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt_ids: list[int], params: SamplingParams,
                    options: RequestOptions | ResolvedOptions | None = None, detokenize: bool = True) -> int:
        """Queue a request (``intake`` then ``add``); its outputs carry text deltas when ``detokenize``.
        Raises ValueError/TypeError for bad input (nothing queued)."""
        return self.add(self.intake(prompt_ids, params, options), detokenize)

    def add(self, intake: Intake, detokenize: bool = True) -> int:
        """Queue a request that came in through ``intake``; its outputs carry text deltas when ``detokenize``."""
        rid = self.loop.add(intake)
        if detokenize:
            self._texts[rid] = ""
        return rid

    def add_sequence(self, seq: Sequence, options: RequestOptions | ResolvedOptions | None = None,
                     prefill: SharedPrefill | None = None) -> int:
        """Queue a caller's ``Sequence`` (its tokens and final output are read from it), optionally
        over a ``shared_prefill`` of its prompt."""
        return self.loop.add_sequence(seq, options, prefill=prefill)

    def abort(self, rid: int) -> None:
        """Stop a request and free its KV now; its last output (finish reason "abort") comes from ``step``
        or ``collect``."""
        self.loop.abort(rid)

    def has_unfinished(self) -> bool:
        return self.loop.has_unfinished()

    def step(self) -> list[EngineOutput]:
        """One step of the loop (schedule -> run -> update) and what it produced. Call ``take_events``
        after it for the step's events (the labels of requests it ended are kept until the next step)."""
        self._ended.clear()
        return self._outputs(self.loop.step())

    def collect(self) -> list[EngineOutput]:
        """Outputs not yet reported without stepping (an abort's final output, at once)."""
        return self._outputs(self.loop.collect_outputs())

    def fail_unfinished(self, error: str) -> list[EngineOutput]:
        """Fail every request not yet done (the loop itself broke) and report them."""
        return self._outputs(self.loop.fail_unfinished(error))

    def generate(self, seqs: list[Sequence], mode: str | None = None, prefills: list[SharedPrefill] | None = None,
                 progress: Callable[[int, int], None] | None = None) -> list[RequestOutput]:
        """Run ``seqs`` to completion together in ``mode`` (default: the engine's); ``prefills[i]``,
        when given, is seqs[i]'s prompt already prefilled (``shared_prefill``; one given for several
        requests is copied for all but the first). ``progress(done, total)``: called after each step that
        prefilled (``prefill_progress``). RuntimeError if one fails."""
        if prefills is not None and len(prefills) != len(seqs):
            raise ValueError(f"got {len(prefills)} prefills for {len(seqs)} requests")
        if prefills is not None:   # the caller's list is left as it is
            seen: set[int] = set()
            own = []
            for p in prefills:
                own.append(p.copy() if id(p) in seen else p)
                seen.add(id(p))
            prefills = own
        opts = self.resolve(RequestOptions(mode=check_mode(mode or self.config.mode)))
        rids = [self.add_sequence(s, opts, prefill=prefills[i] if prefills else None) for i, s in enumerate(seqs)]
        errors: dict[int, str] = {}
        while self.has_unfinished():
            done, total = self.prefill_progress() if progress is not None else (0, 0)
            errors.update((o.request_id, o.error) for o in self.step() if o.error)
            if done < total:   # this step prefilled
                after = self.prefill_progress()
                if after[1] and progress is not None:   # its requests go on (one that ended reports nothing)
                    progress(*after)
        errors.update((o.request_id, o.error) for o in self.collect() if o.error)
        for seq, rid in zip(seqs, rids):
            if rid in errors:
                raise RuntimeError(f"request {seq.request_id} failed: {errors[rid]}")
        return [s.to_output() for s in seqs]

    # ------------------------------------------------------------------ gauges and events
    def counts(self) -> tuple[int, int]:
        """(running, waiting) requests."""
        return self.loop.requests.counts()

    def prefill_progress(self) -> tuple[int, int]:
        """(prefill tokens run, prefill tokens) over the unfinished requests: each prompt's, and once its
        caches are made, its compressor's scoring pass's (KVzip); each runs ``prefill_chunk`` tokens a step."""
        reqs = [r for r in self.loop.requests if not r.done]
        done = sum(min(r.prefill.done_ids, len(r.seq.prompt_ids)) + r.prefill.scored for r in reqs)
        return done, sum(len(r.seq.prompt_ids) + len(r.prefill.scoring_ids) for r in reqs)

    def resident_bytes(self) -> int:
        """Bytes the unfinished requests' caches hold."""
        return sum(r.kv.resident_bytes() for r in self.loop.requests if not r.done)

    def describe(self) -> dict[str, Any]:
        """What this engine computes with: the model, the weights', KV's and linears' arithmetic, the
        kernels and their build (front ends report it: ``/v1/models``, bench JSON)."""
        lm = self.loaded
        isa = built = None
        if lm.kernels == "native":
            from vericache.kernels.cpu import best_isa
            from vericache.kernels.prebuilt import origin

            isa = best_isa()
            built = origin(isa)   # "prebuilt" (the wheel's) or "built here"
        return {"model": lm.name, "numerics": lm.numerics, "kernels": lm.kernels, "build": isa, "build_origin": built,
                "dtype": str(lm.dtype).removeprefix("torch."), "kv_dtype": str(lm.kv_dtype).removeprefix("torch."),
                "mode": self.config.mode, "compressor": self.defaults.compressor.spec()}

    def stats(self) -> dict[str, Any]:
        """Gauges: requests, KV bytes per tier and the device tier's use, the link's bytes and busy time,
        the grouped schedule's mean group count."""
        running, waiting = self.counts()
        link = self.loop.link
        return {"running": running, "waiting": waiting, "kv_device": self.loop.device.used_bytes,
                "kv_host": self.loop.host.used_bytes, "kv_usage": self.loop.device.usage(),
                "link": None if link is None else (link.kind, link.stats.bytes_moved, link.stats.busy_s),
                "mean_groups": self.loop.offload.mean_groups}

    def take_events(self) -> dict[str, list[Any]]:
        """Events since the last call, for metrics: "phases" (start, end, kinds), "rounds" (labels,
        drafted, accepted, swapped, lookup proposed, lookup kept), "rtts" (verifier round trips, s), "prefix" ((event,
        fields) of the remote parts: fetches and store outages, verifier failovers)."""
        phases, rounds, rtts = self.loop.instruments.take_events()
        events: list[RemoteEvent] = []
        for part in (self.loop.prefix, self.loop.verifier):
            while part is not None and part.events:
                events.append(part.events.pop(0))
        return {"phases": phases, "rounds": [(self._labels(rid), *r) for rid, *r in rounds], "rtts": rtts,
                "prefix": events}

    def close(self) -> None:
        if self.loop.link is not None:
            self.loop.link.close()

    # ------------------------------------------------------------------ the verifier role's sessions
    def add_session(self, intake: Intake, session_id: int, full: FullKVCache, served: Served) -> int:
        """A verifier session (``intake``: full mode): a request whose prompt may be partly in ``full``
        (blocks from the prefix store); once prefilled it verifies the rounds queued with
        ``queue_verification``."""
        return self.loop.add_session(intake, session_id, full, served)

    def queue_verification(self, rid: int, start: int, tokens: list[int], reply: Reply) -> bool:
        """Queue [x, d1 .. dk] at ``start`` on session ``rid``; False if the session is gone or done."""
        req = self.loop.requests.get(rid)
        if req is None or req.done or req.remote.served is None:
            return False
        req.remote.served.inbox.append((start, tokens, reply))
        return True

    def sessions_busy(self) -> bool:
        """Some session is waiting, prefilling or has a verification queued."""
        return any((r.remote.served is not None and r.remote.served.inbox) or r.state in (State.WAITING, State.PREFILL)
                   for r in self.loop.requests)

    def failure(self, rid: int) -> str | None:
        """Why request ``rid`` failed, if it did (None while it runs, when it ended otherwise, or is gone)."""
        req = self.loop.requests.get(rid)
        return req.error if req is not None and req.state == State.FAILED else None

    def forget(self, rid: int) -> None:
        """Drop a finished request's record."""
        self.loop.requests.forget(rid)

    # ------------------------------------------------------------------ outputs
    def _labels(self, rid: int) -> dict[str, str]:
        req = self.loop.requests.get(rid)
        if req is None:
            return self._ended.get(rid, {})
        return {"mode": req.opts.mode, "compressor": req.opts.compressor_label}

    def _outputs(self, outs: list[StepOutput]) -> list[EngineOutput]:
        return [self._output(o) for o in outs]

    def _output(self, o: StepOutput) -> EngineOutput:
        req = self.loop.requests[o.request_id]
        out = EngineOutput(o.request_id, o.new_token_ids, self._text_delta(req, o), o.finished, o.finish_reason,
                           o.error, req.error_status)
        if o.finished:
            rs = req.drafting.round   # the engine's own stats (``request_stats``, made when it ended)
            out.stats = {**req.seq.stats, **self._labels(o.request_id), "rounds": rs.rounds,
                         "drafted_tokens": rs.drafted, "accepted_tokens": rs.accepted,
                         "prompt_tokens": len(req.seq.prompt_ids), "completion_tokens": len(req.seq.output_ids)}
            if o.error:
                out.stats["error"], out.stats["status"] = o.error, req.error_status
            self._texts.pop(o.request_id, None)
            self._ended[o.request_id] = self._labels(o.request_id)
            if req.remote.served is None:   # a long-running engine keeps no finished request (sessions: their owner's)
                self.loop.requests.forget(o.request_id)
        return out

    def _text_delta(self, req: Request, o: StepOutput) -> str:
        """The text the new tokens add. Held back: what could still become a stop string (cut from the
        final text) and a trailing partial UTF-8 character, so streamed text is always a prefix of
        the final text."""
        prev = self._texts.get(o.request_id)
        if prev is None:
            return ""
        if o.finished:
            delta = req.seq.text()[len(prev):] if req.state == State.FINISHED else ""
        else:
            text = self.tokenizer.decode(req.seq.output_ids)
            hold = max((len(s) - 1 for s in req.seq.params.stop_list), default=0)
            safe = len(text) - hold
            while safe > 0 and text[safe - 1] == "\ufffd":
                safe -= 1
            delta = text[len(prev):max(safe, len(prev))]
        self._texts[o.request_id] = prev + delta
        return delta
