"""The client side of ``bench prefix``, run inside the drafter's namespace: waits for the server,
sends every prompt at once as a streaming completion, and prints one JSON object: the wall-clock
time they were sent and per request the first-token and end times, token arrival times (seconds
since then), text and the response's stats. A request that fails still gets its row: ``status`` is the
HTTP status, or "timeout" (no byte for ``timeout_s``, which the bench scales to the work) or
"client error", and ``stats["error"]`` says what happened."""

from __future__ import annotations

import json
import sys
import threading
import time

import httpx


def _wait_ready(url: str, timeout_s: float = 300) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"server {url} not ready after {timeout_s} s")


def _one(url: str, model: str, prompt: str, max_tokens: int, t0: float, out: dict, timeout_s: float) -> None:
    times: list[float] = []
    out.update({"status": "client error", "ttft_s": None, "e2e_s": None, "chunk_times": times, "text": "", "stats": {}})
    try:
        _stream(url, model, prompt, max_tokens, t0, out, timeout_s)
    except httpx.TimeoutException as exc:
        out.update({"status": "timeout", "stats": {"error": f"no reply for {timeout_s:.0f} s ({type(exc).__name__})"}})
    except Exception as exc:  # noqa: BLE001 - whatever broke, the row says so and the bench fails on it
        out.update({"status": "client error", "stats": {"error": f"{type(exc).__name__}: {exc}"[:500]}})
    out["e2e_s"] = time.perf_counter() - t0


def _stream(url: str, model: str, prompt: str, max_tokens: int, t0: float, out: dict, timeout_s: float) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    times, text, stats, status = out["chunk_times"], "", {}, 200
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=timeout_s) as r:
        status = r.status_code
        if status != 200:
            r.read()
            stats = {"error": r.text[:500]}
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                stats = {"error": chunk["error"]}
                continue
            for c in chunk.get("choices", []):
                if c.get("text"):
                    times.append(time.perf_counter() - t0)
                    text += c["text"]
            stats = chunk.get("vericache", stats)
    out.update({"status": status, "ttft_s": times[0] if times else None, "text": text, "stats": stats})


def main(url: str, prompts_file: str, max_tokens: int, timeout_s: float = 600) -> None:
    prompts = json.load(open(prompts_file))
    _wait_ready(url)
    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    t0, t0_wall = time.perf_counter(), time.time()
    results = [dict() for _ in prompts]
    threads = [threading.Thread(target=_one, args=(url, model, p, max_tokens, t0, results[i], timeout_s))
               for i, p in enumerate(prompts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps({"sent_at": t0_wall, "requests": results}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]) if len(sys.argv) > 4 else 600)
