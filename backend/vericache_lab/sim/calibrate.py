"""``vericache sim --calibrate``: this machine's terms of the cost model (``drafting.cost.StepCosts``),
measured with the real model and kernels (the same code the engine runs), and stored for ``bench
throughput``'s predictions (``vericache_lab.predict.predict_offloaded``):
- c0, t_seq, t_row: forwards with (almost) no KV, fitted as ``c0 + t_seq * seqs + t_row * rows`` from
  one-row sequences (decode) and one many-row sequence (a chunk);
- t_byte: one-query attention over long KV (the KV read rate); t_pair: a chunk of queries over the
  same KV, less the one-query pass (the compute that bounds verification);
- the emulated link's achieved bytes/s at a nominal rate (its efficiency);
- ``roofline`` (``sim.roofline``): the read bandwidth, the weight matmuls by row count and the
  packed op's peak flop rate, what every bench step is compared against.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from vericache.drafting.cost import StepCosts


@dataclass
class Calibration:
    model: str
    weights_dtype: str
    threads: int
    costs: dict              # StepCosts' terms (``StepCosts.to_dict``)
    link_efficiency: float   # achieved / nominal bytes per second of the emulated link
    kv_bytes_per_position: int
    roofline: dict | None = None   # sim.roofline.Roofline: read bandwidth, weight matmuls by rows, op peak

    @property
    def step_costs(self) -> StepCosts:
        return StepCosts(**self.costs)


def default_path(model: str, dtype: str) -> Path:
    root = Path(os.environ.get("VERICACHE_CACHE_DIR", Path.home() / ".cache" / "vericache"))
    return root / f"calibration-{Path(model).name}-{dtype}-{torch.get_num_threads()}t.json"


def _time(fn, repeat: int = 3) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t) / repeat


@torch.inference_mode()
def calibrate(model: str, dtype: str | None = None, context: int = 4096, log=print) -> Calibration:
    from vericache.kv.full import FullKVCache
    from vericache.kv.link import EmulatedLink
    from vericache.llm import LLM

    llm = LLM(model, device="cpu", dtype=dtype)
    m, cfg, kv_dt = llm.loaded.model, llm.loaded.config, llm.loaded.kv_dtype

    def forward_s(seqs: int, rows_each: int) -> float:
        caches = [FullKVCache(cfg, "cpu", kv_dt, capacity=rows_each + 1) for _ in range(seqs)]
        toks = torch.zeros(seqs * rows_each, dtype=torch.long)
        last = torch.arange(rows_each - 1, seqs * rows_each, rows_each)  # the engine's logits rows

        def run():
            for c in caches:
                c.truncate(0)
            m(toks, [0] * seqs, [rows_each] * seqs, caches, logits_index=last)
        return _time(run)

    seqs = [1, 8, 32, 96]
    per_seq = _slope(seqs, [forward_s(n, 1) for n in seqs])           # s + r
    chunk = [1, 16, 64]
    times = [forward_s(1, r) for r in chunk]
    row = _slope(chunk, times)                                          # r
    a = times[0] - per_seq
    log(f"forward: {times[0] * 1e3:.1f} ms for one token; +{per_seq * 1e3:.2f} ms per one-token sequence, "
        f"+{row * 1e3:.3f} ms per row of a chunk")

    from vericache.kv.packed import KeyPart, attend_packed

    n_seqs, d, hq, hkv = 8, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    kv = [(torch.randn(hkv, context, d, dtype=kv_dt), torch.randn(hkv, context, d, dtype=kv_dt)) for _ in range(n_seqs)]

    def attn(queries: int) -> float:
        q = torch.randn(hq, n_seqs * queries, d, dtype=llm.loaded.attn_dtype)
        parts = [[KeyPart(k, v, n=context)] for k, v in kv]   # the forward's op: all sequences in one call
        return _time(lambda: attend_packed(q, [queries] * n_seqs, parts, hkv)) * cfg.num_hidden_layers
    one, chunk = attn(1), attn(16)
    per_pos = cfg.kv_bytes_per_position(kv_dt.itemsize)
    t_byte = one / (n_seqs * context * per_pos)
    t_pair = max(chunk - one, 0.0) / (n_seqs * context * 15)   # the 15 more queries' pairs
    log(f"attention: {1 / t_byte / 1e9:.1f} GB/s one query; 16-query chunks {chunk / one:.1f}x a one-query pass")

    link = EmulatedLink(gbps=16)
    src = FullKVCache(cfg, "cpu", kv_dt, capacity=context)
    src.begin(0, context)
    dst = FullKVCache(cfg, "cpu", kv_dt, capacity=context)
    t0 = time.perf_counter()
    link.submit(src, context, dst).wait_all()
    eff = (src.nbytes() / (time.perf_counter() - t0)) / link.bytes_per_s
    link.close()
    log(f"link: {eff:.0%} of nominal")
    from vericache_lab.sim.roofline import measure

    # two noisy slopes: on a busy machine a chunk's row can time above a whole sequence's, and no
    # cost is negative
    costs = StepCosts(max(a, 0.0), max(row, 0.0), max(per_seq - row, 0.0), t_byte, t_pair)
    return Calibration(llm.loaded.name, str(llm.loaded.dtype).removeprefix("torch."), torch.get_num_threads(),
                       costs.to_dict(), eff, per_pos, measure(llm, log).to_dict())


def _slope(xs: list[int], ys: list[float]) -> float:
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def save(cal: Calibration, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(cal), indent=2))


def load(path: Path) -> Calibration | None:
    return Calibration(**json.loads(path.read_text())) if path.exists() else None
