"""The batched generation loop: prefill, then decode until every request finishes.

Full mode decodes one token per request per step over the full KV. The
speculative modes (lossy, vericache) plug in through ``vericache.spec``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence as Seq

import torch

from vericache.compress.base import Compressor
from vericache.compress.registry import parse_compressor
from vericache.engine.options import MODES, RequestOptions, ResolvedOptions, check_mode, resolve_options
from vericache.engine.sequence import RequestOutput, Sequence
from vericache.kv.full import FullKVCache
from vericache.kv.tee import QueryRecorder, TeeCache
from vericache.model.loader import LoadedModel
from vericache.sampling import SamplingParams, choose_token
from vericache.spec.adaptive import DraftLengthPolicy
from vericache.spec.decoding import SpecDecoder

__all__ = ["MODES", "DEFAULT_COMPRESSOR", "Engine", "SharedPrefill", "timing_stats"]
DEFAULT_COMPRESSOR = "snapkv:ratio=0.25"


@dataclass
class SharedPrefill:
    """One exact prefill of a prompt, reused by every mode and compressor (evaluation grids).

    Decoding writes past the prompt into ``full``; ``reset()`` drops those positions again.
    """
    full: FullKVCache            # the prompt's K/V, capacity for prompt + max_tokens + 1
    queries: list[torch.Tensor]  # per layer, the last queries [Hq, W, D] (eviction scorers read them)
    logits: torch.Tensor         # [V], the next-token logits after the prompt
    prompt_len: int
    seconds: float

    def reset(self, seq: Sequence) -> FullKVCache:
        """The full cache, back at the end of the prompt, for ``seq`` (which must have this prompt)."""
        if len(seq.prompt_ids) != self.prompt_len:
            raise ValueError(f"request {seq.request_id} has a {len(seq.prompt_ids)}-token prompt; "
                             f"this prefill is of {self.prompt_len} tokens")
        self.full.truncate(self.prompt_len)
        return self.full


class Engine:
    def __init__(self, loaded: LoadedModel, mode: str = "full", compressor: str | Compressor = DEFAULT_COMPRESSOR,
                 draft_len: int | str = "auto", prefill_chunk: int = 2048) -> None:
        check_mode(mode)
        self.loaded = loaded
        self.model = loaded.model
        self.cfg = loaded.config
        self.tokenizer = loaded.tokenizer
        self.prefill_chunk = prefill_chunk
        self.mode = mode
        self.compressor = parse_compressor(compressor)
        self.policy = DraftLengthPolicy.from_arg(draft_len)
        self.defaults = ResolvedOptions(mode, self.compressor, self.policy)

    def resolve(self, options: RequestOptions | None) -> ResolvedOptions:
        """A request's options, the engine's defaults filling what it leaves out (ValueError if invalid)."""
        return resolve_options(options, self.defaults)

    def generate(self, seqs: list[Sequence], mode: str | None = None,
                 prefills: list[SharedPrefill] | None = None) -> list[RequestOutput]:
        """Run requests to completion in ``mode`` (default: the engine's); ``prefills[i]``, when
        given, is seqs[i]'s prompt already prefilled (``shared_prefill``), reused instead of redone."""
        mode = mode or self.mode
        if prefills is not None and len(prefills) != len(seqs):
            raise ValueError(f"got {len(prefills)} prefills for {len(seqs)} requests")
        if mode == "full":
            return self.generate_full(seqs, prefills)
        decoder = SpecDecoder(self, self.compressor, self.policy, prefills)
        if mode == "lossy":
            decoder.generate_lossy(seqs)
        elif mode == "vericache":
            decoder.generate_vericache(seqs)
        else:
            raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
        return [s.to_output() for s in seqs]

    # ------------------------------------------------------------------ limits
    @property
    def max_context(self) -> int:
        limit = self.cfg.max_position_embeddings
        if self.cfg.sliding_window:  # we attend densely, so stay inside the window
            limit = min(limit, self.cfg.sliding_window)
        return limit

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise ValueError("prompt is empty: it encodes to 0 tokens")
        total = len(prompt_ids) + params.max_tokens
        if total > self.max_context:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds "
                f"the model's context limit of {self.max_context} tokens"
            )
        bad = [t for t in prompt_ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.cfg.vocab_size})")

    def new_sequence(self, request_id: int, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        self.check_request(prompt_ids, params)
        return Sequence(request_id, prompt_ids, params, self.tokenizer, self.tokenizer.eos_token_ids)

    def new_cache(self, seq: Sequence) -> FullKVCache:
        return FullKVCache(self.cfg, self.loaded.device, self.loaded.dtype,
                           capacity=len(seq.prompt_ids) + seq.params.max_tokens + 1)

    # ------------------------------------------------------------------ forward helpers
    @torch.inference_mode()
    def prefill(self, ids: list[int], caches: Seq, start: int = 0) -> torch.Tensor:
        """Run ``ids`` (positions start..) through the model in chunks; returns the last logits [V].

        ``caches`` is a list of caches that all receive the same prompt (a full
        cache, and in VeriCache mode the draft cache alongside).
        """
        dev = self.loaded.device
        logits = None
        for cache in caches:
            for s in range(0, len(ids), self.prefill_chunk):
                chunk = ids[s : s + self.prefill_chunk]
                out = self.model(torch.tensor(chunk, device=dev), [start + s], [len(chunk)], [cache],
                                 logits_index=torch.tensor([len(chunk) - 1], device=dev))
            logits = out[0] if logits is None else logits
        return logits

    @torch.inference_mode()
    def decode_step(self, tokens: list[int], starts: list[int], caches: Seq) -> torch.Tensor:
        """One token per sequence: tokens[i] at position starts[i]. Returns logits [B, V]."""
        t = torch.tensor(tokens, device=self.loaded.device)
        return self.model(t, starts, [1] * len(tokens), caches)

    @torch.inference_mode()
    def shared_prefill(self, seq: Sequence, window: int = 64) -> SharedPrefill:
        """Prefill ``seq``'s prompt once over a full cache, keeping what any compressor needs."""
        t0 = time.perf_counter()
        full, recorder = self.new_cache(seq), QueryRecorder(self.cfg.num_hidden_layers, window)
        logits = self.prefill(seq.prompt_ids, [TeeCache(full, recorder)])
        return SharedPrefill(full, recorder.queries, logits, len(seq.prompt_ids), time.perf_counter() - t0)

    # ------------------------------------------------------------------ full mode
    def generate_full(self, seqs: list[Sequence], prefills: list[SharedPrefill] | None = None) -> list[RequestOutput]:
        t0 = time.perf_counter()
        caches = {}
        for i, seq in enumerate(seqs):
            if prefills is not None:
                caches[seq.request_id], logits = prefills[i].reset(seq), prefills[i].logits
            else:
                caches[seq.request_id] = self.new_cache(seq)
                logits = self.prefill(seq.prompt_ids, [caches[seq.request_id]])
            seq.append(choose_token(logits, seq.params, seq.generator))
        t1 = time.perf_counter()
        while active := [s for s in seqs if not s.finished]:
            logits = self.decode_step([s.all_ids[-1] for s in active],
                                      [len(s.all_ids) - 1 for s in active],
                                      [caches[s.request_id] for s in active])
            for row, seq in zip(logits, active):
                seq.append(choose_token(row, seq.params, seq.generator))
        t2 = time.perf_counter()
        for seq in seqs:
            seq.stats.update(timing_stats(t1 - t0, t2 - t1, len(seq.output_ids)))
            seq.stats["mode"] = "full"
        return [s.to_output() for s in seqs]


def timing_stats(prefill_s: float, decode_s: float, n_out: int) -> dict[str, float]:
    """The first token comes from prefill; decode speed counts the tokens after it."""
    decoded = max(n_out - 1, 0)
    return {"prefill_s": round(prefill_s, 6), "decode_s": round(decode_s, 6),
            "decode_tokens_per_s": round(decoded / decode_s, 3) if decode_s > 0 else 0.0}
