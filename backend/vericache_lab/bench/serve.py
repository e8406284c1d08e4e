"""``vericache bench serve``: a streaming load generator over the OpenAI API, and a soak mode.

Reports TTFT, inter-token latency and end-to-end latency percentiles, request and token
throughput, errors by status, and the acceptance figures read from the server's /metrics.
Clients can hang up at random (``--cancel-prob``) to exercise abort-on-disconnect, ask for a whole
body instead of a stream (``--nonstream-prob``) or send a bad request (``--bad-prob``: it must get a
4xx); half the requests are greedy, half sample (T 0.8, top-p 0.95) with a seed; at the end the server's running-request and KV gauges are read back (they must return to 0).
Every 10 s the server's resident memory (``--server-pid``) and its KV bytes in use are sampled.

``--soak MINUTES`` (``soak_verdict``): the load above at concurrency 8 for that long against a server
it starts itself (``vericache serve`` on ``--model``) unless ``--url`` is given; it fails (exit 1) on
any 5xx, any bad request not answered 4xx, requests or KV left after the load, or resident memory
growing more than ``--rss-bound-mb`` after the warm-up (the first fifth of the run).
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from dataclasses import dataclass, field

import httpx

PROMPTS = ["def parse_config(path):\n", "class LRUCache:\n    def __init__(self, capacity):\n",
           "import json\n\n\ndef load(path):\n", "def quicksort(items):\n", "async def fetch(session, url):\n"]


BAD_BODIES = [{"model": "tiny"}, {"prompt": "x", "max_tokens": -1}, {"prompt": "x", "temperature": "hot"},
              {"prompt": ["a", "b"]}, {"prompt": "x", "max_tokens": 10 ** 9}, {"prompt": "x", "vericache": {"mode": "?"}}]


@dataclass
class Result:
    ok: bool = False
    status: int = 0
    kind: str = "stream"      # "stream", "whole" (one JSON body) or "bad" (a request that must get a 4xx)
    cancelled: bool = False
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    e2e: float = 0.0
    tokens: int = 0


def percentiles(xs: list[float]) -> dict:
    if not xs:
        return {"p50": None, "p90": None, "p99": None}
    s = sorted(xs)
    pick = lambda q: round(s[min(int(q * len(s)), len(s) - 1)], 4)  # noqa: E731
    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99)}


async def one_request(client: httpx.AsyncClient, url: str, model: str, max_tokens: int, rng: random.Random,
                      cancel_prob: float, nonstream_prob: float = 0.0, bad_prob: float = 0.0) -> Result:
    kind = "bad" if rng.random() < bad_prob else "whole" if rng.random() < nonstream_prob else "stream"
    r = Result(kind=kind)
    # half the requests greedy, half sampled with a seed (coupled sampling's path)
    sampling = {"temperature": 0} if rng.random() < 0.5 else {"temperature": 0.8, "top_p": 0.95,
                                                             "seed": rng.randrange(1 << 31)}
    body = {"model": model, "prompt": rng.choice(PROMPTS), "max_tokens": max_tokens, **sampling,
            "stream": True, "stream_options": {"include_usage": True}}
    if kind != "stream":
        body = {"model": model, **rng.choice(BAD_BODIES)} if kind == "bad" else {**body, "stream": False}
        body.pop("stream_options", None)
        return await _one_body(client, url, body, r)
    cancel_after = rng.randint(1, max(max_tokens // 2, 1)) if rng.random() < cancel_prob else None
    t0 = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            r.status = resp.status_code
            if resp.status_code != 200:
                await resp.aread()
                return r
            async for line in resp.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    now = time.perf_counter()
                    if last is None:
                        r.ttft = now - t0
                    else:
                        r.itl.append(now - last)
                    last = now
                    r.tokens += 1
                if chunk.get("usage"):
                    r.tokens = chunk["usage"]["completion_tokens"]
                if cancel_after is not None and r.tokens >= cancel_after:
                    r.cancelled = True
                    break  # hang up mid-stream
        r.ok = True
    except httpx.HTTPError:
        r.status = r.status or -1
    r.e2e = time.perf_counter() - t0
    return r


async def _one_body(client: httpx.AsyncClient, url: str, body: dict, r: Result) -> Result:
    """A non-streaming request (or a bad one): one JSON body back."""
    t0 = time.perf_counter()
    try:
        resp = await client.post(url + "/v1/completions", json=body)
        r.status = resp.status_code
        if resp.status_code == 200:
            r.tokens, r.ok = resp.json()["usage"]["completion_tokens"], True
    except httpx.HTTPError:
        r.status = r.status or -1
    r.e2e = time.perf_counter() - t0
    return r


def scrape(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        m = re.match(r"^(vericache_[a-z_]+)(\{[^}]*\})? ([0-9.e+-]+)$", line)
        if m:
            key = m.group(1) + (m.group(2) or "")
            out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


def _sum(metrics: dict, name: str) -> float:
    return sum(v for k, v in metrics.items() if k == name or k.startswith(name + "{"))


def rss_mb(pid: int) -> float | None:
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


async def run_load(url: str, model: str, concurrency: int, requests: int | None, duration: float | None,
                   max_tokens: int, request_rate: float | None, cancel_prob: float, seed: int,
                   server_pid: int | None, log=print, nonstream_prob: float = 0.0, bad_prob: float = 0.0,
                   sample_every: float = 10.0) -> dict:
    """Closed-loop (``concurrency``) or Poisson (``request_rate``) load for ``requests`` or ``duration``
    seconds; latency percentiles, statuses by kind, the server's RSS and KV bytes every ``sample_every``
    seconds, and its metrics' deltas."""
    # Long: the load's workers and monitor are closures over one run's client, semaphore and results
    # (asyncio's usual shape); the summary after them reads those results in place.
    rng = random.Random(seed)
    results: list[Result] = []
    before = scrape(url)
    samples: list[dict] = []
    t0 = time.perf_counter()
    sem = asyncio.Semaphore(concurrency)
    stop_at = t0 + duration if duration else None

    async def sample() -> None:
        m = await asyncio.to_thread(scrape, url)
        samples.append({"t_s": round(time.perf_counter() - t0, 1), "rss_mb": rss_mb(server_pid) if server_pid else None,
                        "kv_bytes": _sum(m, "vericache_kv_cache_bytes"),
                        "running": _sum(m, "vericache_num_requests_running"), "requests_done": len(results)})

    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0)) as client:
        async def worker(i: int) -> None:
            async with sem:
                results.append(await one_request(client, url, model, max_tokens, rng, cancel_prob, nonstream_prob,
                                                 bad_prob))

        async def monitor() -> None:
            last_log = time.perf_counter()
            while True:
                await sample()
                if time.perf_counter() - last_log >= 30:
                    log(f"  {len(results)} requests done after {time.perf_counter() - t0:.0f} s; "
                        f"server RSS {samples[-1]['rss_mb']} MB, KV {samples[-1]['kv_bytes'] / 1e6:.1f} MB")
                    last_log = time.perf_counter()
                await asyncio.sleep(sample_every)

        mon = asyncio.create_task(monitor())
        tasks, i = [], 0
        while (requests is None or i < requests) and (stop_at is None or time.perf_counter() < stop_at):
            tasks.append(asyncio.create_task(worker(i)))
            i += 1
            if request_rate:
                await asyncio.sleep(rng.expovariate(request_rate))
            while len(tasks) - len(results) >= 2 * concurrency:  # bounded: never more than 2x in flight
                await asyncio.sleep(0.01)
        await asyncio.gather(*tasks)
        mon.cancel()
    wall = time.perf_counter() - t0
    await asyncio.sleep(1.0)  # let aborts land
    await sample()            # the last sample: after the load, everything should be back
    after = scrape(url)
    statuses: dict[str, int] = {}
    for r in results:
        statuses[str(r.status)] = statuses.get(str(r.status), 0) + 1
    drafted = _sum(after, "vericache_spec_decode_num_draft_tokens_total") - _sum(before, "vericache_spec_decode_num_draft_tokens_total")
    accepted = _sum(after, "vericache_spec_decode_num_accepted_tokens_total") - _sum(before, "vericache_spec_decode_num_accepted_tokens_total")
    drafts = _sum(after, "vericache_spec_decode_num_drafts_total") - _sum(before, "vericache_spec_decode_num_drafts_total")
    done = [r for r in results if r.ok]
    return {
        "requests": len(results), "completed": sum(1 for r in done if not r.cancelled),
        "cancelled_by_client": sum(1 for r in results if r.cancelled), "wall_s": round(wall, 2),
        "by_kind": {k: sum(1 for r in results if r.kind == k) for k in ("stream", "whole", "bad")},
        "bad_not_4xx": sum(1 for r in results if r.kind == "bad" and not 400 <= r.status < 500),
        "request_throughput": round(len(done) / wall, 3),
        "token_throughput": round(sum(r.tokens for r in done) / wall, 2),
        "ttft_s": percentiles([r.ttft for r in done if r.ttft is not None]),
        "itl_s": percentiles([x for r in done for x in r.itl]),
        "e2e_s": percentiles([r.e2e for r in done if not r.cancelled]),
        "status_counts": statuses, "errors_5xx": sum(v for k, v in statuses.items() if k.startswith("5")),
        "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
        "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else None,
        "after": {"num_requests_running": _sum(after, "vericache_num_requests_running"),
                  "kv_cache_bytes": _sum(after, "vericache_kv_cache_bytes")},
        "samples": samples,
        "server_rss_mb": _rss_summary(samples),
    }


def _rss_summary(samples: list[dict]) -> dict | None:
    rss = [x["rss_mb"] for x in samples if x["rss_mb"] is not None]
    return {"first": rss[0], "max": max(rss), "last": rss[-1]} if rss else None


def soak_verdict(res: dict, rss_bound_mb: float, warmup: float = 0.2) -> list[str]:
    """Why a soak run fails (empty: it passed): any 5xx, a bad request not answered 4xx, requests or KV
    left once the load is over, or the server's resident memory after the warm-up (the first
    ``warmup`` of the samples) growing by more than ``rss_bound_mb``."""
    why = [] if res["completed"] else ["no request completed"]
    if res["errors_5xx"]:
        why.append(f"{res['errors_5xx']} responses were 5xx")
    if res["bad_not_4xx"]:
        why.append(f"{res['bad_not_4xx']} bad requests were not answered 4xx")
    if res["after"]["num_requests_running"] or res["after"]["kv_cache_bytes"]:
        why.append(f"left after the load: {res['after']}")
    rss = [x["rss_mb"] for x in res["samples"] if x["rss_mb"] is not None]
    if rss:
        base = rss[min(int(len(rss) * warmup), len(rss) - 1)]
        growth = max(rss[int(len(rss) * warmup):]) - base
        res["rss_growth_after_warmup_mb"] = round(growth, 1)
        if growth > rss_bound_mb:
            why.append(f"resident memory grew {growth:.0f} MB after the warm-up (bound {rss_bound_mb:.0f} MB)")
    return why


def plot_soak(res: dict, path: str) -> None:
    """The server's resident memory and KV bytes in use over the run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [x["t_s"] / 60 for x in res["samples"]]
    fig, ax = plt.subplots(figsize=(8, 4))
    if any(x["rss_mb"] is not None for x in res["samples"]):
        ax.plot(t, [x["rss_mb"] for x in res["samples"]], label="server RSS (MB)", color="tab:blue")
    ax.set_xlabel("minutes")
    ax.set_ylabel("RSS (MB)")
    kv = ax.twinx()
    kv.plot(t, [x["kv_bytes"] / 1e6 for x in res["samples"]], label="KV in use (MB)", color="tab:orange")
    kv.set_ylabel("KV in use (MB)")
    fig.legend(loc="upper left")
    ax.set_title(f"soak: {res['requests']} requests, {res['errors_5xx']} 5xx, statuses {res['status_counts']}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


class LaunchedServer:
    """``vericache serve`` on a free port of 127.0.0.1 (the soak's own server), stopped with SIGTERM."""

    def __init__(self, model: str, extra: list[str] | None = None, log=print) -> None:
        import socket
        import subprocess
        import sys

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "vericache.cli", "serve", "--model", model, "--host",
                                      "127.0.0.1", "--port", str(port), *(extra or [])],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 300
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}): {self.proc.stderr.read()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                self.close()
                raise RuntimeError("the server did not become healthy within 300 s")
            time.sleep(0.5)
        log(f"server {model} up on {self.url} (pid {self.proc.pid})")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except Exception:  # noqa: BLE001 - it would not drain: stop it
                self.proc.kill()
                self.proc.wait()
