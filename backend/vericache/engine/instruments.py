"""What the engine measures about itself: busy intervals, measured rates, per-request stats.

The rates feed the schedules (how long a transfer takes, how long a draft step takes); the
intervals feed timelines and utilisation; ``request_stats`` is what every caller reports
(``LLM.generate`` outputs, the server's final chunk, the benches).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from vericache.engine.memory import KVMemory
from vericache.engine.request import Request


@dataclass
class StepRecord:
    """One forward: when, what kinds of rows, and the work the roofline charges for it."""
    start: float
    end: float
    kinds: str
    seqs: int
    rows: int
    kv_bytes: int     # K/V bytes its attention reads (all layers)
    pairs: int        # query-key pairs per query head and layer
    post: float = 0.0  # seconds of the step's postprocess after the forward (commits, compression moves)


def _bounded() -> deque:
    return deque(maxlen=65536)   # a long-running server keeps a bounded history


@dataclass
class Instruments:
    """What the engine measured. ``intervals`` and ``steps`` are histories (bounded); the server
    takes what happened since its last look as events (``take_events``), leaving the histories
    for the rates that read them (``draft_step_s``)."""
    intervals: deque = field(default_factory=_bounded)      # (start, end, kinds) per forward or load
    round_log: deque = field(default_factory=_bounded)      # (request, drafted, accepted) not yet taken
    remote_rtts: deque = field(default_factory=_bounded)    # verifier round trips not yet taken
    new_intervals: deque = field(default_factory=_bounded)  # intervals not yet taken
    verify_layer_s: float = 0.0   # forward seconds per layer of a verification (EMA)
    early_verifies: int = 0       # verifications started while their last layers were in flight
    preemptions: int = 0          # requests sent back to waiting (their KV recomputed on re-admission)
    failures: int = 0             # requests failed by an exception in a step
    steps: deque = field(default_factory=lambda: deque(maxlen=4096))   # StepRecord per forward, the latest

    def note_interval(self, start: float, end: float, kinds: str) -> None:
        self.intervals.append((start, end, kinds))
        self.new_intervals.append((start, end, kinds))

    def take_events(self) -> tuple[list, list, list]:
        """(intervals, rounds, verifier round trips) since the last call, for metrics; the
        histories the engine's own rates read stay."""
        out = list(self.new_intervals), list(self.round_log), list(self.remote_rtts)
        self.new_intervals.clear()
        self.round_log.clear()
        self.remote_rtts.clear()
        return out

    def busy_s(self) -> float:
        return sum(e - s for s, e, _ in self.intervals)

    def draft_step_s(self) -> float | None:
        """Mean seconds of a recent step that drafted (None before one ran)."""
        recent = [self.intervals[-i] for i in range(1, min(32, len(self.intervals)) + 1)]
        spans = [e - s for s, e, k in recent if "draft" in k]
        return sum(spans) / len(spans) if spans else None

    def note_verify(self, seconds: float, n_layers: int) -> None:
        per_layer = seconds / n_layers
        self.verify_layer_s = per_layer if self.verify_layer_s <= 0 else 0.7 * self.verify_layer_s + 0.3 * per_layer


def request_stats(req: Request) -> dict:
    """A request's timing, memory and (vericache) acceptance figures."""
    seq, rs = req.seq, req.round
    n_out = len(seq.output_ids)
    decoded = max(n_out - 1, 0)  # the first token comes from prefill
    end = req.finished_at or time.perf_counter()
    prefill_s = (req.first_token_at - req.added_at) if req.first_token_at else 0.0
    decode_s = end - req.first_token_at if req.first_token_at else 0.0
    st = {"mode": req.mode, "prompt_tokens": len(seq.prompt_ids), "completion_tokens": n_out,
          "prefill_s": round(prefill_s, 6), "decode_s": round(decode_s, 6),
          "decode_tokens_per_s": round(decoded / decode_s, 3) if decode_s > 0 else 0.0,
          "kv_resident_bytes": KVMemory.resident_bytes(req)}  # every storage its caches hold, once
    if req.draft is not None:
        full_bytes = req.draft.full_nbytes()
        st.update({
            "compressor": req.opts.compressor.spec(),
            "compression_ratio": round(req.draft.nbytes() / full_bytes, 4) if full_bytes else 1.0,
            "kv_bytes_read_per_token": {"draft": round(req.draft_bytes_read / max(decoded, 1), 1),
                                        "verify": round(req.verify_bytes_read / max(decoded, 1), 1)}})
    if req.mode == "vericache":
        st.update({
            "rounds": rs.rounds, "drafted_tokens": rs.drafted, "accepted_tokens": rs.accepted,
            "acceptance_rate": round(rs.accepted / rs.drafted, 4) if rs.drafted else 0.0,
            # tokens emitted per verification round, bonus/correction included
            "mean_acceptance_length": round(decoded / rs.rounds, 3) if rs.rounds else 0.0,
            "accepted_per_position": list(rs.accepted_per_pos),
            "fallbacks": getattr(req.policy_state, "fallbacks", 0)})
    if req.prefix_tokens or req.fetch_bytes or req.verifier_hit_tokens:
        st.update({"prefix_tokens": req.prefix_tokens, "prefix_fetch_bytes": req.fetch_bytes,
                   "prefix_fetch_s": round(req.fetch_s, 6), "verifier_prefix_tokens": req.verifier_hit_tokens})
    if req.error:
        st["error"] = req.error
    return st
