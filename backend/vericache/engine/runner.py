"""The model runner: a loaded model, the default options, request checks, ``prefill`` and
``execute``, which runs one step's plan as one forward. It only runs the model: the requests and
the step loop are the ``Engine``'s (``engine.engine``), the one place that builds a runner.

``execute`` takes a
``StepPlan`` (plain rows, ``engine.scheduler``) and returns a ``StepResult`` (logits of the sampled
rows) and a ``StepRecord`` (its time and the work the roofline charges); it holds no request state.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq

import torch

from vericache.compress.registry import parse_compressor
from vericache.drafting.round import DraftLengthPolicy
from vericache.engine.config import EXACT_FULL, EngineConfig
from vericache.engine.options import (
    MODES,
    Intake,
    RequestOptions,
    ResolvedOptions,
    make_intake,
    resolve_options,
)
from vericache.engine.requests import StepRecord
from vericache.engine.scheduler import RowKind, StepPlan, StepResult
from vericache.engine.shared_prefill import SharedPrefill
from vericache.kv.full import FullKVCache
from vericache.kv.protocol import KVCache
from vericache.kv.tee import QueryRecorder, TeeCache
from vericache.model.draft_weights import draft_vocab_size, measured_choice
from vericache.model.loader import LoadedModel
from vericache.sampling import SamplingParams, Sequence

__all__ = ["MODES", "ModelRunner", "SharedPrefill"]
AUTO_DRAFT_KINDS = ("q8",)   # what "auto" measures beside the exact weights (no copies: int8/int4 are asked for by name)


class ModelRunner:
    def __init__(self, loaded: LoadedModel, config: EngineConfig = EXACT_FULL) -> None:
        """``config``: the engine's (``Engine``), whole; this reads what runs the model and what a request
        gets when it asks for nothing (mode, compressor, draft length, draft weights, lookup, acceptance,
        prefill chunk). Its default, ``EXACT_FULL``, is a bare runner's (exact full decoding, as unit tests
        use it), not the product's. ``draft_weights``: what draft rows read, "fp32" (the exact weights),
        "q8" (integer dots on the stored weights), "int8" or "int4" copies (``model.draft_weights``), or
        "auto": on CPU the exact weights and "q8" (no copies), each step's draft rows on the one measured
        faster for their count here (``DraftChoice``), on other devices fp32. Verification, full and lossy
        rows always read the exact weights."""
        if not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig, got {type(config).__name__}")
        draft_weights = config.draft_weights
        if draft_weights == "auto" and loaded.device.type != "cpu":
            draft_weights = "fp32"
        if draft_weights != "fp32" and loaded.device.type != "cpu":
            raise ValueError(f"draft_weights={draft_weights!r} runs on CPU only (fbgemm, the int4 CPU kernel), not on {loaded.device}")
        self.loaded = loaded
        self.model = loaded.model
        self.cfg = loaded.config
        self.tokenizer = loaded.tokenizer
        self.prefill_chunk = config.prefill_chunk
        self.mode = config.mode
        self.compressor = parse_compressor(config.compressor)
        self.policy = DraftLengthPolicy.from_arg(config.draft_len)
        self.defaults = ResolvedOptions(config.mode, self.compressor, self.policy, config.lookup, config.acceptance)
        self.draft_weights = draft_weights
        # drafts' logits over the vocabulary's first n tokens (None: all): the model holds it, so
        # engines sharing one model with different settings set theirs at each step (``execute``)
        self.draft_vocab = draft_vocab_size(config.draft_vocab, self.cfg.vocab_size)
        if self.model.draft_vocab != self.draft_vocab:
            self.model.set_draft_vocab(self.draft_vocab)

    def build_drafts(self) -> None:
        """The draft copies this engine's steps read (an extra copy each: the exact weights stay for
        the rest), and for "auto" their measured times (once per model; engines sharing it share them):
        at a serving engine's start (``Engine``), else on the first draft step (a one-prompt script's first
        token does not wait for them)."""
        kinds = self.auto_draft_kinds() if self.draft_weights == "auto" else (self.draft_weights,)
        for kind in kinds:
            if kind != "fp32" and kind not in self.model.draft_sets:
                self.model.quantize_drafts(kind)
        if self.draft_weights == "auto":
            measured_choice(self.model)

    def auto_draft_kinds(self) -> tuple[str, ...]:
        """The copies "auto" measures against the exact weights: none that would run the exact weights'
        own op ("q8" drafts are the stored weights in the q8 numerics, which a q8 model's exact rows
        already run: the same op was timed twice, 12.8 s of timing in all on the 0.5B code model, AVX2)."""
        return tuple(k for k in AUTO_DRAFT_KINDS if not (k == "q8" and self.loaded.linears_q8))

    def draft_kind(self, n_draft_rows: int) -> str:
        """The weights a step with ``n_draft_rows`` draft rows runs them on."""
        if self.draft_weights == "fp32" or not n_draft_rows:
            return "fp32"
        self.build_drafts()
        if self.draft_weights == "auto":
            choice = self.model.draft_choice
            assert choice is not None, "build_drafts measures the choice for auto"
            return choice.kind_for(n_draft_rows, ("fp32", *self.auto_draft_kinds()))
        return self.draft_weights

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> tuple[StepResult, StepRecord]:
        """One forward over all of the plan's rows. Only the sampled rows get logits (the LM head over a
        whole prefill chunk would be wasted). Draft rows go first when they read draft weights
        (``draft_kind``) or the draft vocabulary (where the model has one: ``Transformer.set_draft_vocab``,
        with the draft rows' prompts' rare tokens, so a lookup proposal copying the prompt is checked over
        them too); every other row reads the exact weights and the whole head."""
        rows, drafts = plan.rows, plan.of(RowKind.DRAFT)
        if drafts and self.model.draft_vocab != self.draft_vocab:
            self.model.set_draft_vocab(self.draft_vocab)
        n_draft = sum(len(r.tokens) for r in drafts)
        draft_weights = self.draft_kind(n_draft)
        n_vocab = n_draft if self.model.draft_vocab is not None else 0
        if draft_weights != "fp32" or n_vocab:
            if self.model.draft_weights != draft_weights:  # engines sharing one model may draft on different copies
                self.model.quantize_drafts(draft_weights)
            rows = sorted(rows, key=lambda r: r.kind != RowKind.DRAFT)    # stable: the others keep their order
        else:
            n_draft = 0
        tokens: list[int] = []
        index: list[int] = []
        offset = 0
        for row in rows:
            tokens.extend(row.tokens)
            n = len(row.tokens)
            if row.logits_for == "all":
                index.extend(range(offset, offset + n))
            elif row.logits_for == "last":
                index.append(offset + n - 1)
            offset += n
        work = attention_work(plan)
        dev, extra = self.loaded.device, {"n_draft": n_draft, "n_vocab": n_vocab} if n_draft else {}
        # the draft rows' requests' prompts' rare tokens, for all of them (a superset of each one's)
        own = [r.req.drafting.vocab for r in rows if r.kind == RowKind.DRAFT and r.req.drafting.vocab is not None] \
            if n_vocab else []
        vocab_extra = None if not own else own[0] if len(own) == 1 else torch.unique(torch.cat(own))
        t0 = time.perf_counter()
        logits = self.model(torch.tensor(tokens, device=dev), [r.start for r in rows], [len(r.tokens) for r in rows],
                            [r.cache for r in rows], logits_index=torch.tensor(index, dtype=torch.long, device=dev),
                            vocab_extra=vocab_extra, **extra)   # [len(index), V]
        top = logits.argmax(dim=-1).tolist()
        at, out = 0, {}
        for row in rows:
            n = {"all": len(row.tokens), "last": 1}.get(row.logits_for, 0)
            out[id(row)] = (logits[at : at + n], top[at : at + n]) if n else (None, None)
            at += n
        t1 = time.perf_counter()
        result = StepResult([out[id(r)][0] for r in plan.rows], [out[id(r)][1] for r in plan.rows])
        by_kind = {k.value: (len(rs), sum(len(r.tokens) for r in rs)) for k in RowKind if (rs := plan.of(k))}
        vocab_rows = sum(i < n_vocab for i in index)   # logits rows on the draft vocabulary's head
        return result, StepRecord(t0, t1, plan.kinds, len(plan.rows), *work, by_kind=by_kind, vocab_rows=vocab_rows)

    def resolve(self, options: RequestOptions | None) -> ResolvedOptions:
        """A request's options, the engine's defaults filling what it leaves out (ValueError if invalid)."""
        return resolve_options(options, self.defaults)

    # ------------------------------------------------------------------ limits
    @property
    def max_context(self) -> int:
        return self.cfg.context_limit

    def intake(self, prompt_ids: list[int], params: SamplingParams,
               options: RequestOptions | ResolvedOptions | None = None) -> Intake:
        """The request checked and its options resolved, once (``options.make_intake``)."""
        return make_intake(prompt_ids, params, options, self.defaults, self.max_context, self.cfg.vocab_size)

    def new_sequence(self, request_id: int, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        """A checked request's ``Sequence`` (ValueError / TypeError for bad input)."""
        return self.sequence_of(self.intake(prompt_ids, params), request_id)

    def sequence_of(self, intake: Intake, request_id: int) -> Sequence:
        """The ``Sequence`` of a request that came in through ``intake`` (checked there)."""
        return Sequence(request_id, intake.prompt_ids, intake.params, self.tokenizer, self.tokenizer.eos_token_ids)

    def new_cache(self, seq: Sequence) -> FullKVCache:
        return FullKVCache(self.cfg, self.loaded.device, self.loaded.kv_dtype,
                           capacity=seq.capacity, key_codes=self.loaded.key_codes)

    # ------------------------------------------------------------------ forward helpers
    @torch.inference_mode()
    def prefill(self, ids: list[int], caches: Seq[KVCache], start: int = 0) -> torch.Tensor:
        """Run ``ids`` (positions start..) through the model in chunks over each of ``caches``;
        returns the last logits [V] (of the first cache)."""
        if not caches or not ids:
            raise ValueError(f"prefill needs tokens and a cache, got {len(ids)} tokens and {len(caches)} caches")
        dev = self.loaded.device
        logits: torch.Tensor | None = None
        for cache in caches:
            for s in range(0, len(ids), self.prefill_chunk):
                chunk = ids[s : s + self.prefill_chunk]
                out = self.model(torch.tensor(chunk, device=dev), [start + s], [len(chunk)], [cache],
                                 logits_index=torch.tensor([len(chunk) - 1], device=dev))
            logits = out[0] if logits is None else logits
        assert logits is not None
        return logits

    @torch.inference_mode()
    def shared_prefill(self, seq: Sequence, window: int = 64, prefix: SharedPrefill | None = None) -> SharedPrefill:
        """Prefill ``seq``'s prompt once over a full cache, keeping what any compressor needs. ``prefix``: a
        shared prefill of the prompt's first tokens (a long context many prompts share: an evaluation
        grid's), copied and extended by the rest; the same bits as prefilling the whole prompt (a row's
        bits depend on neither its chunk nor its step), in the time of the rest alone."""
        t0 = time.perf_counter()
        full, start = self.new_cache(seq), 0
        if prefix is not None:
            start = prefix.prompt_len
            if not prefix.prompt_ids or tuple(seq.prompt_ids[:start]) != prefix.prompt_ids or start >= len(seq.prompt_ids):
                raise ValueError(f"prefix: a prefill of {start} tokens is not a proper prefix of request "
                                 f"{seq.request_id}'s {len(seq.prompt_ids)}-token prompt")
            full.load(prefix.full, start)
        recorder = QueryRecorder(self.cfg.num_hidden_layers, window, prefix.queries if prefix is not None else None)
        logits = self.prefill(seq.prompt_ids[start:], [TeeCache(full, recorder)], start=start)
        return SharedPrefill(full, recorder.queries, logits, len(seq.prompt_ids), time.perf_counter() - t0,
                             tuple(seq.prompt_ids))


def attention_work(plan: StepPlan) -> tuple[int, int, int]:
    """(rows, K/V bytes read, query-key pairs per query head and layer) of a plan's forward, from each
    row's cache before it runs: what the roofline charges (``sim.roofline``)."""
    rows = kv_bytes = pairs = 0
    for row in plan.rows:
        b, p = row.cache.attention_cost(row.start, len(row.tokens))
        rows, kv_bytes, pairs = rows + len(row.tokens), kv_bytes + b, pairs + p
    return rows, kv_bytes, pairs
