"""What a step should cost on this machine: the roofline every bench step is compared against.

Measured in the process that runs the bench, with the engine's own kernels:
- the memory read bandwidth (a 1 GB fp32 sum, best of three);
- one forward's weight matmuls (every linear layer and the LM head) at 1, 2, 4 ... 512 rows:
  bandwidth-bound at few rows, compute-bound at many;
- the packed attention op's flop rate on a compute-bound shape (256 queries over 4096 keys).

A step of ``rows`` rows whose attention reads ``kv_bytes`` and computes ``pairs`` query-key pairs
(per query head and layer, ``runner.attention_work``) costs at least
``weights_s(rows) + max(kv_bytes / bandwidth, pairs * flops_per_pair / flop_rate)``; its
``step_ms / roofline_ms`` says how far the engine is from what the hardware allows.
"""

from __future__ import annotations

import bisect
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from vericache.timing import best_seconds

WEIGHT_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


@dataclass
class Roofline:
    read_bytes_per_s: float
    attn_flops_per_s: float
    flops_per_pair: int                      # 4 * head_dim * query heads * layers (QK and PV, multiply-add)
    weight_rows: list[int] = field(default_factory=list)
    weight_s: list[float] = field(default_factory=list)   # one forward's matmuls at weight_rows[i] rows

    def weights_s(self, rows: int) -> float:
        """Piecewise-linear in rows between the measured points (and beyond the last two)."""
        xs, ys = self.weight_rows, self.weight_s
        i = min(max(bisect.bisect_left(xs, rows), 1), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return max(y0 + (y1 - y0) * (rows - x0) / (x1 - x0), ys[0])

    def attention_s(self, kv_bytes: float, pairs: float) -> float:
        return max(kv_bytes / self.read_bytes_per_s, pairs * self.flops_per_pair / self.attn_flops_per_s)

    def step_s(self, rows: int, kv_bytes: float, pairs: float) -> float:
        return self.weights_s(rows) + self.attention_s(kv_bytes, pairs)

    def to_dict(self) -> dict:
        return asdict(self)

    def best(self, other: Roofline) -> Roofline:
        """The faster of two measurements, figure by figure: on a shared machine a slow moment
        (another tenant's burst) should not lower what the hardware is credited with."""
        if other.weight_rows != self.weight_rows:
            raise ValueError("rooflines measured at different row counts")
        return Roofline(max(self.read_bytes_per_s, other.read_bytes_per_s),
                        max(self.attn_flops_per_s, other.attn_flops_per_s), self.flops_per_pair,
                        list(self.weight_rows), [min(a, b) for a, b in zip(self.weight_s, other.weight_s)])


def read_bandwidth(n_bytes: int = 1 << 30, repeats: int = 3) -> float:
    """This machine's memory read rate (bytes/s): the best of ``repeats`` sums over ``n_bytes`` of fp32."""
    x = torch.ones(n_bytes // 4)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return n_bytes / best


@torch.inference_mode()
def weights_seconds(model, rows: int, repeats: int = 3) -> float:
    """One forward's weight matmuls at ``rows`` rows, as the forward runs them (fused q/k/v and
    gate/up where the model has them), the LM head over every row (verification needs each row's
    logits; at decode's few rows it is bandwidth-bound, so the count barely matters)."""
    cfg = model.config
    dt = model.lm_head.weight.dtype
    x = torch.randn(rows, cfg.hidden_size, dtype=dt)
    xo = torch.randn(rows, cfg.num_attention_heads * cfg.head_dim, dtype=dt)
    xi = torch.randn(rows, cfg.intermediate_size, dtype=dt)

    def run() -> None:
        if model.head_exact is not None:   # the batch-invariant op over the stored weights
            from vericache.model.exact_linear import exact_linears

            for lin in exact_linears(model):
                lin({cfg.hidden_size: x, xo.shape[1]: xo, xi.shape[1]: xi}[lin.in_features])
            return
        for layer in model.model.layers:
            a, mlp = layer.self_attn, layer.mlp
            if a.qkv is not None:
                F.linear(x, *a.qkv)
            else:
                a.q_proj(x), a.k_proj(x), a.v_proj(x)
            if mlp.gate_up is not None:
                F.linear(x, mlp.gate_up)
            else:
                mlp.gate_proj(x), mlp.up_proj(x)
            a.o_proj(xo), mlp.down_proj(xi)
        model.lm_head(x)

    return best_seconds(run, repeats)


@torch.inference_mode()
def attention_flop_rate(cfg, dtype: torch.dtype, queries: int = 256, keys: int = 4096) -> float:
    """The packed op's flops/s where it is compute-bound: one sequence, ``queries`` (fp32) over
    ``keys`` held in ``dtype`` (the full KV's)."""
    from vericache.kv.packed import KeyPart, attend_packed

    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    k, v = torch.randn(hkv, keys, d, dtype=dtype), torch.randn(hkv, keys, d, dtype=dtype)
    q = torch.randn(hq, queries, d)
    s = best_seconds(lambda: attend_packed(q, [queries], [[KeyPart(k, v, n=keys)]], hkv), 5)
    return 4 * d * hq * queries * keys / s


def measure(llm, log=print) -> Roofline:
    """The roofline of ``llm``'s model on this machine (CPU), measured now (~10 s)."""
    model, cfg = llm.loaded.model, llm.loaded.config
    bw = read_bandwidth()
    rows = list(WEIGHT_ROWS)
    secs = [weights_seconds(model, r) for r in rows]
    flops = attention_flop_rate(cfg, llm.loaded.kv_dtype)
    log(f"roofline: read {bw / 1e9:.1f} GB/s; weights {secs[0] * 1e3:.1f} ms at 1 row, "
        f"{secs[rows.index(16)] * 1e3:.1f} at 16, {secs[-1] * 1e3:.0f} at {rows[-1]}; "
        f"attention op {flops / 1e9:.0f} GFLOP/s")
    return Roofline(bw, flops, 4 * cfg.head_dim * cfg.num_attention_heads * cfg.num_hidden_layers, rows, secs)


def step_kind(kinds: str, mode: str) -> str | None:
    """A step's roofline class: full (full-KV decode), draft (lossy decode or drafting), verification
    (any step with a verification chunk); None for steps with prefill (not decode)."""
    if "prefill" in kinds:
        return None
    if "verify" in kinds:
        return "verification"
    return "full" if kinds == "decode" and mode == "full" else "draft"


def summarize(steps, roofline: Roofline, mode: str, label: str | None = None) -> list[dict]:
    """Per step kind of one mode's run (shown as ``label``, default the mode): steps, median step_ms
    (the forward) and roofline_ms, their ratio (total measured time over total roofline time), the
    median of step minus roofline (``fixed_ms``: what a step costs beyond its matmuls at their measured
    speed and its KV at the read rate), the median postprocess (commits, compression moves) and the
    slowest step, forward + postprocess."""
    groups: dict[str, list[tuple[float, float, float]]] = {}
    for s in steps:
        kind = step_kind(s.kinds, mode)
        if kind is not None:
            roof = roofline.step_s(s.rows, s.kv_bytes, s.pairs)
            groups.setdefault(kind, []).append((s.end - s.start, roof, s.post))
    out = []
    for kind, rows in groups.items():
        measured, roof, post = zip(*rows)
        out.append({"mode": label or mode, "step_kind": kind, "steps": len(rows),
                    "step_ms": round(statistics.median(measured) * 1e3, 2),
                    "roofline_ms": round(statistics.median(roof) * 1e3, 2),
                    "x_roofline": round(sum(measured) / sum(roof), 2),
                    "fixed_ms": round(statistics.median(m - r for m, r in zip(measured, roof)) * 1e3, 2),
                    "post_ms": round(statistics.median(post) * 1e3, 2),
                    "slowest_ms": round(max(m + p for m, _, p in rows) * 1e3, 2)})
    return out


def verified_row_cost(full_steps, vericache_steps) -> dict | None:
    """What one more verified row costs (issue 40's measure): median over verification steps of
    (step - the median full decode step) / (rows - 1), against the median draft step. None without
    both kinds of step."""
    full = [s.end - s.start for s in full_steps if step_kind(s.kinds, "full") == "full"]
    drafts = [s.end - s.start for s in vericache_steps if step_kind(s.kinds, "vericache") == "draft"]
    verify = [s for s in vericache_steps if step_kind(s.kinds, "vericache") == "verification" and s.rows > 1]
    if not (full and drafts and verify):
        return None
    one = statistics.median(full)
    marginal = statistics.median((s.end - s.start - one) / (s.rows - 1) for s in verify)
    draft = statistics.median(drafts)
    return {"full_step_ms": round(one * 1e3, 2), "verified_row_ms": round(marginal * 1e3, 2),
            "draft_step_ms": round(draft * 1e3, 2), "row_over_draft": round(marginal / draft, 3),
            "rows_per_verification": round(statistics.median(s.rows for s in verify), 1)}


def stall(steps, mode: str) -> dict | None:
    """The slowest decode step (forward + postprocess, any kind) against the median draft step:
    how much one step stalls every request in it (None without draft steps)."""
    drafts = [s.end - s.start + s.post for s in steps if step_kind(s.kinds, mode) == "draft"]
    decode = [s.end - s.start + s.post for s in steps if step_kind(s.kinds, mode) is not None]
    if not drafts:
        return None
    median = statistics.median(drafts)
    return {"slowest_ms": round(max(decode) * 1e3, 1), "median_draft_ms": round(median * 1e3, 1),
            "slowest_draft_ms": round(max(drafts) * 1e3, 1), "x_median_draft": round(max(decode) / median, 2)}


ROOFLINE_COLUMNS = ["mode", "step_kind", "steps", "step_ms", "roofline_ms", "x_roofline", "fixed_ms", "post_ms",
                    "slowest_ms"]


def plot_roofline(runs: dict[str, tuple[str, list]], roofline: Roofline, path: str, title: str) -> None:
    """Every decode step of every run (label -> (mode, step records)): measured time against its
    roofline (log-log; y = x is the roofline)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5.5))
    lo, hi = float("inf"), 0.0
    for label, (mode, steps) in runs.items():
        by_kind: dict[str, tuple[list, list]] = {}
        for s in steps:
            kind = step_kind(s.kinds, mode)
            if kind is None:
                continue
            xs, ys = by_kind.setdefault(kind, ([], []))
            xs.append(roofline.step_s(s.rows, s.kv_bytes, s.pairs) * 1e3)
            ys.append((s.end - s.start) * 1e3)
        for kind, (xs, ys) in by_kind.items():
            ax.scatter(xs, ys, s=10, alpha=0.6, label=f"{label}: {kind} ({len(xs)} steps)")
            lo, hi = min(lo, *xs, *ys), max(hi, *xs, *ys)
    if hi > 0:
        ax.plot([lo, hi], [lo, hi], "k-", lw=1, label="roofline (y = x)")
        ax.plot([lo, hi], [1.3 * lo, 1.3 * hi], "k:", lw=1, label="1.3x roofline")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("roofline ms (weights + max(KV bytes / bandwidth, attention flops / op peak))")
    ax.set_ylabel("measured step ms")
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
