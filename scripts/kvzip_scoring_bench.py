"""Time KVzip's reconstruction pass (``compress/kvzip_scoring.py``) at a base commit beside this tree's, in one
process on one prefilled context, alternately; print each side's seconds and how far their scores agree.

    python scripts/kvzip_scoring_bench.py --base 84a4e3b --model qwen2.5-coder-0.5b --context 8000

The base's module is read from git (``git show BASE:backend/vericache/compress/kvzip_scoring.py``) and run
with this tree's model; the context is this repository's own Python source, tokenized.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
MODULE = "backend/vericache/compress/kvzip_scoring.py"


def base_module(commit: str, folder: Path):
    path = folder / "kvzip_scoring_base.py"
    path.write_text(subprocess.run(["git", "-C", str(ROOT), "show", f"{commit}:{MODULE}"], check=True,
                                   capture_output=True, text=True).stdout)
    spec = importlib.util.spec_from_file_location("kvzip_scoring_base", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cls = module.ReconstructionScoringCache
    if len(inspect.signature(cls.attend).parameters) == 5:   # a base from before the model passed its op in
        own = cls.attend
        cls.attend = lambda self, layer, q, k, v, attention=None: own(self, layer, q, k, v)
    return module


def top_overlap(a: dict[int, torch.Tensor], b: dict[int, torch.Tensor], kept: float) -> list[float]:
    """Per (layer, KV head): the share of the top ``kept`` keys both sides choose."""
    shares = []
    for layer in a:
        k = max(1, int(a[layer].shape[1] * kept))
        for x, y in zip(a[layer], b[layer]):
            shares.append(len(set(x.topk(k).indices.tolist()) & set(y.topk(k).indices.tolist())) / k)
    return shares


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="the commit whose scoring module to compare against")
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--context", type=int, default=4096, help="context tokens (the prefilled cache)")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    sys.path[:0] = [str(ROOT / "backend")]
    from vericache.compress import kvzip_scoring
    from vericache.compress.eviction import KVzip
    from vericache.kv.full import FullKVCache
    from vericache.model.loader import load_model

    loaded = load_model(args.model)
    text = "".join(p.read_text() for p in sorted((ROOT / "backend" / "vericache").rglob("*.py")))
    ids = loaded.tokenizer.encode(text)[: args.context]
    if len(ids) < args.context:
        raise SystemExit(f"the source holds {len(ids)} tokens, fewer than --context {args.context}")
    cache = FullKVCache(loaded.config, loaded.device, loaded.kv_dtype, capacity=len(ids), key_codes=loaded.key_codes)
    t0 = time.perf_counter()
    with torch.inference_mode():
        cache.begin(0, len(ids))
        loaded.model(torch.tensor(ids), [0], [len(ids)], [cache], logits_index=torch.tensor([len(ids) - 1]))
    print(f"{args.model}, {len(ids)} tokens prefilled in {time.perf_counter() - t0:.1f} s", flush=True)
    repeat = loaded.tokenizer.encode(KVzip.repeat_prompt)
    with tempfile.TemporaryDirectory() as tmp:
        sides = {"base": base_module(args.base, Path(tmp)), "head": kvzip_scoring}
        seconds: dict[str, list[float]] = {"base": [], "head": []}
        scores = {}
        for i in range(args.repeats):
            for side, module in sides.items():
                t0 = time.perf_counter()
                scores[side] = module.reconstruction_scores(loaded.model, cache, ids, repeat)
                seconds[side].append(time.perf_counter() - t0)
                print(f"  run {i + 1} {side}: {seconds[side][-1]:.1f} s", flush=True)
    best = {side: min(s) for side, s in seconds.items()}
    shares = top_overlap(scores["base"], scores["head"], 0.125)
    print(f"reconstruction pass, best of {args.repeats}: base {best['base']:.1f} s, head {best['head']:.1f} s "
          f"({best['base'] / best['head']:.2f}x); the top 1/8 keys both choose: min {min(shares):.3f}, "
          f"mean {sum(shares) / len(shares):.3f} over {len(shares)} (layer, KV head) pairs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
