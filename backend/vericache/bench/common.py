"""Shared pieces of the benchmark commands: prompts, recording, plotting."""

from __future__ import annotations

import datetime
import platform
import shlex
import sys
from pathlib import Path

from vericache.eval.run_model_eval import heldout_tokens


def code_prompt(tokenizer, n_tokens: int) -> list[int]:
    """``n_tokens`` of real held-out standard-library code (repeated if the split is shorter)."""
    ids = heldout_tokens(tokenizer)
    while len(ids) < n_tokens:
        ids = ids + ids
    return ids[:n_tokens]


def label_parts(label: str) -> tuple[str, str, str | None]:
    """A bench mode label ``mode[+weights][@compressor]`` -> (mode, draft weights, compressor or None):
    "vericache+int8" drafts on int8 weights, "lossy@kivi:bits=2" decodes over KIVI-2 whatever the
    bench's --compressor, "vericache+auto@snapkv:ratio=0.125+kivi:bits=2" both."""
    head, _, compressor = label.partition("@")
    mode, _, weights = head.partition("+")
    return mode, weights or "fp32", compressor or None


def engine_for(llm, label: str, engines: dict):
    """A bench mode label's engine and mode (``label_parts``); the engines share ``llm``'s model and
    are made once per label."""
    mode, weights, compressor = label_parts(label)
    if label not in engines:
        from vericache.engine.engine import Engine

        e = llm.engine
        draft_len = "auto" if e.policy.fixed is None else e.policy.fixed
        engines[label] = Engine(llm.loaded, mode=mode, compressor=compressor or e.compressor, draft_len=draft_len,
                                prefill_chunk=e.prefill_chunk, draft_weights=weights)
    return engines[label], mode


def cpu_model() -> str:
    """The CPU this bench runs on (``lscpu``'s model name), named beside every figure."""
    info = Path("/proc/cpuinfo")
    line = next((ln for ln in info.read_text().splitlines() if ln.startswith("model name")), "") if info.exists() else ""
    return line.partition(":")[2].strip() or platform.processor() or "unknown CPU"


def command_line(argv: list[str] | None = None) -> str:
    return "vericache " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))


def record(path: str | None, title: str, markdown: str, argv: list[str] | None = None) -> None:
    """Append a section with the exact command, the date and the figures to a markdown file."""
    if not path:
        return
    f = Path(path)
    f.parent.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    with f.open("a") as out:
        out.write(f"\n## {title} ({stamp})\n\nCommand: `{command_line(argv)}`\n\n{markdown}\n")


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(str(r.get(c, "")) for c in columns) + " |")
    return "\n".join(lines)


def load_calibration(llm, path: str | None, log=print):
    """The cost model's measurements for this model (CPU only): ``path`` "here" measures them now, in
    this run (on a shared machine, a calibration from another moment predicts another machine);
    otherwise ``vericache sim --calibrate``'s file (None with a hint when there is none)."""
    from vericache.sim.calibrate import calibrate, default_path, load

    if llm.loaded.device.type != "cpu":
        return None
    if path == "here":
        log("calibrating the cost model in this run (vericache sim --calibrate's measurements)")
        return calibrate(llm.loaded.name, str(llm.loaded.dtype).removeprefix("torch."), log=log)
    cal_path = Path(path or default_path(llm.loaded.name, str(llm.loaded.dtype).removeprefix("torch.")))
    cal = load(cal_path)
    if cal is None:
        log(f"no calibration at {cal_path}: run `vericache sim --calibrate` for predicted_tokens_per_s")
    return cal


class RowPredictor:
    """The cost model's tokens/s for a bench row (``sim.calibrate.predict``), charged what the run
    spends beyond the calibration: the draft weights' own matmul times (measured on the model's
    copies) and one compression move per ``window`` tokens (measured here per compressor)."""

    def __init__(self, cal, llm, context: int, log=print) -> None:
        self.cal, self.llm, self.context, self.log, self.moves = cal, llm, context, log, {}

    def move_s(self, comp) -> float:
        from vericache.sim.calibrate import move_seconds

        if comp.spec() not in self.moves:
            self.moves[comp.spec()] = move_seconds(comp, self.llm.loaded.config, self.llm.loaded.kv_dtype, self.context)
            self.log(f"one compression move of {comp.spec()} at {self.context}: {self.moves[comp.spec()] * 1e3:.1f} ms")
        return self.moves[comp.spec()]

    def __call__(self, eng, mode: str, n: int, tokens_per_round: float, drafted_per_round: float) -> float:
        from vericache.model.draft_weights import DraftChoice
        from vericache.sim.calibrate import predict

        comp, model, matmuls = eng.compressor, eng.model, None
        if mode == "vericache" and eng.draft_weights != "fp32":
            eng.draft_kind(1)   # builds the copies
            if model.draft_choice is None or not set(model.draft_sets) <= set(model.draft_choice.seconds):
                model.draft_choice = DraftChoice.measure(model)
            choice, kind = model.draft_choice, eng.draft_weights
            matmuls = lambda rows: choice.seconds_at(kind, rows)  # noqa: E731
        # eviction reads `ratio` of the keys; a quantized store is read at about the dense rate
        # here (its dequantization, not its bytes, bounds it: docs/BENCHMARKS.md, issue 19)
        kept = comp.keep_budget(self.context) / self.context if comp.evicts else 1.0
        move = self.move_s(comp) if mode != "full" else 0.0
        return predict(self.cal, mode, n, self.context, kept=kept, window=comp.window,
                       acceptance=tokens_per_round, draft_len=drafted_per_round, draft_matmul_s=matmuls, move_s=move)
