"""Shared pieces of the benchmark commands: prompts, recording, plotting."""

from __future__ import annotations

import platform
import time
from pathlib import Path

from vericache_lab.eval.run_model_eval import heldout_tokens


def code_prompt(tokenizer, n_tokens: int) -> list[int]:
    """``n_tokens`` of real held-out standard-library code (repeated if the split is shorter)."""
    ids = heldout_tokens(tokenizer)
    while len(ids) < n_tokens:
        ids = ids + ids
    return ids[:n_tokens]


def label_parts(label: str) -> tuple[str, str, str | None, int | str | None]:
    """A bench mode label ``mode[+weights][+vocab=N][@compressor]`` -> (mode, draft weights, compressor or
    None, draft vocabulary or None): "vericache+int8" drafts on int8 weights, "lossy@kivi:bits=2" decodes
    over KIVI-2 whatever the bench's --compressor, "vericache+auto@snapkv:ratio=0.125+kivi:bits=2" both,
    "vericache+vocab=0" drafts over the whole vocabulary (``EngineConfig.draft_vocab``)."""
    head, _, compressor = label.partition("@")
    mode, *rest = head.split("+")
    vocab = [r.removeprefix("vocab=") for r in rest if r.startswith("vocab=")]
    weights = [r for r in rest if not r.startswith("vocab=")]
    if len(vocab) > 1 or len(weights) > 1:
        raise ValueError(f"a bench label is mode[+weights][+vocab=N][@compressor], got {label!r}")
    draft_vocab = None if not vocab else vocab[0] if vocab[0] == "auto" else int(vocab[0])
    return mode, weights[0] if weights else "fp32", compressor or None, draft_vocab


def mode_labels(text: str) -> list[str]:
    """``--modes`` split into labels: at commas, except those inside a label's compressor spec
    ("full,vericache@snapkv:ratio=0.125,guided=false" is two labels: an item that does not start
    with a mode continues the one before)."""
    from vericache.engine.options import MODES

    labels: list[str] = []
    for item in filter(None, text.split(",")):
        if labels and "@" in labels[-1] and item.partition("+")[0].partition("@")[0] not in MODES:
            labels[-1] += "," + item
        else:
            labels.append(item)
    return labels


def engine_for(llm, label: str, engines: dict):
    """A bench mode label's engine and mode (``label_parts``): ``llm``'s settings with the label's
    mode, draft weights and compressor, every cache in one memory (no tier, no budget: a bench
    compares decoding, not admission); the engines share ``llm``'s model and are made once per label."""
    mode, weights, compressor, vocab = label_parts(label)
    if label not in engines:
        from vericache.engine.engine import Engine

        config = llm.engine.config
        engines[label] = Engine(llm.loaded, config, mode=mode, compressor=compressor or config.compressor,
                                draft_weights=weights, draft_vocab=config.draft_vocab if vocab is None else vocab,
                                tiered=False, device_budget_gb=None)
    return engines[label], mode


def cpu_model() -> str:
    """The CPU this bench runs on (``lscpu``'s model name) and the kernels' build it runs (the ISA
    variant: ``VERICACHE_ISA`` or the widest this CPU has), named beside every figure."""
    from vericache.kernels.cpu import best_isa, model_name

    name = model_name() or platform.processor() or "unknown CPU"
    return f"{name} (kernels: {best_isa()} build)"


class RowPredictor:
    """The cost model's tokens/s for each bench row (``drafting.cost``): its terms measured
    here, at the bench's context, on the engine's real caches, once per compressor; the draft
    weights' own matmul times (measured on the model's copies); one compression move per
    ``window`` tokens (measured per compressor); the run's own acceptance and draft lengths."""

    def __init__(self, llm, context: int, weights_s, log=print) -> None:
        self.llm, self.context, self.weights_s, self.log = llm, context, weights_s, log
        self.costs, self.moves = {}, {}

    def _measured(self, comp):
        from vericache_lab.predict import measure_step_costs, move_seconds

        key = comp.spec()
        if key not in self.costs:
            self.costs[key] = c = measure_step_costs(self.llm, comp, self.context, self.weights_s)
            self.moves[key] = move_seconds(comp, self.llm.loaded.config, self.llm.loaded.kv_dtype, self.context)
            self.log(f"step costs at {self.context} ({key}): fixed {c.c0 * 1e3:.1f} ms, per sequence full "
                     f"{c.full * 1e3:.1f} / draft {c.draft * 1e3:.1f} / verify of 8 rows {c.verify(8) * 1e3:.1f}; "
                     f"one compression move {self.moves[key] * 1e3:.1f} ms")
        return self.costs[key], self.moves[key]

    def __call__(self, engine, mode: str, n: int, tokens_per_round: float, drafted_per_round: float) -> float:
        from vericache.model.draft_weights import measured_choice
        from vericache_lab.predict import predict_tokens_per_s

        runner = engine.runner   # the draft weights' measured times are the runner's
        comp, matmuls = runner.compressor, None
        if mode == "vericache" and runner.draft_weights != "fp32":
            runner.draft_kind(1)   # builds the copies
            choice, kind = measured_choice(runner.model), runner.draft_weights
            matmuls = lambda rows: choice.seconds_at(kind, rows)  # noqa: E731
        costs, move = self._measured(comp)
        return predict_tokens_per_s(costs, mode, n, tokens_per_round, drafted_per_round, matmuls,
                                    move if mode != "full" else 0.0, comp.window)


def shared_prefills(base, prompts: list[list[int]], params, log) -> list:
    """Each prompt prefilled once, exactly, on ``base`` (an ``Engine``): every mode of a bench
    loads the same prefills (``cached_prefill``). Progress through ``log``."""
    t0, prefills = time.perf_counter(), []
    for i, p in enumerate(prompts):
        prefills.append(cached_prefill(base, base.new_sequence(i, p, params)))
        log(f"  prefill {i + 1}/{len(prompts)}: {time.perf_counter() - t0:.0f} s")
    return prefills


def cached_prefill(base, seq):
    """``base.shared_prefill(seq)``; where ``$VERICACHE_PREFILL_CACHE`` names a folder, kept there (keyed
    by the model, its numerics (and key coding), KV dtype, kernels' build, prompt and capacity) and loaded by the next run:
    a developer's repeated bench runs skip minutes of prefill (8 x 4K: 5 minutes on a Zen 2; the code
    model's 8K HumanEval context: 4 minutes on a Zen 3); what is timed after it is the same either way."""
    import dataclasses
    import hashlib
    import os

    import torch

    from vericache.kernels.cpu import best_isa
    from vericache.kv.packed import KeyCodes

    folder, loaded = os.environ.get("VERICACHE_PREFILL_CACHE"), base.loaded
    # what a kept prefill holds changes with the caches' code: q8qk's key codes' layout is in the key (a
    # pickled cache of another layout would load, then fail in the first step), and the key coding they
    # were made under (``numerics_id``: codes of another coding would load and give other bits)
    layout = (repr([f.name for f in dataclasses.fields(KeyCodes)]),) if loaded.key_codes else ()
    key = hashlib.sha256(repr((loaded.name, loaded.numerics_id, loaded.kernels, str(loaded.kv_dtype), best_isa(),
                               seq.capacity, seq.prompt_ids, *layout)).encode()).hexdigest()[:24]
    path = Path(folder) / f"prefill-{key}.pt" if folder else None
    if path is not None and path.exists():
        return torch.load(path, weights_only=False)
    prefill = base.shared_prefill(seq)
    if path is not None:   # written whole, then renamed: a run stopped mid-write leaves no partial file
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        torch.save(prefill, tmp)
        os.replace(tmp, path)
    return prefill
