"""The remote prefix-caching scenario at cluster scale (issue 55 item 4, ``vericache sim remote``): D
drafters, V verifiers, S store shards.

Each drafter serves n requests that arrive together (``remote_prefix``'s one-node setting: a stored
prefix plus a tail each, ``max_tokens`` out). Prefixes are placed on verifiers by rendezvous hashing, so
each verifier holds about D n / V sessions; a prefix's blocks are spread over every shard (hash tags),
so each fetch draws on all of them. What each shared part costs:

- the store: S shards, each answering ``shard_Bps`` (one Redis thread's reply rate), S * shard_Bps in
  all, the sessions' fetches answered in turn (a verifier's first tokens come as its fetches land);
- a drafter's slow link (``slow_Bps``, ``rtt_s``): its own fetches and its rounds' traffic;
- a verifier's fast link (``fast_Bps``): its sessions' full KV;
- compute: a drafter's forwards over its n sessions, a verifier's over its D n / V (``RemoteCosts``).

Each mode's TTFT and end-to-end time are ``remote_prefix.predict_remote``'s with every shared part's
time the longest of its users' (at D = V = S = 1, the fast link at the one-node model's fetch rate and
the store unbounded, it is the one-node model itself: ``tests/test_sim.py`` checks it), and each row
names the part that sets its TTFT and its rounds: the store, a slow link, the verifier's fast link, or
a role's compute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from vericache_lab.sim.remote_prefix import RemoteCosts, RemoteSetting, open_pipeline


@dataclass(frozen=True)
class Cluster:
    drafters: int
    verifiers: int
    shards: int
    shard_Bps: float     # one shard's reply rate (bytes/s)
    fast_Bps: float      # a verifier's link to the store (bytes/s)


def _longest(parts: dict[str, float]) -> tuple[float, str]:
    name = max(parts, key=lambda k: parts[k])
    return parts[name], name


def predict_cluster(s: RemoteSetting, c: Cluster, drafter: RemoteCosts, verifier: RemoteCosts) -> dict[str, dict]:
    """{mode: {"ttft_s", "e2e_s", "tokens_per_s", "ttft_limit", "decode_limit"}} for full-remote,
    lossy-remote and vericache: ``s`` is one drafter's setting (its n requests, its slow link), ``drafter``
    and ``verifier`` the roles' forward costs (``verifier`` at D n / V sessions)."""
    d, v, n = c.drafters, c.verifiers, s.n
    store = c.shards * c.shard_Bps
    tokens, later = d * n * s.max_tokens, s.max_tokens - 1
    out = {}
    for mode, nbytes, prefill, step in (("full-remote", s.full_bytes, drafter.prefill, drafter.decode_full(n)),
                                        ("lossy-remote", s.comp_bytes, drafter.prefill_comp, drafter.decode_comp(n))):
        fetch, limit = _longest({"slow link": n * nbytes / s.slow_Bps, "store": d * n * nbytes / store})
        ttft = s.rtt_s + fetch + prefill
        e2e = ttft + later * step
        out[mode] = {"ttft_s": ttft, "e2e_s": e2e, "tokens_per_s": tokens / e2e, "ttft_limit": limit,
                     "decode_limit": "drafter compute"}
    per_verifier = d * n / v                   # sessions on each verifier (rendezvous: an even share)
    k, a = max(s.drafted, 1.0), max(s.tokens_per_round, 1.0)
    g = min(s.group or n, n)                   # a drafter's sessions per verification forward
    gv = g * per_verifier / n                  # ... and a verifier's: the same share of its sessions
    # The store answers the D n sessions' fetches in turn (each its full form for a verifier and its
    # compressed one for a drafter: ``slot`` seconds); rendezvous placement deals them round the verifiers,
    # each of which takes its own in over its fast link and prefills them as they land (open_pipeline).
    slot, link = (s.full_bytes + s.comp_bytes) / store, s.full_bytes / c.fast_Bps
    first, busy = [], 0.0
    for verifier_index in range(min(v, d * n)):
        mine = range(verifier_index, d * n, v)        # the global turns of this verifier's sessions
        arrivals = [max((turn + 1) * slot, (j + 1) * link) for j, turn in enumerate(mine)]
        opens, loop = open_pipeline(arrivals, verifier.prefill_tails)
        first += [1.5 * s.rtt_s + t for t in opens]
        busy = max(busy, loop)
    ttft = sum(first) / len(first)
    fetch, ttft_limit = _longest({"verifier fast link": math.ceil(d * n / v) * link, "store": d * n * slot})
    ttft_limit = ttft_limit if fetch >= busy else "verifier compute"
    drafter_fetch = max(n * s.comp_bytes / s.slow_Bps, d * n * s.comp_bytes / store)
    drafter_ready = s.rtt_s + drafter_fetch + drafter.prefill_comp
    exchange = s.rtt_s + g * a * s.kv_pos_bytes / s.slow_Bps
    round_s, decode_limit = _longest({"round trip (drafts, link, verification)":
                                      k * drafter.draft(g) + exchange + verifier.verify(gv),
                                      "verifier compute": per_verifier / gv * verifier.verify(gv),
                                      "drafter compute": k * n / g * drafter.draft(g)})
    e2e = sum(max(t, drafter_ready) for t in first) / len(first) + math.ceil(later / a) * round_s
    out["vericache"] = {"ttft_s": ttft, "e2e_s": e2e, "tokens_per_s": tokens / e2e, "ttft_limit": ttft_limit,
                        "decode_limit": decode_limit}
    return out


def sweep(s: RemoteSetting, shard_Bps: float, fast_Bps: float, drafter: RemoteCosts, verifier_at,
          drafters: list[int], verifiers: list[int], shards: list[int]) -> list[dict]:
    """One row per (D, V, S, mode); ``verifier_at(sessions)``: a verifier's ``RemoteCosts`` with that many
    sessions (its prefill and forwards grow with them)."""
    rows = []
    for d in drafters:
        for v in verifiers:
            for sh in shards:
                c = Cluster(d, v, sh, shard_Bps, fast_Bps)
                per_verifier = max(round(d * s.n / v), 1)
                for mode, r in predict_cluster(s, c, drafter, verifier_at(per_verifier)).items():
                    rows.append({"drafters": d, "verifiers": v, "shards": sh, "mode": mode,
                                 **{key: round(x, 3) if isinstance(x, float) else x for key, x in r.items()}})
    return rows


def plot_cluster(rows: list[dict], path: str, title: str) -> None:
    """Per shard count: VeriCache's modelled tokens/s against drafters, a line per verifier count, each
    point marked by what limits it (its TTFT's part where that is most of the time, else its rounds');
    full-remote's line beside (dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shards = sorted({r["shards"] for r in rows})
    markers = {"store": "s", "verifier compute": "^", "drafter compute": "v", "verifier fast link": "D",
               "round trip (drafts, link, verification)": "o"}
    fig, axes = plt.subplots(1, len(shards), figsize=(5 * len(shards), 4.2), squeeze=False, sharey=True)
    for ax, sh in zip(axes[0], shards):
        for v in sorted({r["verifiers"] for r in rows}):
            pts = sorted((r for r in rows if r["shards"] == sh and r["verifiers"] == v and r["mode"] == "vericache"),
                         key=lambda r: r["drafters"])
            line, = ax.plot([r["drafters"] for r in pts], [r["tokens_per_s"] for r in pts], label=f"VeriCache, {v} verifiers")
            for r in pts:   # marked by what limits the phase that takes most of the time
                limit = r["ttft_limit"] if r["ttft_s"] > 0.5 * r["e2e_s"] else r["decode_limit"]
                ax.scatter(r["drafters"], r["tokens_per_s"], marker=markers.get(limit, "o"), color=line.get_color(), s=22)
        full = sorted((r for r in rows if r["shards"] == sh and r["mode"] == "full-remote"
                       and r["verifiers"] == min(x["verifiers"] for x in rows)), key=lambda r: r["drafters"])
        ax.plot([r["drafters"] for r in full], [r["tokens_per_s"] for r in full], "k--", label="full-remote")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{sh} store shards")
        ax.set_xlabel("drafters")
        ax.set_ylabel("modelled tokens/s, all drafters")
    handles = [plt.Line2D([], [], marker=m, ls="", color="grey", label=f"limit: {k}") for k, m in markers.items()]
    axes[0][-1].legend(handles=axes[0][-1].get_legend_handles_labels()[0] + handles, fontsize=6, loc="upper left")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
