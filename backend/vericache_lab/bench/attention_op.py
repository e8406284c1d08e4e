"""``vericache bench attention-op``: the packed attention op alone, on synthetic caches, per query rows.

No model and no prefill: every layer's cache is random K/V of ``context`` tokens (SmolLM2's shape by
default: 3 KV heads of 64 channels, 9 query heads, 30 layers, each layer its own tensors, so a step
reads them from memory as decoding does), stored as the full fp16 cache or encoded as a quantized store.
For each cache and each row count T (1: a decode step; k + 1: a verification chunk; 512: a prefill
chunk) it times the op over all layers and prints the bytes read, the achieved rate and this machine's
measured read rate. Rows T > 1 are causal at the cache's end, as a chunk is.
``numerics="q8qk"`` times the full cache as a GGUF model's verification reads it: integer scores on this
CPU's fastest unit (``linear_op.score_unit``) over key codes kept beside the fp16 K/V as the cache keeps
them (coded in the untimed first call; their bytes counted). ``shape`` picks the heads: SmolLM2's, or the
code model's 2 KV heads of 7 query heads each over 24 layers, where a verification's 9 rows are 63 rows a
KV head.
"""

from __future__ import annotations

import torch

from vericache.kernels.cpu import best_isa
from vericache.kernels.linear_op import score_unit
from vericache.kv.packed import KeyPart, attend_packed, new_key_codes
from vericache.kv.quantized import CHANNEL_GROUPS, FP8, TOKEN_GROUPS, Layout
from vericache_lab.bench.attention import median_ms
from vericache_lab.bench.common import cpu_model
from vericache_lab.sim.roofline import read_bandwidth

STORES = {  # name -> (K layout, V layout): the compressors' stores (compress/quant.py)
    "kivi2": (Layout(CHANNEL_GROUPS, 2, 32), Layout(TOKEN_GROUPS, 2, 32)),
    "kivi4": (Layout(CHANNEL_GROUPS, 4, 32), Layout(TOKEN_GROUPS, 4, 32)),
    "int4": (Layout(TOKEN_GROUPS, 4, 32),) * 2,
    "int8": (Layout(TOKEN_GROUPS, 8, 32),) * 2,
    "fp8": (Layout(FP8),) * 2,
}
SHAPES = {  # name -> (layers, KV heads, query heads a KV head)
    "smollm2": (30, 3, 3),
    "qwen2.5-coder-0.5b": (24, 2, 7),
}
NUMERICS = ("fp32", "q8qk")


def _layer_part(cache: str, hkv: int, n: int, d: int, rows: int, g: torch.Generator,
                codes: bool = False) -> tuple[KeyPart, int]:
    """One layer's part and the bytes a step reads: the full fp16 cache (causal at the end; with ``codes``,
    the q8qk numerics' key codes beside it, which are all a step reads once they are made) or a quantized
    store."""
    k, v = torch.randn(hkv, n, d, generator=g) * 2, torch.randn(hkv, n, d, generator=g)
    if cache == "full":
        k16, v16 = k.half(), v.half()
        if not codes:
            return KeyPart(k16, v16, n, n - rows), 2 * k16.numel() * 2
        kc = new_key_codes(1, hkv, n, d, k.device).layer(0)
        return KeyPart(k16, v16, n, n - rows, codes=kc), sum(t.numel() * t.element_size() for t in kc.arrays())
    layouts, fields, nbytes = STORES[cache], [], 0
    for layout, x in zip(layouts, (k, v)):
        tok, grp = layout.encode(x)
        fields.append({"tok": tok, "grp": grp})
        nbytes += sum(t.numel() * t.element_size() for t in [*tok.values(), *grp.values()])
    pos = torch.arange(n, dtype=torch.int32).expand(hkv, n).contiguous()
    return KeyPart(fields[0], fields[1], n, None, layouts, pos), nbytes


@torch.inference_mode()
def run_attention_op(context: int, caches: list[str], rows: list[int], shape: str = "smollm2", numerics: str = "fp32",
                     head_dim: int = 64, repeats: int = 10, log=print) -> dict:
    for c in caches:
        if c != "full" and c not in STORES:
            raise ValueError(f"unknown cache {c!r}; choose from full, {', '.join(STORES)}")
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose from {', '.join(SHAPES)}")
    if numerics not in NUMERICS:
        raise ValueError(f"unknown numerics {numerics!r}; choose from {', '.join(NUMERICS)}")
    if numerics == "q8qk" and caches != ["full"]:
        raise ValueError(f"q8qk's integer scores read the full cache only (--caches full), got {','.join(caches)}")
    layers, kv_heads, groups = SHAPES[shape]
    unit = score_unit(numerics, best_isa())
    if context % 32 or context <= max(rows):
        raise ValueError(f"--context must be a multiple of 32 (KIVI's position groups) above the rows, got {context}")
    bw = read_bandwidth() / 1e9
    log(f"{cpu_model()}: read bandwidth {bw:.1f} GB/s; {layers} layers x {kv_heads} KV heads x {context} tokens, "
        f"{numerics} (score unit {unit})")
    out = []
    for cache in caches:
        for t in rows:
            g = torch.Generator().manual_seed(0)
            parts = [_layer_part(cache, kv_heads, context, head_dim, t, g, unit != 0) for _ in range(layers)]
            q = torch.randn(kv_heads * groups, t, head_dim, generator=g)
            nbytes = sum(b for _, b in parts)

            def step() -> None:
                for p, _ in parts:
                    attend_packed(q, [t], [[p]], kv_heads, score_unit=unit)

            ms = median_ms(step, repeats)
            row = {"cache": cache, "rows": t, "MB": round(nbytes / 1e6, 1), "ms": round(ms, 2),
                   "GBps": round(nbytes / ms / 1e6, 2), "x_read_bandwidth": round(nbytes / ms / 1e6 / bw, 3)}
            out.append(row)
            log(f"  {cache} T={t}: {ms:.2f} ms, {row['GBps']} GB/s ({row['x_read_bandwidth']} of the read rate)")
    return {"cpu": cpu_model(), "threads": torch.get_num_threads(), "context": context, "shape": shape,
            "numerics": numerics, "score_unit": unit, "isa": best_isa(),
            "read_bandwidth_GBps": round(bw, 1), "rows": out}
