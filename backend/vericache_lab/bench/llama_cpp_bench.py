"""llama.cpp on the same GGUF, side by side with our rows: what CPU users run today.

Through llama-cpp-python's bindings of llama.h (``pip install -e '.[llamacpp]'``, a build of about
10 minutes; CI does not need it): the model's own GGUF (its quantized weights as shipped), f16 KV,
one KV stream per sequence (``kv_unified = false``), the bench's thread count and
the same prompts, with and without its flash attention. Each prompt is prefilled (not timed), then
every sequence decodes greedily, one token per sequence per ``llama_decode``; tokens/s counts the
decode only, as our rows do.
"""

from __future__ import annotations

import ctypes
import importlib.util
import time
from pathlib import Path

import numpy as np
import torch


def available() -> bool:
    """llama-cpp-python imports here (its dependencies included)."""
    if importlib.util.find_spec("llama_cpp") is None:
        return False
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def gguf_path(model_name: str) -> Path | None:
    """The GGUF file a model name or path comes from (None: the model has none, e.g. ``tiny``)."""
    from vericache.model.registry import ALIASES, MODELS, model_file

    path = model_file(model_name) if model_name in MODELS or model_name in ALIASES else Path(model_name)
    return path if path.is_file() and path.suffix == ".gguf" else None


class LlamaCppRunner:
    """One llama.cpp context for ``n_seqs`` sequences of up to ``n_ctx_seq`` positions each."""

    def __init__(self, gguf: Path, n_seqs: int, n_ctx_seq: int, threads: int, flash_attn: bool = True,
                 n_batch: int = 512) -> None:
        import llama_cpp as L
        from llama_cpp._logger import set_verbose

        set_verbose(False)  # llama.cpp's load and graph logs: errors only
        self.L, self.n_batch = L, n_batch
        L.llama_backend_init()
        mp = L.llama_model_default_params()
        # no extra (repacked-weight) buffer types: on a CPU with AMX, ggml's AMX matmul segfaulted in
        # this process (llama-cpp-python 0.3.36); ggml's regular CPU kernels run instead
        mp.use_extra_bufts = False
        self.model = L.llama_model_load_from_file(str(gguf).encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch = n_seqs * n_ctx_seq, n_batch, n_batch
        cp.n_seq_max, cp.kv_unified = n_seqs, False
        cp.n_threads = cp.n_threads_batch = threads
        cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else L.LLAMA_FLASH_ATTN_TYPE_DISABLED
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.batch = L.llama_batch_init(n_batch, 0, 1)

    def _decode(self, items: list[tuple[int, int, int, bool]]) -> list[int]:
        """items: (token, position, sequence, wants logits); returns the argmax of each logits row."""
        b = self.batch
        for i, (tok, pos, seq, logits) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, logits
            b.seq_id[i][0] = seq
        b.n_tokens = len(items)
        if self.L.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed (context full?)")
        out = []
        for i, item in enumerate(items):
            if item[3]:
                ptr = self.L.llama_get_logits_ith(self.ctx, i)
                row = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(self.n_vocab,))
                out.append(int(row.argmax()))
        return out

    def prefill(self, prompts: list[list[int]], log=print) -> list[int]:
        """Each prompt into its own sequence, ``n_batch`` tokens a call; the first greedy token of each."""
        first = []
        for s, ids in enumerate(prompts):
            for at in range(0, len(ids), self.n_batch):
                chunk = ids[at : at + self.n_batch]
                last = at + len(chunk) == len(ids)
                top = self._decode([(t, at + i, s, last and i == len(chunk) - 1) for i, t in enumerate(chunk)])
            first.append(top[0])
            log(f"  llama.cpp prefill {s + 1}/{len(prompts)}")
        return first

    def prefill_copies(self, prompt: list[int], n_seqs: int, log=print) -> list[int]:
        """Prefill ``prompt`` once into sequence 0 and copy its KV to sequences 1..n-1 (llama.cpp's
        own ``llama_memory_seq_cp``): the same bytes to read per decode step as n prefills."""
        first = self.prefill([prompt], log)
        mem = self.L.llama_get_memory(self.ctx)
        for s in range(1, n_seqs):
            self.L.llama_memory_seq_cp(mem, 0, s, -1, -1)
        return first * n_seqs

    def decode(self, prompts: list[list[int]], first: list[int], max_tokens: int) -> tuple[float, int]:
        """Every sequence decodes ``max_tokens - 1`` more tokens together; (seconds, tokens decoded)."""
        last, pos = list(first), [len(p) for p in prompts]
        t0 = time.perf_counter()
        for _ in range(max_tokens - 1):
            last = self._decode([(last[s], pos[s], s, True) for s in range(len(prompts))])
            pos = [p + 1 for p in pos]
        return time.perf_counter() - t0, len(prompts) * (max_tokens - 1)

    def close(self) -> None:
        self.L.llama_batch_free(self.batch)
        self.L.llama_free(self.ctx)
        self.L.llama_model_free(self.model)


def run(model_name: str, prompts: list[list[int]], max_tokens: int, log=print, flash_attn: bool = True,
        copies: bool = False) -> dict | None:
    """llama.cpp's row for ``prompts`` decoded together; None when the model has no GGUF. ``copies``:
    prefill the first prompt only and decode every sequence from a copy of its KV (for batches whose
    prefill would take long: llama.cpp prefilled ~73 tokens/s on the machine of docs/history/BENCHMARKS-by-issue.md, issue 19)."""
    gguf = gguf_path(model_name)
    if gguf is None:
        log(f"llama.cpp: {model_name} has no GGUF file; no llama.cpp row")
        return None
    threads = torch.get_num_threads()
    try:  # a side-by-side row: if llama.cpp fails, say so and keep the bench's own figures
        runner = LlamaCppRunner(gguf, len(prompts), max(len(p) for p in prompts) + max_tokens + 8, threads,
                                flash_attn)
        try:
            if copies:
                prompts = [prompts[0]] * len(prompts)
                first = runner.prefill_copies(prompts[0], len(prompts), log)
            else:
                first = runner.prefill(prompts, log)
            seconds, tokens = runner.decode(prompts, first, max_tokens)
        finally:
            runner.close()
    except Exception as exc:  # noqa: BLE001 - any failure of the optional row
        log(f"llama.cpp: failed ({type(exc).__name__}: {exc}); no llama.cpp row")
        return None
    attn = "flash attention" if flash_attn else "no flash attention"
    how = ", KV copied from one prefill" if copies else ""
    row = {"mode": f"llama.cpp ({gguf.name.split('.')[-2]} weights, f16 KV, {attn}{how})",
           "tokens_per_s": round(tokens / seconds, 2), "decode_s": round(seconds, 2), "steps": max_tokens - 1}
    log(f"llama.cpp ({attn}): {row['tokens_per_s']} tok/s over {len(prompts)} sequence(s), {threads} threads")
    return row


def rows(model_name: str, prompts: list[list[int]], max_tokens: int, log=print,
         flash_attn: str = "both", copies: bool = False) -> list[dict]:
    """llama.cpp's attention paths ("both", "on", "off"; its CPU flash attention is the slower one on
    some CPUs, 2.5x at 8K on an Intel Xeon with AVX-512 here): each its own prefill, then the decode."""
    paths = {"both": (True, False), "on": (True,), "off": (False,)}
    if flash_attn not in paths:
        raise ValueError(f"flash_attn must be both, on or off, got {flash_attn!r}")
    return [r for fa in paths[flash_attn] if (r := run(model_name, prompts, max_tokens, log, fa, copies)) is not None]
