"""``vericache bench serve --prompt-tokens N``: the server under long contexts, beside ``bench batch``.

``C`` distinct ``N``-token stretches of held-out code (``bench batch``'s own prompts) are sent at once
as streaming completions with the official ``openai`` client to a ``vericache serve`` (started here with
its defaults but ``--compressor``, unless ``--url`` is given), once per mode (the request's
``vericache.mode``; ``ignore_eos`` so every request decodes ``M`` tokens, as ``bench batch`` does).
Per mode: the decode throughput while all requests decode (the tokens streamed between the moment the
last request got its first token and the moment the first one ended, over that span), the time to
first token, and whether each text equals full mode's. Then ``bench batch`` runs the same requests
in-process, and each mode's server throughput is given over its batch throughput.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

COLUMNS = ["mode", "server_decode_tokens_per_s", "batch_tokens_per_s", "server_over_batch", "server_x_full",
           "batch_x_full", "identical_to_full", "tokens_per_round", "batch_tokens_per_round", "ttft_median_s",
           "ttft_max_s", "window_s", "server_wall_s"]


@dataclass
class Stream:
    """One streamed completion: when each chunk's tokens arrived, and the text."""
    sent: float
    chunks: list[tuple[float, int]] = field(default_factory=list)   # (arrival, completion tokens so far)
    text: str = ""
    stats: dict = field(default_factory=dict)   # the request's engine figures (the last chunk's ``vericache``)

    @property
    def ttft(self) -> float:
        return self.chunks[0][0] - self.sent


def decode_window(streams: list[Stream]) -> tuple[float, int]:
    """(seconds, tokens) between the last first token and the first last token: every request decoding."""
    start = max(s.chunks[0][0] for s in streams)
    end = min(s.chunks[-1][0] for s in streams)
    if end <= start:
        return 0.0, 0
    tokens = 0
    for s in streams:
        before = max((n for t, n in s.chunks if t <= start), default=0)
        upto = max((n for t, n in s.chunks if t <= end), default=0)
        tokens += upto - before
    return end - start, tokens


async def one_stream(client, model: str, prompt: str, max_tokens: int, mode: str) -> Stream:
    s = Stream(time.perf_counter())
    # continuous usage (vLLM's extension): a chunk carries a delta, which may hold several tokens (a
    # VeriCache round's), so the tokens are counted from the usage each chunk carries, not the chunks
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True, "vericache": {"mode": mode},
                                             "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    async for chunk in stream:
        if (chunk.model_extra or {}).get("vericache"):
            s.stats = chunk.model_extra["vericache"]
        if chunk.choices:
            s.text += chunk.choices[0].text
            if chunk.usage is not None and chunk.usage.completion_tokens > (s.chunks[-1][1] if s.chunks else 0):
                s.chunks.append((time.perf_counter(), chunk.usage.completion_tokens))
    return s


async def load(url: str, model: str, prompts: list[str], max_tokens: int, mode: str) -> tuple[list[Stream], float]:
    """Every prompt at once; the streams and the wall time."""
    import openai

    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=3600) as client:
        await one_stream(client, model, "def warm_up():\n", 4, mode)   # kernels and draft weights measured
        t0 = time.perf_counter()
        streams = await asyncio.gather(*(one_stream(client, model, p, max_tokens, mode) for p in prompts))
    return list(streams), time.perf_counter() - t0


def server_rows(url: str, model: str, prompts: list[str], max_tokens: int, modes: list[str], log=print) -> list[dict]:
    rows, reference = [], None
    for mode in modes:
        log(f"server, {mode}: {len(prompts)} streams of {max_tokens} tokens")
        streams, wall = asyncio.run(load(url, model, prompts, max_tokens, mode))
        texts = [s.text for s in streams]
        reference = texts if mode == "full" else reference
        seconds, tokens = decode_window(streams)
        ttfts = sorted(s.ttft for s in streams)
        rounds = sum(s.stats.get("rounds", 0) for s in streams)
        emitted = sum(s.stats.get("completion_tokens", 0) - 1 for s in streams)
        rows.append({"mode": mode, "server_decode_tokens_per_s": round(tokens / seconds, 2) if seconds else None,
                     "window_s": round(seconds, 1), "window_tokens": tokens, "server_wall_s": round(wall, 1),
                     "ttft_median_s": round(ttfts[len(ttfts) // 2], 2), "ttft_max_s": round(ttfts[-1], 2),
                     "identical_to_full": None if reference is None else texts == reference,
                     "tokens_per_round": round(emitted / rounds, 2) if rounds else None,
                     "texts_equal_to_full": None if reference is None else sum(a == b for a, b in zip(texts, reference))})
        log(f"  {rows[-1]['server_decode_tokens_per_s']} tok/s while all decode ({tokens} tokens in {seconds:.1f} s), "
            f"TTFT median {rows[-1]['ttft_median_s']} s, texts equal to full {rows[-1]['texts_equal_to_full']}")
    return rows


def run_serve_long(model: str, prompt_tokens: int, concurrency: int, max_tokens: int, modes: list[str],
                   compressor: str, url: str | None = None, batch: bool = True, log=print) -> dict:
    from vericache.model.loader import load_tokenizer
    from vericache_lab.bench.batch import distinct_prompts, run_batch
    from vericache_lab.bench.common import cpu_model
    from vericache_lab.bench.serve import LaunchedServer

    tokenizer, _ = load_tokenizer(model)
    prompts = [tokenizer.decode(p) for p in distinct_prompts(tokenizer, concurrency, prompt_tokens)]
    server = LaunchedServer(model, ["--compressor", compressor], log=log) if url is None else None
    try:
        rows = server_rows(url or server.url, model, prompts, max_tokens, modes, log)
    finally:
        if server is not None:
            server.close()
    if batch:
        res = run_batch(model, concurrency, prompt_tokens, max_tokens, modes, compressor, log=log, llamacpp=False)
        by_mode = {r["mode"]: r for r in res["rows"]}
        for r in rows:
            batch_row = by_mode.get(r["mode"], {})
            r["batch_tokens_per_s"] = batch_row.get("tokens_per_s")
            r["batch_tokens_per_round"] = batch_row.get("mean_acceptance_length")
            if r["batch_tokens_per_s"] and r["server_decode_tokens_per_s"]:
                r["server_over_batch"] = round(r["server_decode_tokens_per_s"] / r["batch_tokens_per_s"], 2)
    full = next((r for r in rows if r["mode"] == "full"), None)
    for r in rows:
        for key, out in (("server_decode_tokens_per_s", "server_x_full"), ("batch_tokens_per_s", "batch_x_full")):
            if full and full.get(key) and r.get(key):
                r[out] = round(r[key] / full[key], 2)
    return {"model": model, "cpu": cpu_model(), "prompt_tokens": prompt_tokens, "concurrency": concurrency,
            "max_tokens": max_tokens, "compressor": compressor, "rows": rows}


def plot_serve_long(res: dict, path: str) -> None:
    """Each mode's decode throughput through the server beside ``bench batch``'s, and its TTFT."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["rows"]
    modes = [r["mode"] for r in rows]
    x = range(len(modes))
    fig, (ax, tx) = plt.subplots(1, 2, figsize=(10, 4))
    ax.bar([i - 0.2 for i in x], [r.get("server_decode_tokens_per_s") or 0 for r in rows], 0.4, label="server")
    ax.bar([i + 0.2 for i in x], [r.get("batch_tokens_per_s") or 0 for r in rows], 0.4, label="bench batch")
    ax.set_xticks(list(x), modes)
    ax.set_ylabel("decode tokens/s (all requests decoding)")
    ax.legend()
    tx.bar(list(x), [r["ttft_median_s"] for r in rows], 0.5, color="tab:gray")
    tx.set_xticks(list(x), modes)
    tx.set_ylabel("median time to first token (s)")
    fig.suptitle(f"{res['concurrency']} x {res['prompt_tokens']} tokens, {res['max_tokens']} new, {res['model']}, "
                 f"{res['compressor']}\n{res['cpu']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
