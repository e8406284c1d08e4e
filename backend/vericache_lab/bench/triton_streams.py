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

With ``prompt_tokens`` (the benches' load): each stream sends one of ``bench batch``'s prompts (that many
tokens of held-out code, a different stretch each), all at once, once per request mode (``modes``:
full and VeriCache, the model's ``mode`` input), so each side's VeriCache over full is measured at the
load ``bench batch`` and ``bench serve`` measure, by the decode throughput while every request decodes
(``bench serve``'s window: prefill is not what either side's rounds change).
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
from vericache.engine.options import RequestOptions
from vericache.sampling import SamplingParams
from vericache.serving.service import BackgroundService
from vericache_lab.bench.common import cpu_model
from vericache_lab.bench.serve_long import decode_window

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
    chunks: list[tuple[float, int]] = field(default_factory=list)   # (arrival, tokens so far), every request

    def received(self, first: bool, t0: float, last: float, now: float, tokens: int) -> None:
        """A response of ``tokens`` new tokens arrived at ``now`` (``t0``: the request sent; ``last``: its
        previous tokens)."""
        (self.ttft if first else self.itl).append(now - (t0 if first else last))
        self.tokens += tokens
        self.chunks.append((now, self.tokens))


@dataclass
class Load:
    """What every stream sends: ``requests`` requests, the i-th stream's r-th prompt ``prompt(i, r)``,
    ``max_tokens`` each, in the request ``mode`` (None: the server's)."""
    streams: int
    requests: int
    max_tokens: int
    prompts: list[str] = field(default_factory=lambda: PROMPTS)
    mode: str | None = None

    def prompt(self, stream: int, request: int) -> str:
        return self.prompts[(stream + request) % len(self.prompts)]


def _summary(label: str, load: Load, logs: list[StreamLog], seconds: float) -> dict:
    tokens = sum(s.tokens for s in logs)
    window_s, window_tokens = decode_window(logs) if all(s.chunks for s in logs) else (0.0, 0)
    ttft = sorted(t for s in logs for t in s.ttft)
    itl = sorted(t for s in logs for t in s.itl)

    def pct(xs: list[float], q: float) -> float | None:
        return round(xs[min(int(q * len(xs)), len(xs) - 1)], 4) if xs else None

    return {"mode": label, "request_mode": load.mode or "default", "requests": sum(len(s.texts) for s in logs),
            "tokens": tokens, "seconds": round(seconds, 2), "tokens_per_s": round(tokens / seconds, 2),
            "decode_tokens_per_s": round(window_tokens / window_s, 2) if window_s else None,
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


def embedded_load(service: BackgroundService, tokenizer, load: Load) -> dict:
    """``load.streams`` threads each submitting its requests to the service, reading their deltas."""
    def one_stream(i: int, log: StreamLog) -> None:
        for r in range(load.requests):
            t0 = last = time.perf_counter()
            stream = service.submit(tokenizer.encode(load.prompt(i, r)), SamplingParams(max_tokens=load.max_tokens),
                                    RequestOptions(mode=load.mode))
            text, first = "", True
            while True:
                d = stream.get(timeout=600)
                now = time.perf_counter()
                if d.token_ids:
                    log.received(first, t0, last, now, len(d.token_ids))
                    first, last = False, now
                text += d.text
                if d.finished:
                    if d.finish_reason == "error":
                        raise RuntimeError(f"embedded request failed: {d.stats}")
                    log.drafted += d.stats.get("drafted_tokens", 0)
                    log.accepted += d.stats.get("accepted_tokens", 0)
                    break
            log.texts.append(text)

    logs, seconds = _run_streams(load.streams, one_stream)
    return {**_summary("embedded", load, logs, seconds), "texts": [s.texts for s in logs]}


def triton_load(grpc_url: str, load: Load) -> dict:
    """``load.streams`` tritonclient gRPC streams (a client each) sending their requests one after another."""
    import numpy as np
    import tritonclient.grpc as g

    def inputs(text: str) -> list:
        def t(name, arr, dt):
            x = g.InferInput(name, list(arr.shape), dt)
            x.set_data_from_numpy(arr)
            return x

        mode = [] if load.mode is None else [t("mode", np.array([load.mode.encode()], dtype=np.object_), "BYTES")]
        return [t("text_input", np.array([text.encode()], dtype=np.object_), "BYTES"),
                t("max_tokens", np.array([load.max_tokens], dtype=np.int32), "INT32"),
                t("stream", np.array([True]), "BOOL")] + mode

    def one_stream(i: int, log: StreamLog) -> None:
        client = g.InferenceServerClient(grpc_url)
        q: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: q.put((result, error)))
        try:
            for r in range(load.requests):
                t0 = last = time.perf_counter()
                client.async_stream_infer("vericache", inputs(load.prompt(i, r)), enable_empty_final_response=True)
                text, first = "", True
                while True:
                    result, error = q.get(timeout=600)
                    if error is not None:
                        raise RuntimeError(f"triton stream {i}: {error}")
                    now = time.perf_counter()
                    ids = result.as_numpy("output_ids")   # None: a final flag alone (a cancelled request)
                    if ids is not None and len(ids):
                        log.received(first, t0, last, now, len(ids))
                        first, last = False, now
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

    logs, seconds = _run_streams(load.streams, one_stream)
    return {**_summary("triton-grpc", load, logs, seconds), "texts": [s.texts for s in logs]}


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
                       max_tokens: int = 64, repeats: int = 2, grpc_url: str | None = None, log=print,
                       prompt_tokens: int | None = None, modes: list[str] | None = None) -> dict:
    """Alternate Triton and embedded runs ``repeats`` times (each request mode of ``modes`` in turn on
    each side; None: the server's default mode); rows per run, the median ratio per mode, each side's
    modes over its full mode, and whether every text is the same on both sides and in every mode (greedy:
    they must). ``prompt_tokens``: one request a stream of that many tokens of code (the module doc)."""
    config = EngineConfig() if model is None else EngineConfig(model=model)
    server = None if grpc_url else LaunchedTriton(workdir, model, log)
    engine = Engine(config=config)
    service, tokenizer = BackgroundService(engine, max_queue=max(64, streams)), engine.tokenizer
    prompts = PROMPTS
    if prompt_tokens is not None:
        from vericache_lab.bench.batch import distinct_prompts

        prompts, requests = [tokenizer.decode(p) for p in distinct_prompts(tokenizer, streams, prompt_tokens)], 1
    loads = [Load(streams, requests, max_tokens, prompts, mode) for mode in (modes or [None])]
    rate = "decode_tokens_per_s" if prompt_tokens is not None else "tokens_per_s"
    try:
        url = grpc_url or server.grpc
        triton_load(url, Load(min(streams, 2), 1, 4))            # warm-up: both sides' first forwards
        embedded_load(service, tokenizer, Load(min(streams, 2), 1, 4))
        rows = []
        for rep in range(repeats):
            for load in loads:
                for side in ("triton", "embedded"):
                    res = triton_load(url, load) if side == "triton" else embedded_load(service, tokenizer, load)
                    res["repeat"] = rep
                    rows.append(res)
                    log(f"repeat {rep + 1}/{repeats} {res['mode']} ({res['request_mode']}): {res[rate]} tok/s "
                        f"({res['tokens']} tokens in {res['seconds']} s)")
    finally:
        service.shutdown(drain_timeout=5)
        if server is not None:
            server.close()
    texts = [r.pop("texts") for r in rows]
    if any(r[rate] is None for r in rows):
        raise RuntimeError("a run had no stretch where every request decoded at once: raise --max-tokens")
    by_mode: dict[str, list[float]] = {}
    for t, e in zip(rows[0::2], rows[1::2]):
        by_mode.setdefault(t["request_mode"], []).append(t[rate] / e[rate])
    ratios = [r for rs in by_mode.values() for r in rs]
    res = {"cpu": cpu_model(), "model": config.model, "streams": streams, "requests_per_stream": requests,
           "max_tokens": max_tokens, "prompt_tokens": prompt_tokens, "rows": rows,
           "triton_over_embedded": round(statistics.median(ratios), 3), "ratios": [round(r, 3) for r in ratios],
           "triton_over_embedded_by_mode": {m: round(statistics.median(rs), 3) for m, rs in by_mode.items()},
           "identical_texts": all(t == texts[0] for t in texts)}
    if "full" in by_mode:   # each side's modes over its full mode in the same repeat, medians of the repeats
        at = {(r["repeat"], r["mode"], r["request_mode"]): r[rate] for r in rows}
        res["x_full"] = {f"{side} {m}": round(statistics.median(at[rep, side, m] / at[rep, side, "full"]
                                                                 for rep in range(repeats)), 3)
                         for side in ("triton-grpc", "embedded") for m in by_mode}
    return res


COLUMNS = ["repeat", "mode", "request_mode", "requests", "tokens", "seconds", "tokens_per_s", "decode_tokens_per_s",
           "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "drafted_tokens", "accepted_tokens"]
