"""``vericache bench triton``: the Triton model under N concurrent gRPC streams against the embedded
engine at the same load, side by side in one run.

Both sides serve the same engine configuration (the model repository's, i.e. ``EngineConfig``'s
defaults unless ``--model`` names another): a real ``tritonserver`` reached with ``tritonclient``'s
gRPC streaming client (one client and stream per stream), and ``BackgroundService`` in this process
with one consumer thread per stream. Each stream sends ``requests`` greedy requests back to back, so
both sides decode the same tokens. The two runs alternate (Triton, embedded, Triton, embedded ...),
so the machine's noise falls on both. Reported: tokens/s, TTFT and inter-token latency percentiles,
and Triton's tokens/s as a fraction of the embedded engine's: what the model's one IPC lock and
Triton's own path cost.
"""

from __future__ import annotations

import queue
import shutil
import socket
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from vericache.engine.config import EngineConfig
from vericache.engine.engine import Engine
from vericache.sampling import SamplingParams
from vericache.serving.service import BackgroundService
from vericache_lab.bench.common import cpu_model

PROMPTS = ["def parse_config(path):\n", "class LRUCache:\n    def __init__(self, capacity):\n",
           "import json\n\n\ndef load(path):\n", "def quicksort(items):\n", "async def fetch(session, url):\n",
           "def levenshtein(a, b):\n", "class Matrix:\n    def __mul__(self, other):\n", "def read_csv(path):\n"]


@dataclass
class StreamLog:
    """What one stream saw: per request its text, TTFT and gaps between deltas (s)."""
    texts: list[str] = field(default_factory=list)
    tokens: int = 0
    drafted: int = 0    # draft tokens its requests proposed and verification accepted (their final stats):
    accepted: int = 0   # how much of each side's decoding ran as rounds, how much as plain full steps
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)


def _prompt(stream: int, request: int) -> str:
    return PROMPTS[(stream + request) % len(PROMPTS)]


def _summary(label: str, logs: list[StreamLog], seconds: float) -> dict:
    tokens = sum(s.tokens for s in logs)
    ttft = sorted(t for s in logs for t in s.ttft)
    itl = sorted(t for s in logs for t in s.itl)

    def pct(xs: list[float], q: float) -> float | None:
        return round(xs[min(int(q * len(xs)), len(xs) - 1)], 4) if xs else None

    return {"mode": label, "requests": sum(len(s.texts) for s in logs), "tokens": tokens,
            "seconds": round(seconds, 2), "tokens_per_s": round(tokens / seconds, 2),
            "ttft_p50_s": pct(ttft, 0.5), "ttft_p99_s": pct(ttft, 0.99),
            "itl_p50_s": pct(itl, 0.5), "itl_p99_s": pct(itl, 0.99),
            "drafted_tokens": sum(s.drafted for s in logs), "accepted_tokens": sum(s.accepted for s in logs)}


def _run_streams(streams: int, one_stream) -> tuple[list[StreamLog], float]:
    logs = [StreamLog() for _ in range(streams)]
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            one_stream(i, logs[i])
        except BaseException as exc:  # noqa: BLE001 - reported after the join
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(streams)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{len(errors)} stream(s) failed: {errors[0]!r}") from errors[0]
    return logs, time.perf_counter() - t0


def embedded_load(service: BackgroundService, tokenizer, streams: int, requests: int, max_tokens: int) -> dict:
    """``streams`` threads each submitting ``requests`` requests to the service, reading their deltas."""
    def one_stream(i: int, log: StreamLog) -> None:
        for r in range(requests):
            t0 = last = time.perf_counter()
            stream = service.submit(tokenizer.encode(_prompt(i, r)), SamplingParams(max_tokens=max_tokens))
            text, first = "", True
            while True:
                d = stream.get(timeout=600)
                now = time.perf_counter()
                if d.token_ids:
                    (log.ttft if first else log.itl).append(now - (t0 if first else last))
                    first, last = False, now
                    log.tokens += len(d.token_ids)
                text += d.text
                if d.finished:
                    if d.finish_reason == "error":
                        raise RuntimeError(f"embedded request failed: {d.stats}")
                    log.drafted += d.stats.get("drafted_tokens", 0)
                    log.accepted += d.stats.get("accepted_tokens", 0)
                    break
            log.texts.append(text)

    logs, seconds = _run_streams(streams, one_stream)
    return {**_summary("embedded", logs, seconds), "texts": [s.texts for s in logs]}


def triton_load(grpc_url: str, streams: int, requests: int, max_tokens: int) -> dict:
    """``streams`` tritonclient gRPC streams (a client each) sending ``requests`` requests one after another."""
    import numpy as np
    import tritonclient.grpc as g

    def inputs(text: str) -> list:
        def t(name, arr, dt):
            x = g.InferInput(name, list(arr.shape), dt)
            x.set_data_from_numpy(arr)
            return x

        return [t("text_input", np.array([text.encode()], dtype=np.object_), "BYTES"),
                t("max_tokens", np.array([max_tokens], dtype=np.int32), "INT32"),
                t("stream", np.array([True]), "BOOL")]

    def one_stream(i: int, log: StreamLog) -> None:
        client = g.InferenceServerClient(grpc_url)
        q: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: q.put((result, error)))
        try:
            for r in range(requests):
                t0 = last = time.perf_counter()
                client.async_stream_infer("vericache", inputs(_prompt(i, r)), enable_empty_final_response=True)
                text, first = "", True
                while True:
                    result, error = q.get(timeout=600)
                    if error is not None:
                        raise RuntimeError(f"triton stream {i}: {error}")
                    now = time.perf_counter()
                    ids = result.as_numpy("output_ids")   # None: a final flag alone (a cancelled request)
                    if ids is not None and len(ids):
                        (log.ttft if first else log.itl).append(now - (t0 if first else last))
                        first, last = False, now
                        log.tokens += len(ids)
                    if ids is not None:
                        text += result.as_numpy("text_output")[0].decode()
                        if result.as_numpy("finish_reason")[0]:   # the last response: the request's stats
                            log.drafted += int(result.as_numpy("drafted_tokens")[0])
                            log.accepted += int(result.as_numpy("accepted_tokens")[0])
                    final = result.get_response().parameters.get("triton_final_response")
                    if final is not None and final.bool_param:
                        break
                log.texts.append(text)
        finally:
            client.stop_stream()
            client.close()

    logs, seconds = _run_streams(streams, one_stream)
    return {**_summary("triton-grpc", logs, seconds), "texts": [s.texts for s in logs]}


def free_ports(n: int) -> list[int]:
    """``n`` distinct free TCP ports of 127.0.0.1."""
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class LaunchedTriton:
    """``tritonserver`` on our model repository (its ``model`` parameter set when given), on free ports
    of 127.0.0.1, ready within ``ready_timeout_s`` or stopped with its log's tail; ``close`` stops it."""

    def __init__(self, workdir: Path, model: str | None = None, log=print, ready_timeout_s: float = 600) -> None:
        import httpx

        from vericache.serving.triton_launcher import DEFAULT_REPOSITORY, start_triton

        http, grpc, metrics = free_ports(3)
        repo = DEFAULT_REPOSITORY
        if model is not None:   # a copy of the repository with its model parameter set
            repo = workdir / "repository"
            shutil.copytree(DEFAULT_REPOSITORY, repo, dirs_exist_ok=True)
            cfg = repo / "vericache" / "config.pbtxt"
            cfg.write_text(cfg.read_text().replace('key: "model", value: { string_value: "" }',
                                                   f'key: "model", value: {{ string_value: "{model}" }}'))
        self.log_path = workdir / "tritonserver.log"
        self.proc = start_triton(repo, http_port=http, grpc_port=grpc, metrics_port=metrics,
                                 log_file=open(self.log_path, "w"), workdir=workdir / "work")
        self.grpc, self.metrics = f"127.0.0.1:{grpc}", f"http://127.0.0.1:{metrics}/metrics"
        deadline = time.time() + ready_timeout_s
        while time.time() < deadline and self.proc.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{http}/v2/health/ready", timeout=1).status_code == 200:
                    log(f"tritonserver ready (gRPC {self.grpc})")
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.close()
        raise RuntimeError("tritonserver did not become ready: " + self.log_tail())

    def log_tail(self, chars: int = 3000) -> str:
        """The end of the server's log (its stubs' output included): why it stopped, when it did."""
        return self.log_path.read_text(errors="replace")[-chars:]

    def close(self) -> None:
        from vericache.serving.triton_launcher import stop_triton

        stop_triton(self.proc)


def run_triton_streams(workdir: Path, model: str | None = None, streams: int = 32, requests: int = 2,
                       max_tokens: int = 64, repeats: int = 2, grpc_url: str | None = None, log=print) -> dict:
    """Alternate Triton and embedded runs ``repeats`` times; rows per run, the median ratio, and
    whether both sides gave the same texts (greedy: they must)."""
    config = EngineConfig() if model is None else EngineConfig(model=model)
    server = None if grpc_url else LaunchedTriton(workdir, model, log)
    engine = Engine(config=config)
    service, tokenizer = BackgroundService(engine, max_queue=max(64, streams)), engine.tokenizer
    try:
        url = grpc_url or server.grpc
        triton_load(url, min(streams, 2), 1, 4)            # warm-up: both sides' first forwards
        embedded_load(service, tokenizer, min(streams, 2), 1, 4)
        rows = []
        for rep in range(repeats):
            for side in ("triton", "embedded"):
                res = (triton_load(url, streams, requests, max_tokens) if side == "triton"
                       else embedded_load(service, tokenizer, streams, requests, max_tokens))
                res["repeat"] = rep
                rows.append(res)
                log(f"repeat {rep + 1}/{repeats} {res['mode']}: {res['tokens_per_s']} tok/s "
                    f"({res['tokens']} tokens in {res['seconds']} s)")
    finally:
        service.shutdown(drain_timeout=5)
        if server is not None:
            server.close()
    texts = {r["mode"]: r.pop("texts") for r in rows}
    ratios = [t["tokens_per_s"] / e["tokens_per_s"] for t, e in zip(rows[0::2], rows[1::2])]
    return {"cpu": cpu_model(), "model": config.model, "streams": streams, "requests_per_stream": requests,
            "max_tokens": max_tokens, "rows": rows, "triton_over_embedded": round(statistics.median(ratios), 3),
            "ratios": [round(r, 3) for r in ratios], "identical_texts": texts["triton-grpc"] == texts["embedded"]}


COLUMNS = ["repeat", "mode", "requests", "tokens", "seconds", "tokens_per_s", "ttft_p50_s", "ttft_p99_s",
           "itl_p50_s", "itl_p99_s", "drafted_tokens", "accepted_tokens"]
