"""``vericache bench serve``: a streaming load generator over the OpenAI API, and a soak mode.

Reports TTFT, inter-token latency and end-to-end latency percentiles, request and token
throughput, errors by status, and the acceptance figures read from the server's /metrics.
Clients can hang up at random (``--cancel-prob``) to exercise abort-on-disconnect; at the end
the server's running-request and KV gauges are read back (they must return to 0), and with
``--server-pid`` its resident memory is sampled over the run (it must stay flat).
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


@dataclass
class Result:
    ok: bool = False
    status: int = 0
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
                      cancel_prob: float) -> Result:
    r = Result()
    body = {"model": model, "prompt": rng.choice(PROMPTS), "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
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
                   server_pid: int | None, log=print) -> dict:
    """Closed-loop (``concurrency``) or Poisson (``request_rate``) streaming load for ``requests`` or
    ``duration`` seconds; latency percentiles, errors, the server's RSS and its metrics' deltas."""
    # Long: the load's workers and monitor are closures over one run's client, semaphore and results
    # (asyncio's usual shape); the summary after them reads those results in place.
    rng = random.Random(seed)
    results: list[Result] = []
    before = scrape(url)
    rss: list[float] = []
    t0 = time.perf_counter()
    sem = asyncio.Semaphore(concurrency)
    stop_at = t0 + duration if duration else None

    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0)) as client:
        async def worker(i: int) -> None:
            async with sem:
                results.append(await one_request(client, url, model, max_tokens, rng, cancel_prob))

        async def monitor() -> None:
            last_log = time.perf_counter()
            while True:
                if server_pid and (m := rss_mb(server_pid)) is not None:
                    rss.append(m)
                if time.perf_counter() - last_log >= 30:
                    log(f"  {len(results)} requests done after {time.perf_counter() - t0:.0f} s")
                    last_log = time.perf_counter()
                await asyncio.sleep(2)

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
        "server_rss_mb": {"first": rss[0], "max": max(rss), "last": rss[-1]} if rss else None,
    }
