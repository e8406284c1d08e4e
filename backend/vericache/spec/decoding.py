"""Lossy decoding and VeriCache draft/verify decoding, batched over requests.

A VeriCache round for a request whose last token x (at position n) is not yet in any cache:
  draft   x, d1 .. d(k-1) through the compressed cache -> d1 .. dk          (k cheap steps)
  verify  [x, d1 .. dk] at positions n .. n+k through the full cache -> p0 .. pk   (one forward)
  accept  d(i+1) while it equals p_i's choice; then append p_m's choice (a correction, or a
          bonus token when all k matched). Under sampling: accept with min(1, p/q), else resample
          from normalise(max(p - q, 0)) (Leviathan et al.), so outputs are distributed as full-KV.
  commit  the full cache keeps n .. n+m; the compressed cache drops its speculative tail and takes
          the full-KV K/V of the accepted positions, so the drafter tracks the full model.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from vericache.compress.base import Compressor
from vericache.engine.sequence import Sequence
from vericache.kv.compressed import CompressedKVCache
from vericache.kv.full import FullKVCache
from vericache.kv.tee import TeeCache
from vericache.sampling import choose_token, probs_from_logits, sample_token, speculative_accept
from vericache.spec.adaptive import DraftLengthPolicy, DraftState


@dataclass
class SpecRequest:
    seq: Sequence
    draft: CompressedKVCache
    full: FullKVCache | None
    policy_state: DraftState
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    draft_bytes_read: int = 0
    verify_bytes_read: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    @property
    def position(self) -> int:
        """Position of the last token (the one no cache holds yet)."""
        return len(self.seq.all_ids) - 1


def accept_draft(seq: Sequence, target_logits: torch.Tensor, draft: list[int], q: list[torch.Tensor]) -> int:
    """Append accepted draft tokens and the verifier's token; returns m, the accepted draft count.

    target_logits: [k+1, V], the verifier's logits at the last token and at each draft token.
    """
    params = seq.params
    for i, d in enumerate(draft):
        if params.greedy:
            t = int(target_logits[i].argmax())
            ok, replacement = t == d, t
        else:
            p = probs_from_logits(target_logits[i][None], params)[0]
            ok, replacement = speculative_accept(p, q[i], d, seq.generator)
        if not ok:
            seq.append(replacement)
            return i
        if seq.append(d):
            return i + 1
    seq.append(choose_token(target_logits[len(draft)], params, seq.generator))  # the bonus token
    return len(draft)


def draft_token(seq: Sequence, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
    """The drafter's choice from logits [V]: argmax when greedy, else a draw (with its distribution q)."""
    if seq.params.greedy:
        return int(logits.argmax()), None
    q = probs_from_logits(logits[None], seq.params)[0]
    return sample_token(q, seq.generator), q


class SpecDecoder:
    def __init__(self, engine, compressor: Compressor, policy: DraftLengthPolicy, prefills=None) -> None:
        self.engine = engine
        self.compressor = compressor
        self.policy = policy
        self.prefills = prefills  # optional list of SharedPrefill, aligned with the sequences

    # ------------------------------------------------------------------ prefill
    def _start(self, seq: Sequence, with_full: bool, index: int) -> SpecRequest:
        eng = self.engine
        dev, dt = eng.loaded.device, eng.loaded.dtype
        cap = len(seq.prompt_ids) + seq.params.max_tokens + 1
        draft = CompressedKVCache(self.compressor, eng.cfg, dev, dt, capacity=cap)
        if self.prefills is not None:  # the exact prefill was done once, for every mode and compressor
            shared = self.prefills[index]
            full, logits = shared.reset(seq), shared.logits
            draft.load_prefill(full, shared.queries)
            context, full = full, (full if with_full else None)
        else:
            full = FullKVCache(eng.cfg, dev, dt, capacity=cap) if with_full else None
            # one exact prefill: over the full cache (VeriCache) or the still-uncompressed residual (lossy)
            logits = eng.prefill(seq.prompt_ids, [TeeCache(full, draft) if full is not None else draft])
            context = full if full is not None else draft.residual
        scores = self.compressor.on_prefill(eng.model, context, seq.prompt_ids, eng.tokenizer)
        draft.set_prefill_scores(scores, len(seq.prompt_ids))
        draft.commit(len(seq.prompt_ids))
        seq.append(choose_token(logits, seq.params, seq.generator))
        return SpecRequest(seq, draft, full, self.policy.new_state())

    # ------------------------------------------------------------------ lossy
    def generate_lossy(self, seqs: list[Sequence]) -> None:
        t0 = time.perf_counter()
        reqs = [self._start(s, with_full=False, index=i) for i, s in enumerate(seqs)]
        t1 = time.perf_counter()
        while active := [r for r in reqs if not r.seq.finished]:
            logits = self.engine.decode_step([r.seq.all_ids[-1] for r in active], [r.position for r in active],
                                             [r.draft for r in active])
            for row, r in zip(logits, active):
                r.draft_bytes_read += r.draft.nbytes()
                r.draft.commit(r.position + 1)  # lossy: the drafter's own K/V are final
                r.seq.append(choose_token(row, r.seq.params, r.seq.generator))
        self._finish(reqs, "lossy", t1 - t0, time.perf_counter() - t1)

    # ------------------------------------------------------------------ vericache
    def generate_vericache(self, seqs: list[Sequence]) -> None:
        t0 = time.perf_counter()
        reqs = [self._start(s, with_full=True, index=i) for i, s in enumerate(seqs)]
        t1 = time.perf_counter()
        while active := [r for r in reqs if not r.seq.finished]:
            self.round(active)
        self._finish(reqs, "vericache", t1 - t0, time.perf_counter() - t1)

    def round(self, active: list[SpecRequest]) -> None:
        """One batched draft phase, then one batched verification."""
        ks = {id(r): self.policy.next_len(r.policy_state, r.seq.params.max_tokens - len(r.seq.output_ids))
              for r in active}
        drafts, draft_probs = self._draft(active, ks)
        self._verify(active, drafts, draft_probs)

    @torch.inference_mode()
    def _draft(self, active: list[SpecRequest], ks: dict[int, int]):
        drafts: dict[int, list[int]] = {id(r): [] for r in active}
        probs: dict[int, list[torch.Tensor]] = {id(r): [] for r in active}
        for step in range(max(ks.values(), default=0)):
            rows = [r for r in active if len(drafts[id(r)]) < ks[id(r)]]
            tokens = [drafts[id(r)][-1] if step else r.seq.all_ids[-1] for r in rows]
            logits = self.engine.decode_step(tokens, [r.position + step for r in rows], [r.draft for r in rows])
            for row, r in zip(logits, rows):
                r.draft_bytes_read += r.draft.nbytes()
                token, q = draft_token(r.seq, row)
                drafts[id(r)].append(token)
                probs[id(r)].append(q)
        return drafts, probs

    @torch.inference_mode()
    def _verify(self, active: list[SpecRequest], drafts, draft_probs) -> None:
        chunks = [[r.seq.all_ids[-1]] + drafts[id(r)] for r in active]
        dev = self.engine.loaded.device
        tokens = torch.tensor([t for c in chunks for t in c], device=dev)
        logits = self.engine.model(tokens, [r.position for r in active], [len(c) for c in chunks],
                                   [r.full for r in active])
        offset = 0
        for r, chunk in zip(active, chunks):
            r.verify_bytes_read += r.full.nbytes()
            start = r.position
            m = accept_draft(r.seq, logits[offset : offset + len(chunk)], drafts[id(r)], draft_probs[id(r)])
            offset += len(chunk)
            r.full.truncate(start + 1 + m)
            r.draft.commit(start + 1 + m, source=r.full)
            k = len(chunk) - 1
            r.rounds += 1
            r.drafted += k
            r.accepted += m
            while len(r.accepted_per_pos) < k:
                r.accepted_per_pos.append(0)
            for i in range(m):
                r.accepted_per_pos[i] += 1
            self.policy.update(r.policy_state, k, m)

    # ------------------------------------------------------------------ stats
    def _finish(self, reqs: list[SpecRequest], mode: str, prefill_s: float, decode_s: float) -> None:
        from vericache.engine.engine import timing_stats

        for r in reqs:
            n_out = len(r.seq.output_ids)
            st = r.seq.stats
            st.update(timing_stats(prefill_s, decode_s, n_out))
            full_bytes = r.draft.full_nbytes()
            st.update({
                "mode": mode, "compressor": self.compressor.spec(),
                "compression_ratio": round(r.draft.nbytes() / full_bytes, 4) if full_bytes else 1.0,
                "kv_bytes_read_per_token": {
                    "draft": round(r.draft_bytes_read / max(n_out - 1, 1), 1),
                    "verify": round(r.verify_bytes_read / max(n_out - 1, 1), 1)},
            })
            if mode == "vericache":
                st.update({
                    "rounds": r.rounds, "drafted_tokens": r.drafted, "accepted_tokens": r.accepted,
                    "acceptance_rate": round(r.accepted / r.drafted, 4) if r.drafted else 0.0,
                    # tokens emitted per verification round, bonus/correction included
                    "mean_acceptance_length": round((n_out - 1) / r.rounds, 3) if r.rounds else 0.0,
                    "accepted_per_position": list(r.accepted_per_pos),
                    "fallbacks": r.policy_state.fallbacks,
                })
