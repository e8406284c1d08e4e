"""``python -m vericache.bench.gpu_check --out DIR``: the device check (one command, < 8 minutes).

On an NVIDIA GPU it measures, with CUDA events:
- host-to-device copy bandwidth from pinned memory on a side stream (and from pageable memory);
- draft-step time (one token over a compressed cache) and verify-step time (k+1 tokens over the
  full KV) of the bundled model at several contexts, bf16;
- the throughput bench on CUDA (real PCIe link, no emulation);
and writes everything to DIR/gpu_check.json next to the cost model's prediction for the same
copy bandwidth. Without CUDA it exits 0 after saying so (CI never has a GPU).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from vericache.model.registry import DEFAULT_MODEL


def _cuda_time(fn, repeat: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeat / 1e3


def copy_bandwidth(nbytes: int = 1 << 30) -> dict:
    src_pinned = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    src_pageable = torch.empty(nbytes, dtype=torch.uint8)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()

    def pinned():
        with torch.cuda.stream(stream):
            dst.copy_(src_pinned, non_blocking=True)
        torch.cuda.current_stream().wait_stream(stream)

    t_pinned = _cuda_time(pinned, 5)
    t_pageable = _cuda_time(lambda: dst.copy_(src_pageable), 3)
    return {"bytes": nbytes, "pinned_GBps": round(nbytes / t_pinned / 1e9, 2),
            "pageable_GBps": round(nbytes / t_pageable / 1e9, 2)}


@torch.inference_mode()
def step_times(contexts: list[int], k: int = 32, compressor: str = "snapkv:ratio=0.125") -> list[dict]:
    from vericache.compress.registry import parse_compressor
    from vericache.kv.compressed import CompressedKVCache
    from vericache.kv.full import FullKVCache
    from vericache.model.loader import load_model

    lm = load_model(DEFAULT_MODEL, device="cuda", dtype="bfloat16")
    m, cfg = lm.model, lm.config
    rows = []
    for n in contexts:
        ids = torch.randint(0, cfg.vocab_size, (n,), device="cuda")
        full = FullKVCache(cfg, "cuda", torch.bfloat16, capacity=n + k + 2)
        draft = CompressedKVCache(parse_compressor(compressor), cfg, "cuda", torch.bfloat16, capacity=n + k + 2)
        for s in range(0, n, 4096):
            chunk = ids[s : s + 4096]
            m(chunk, [s], [len(chunk)], [full])
            m(chunk, [s], [len(chunk)], [draft])
        draft.commit(n)
        one = torch.tensor([5], device="cuda")
        chunk = torch.randint(0, cfg.vocab_size, (k + 1,), device="cuda")

        def full_step():
            m(one, [n], [1], [full])
            full.truncate(n)

        def draft_step():
            m(one, [n], [1], [draft])

        def verify():
            m(chunk, [n], [k + 1], [full])
            full.truncate(n)

        rows.append({"context": n, "full_step_ms": round(_cuda_time(full_step) * 1e3, 3),
                     "draft_step_ms": round(_cuda_time(draft_step) * 1e3, 3),
                     f"verify_{k + 1}_tokens_ms": round(_cuda_time(verify) * 1e3, 3),
                     "full_kv_MB": round(full.nbytes() / 1e6, 2), "compressed_kv_MB": round(draft.nbytes() / 1e6, 2)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


FAMILIES = ("snapkv:ratio=0.125", "streaming:ratio=0.125", "h2o:ratio=0.125", "kvzip:ratio=0.25", "kivi:bits=2",
            "int4", "fp8", "snapkv:ratio=0.125+kivi:bits=2")


def identity_on_cuda(context: int = 2048, max_tokens: int = 48) -> list[dict]:
    """VeriCache == full KV, token for token, on CUDA for every compressor family (bf16)."""
    from vericache.bench.common import code_prompt
    from vericache.llm import LLM
    from vericache.sampling import SamplingParams

    llm = LLM(DEFAULT_MODEL, device="cuda")
    runner, params = llm.runner, SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    prompt = code_prompt(llm.tokenizer, context)
    ref = runner.generate([runner.new_sequence(0, prompt, params)], "full")[0]
    rows = []
    for spec in FAMILIES:
        runner.compressor = runner.defaults.compressor = parse_spec(spec)
        out = runner.generate([runner.new_sequence(0, prompt, params)], "vericache")[0]
        rows.append({"compressor": spec, "identical_to_full": out.token_ids == ref.token_ids,
                     "mean_acceptance_length": out.stats.get("mean_acceptance_length")})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def parse_spec(spec: str):
    from vericache.compress.registry import parse_compressor

    return parse_compressor(spec)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="gpu_check_out")
    ap.add_argument("--contexts", default="4096,16384,65536")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing to measure (this is expected on CPU machines and in CI)")
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    report["copy"] = copy_bandwidth()
    print(json.dumps(report["copy"]), flush=True)
    report["steps"] = step_times([int(c) for c in args.contexts.split(",")])
    report["identity"] = identity_on_cuda()

    from vericache.bench.batch import run_batch
    from vericache.bench.decode import run_decode_bench
    from vericache.bench.throughput import plot_timeline, run_throughput

    report["decode"] = run_decode_bench(DEFAULT_MODEL, [8000], 96, ["full", "lossy", "vericache"],
                                        "snapkv:ratio=0.125", with_transformers=False, dtype="bfloat16",
                                        device="cuda")["rows"]
    report["batch"] = run_batch(DEFAULT_MODEL, 16, 8000, 128, ["full", "lossy", "vericache"], "snapkv:ratio=0.125",
                                device="cuda")["rows"]
    from vericache.sim.cost_model import GPUS, MODELS, SimConfig, simulate

    res = run_throughput(DEFAULT_MODEL, 16, 8192, 128, 0.25, 0.0, "snapkv:ratio=0.125", device="cuda", resident_layers=3)
    report["throughput"] = res["rows"]
    plot_timeline(res["timelines"], str(out / "gpu_timeline.png"), res["link"])
    measured_link = report["copy"]["pinned_GBps"] * 1e9
    report["cost_model_llama3_8b_32k_at_measured_link"] = simulate(
        SimConfig(GPUS["h200"], MODELS["llama3-8b"], measured_link, 32768))
    report["seconds"] = round(time.time() - t0, 1)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
