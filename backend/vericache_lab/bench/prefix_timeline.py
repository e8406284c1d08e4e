"""What ``bench prefix`` reads back from a run: the links' traffic sampled while it ran, each role's
trace (``serve --trace``) cut to the run's window, and the timeline plot of them all."""

from __future__ import annotations

import threading
import time

from vericache_lab import netlab

# trace events that are forwards of a role's engine (a verification riding in a prefill's forward
# is in that forward's seconds already)
COMPUTE = {"phase", "prefill", "verify_step"}


class LinkSampler:
    """Each link's byte counter every ``every_s`` seconds, in a thread, between ``start`` and ``stop``."""

    def __init__(self, every_s: float = 0.25) -> None:
        self.every_s, self.samples = every_s, []     # (wall time, {link: bytes})
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="vericache-link-sampler")

    def start(self) -> LinkSampler:
        self._thread.start()
        return self

    def stop(self) -> list[tuple[float, dict]]:
        self._stop.set()
        self._thread.join(timeout=5)
        return self.samples

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.time(), netlab.link_bytes()))
            self._stop.wait(self.every_s)


def link_rates(samples: list[tuple[float, dict]], t0: float) -> dict[str, list[tuple[float, float]]]:
    """Per link, (seconds since t0, Gbit/s over the interval before it)."""
    out: dict[str, list[tuple[float, float]]] = {}
    for (ta, a), (tb, b) in zip(samples, samples[1:]):
        for link in b:
            out.setdefault(link, []).append((tb - t0, (b[link] - a[link]) * 8 / max(tb - ta, 1e-9) / 1e9))
    return out


def spans(records: list[dict], t0: float, t1: float) -> list[dict]:
    """The trace's timed events that end inside [t0, t1], as {event, kind, start, seconds} (seconds since t0)."""
    out = []
    for r in records:
        if "seconds" not in r or not t0 <= r["end"] <= t1:
            continue
        kind = r.get("kind") or r.get("tier") or r["event"]
        out.append({"event": r["event"], "kind": kind, "start": r["end"] - r["seconds"] - t0, "seconds": r["seconds"],
                    "with_prefill": r.get("with_prefill", False), "bytes": r.get("bytes", 0), "rows": r.get("rows", 0)})
    return out


def busy_share(role_spans: list[dict], wall_s: float) -> float:
    """Seconds the role's engine ran forwards / the run's wall seconds."""
    busy = sum(s["seconds"] for s in role_spans if s["event"] in COMPUTE and not s["with_prefill"])
    return round(busy / wall_s, 3) if wall_s > 0 else 0.0


def sessions_per_forward(role_spans: list[dict], event: str = "verify_step") -> float:
    """Mean sessions (rows of the trace's ``event``) per forward: 1 when requests verify out of step."""
    rows = [s["rows"] for s in role_spans if s["event"] == event and s["rows"]]
    return round(sum(rows) / len(rows), 2) if rows else 0.0


def fetch_rate_gbps(role_spans: list[dict]) -> float | None:
    """The role's store fetches together: their bytes over the time from the first start to the last end."""
    fetches = [s for s in role_spans if s["event"] == "prefix" and s["bytes"]]
    if not fetches:
        return None
    first, last = min(s["start"] for s in fetches), max(s["start"] + s["seconds"] for s in fetches)
    return round(sum(s["bytes"] for s in fetches) * 8 / max(last - first, 1e-9) / 1e9, 3)


COLORS = {"prefill": "tab:gray", "decode": "tab:blue", "draft": "tab:green", "verify": "tab:red",
          "verify_step": "tab:red", "full": "tab:purple", "compressed": "tab:olive"}


def _color(kind: str) -> str:
    # a step packing several kinds is drawn in its costliest kind's colour
    return next((COLORS[k] for k in ("verify", "prefill", "decode", "draft", "full", "compressed") if k in kind),
                "black")


def plot_prefix(res: dict, path: str) -> None:
    """Per mode: the drafter's and the verifier's forwards and store fetches, each request's first
    token, and every link's traffic (right axis, Gbit/s)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["rows"]
    fig, axes = plt.subplots(len(rows), 1, figsize=(11, 1.9 * len(rows) + 0.9), squeeze=False)
    for ax, row in zip(axes[:, 0], rows):
        lanes = [("drafter", row.get("drafter_spans", [])), ("verifier", row.get("verifier_spans", []))]
        for y, (name, role_spans) in enumerate(lanes):
            for event, height in (("compute", 0.7), ("prefix", 0.3)):
                want = {"prefix"} if event == "prefix" else COMPUTE
                sel = [s for s in role_spans if s["event"] in want and not s["with_prefill"]]
                for kind in sorted({s["kind"] for s in sel}):
                    bars = [(s["start"], s["seconds"]) for s in sel if s["kind"] == kind]
                    ax.broken_barh(bars, (2 * y + (1.0 if event == "prefix" else 0.1), height), color=_color(kind),
                                   label=f"{name} {'fetch ' if event == 'prefix' else ''}{kind}")
        for req in row["timeline"]:
            ax.plot([req["ttft_s"]], [4.2], "kv", markersize=4)
        ax.set_yticks([0.5, 1.15, 2.5, 3.15, 4.2], ["drafter", "fetch", "verifier", "fetch", "first tokens"], fontsize=7)
        where = f" on {row['store']}" if len(res["stores"]) > 1 else ""
        ax.set_title(f"{row['mode']}{where} ({row['threads']} thread(s) per engine)", fontsize=9, loc="left")
        twin = ax.twinx()
        for link, series in row.get("link_gbps", {}).items():
            series = [(t, g) for t, g in series if t >= 0]
            if any(g > 0.01 for _, g in series):
                twin.plot([t for t, _ in series], [g for _, g in series], lw=0.8, label=f"{link} Gbit/s")
        ax.set_xlim(0, row["makespan_s"] * 1.02)   # each mode on its own scale: recompute takes minutes
        twin.set_ylabel("Gbit/s", fontsize=7)
        handles = ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
        labels = ax.get_legend_handles_labels()[1] + twin.get_legend_handles_labels()[1]
        ax.legend(handles, labels, fontsize=5.5, loc="upper right", ncol=4)
    axes[-1, 0].set_xlabel("seconds since the requests were sent (each mode on its own scale)")
    fig.suptitle(f"Remote prefix caching: {res['requests']} requests x {res['prefix_tokens']}-token stored prefixes, "
                 f"{res['compressor']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
