"""``vericache sim --calibrate``: this machine's measured rates, and the cost model on them.

Measured with the real model and kernels (the same code the engine runs):
- ``step``: seconds of one forward with (almost) no KV, fitted as ``a + s * seqs + r * rows`` (a:
  reading the weights once; s: each sequence's per-layer work outside the matmuls, its cache calls;
  r: each row's matmul work), from one-row sequences (decode) and one many-row sequence (a chunk);
- ``attention``: one-query attention over long KV gives the KV read bandwidth (bytes/s); a chunk of
  queries over the same KV gives the compute rate (query-key pairs per second) that bounds
  verification;
- ``link``: the emulated link's achieved bytes/s at a nominal rate (its efficiency);
- ``roofline`` (``sim.roofline``): the read bandwidth, the weight matmuls by row count and the
  packed op's peak flop rate, what every bench step is compared against.

``predict`` turns them into tokens/s for ``bench throughput``'s rows (decode only; the prefill is
shared and not timed), so every measured row is printed beside what the model says it should be.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch


@dataclass
class Calibration:
    model: str
    weights_dtype: str
    threads: int
    step_a: float            # seconds per forward (weights read once, per-layer overhead)
    step_seq: float          # seconds per sequence in the forward (its per-layer cache calls)
    step_row: float          # seconds per row (token) in the forward
    attn_bytes_per_s: float  # KV bytes read per second by one-query attention
    attn_pairs_per_s: float  # query-key pairs (all layers, all query heads) per second, chunked queries
    link_efficiency: float   # achieved / nominal bytes per second of the emulated link
    kv_bytes_per_position: int
    roofline: dict | None = None   # sim.roofline.Roofline: read bandwidth, weight matmuls by rows, op peak

    def step_s(self, seqs: int, rows: int | None = None) -> float:
        """A forward over ``seqs`` sequences with ``rows`` tokens in all (default: one each)."""
        return self.step_a + self.step_seq * seqs + self.step_row * (seqs if rows is None else rows)

    def attention_s(self, n_seqs: int, keys: float, queries: int = 1) -> float:
        """``n_seqs`` sequences, each ``queries`` queries over ``keys`` keys (all layers)."""
        read = n_seqs * keys * self.kv_bytes_per_position / self.attn_bytes_per_s
        compute = n_seqs * keys * queries / self.attn_pairs_per_s
        return max(read, compute)


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
    bw = n_seqs * context * per_pos / one
    pairs = n_seqs * context * 16 / chunk
    log(f"attention: {bw / 1e9:.1f} GB/s one query; 16-query chunks {chunk / one:.1f}x a one-query pass")

    link = EmulatedLink(gbps=16)
    src = FullKVCache(cfg, "cpu", kv_dt, capacity=context)
    src.begin(0, context)
    dst = FullKVCache(cfg, "cpu", kv_dt, capacity=context)
    t0 = time.perf_counter()
    link.submit(src, context, dst).wait_all()
    eff = (src.nbytes() / (time.perf_counter() - t0)) / link.bytes_per_s
    link.close()
    log(f"link: {eff:.0%} of nominal")
    from vericache.sim.roofline import measure

    # two noisy slopes: on a busy machine a chunk's row can time above a whole sequence's, and no
    # cost is negative
    return Calibration(llm.loaded.name, str(llm.loaded.dtype).removeprefix("torch."), torch.get_num_threads(),
                       a, max(per_seq - row, 0.0), row, bw, pairs, eff, per_pos, measure(llm, log).to_dict())


def _slope(xs: list[int], ys: list[float]) -> float:
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def save(cal: Calibration, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(cal), indent=2))


def load(path: Path) -> Calibration | None:
    return Calibration(**json.loads(path.read_text())) if path.exists() else None


def predict(cal: Calibration, mode: str, n: int, context: int, budget_bytes: float, link_bytes_per_s: float,
            kept: float, window: int, acceptance: float, draft_len: float) -> float:
    """Modelled decode tokens/s of a ``bench throughput`` row.

    full: as many requests as the budget holds decode together, one token per step;
    lossy: all requests on their compressed KV (``kept`` of the tokens plus the window);
    vericache: a round is ``draft_len`` draft steps for all, and each request's verification
    (its full KV over the link, ``draft_len + 1`` queries over it), ``acceptance`` tokens each:
    naive = compute + link; staggered/grouped = max(compute, link) (P1 hides the smaller).
    """
    full_req = (context + 1) * cal.kv_bytes_per_position
    if mode == "full":
        b = max(min(n, int(budget_bytes // full_req)), 1)
        return b / (cal.step_s(b) + cal.attention_s(b, context))
    draft_keys = kept * context + window
    draft_step = cal.step_s(n) + cal.attention_s(n, draft_keys)
    if mode == "lossy":
        return n / draft_step
    k = draft_len  # each request's chunk of k + 1 rows rides in a step beside the others' draft rows
    verify = n * (cal.step_seq + cal.step_row * (k + 1)) + cal.attention_s(n, context, math.ceil(k + 1))
    compute = k * draft_step + verify
    link = n * full_req / (link_bytes_per_s * cal.link_efficiency)
    round_s = compute + link if mode.endswith("naive") else max(compute, link)
    return n * acceptance / round_s
