"""The measurements of ``vericache bench gpu-check`` (``bench/gpu_check.py`` runs them in order): each
takes a device and sizes and returns plain rows; timings by CUDA events on a GPU, by the wall clock
elsewhere (the dry run, where the figures only show that the code ran)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from vericache.config import ModelConfig
from vericache.engine.engine import Engine
from vericache.engine.options import RequestOptions
from vericache.engine.runner import SharedPrefill
from vericache.kv.full import FullKVCache
from vericache.kv.link import CudaLink, EmulatedLink
from vericache.kv.packed import KeyPart, attend_packed
from vericache.model.loader import LoadedModel, use_gpu_kernels
from vericache.sampling import SamplingParams

GB = 1e9


def timed(fn: Callable[[], object], device: torch.device, repeat: int = 5) -> float:
    """Seconds per call of ``fn`` after one warm-up call (CUDA events on a GPU)."""
    fn()
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(repeat):
            fn()
        return (time.perf_counter() - t0) / repeat
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / repeat


def read_rate(device: torch.device, nbytes: int) -> dict:
    """The memory's read rate: one reduction over ``nbytes`` of fp32 (every byte read once)."""
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    s = timed(lambda: x.sum(), device, repeat=10)
    return {"bytes": nbytes, "read_GBps": round(nbytes / s / GB, 1)}


def link_rate(cfg: ModelConfig, device: torch.device, kv_dtype: torch.dtype, positions: int) -> dict:
    """The full KV's swap as the engine does it: ``positions`` of every layer from the host tier into a
    device buffer through the engine's link (CUDA: ``CudaLink``, pinned memory, a side stream, an event
    per layer; elsewhere the emulated link at its 32 Gbit/s), and a raw pinned copy beside it."""
    host = FullKVCache(cfg, "cpu", kv_dtype, capacity=positions)
    host.begin(0, positions)
    cuda = device.type == "cuda"
    if cuda:
        host.pin()
    link = CudaLink(device) if cuda else EmulatedLink(gbps=32)
    dst = FullKVCache(cfg, device, kv_dtype, capacity=positions)
    try:
        link.submit(host, positions, dst).wait_all()   # warm-up
        t0 = time.perf_counter()
        link.submit(host, positions, dst).wait_all()
        seconds = time.perf_counter() - t0
    finally:
        link.close()
    out = {"link": link.kind, "positions": positions, "bytes": host.nbytes(),
           "layer_chunk_bytes": host.nbytes() // cfg.num_hidden_layers,
           "link_GBps": round(host.nbytes() / seconds / GB, 2)}
    if cuda:
        src, buf, stream = torch.empty(1 << 30, dtype=torch.uint8).pin_memory(), \
            torch.empty(1 << 30, dtype=torch.uint8, device=device), torch.cuda.Stream(device)

        def copy() -> None:
            with torch.cuda.stream(stream):
                buf.copy_(src, non_blocking=True)
            torch.cuda.current_stream(device).wait_stream(stream)

        out["raw_pinned_GBps"] = round((1 << 30) / timed(copy, device) / GB, 2)
    return out


def verified_copies(cfg: ModelConfig, device: torch.device, kv_dtype: torch.dtype, context: int,
                    k: int = 32) -> dict:
    """A round's copies of its k+1 verified positions: into the draft cache's residual on the device
    (``CompressedKVCache.commit(source=...)``) and back to the host tier (the offloaded write-back):
    microseconds per round, each one strided copy of K and one of V, all layers at once."""
    full = FullKVCache(cfg, device, kv_dtype, capacity=context + k + 1)
    full.begin(0, context + k + 1)
    residual = FullKVCache(cfg, device, kv_dtype, capacity=context + k + 1)
    residual.begin(0, context + k + 1)
    host = FullKVCache(cfg, "cpu", kv_dtype, capacity=context + k + 1)
    host.begin(0, context + k + 1)
    if device.type == "cuda":
        host.pin()
    a, b = context, context + k + 1
    return {"positions": k + 1,
            "into_draft_cache_us": round(timed(lambda: residual.overwrite(full, a, b), device, 20) * 1e6, 1),
            "write_back_to_host_us": round(timed(lambda: host.overwrite(full, a, b), device, 20) * 1e6, 1)}


def synthetic_prefill(loaded: LoadedModel, prompt_len: int, capacity: int, seed: int, window: int = 64) -> SharedPrefill:
    """A prompt's prefill made of random K/V, last queries and logits (as ``ModelRunner.shared_prefill``
    returns them): decoding reads it as it reads a real one and costs the same, since no kernel's
    work depends on the values. Full decoding and VeriCache over it must still agree token for token."""
    cfg, dev = loaded.config, loaded.device
    gen = torch.Generator(device=dev).manual_seed(seed)
    full = FullKVCache(cfg, dev, loaded.kv_dtype, capacity=capacity)
    shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, 0, cfg.head_dim)
    for s in range(0, prompt_len, 4096):   # in chunks: a whole 32K request's K/V at once is 4 GB more
        t = min(4096, prompt_len - s)
        k, v = (torch.randn(shape[:2] + (t,) + shape[3:], generator=gen, device=dev).to(loaded.kv_dtype) for _ in "kv")
        full.append(k, v)
    queries = [torch.randn(cfg.num_attention_heads, window, cfg.head_dim, generator=gen, device=dev).to(loaded.kv_dtype)
               for _ in range(cfg.num_hidden_layers)]
    logits = torch.randn(cfg.vocab_size, generator=gen, device=dev)
    return SharedPrefill(full, queries, logits, prompt_len, 0.0)


def decode_rows(loaded: LoadedModel, kernels: str, prefills: list[SharedPrefill], prompts: list[list[int]],
                max_tokens: int, modes: list[str], compressor: str, draft_len: int | str, until: float,
                log=print) -> list[dict]:
    """Each mode's decode of every request over the shared prefills on ``kernels``: tokens/s, and
    VeriCache's tokens against full decoding's on the same kernels. A mode started after ``until`` is
    skipped; one that runs past it is cut (its row says so)."""
    from vericache_lab.bench.batch import decode_all

    use_gpu_kernels(loaded.model, kernels)
    loaded.kernels = kernels
    engine = Engine(loaded, mode="full", compressor=compressor, draft_len=draft_len, draft_weights="fp32",
                    tiered=False, device_budget_gb=None)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    rows, reference = [], None
    for mode in modes:
        if time.perf_counter() > until:
            rows.append({"kernels": kernels, "mode": mode, "skipped": "out of time"})
            continue
        seqs = [engine.new_sequence(i, p, params) for i, p in enumerate(prompts)]
        res = decode_all(engine, seqs, engine.resolve(RequestOptions(mode=mode)),
                         prefills, log, f"{kernels}/{mode}", until=until)
        outs = [s.output_ids for s in seqs]
        reference = outs if mode == "full" else reference
        rounds = sum(s.stats.get("rounds", 0) for s in seqs)
        decoded = sum(len(o) - 1 for o in outs)
        same = None if reference is None or mode == "lossy" else all(   # a cut run: the tokens both have
            o[: min(len(o), len(r))] == r[: min(len(o), len(r))] for o, r in zip(outs, reference))
        rows.append({"kernels": kernels, "mode": mode, "tokens_per_s": round(res["decoded"] / max(res["decode_s"], 1e-9), 2),
                     "output_tokens": sum(map(len, outs)), "decoded": res["decoded"], "decode_s": round(res["decode_s"], 3), "steps": res["steps"],
                     "load_s": round(res["load_s"], 2), "cut": res["cut"], "identical_to_full": same,
                     "mean_acceptance_length": round(decoded / rounds, 2) if rounds else None})
        log(f"  {kernels}/{mode}: {rows[-1]['tokens_per_s']} tok/s" + (" (cut)" if res["cut"] else ""))
    return rows


def attention_rate(loaded: LoadedModel, kernels: str, prefills: list[SharedPrefill], read_GBps: float) -> dict:
    """One layer's packed attention of one query per request over its whole full KV (a full decode
    step's attention): K/V bytes read per second, against the memory's read rate."""
    cfg, dev = loaded.config, loaded.device
    adt = loaded.model.attn_dtype or loaded.dtype
    n = len(prefills)
    q = torch.randn(cfg.num_attention_heads, n, cfg.head_dim, device=dev).to(adt)
    parts, nbytes = [], 0
    for p in prefills:   # the query at the prompt's last position sees all its keys (nothing is written)
        keys = p.prompt_len
        k, v = p.full.layer_views(0, keys)
        parts.append([KeyPart(k, v, n=keys, diag=keys - 1)])
        nbytes += 2 * k.numel() * k.element_size()
    s = timed(lambda: attend_packed(q, [1] * n, parts, cfg.num_key_value_heads, kernels), dev, repeat=5)
    return {"kernels": kernels, "requests": n, "keys_per_request": prefills[0].prompt_len, "bytes": nbytes,
            "seconds": s, "read_GBps": float(f"{nbytes / s / GB:.3g}"),
            "x_memory_read_rate": float(f"{nbytes / s / GB / read_GBps:.3g}") if read_GBps else None}


def identity_rows(make_model: Callable[[str], LoadedModel], kernel_sets: list[str], families: list[str],
                  prompts: list[list[int]], max_tokens: int, until: float, log=print) -> list[dict]:
    """On each kernel set: the prompts decoded together in full mode, then with VeriCache for each
    compressor family; a row per family says whether every request's tokens are full decoding's."""
    from vericache_lab.bench.batch import decode_all

    rows = []
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for kernels in kernel_sets:
        engine = Engine(make_model(kernels), mode="full", draft_weights="fp32", tiered=False, device_budget_gb=None)

        def run(mode: str, compressor: str | None = None) -> tuple[list[list[int]], int]:
            seqs = [engine.new_sequence(i, p, params) for i, p in enumerate(prompts)]
            opts = engine.resolve(RequestOptions(mode=mode, compressor=compressor))
            decode_all(engine, seqs, opts, [None] * len(seqs), log, f"{kernels}/{mode}")
            return [s.output_ids for s in seqs], sum(s.stats.get("rounds", 0) for s in seqs)

        reference, _ = run("full")
        for spec in families:
            if time.perf_counter() > until:
                rows.append({"kernels": kernels, "compressor": spec, "skipped": "out of time"})
                continue
            outs, rounds = run("vericache", spec)
            decoded = sum(len(o) - 1 for o in outs)
            rows.append({"kernels": kernels, "compressor": spec, "identical_to_full": outs == reference,
                         "mean_acceptance_length": round(decoded / rounds, 2) if rounds else None})
            log(f"  identity {kernels} {spec}: {rows[-1]['identical_to_full']}")
    return rows
