"""OpenVINO GenAI on the same GGUF, side by side with our rows: another CPU stack users pick.

``pip install -e '.[openvino]'`` (``openvino-genai``; CI does not need it: without it the rows are
left out and the bench says why). Its ``ContinuousBatchingPipeline`` reads the default model's GGUF
file as is; the bench's thread count (``INFERENCE_NUM_THREADS``), prefix caching off, the same token
ids (its GGUF tokenizer keeps only the last 8192 tokens of one ``encode`` call, so ids go in, not
text), greedy, ``ignore_eos``. Three rows: its defaults (bf16 inference where the CPU has it, u8 KV),
f16 KV, and its own cache eviction keeping the bench's kept fraction (lossy, like our lossy rows).
Decode tokens/s leave the prefill out as our rows do (its own perf metrics: the time a token after the
first); each row says whether its texts equal our full mode's. A short generate first warms it up (its
first call compiles).
"""

from __future__ import annotations

import importlib.util

import numpy as np
import torch

from vericache_lab.bench.llama_cpp_bench import gguf_path

KV_BLOCK = 32   # its KV block size on the CPU: eviction sizes are multiples of it


def unavailable() -> str | None:
    """Why the OpenVINO GenAI rows cannot run here (None: they can)."""
    if importlib.util.find_spec("openvino_genai") is None:
        return "openvino-genai is not installed (pip install -e '.[openvino]')"
    try:
        import openvino_genai  # noqa: F401
    except ImportError as exc:
        return f"openvino-genai does not import: {exc}"
    return None


def variants(keep: int | None, context: int) -> dict[str, dict]:
    """Row label -> settings: its defaults, f16 KV, and (where our compressor evicts: ``keep`` tokens of
    ``context``) its own eviction keeping as many, in whole blocks."""
    out = {"OpenVINO GenAI (defaults: u8 KV)": {}, "OpenVINO GenAI (f16 KV)": {"kv": "f16"}}
    if keep is not None:
        budget = max(KV_BLOCK * round(keep / KV_BLOCK), 6 * KV_BLOCK)   # above its start (1) + recent (4) blocks
        out[f"OpenVINO GenAI (its eviction, {budget} of {context} tokens kept; lossy)"] = {"evict": budget}
    return out


def _pipeline(gguf, threads: int, kv: str | None = None, evict: int | None = None):
    import openvino_genai as ov_genai

    sc = ov_genai.SchedulerConfig()
    sc.enable_prefix_caching = False
    sc.cache_size = 4   # GB of KV blocks: 8 x 8K of SmolLM2 in f16 is 1.5 GB
    if evict is not None:
        sc.use_cache_eviction = True
        sc.cache_eviction_config = ov_genai.CacheEvictionConfig(KV_BLOCK, 4 * KV_BLOCK, evict, ov_genai.AggregationMode.NORM_SUM)
    props = {"INFERENCE_NUM_THREADS": threads}
    if kv is not None:
        props["KV_CACHE_PRECISION"] = kv
    return ov_genai.ContinuousBatchingPipeline(str(gguf), sc, "CPU", props)


def _generate(pipe, prompts: list[list[int]], new_tokens: int) -> tuple[list[float], list[float], list[list[int]]]:
    """All prompts together, greedy: each one's first-token seconds, seconds a later token (its own
    perf metrics: TTFT and TPOT) and generated ids."""
    import openvino as ov
    import openvino_genai as ov_genai

    config = ov_genai.GenerationConfig()
    config.max_new_tokens, config.ignore_eos, config.do_sample = new_tokens, True, False
    results = pipe.generate([ov.Tensor(np.array([p], dtype=np.int64)) for p in prompts], [config] * len(prompts))
    return ([r.perf_metrics.get_ttft().mean / 1e3 for r in results], [r.perf_metrics.get_tpot().mean / 1e3 for r in results],
            [list(r.m_generation_ids[0]) for r in results])


def rows(model_name: str, prompts: list[list[int]], max_tokens: int, compressor: str,
         reference: list[list[int]] | None, log=print) -> list[dict]:
    """OpenVINO GenAI's rows for ``prompts`` decoded together (``compressor``: our lossy rows', whose
    kept tokens its eviction row keeps; ``reference``: our full mode's ids of each, first token
    included); [] with the reason logged where it cannot run. Decode tokens/s: the prompts' count over
    their mean time a token after the first (they decode together), so the prefill stays out."""
    from vericache.compress.registry import parse_compressor

    why = unavailable()
    gguf = gguf_path(model_name)
    if why is None and gguf is None:
        why = f"{model_name} has no GGUF file"
    if why is not None:
        log(f"OpenVINO GenAI: {why}; no OpenVINO GenAI rows")
        return []
    out, threads = [], torch.get_num_threads()
    context = max(len(p) for p in prompts)
    for label, settings in variants(parse_compressor(compressor).keep_budget(context), context).items():
        try:   # a side-by-side row: if it fails, say so and keep the bench's own figures
            pipe = _pipeline(gguf, threads, **settings)
            _generate(pipe, [prompts[0][:16]], 2)   # warm-up: its first generate compiles the model's graphs
            ttft, tpot, ids = _generate(pipe, prompts, max_tokens)
        except Exception as exc:  # noqa: BLE001 - any failure of the optional row
            log(f"{label}: failed ({type(exc).__name__}: {exc})")
            continue
        row = {"mode": label, "tokens_per_s": round(len(prompts) / (sum(tpot) / len(tpot)), 2),
               "first_token_s": round(max(ttft), 2), "identical_to_full": ids == reference if reference is not None else None}
        log(f"{label}: {row['tokens_per_s']} tok/s over {len(prompts)} sequence(s), first token(s) after "
            f"{row['first_token_s']} s, identical to our full mode: {row['identical_to_full']}")
        out.append(row)
    return out
