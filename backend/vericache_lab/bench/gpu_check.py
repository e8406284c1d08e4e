"""``vericache bench gpu-check``: the device check, one command sized for one run on one H200 in under
8 minutes (issue 33), and its ``--dry-run``: the same code on the CPU at toy shapes, the Triton kernels
in Triton's interpreter (what CI runs).

In order, each part into one JSON, ``<out>/gpu_check.json`` (``--out``, default ``$OUT``), rewritten
after every part so that a run cut short still brings back what it measured:
1. ``rates``: the device memory's read rate, the full KV's host-to-device rate through the engine's own
   link (pinned memory, a side stream, an event per layer) beside a raw pinned copy, and the copies a
   round makes of its verified positions (into the draft cache; back to the host tier).
2. ``identity``: the bundled ``tiny`` model (the dry run: a random toy model), several requests decoded
   together, full decoding against VeriCache for each compressor family, on the Triton kernels and on
   PyTorch's.
3. ``decode``: a random-weight model of Llama-3-8B's shapes (bf16, made on the device: no checkpoint
   travels), 16 requests x 32K tokens, full / lossy / VeriCache tokens/s on PyTorch's kernels, then on
   the Triton ones; VeriCache's tokens checked against full decoding's. The prompts' K/V are random
   (``gpu_parts.synthetic_prefill``): decode costs what it costs whatever the values, and 16 real 32K
   prefills would take the budget. Acceptance on random weights says nothing about a trained model's.
4. ``attention``: one layer's packed attention over the 16 full caches, bytes read per second against
   the measured read rate, on each kernel set.
5. ``cost_model``: ``vericache sim``'s prediction for Llama-3-8B at 32K on an H200 at the measured link.
Without CUDA and without ``--dry-run`` it says so and measures nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

FAMILIES = ("snapkv:ratio=0.125", "streaming:ratio=0.125", "h2o:ratio=0.125", "kvzip:ratio=0.25", "kivi:bits=2",
            "int4", "fp8", "snapkv:ratio=0.125+kivi:bits=2")
W8 = "window=8"   # toy prompts are short: a small window, so compression happens
# the interpreter runs a toy step in about a second: one family, kept tokens quantized with their
# positions beside KIVI's dense recent window (the decode part's VeriCache rows draft over SnapKV's dense
# kept tokens; tests/test_triton_kernels.py checks every part kind against the CPU op)
DRY_FAMILIES = (f"snapkv:ratio=0.25,{W8}+kivi:bits=2,{W8}",)
KERNEL_SETS = ("torch", "triton")   # PyTorch's first: its figures come back even if the Triton part runs out


@dataclass(frozen=True)
class Sizes:
    model: str                 # ``model.random_model.SHAPES`` name of the timed model
    requests: int
    context: int
    max_tokens: int
    identity_model: str        # "tiny", or a random model's shape
    identity_requests: int
    identity_context: int
    identity_tokens: int
    families: tuple[str, ...]
    read_bytes: int
    link_positions: int
    compressor: str = "snapkv:ratio=0.125"


DEVICE_SIZES = Sizes("llama3-8b", 16, 32768, 24, "tiny", 4, 1024, 32, FAMILIES, 4 << 30, 4096)
DRY_SIZES = Sizes("toy", 2, 48, 4, "toy", 2, 48, 4, DRY_FAMILIES, 64 << 20, 256, f"snapkv:ratio=0.25,{W8}")


class Report(dict):
    """The JSON and the check's clock: each part runs unless the budget is spent, and is saved at once."""

    def __init__(self, path: Path, budget_s: float, log=print, **fields) -> None:
        super().__init__(fields, budget_s=budget_s)
        self.path, self.log = path, log
        self.t0 = time.perf_counter()
        self.until = self.t0 + budget_s

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self, indent=2, default=str))

    def part(self, name: str, fn) -> None:
        """``self[name] = fn()``, or why not (out of time, or what it raised); saved."""
        if time.perf_counter() > self.until:
            self[name] = {"skipped": "out of time"}
        else:
            self.log(f"{name} ({time.perf_counter() - self.t0:.0f} s in)")
            self[name] = _or_error(fn, {}, self.log)
        self["seconds"] = round(time.perf_counter() - self.t0, 1)
        self.save()

    def each_set(self, fn) -> list[dict]:
        """``fn(kernels)``'s rows for each kernel set; a set that raises leaves a row saying why."""
        return [row for k in KERNEL_SETS for row in _or_error(lambda: fn(k), {"kernels": k}, self.log, listed=True)]


def _identity_model(name: str, device: torch.device):
    from vericache.model.loader import load_model
    from vericache.model.random_model import random_model

    if name == "tiny":
        return lambda kernels: load_model("tiny", device=device, kernels=kernels)
    return lambda kernels: random_model(name, device, kernels=kernels, seed=1)


def _prompts(vocab_size: int, n: int, length: int, seed: int) -> list[list[int]]:
    """``n`` prompts of random token ids (a random model's: any text means as little)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (length,), generator=gen).tolist() for _ in range(n)]


def run_check(out: Path, dry_run: bool, budget_s: float, log=print, draft_len: int | str = "auto") -> Report:
    """Every part in order, each skipped once ``budget_s`` is spent; returns the report (saved)."""
    from vericache.model.random_model import random_model
    from vericache_lab.bench import gpu_parts as parts
    from vericache_lab.bench.batch import distinct_prompts
    from vericache_lab.sim.cost_model import GPUS, MODELS, SimConfig, simulate

    sizes = DRY_SIZES if dry_run else DEVICE_SIZES
    dev = torch.device("cpu" if dry_run else "cuda")
    report = Report(out / "gpu_check.json", budget_s, log, dry_run=dry_run, sizes=asdict(sizes),
                    device=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (Triton interpreter)",
                    torch=torch.__version__, triton=_triton_version())
    part, each_set, until = report.part, report.each_set, report.until
    timed_model = random_model(sizes.model, dev, "bfloat16" if dev.type == "cuda" else "float32", "torch",
                               max_context=sizes.context + sizes.max_tokens + 8)
    cfg, kv_dtype = timed_model.config, timed_model.kv_dtype
    part("rates", lambda: {"memory": parts.read_rate(dev, sizes.read_bytes),
                           "link": parts.link_rate(cfg, dev, kv_dtype, sizes.link_positions),
                           "verified_copies": parts.verified_copies(cfg, dev, kv_dtype, sizes.link_positions)})

    def identity() -> list[dict]:
        make = _identity_model(sizes.identity_model, dev)
        probe = make("torch")
        prompts = (distinct_prompts(probe.tokenizer, sizes.identity_requests, sizes.identity_context)
                   if sizes.identity_model == "tiny" else
                   _prompts(probe.config.vocab_size, sizes.identity_requests, sizes.identity_context, seed=2))
        del probe
        return each_set(lambda k: parts.identity_rows(make, [k], list(sizes.families), prompts, sizes.identity_tokens,
                                                      until, log))

    part("identity", identity)
    prefills = [parts.synthetic_prefill(timed_model, sizes.context, sizes.context + sizes.max_tokens + 1, seed=i)
                for i in range(sizes.requests)]
    prompts = _prompts(cfg.vocab_size, sizes.requests, sizes.context, seed=3)
    part("decode", lambda: each_set(lambda k: parts.decode_rows(
        timed_model, k, prefills, prompts, sizes.max_tokens, ["full", "lossy", "vericache"], sizes.compressor,
        draft_len, until, log)))
    read = report["rates"].get("memory", {}).get("read_GBps", 0.0) if isinstance(report["rates"], dict) else 0.0
    part("attention", lambda: each_set(lambda k: parts.attention_rate(timed_model, k, prefills, read)))
    link = report["rates"].get("link", {}).get("link_GBps") if isinstance(report["rates"], dict) else None
    part("cost_model", lambda: {"link_GBps": link, "llama3_8b_32k_h200": simulate(
        SimConfig(GPUS["h200"], MODELS["llama3-8b"], (link or 0.0) * 1e9 or 1.0, 32768))})
    if dev.type == "cuda":
        report["peak_device_bytes"] = torch.cuda.max_memory_allocated(dev)
    report.save()
    return report


def _or_error(fn, where: dict, log, listed: bool = False):
    """``fn()``, or what it raised (one run on a lent device: a part that fails must not cost the
    others; the exit status says it failed)."""
    try:
        out = fn()
        return out if not listed or isinstance(out, list) else [out]
    except Exception as exc:  # noqa: BLE001 - recorded in the report, the run goes on
        log(f"  failed: {type(exc).__name__}: {exc}")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()   # an out-of-memory must not starve the next part
        failed = where | {"error": f"{type(exc).__name__}: {exc}"[:2000],
                          "traceback": traceback.format_exc()[-3000:]}
        return [failed] if listed else failed


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="vericache bench gpu-check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    return run(ap.parse_args(argv))


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--out", default=None, help="folder for gpu_check.json (default $OUT, else ./gpu_check_out)")
    ap.add_argument("--dry-run", action="store_true",
                    help="the same code on the CPU at toy shapes, the Triton kernels in Triton's interpreter (CI)")
    ap.add_argument("--budget-s", type=float, default=420.0,
                    help="seconds after which the parts left are skipped and a running decode is cut")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args: argparse.Namespace) -> int:
    if args.budget_s <= 0:
        raise ValueError(f"--budget-s must be > 0, got {args.budget_s}")
    if args.dry_run:   # before triton is imported: its jit reads this once
        os.environ["TRITON_INTERPRET"] = "1"
    elif not torch.cuda.is_available():
        print("gpu-check: no CUDA device here, nothing to measure; `--dry-run` runs the same code on the CPU")
        return 0
    out = Path(args.out or os.environ.get("OUT") or "gpu_check_out")
    report = run_check(out, args.dry_run, args.budget_s, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(json.dumps(report, indent=2, default=str) if args.json else f"gpu-check: {report.path} ({report['seconds']} s)")
    return 1 if not_identical(report) or errors(report) else 0


def errors(report: dict) -> list[str]:
    """What raised, part by part and row by row."""
    found = []
    for name, value in report.items():
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, dict) and "error" in item:
                found.append(f"{name}: {item['error']}")
    for line in found:
        print(f"gpu-check: FAILED: {line}", file=sys.stderr)
    return found


def not_identical(report: dict) -> list[dict]:
    """The rows on the batch-invariant (Triton) kernels whose VeriCache output differs from full
    decoding's: a failure. On PyTorch's kernels (cuBLAS: bits depend on the batch) a near-tie may
    resolve differently in the two modes, as between two batch sizes of plain decoding: reported only."""
    rows = [r for part in ("identity", "decode") if isinstance(report.get(part), list) for r in report[part]]
    bad = [r for r in rows if r.get("kernels") == "triton" and r.get("identical_to_full") is False]
    for r in bad:
        print(f"gpu-check: NOT IDENTICAL on the batch-invariant kernels: {r}", file=sys.stderr)
    return bad


if __name__ == "__main__":
    sys.exit(main())
