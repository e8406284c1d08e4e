"""``vericache bench prefix``: the remote prefix-caching scenario on a real shaped network.

Namespaces from ``remote.netlab``: Redis in vc-store, the verifier in vc-verify (fast link to the
store), the drafter and the client in vc-draft (slow links to both). Each of ``--requests``
prompts is its own stored prefix (``--prefix-tokens``, put beforehand with ``vericache prefix put``
from the verifier's side) plus a short request suffix. Four runs, one server set each:
  recompute     the drafter prefills everything itself (full KV, no store)
  full-remote   the drafter fetches the full KV over the slow link, then decodes (LMCache-style)
  lossy-remote  the drafter fetches the compressed KV over the slow link and decodes from it alone
  vericache     the drafter fetches the compressed KV over the slow link and drafts; the verifier
                fetches the full KV over the fast link, prefills the tail, sends the first token,
                and verifies every round
``identical_to_full`` compares each output with full-remote's (full-KV decoding of the same stored
KV). Link bytes are the veth counters of the links during each run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from vericache.remote import netlab

MODES = ["recompute", "full-remote", "lossy-remote", "vericache"]


def _prompts(model: str, n: int, prefix_tokens: int) -> tuple[list[str], list[str], list[int], str]:
    """Each request's prefix text and prompt, the prefix's token count, and the model's KV id."""
    from vericache.eval.run_model_eval import heldout_tokens
    from vericache.model.loader import load_model
    from vericache.remote.prefixes import model_id

    loaded = load_model(model, device="cpu", dtype="float32")
    tok = loaded.tokenizer
    ids = heldout_tokens(tok)
    while len(ids) < n * prefix_tokens + 1:
        ids = ids + ids
    prefixes, prompts, lens = [], [], []
    for i in range(n):
        text = tok.decode(ids[i * prefix_tokens : (i + 1) * prefix_tokens])
        text = text[: text.rfind("\n") + 1]  # end on a line: tokens before it encode the same in the prompt
        prefixes.append(text)
        prompts.append(text + f"\n\ndef summarize_section_{i}(items):\n    \"\"\"Return")
        lens.append(len(tok.encode(text)))
    return prefixes, prompts, lens, model_id(loaded)


class Procs:
    """Processes started in namespaces, logged to files, stopped together."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir, self.procs = log_dir, []

    def start(self, role: str, name: str, cmd: list[str], threads: int) -> subprocess.Popen:
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
        log = open(self.log_dir / f"{name}.log", "w")
        p = subprocess.Popen(netlab.exec_in(role, *cmd), stdout=log, stderr=subprocess.STDOUT, env=env)
        self.procs.append(p)
        return p

    def wait_line(self, name: str, needle: str, timeout_s: float = 180) -> None:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if needle in (self.log_dir / f"{name}.log").read_text():
                return
            time.sleep(0.2)
        raise RuntimeError(f"{name} did not print {needle!r}; see {self.log_dir / (name + '.log')}")

    def stop(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        self.procs = []


def run_prefix_bench(model: str, prefix_tokens: int, requests: int, max_tokens: int, shape: netlab.Shape,
                     compressor: str, modes: list[str] = MODES, draft_dtype: str = "float32", log=print) -> dict:
    """The four modes, side by side in one run. Exact outputs (recompute, full-remote, the verifier)
    come from fp32 weights; the drafter's weights (lossy-remote, vericache's drafter) are
    ``draft_dtype``: its output is a draft, so a cheaper dtype only costs acceptance."""
    reason = netlab.available()
    if reason:
        raise RuntimeError(f"bench prefix needs network namespaces: {reason}")
    if shutil.which("redis-server") is None:
        raise RuntimeError("bench prefix needs redis-server (apt-get install redis-server)")
    vc = [sys.executable, "-m", "vericache.cli"]
    cores = os.cpu_count() or 2
    work = Path(tempfile.mkdtemp(prefix="vericache-prefix-bench-"))
    procs = Procs(work)
    log(f"netlab up: slow {shape.slow_gbps} Gbps / {shape.rtt_ms} ms RTT, fast {shape.fast_gbps} Gbps")
    lab = netlab.up(shape)
    try:
        measured = netlab.measure(lab)
        log(f"measured links: {json.dumps(measured)}")
        ep = lab.endpoints
        procs.start("store", "redis", ["redis-server", "--port", str(netlab.SERVICE_PORTS["store"]), "--bind",
                                       "127.0.0.1", ep["store_from_verify"].split(":")[0], "--save", "",
                                       "--appendonly", "no", "--protected-mode", "no", "--dir", str(work)], 1)
        procs.wait_line("redis", "Ready to accept connections")
        version = subprocess.run(["redis-server", "--version"], capture_output=True, text=True).stdout.split()[2].removeprefix("v=")
        prefixes, prompts, lens, kv_id = _prompts(model, requests, prefix_tokens)
        (work / "prompts.json").write_text(json.dumps(prompts))
        near, far = f"redis://{ep['store_from_verify']}", f"redis://{ep['store_from_draft']}"
        for i, text in enumerate(prefixes):
            f = work / f"prefix{i}.txt"
            f.write_text(text)
            t0 = time.perf_counter()
            r = subprocess.run(netlab.exec_in("verify", *vc, "prefix", "put", "--redis", near, "--model", model,
                                              "--dtype", "float32",
                                              "--prompt-file", str(f), "--compressor", compressor, "--json"),
                               capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(cores)})
            if r.returncode:
                raise RuntimeError(f"prefix put failed: {r.stderr[-2000:]}")
            entry = json.loads(r.stdout)
            log(f"stored prefix {i + 1}/{requests}: {entry['tokens']} of {lens[i]} tokens, "
                f"{entry['bytes'] / 1e6:.1f} MB, {time.perf_counter() - t0:.1f} s")
        rows, outputs = [], {}
        for mode in modes:
            log(f"mode {mode} ...")
            rows.append(_run_mode(mode, Procs(work), vc, model, compressor, near, far, ep, cores, work, max_tokens,
                                  kv_id, draft_dtype))
            outputs[mode] = rows[-1].pop("texts")
            log(f"  {json.dumps(rows[-1])}")
        ref = outputs.get("full-remote")
        for row in rows:
            row["identical_to_full"] = None if ref is None else outputs[row["mode"]] == ref
        return {"store": f"redis {version}", "network": measured, "model": model, "compressor": compressor,
                "draft_dtype": draft_dtype,
                "prefix_tokens": prefix_tokens, "requests": requests, "max_tokens": max_tokens, "cores": cores,
                "rows": rows, "work_dir": str(work)}
    finally:
        procs.stop()
        netlab.down()


def _run_mode(mode, procs: Procs, vc, model, compressor, near, far, ep, cores, work, max_tokens, kv_id,
              draft_dtype) -> dict:
    serve = [*vc, "serve", "--model", model, "--host", "127.0.0.1", "--port", "8000", "--compressor", compressor,
             "--prefix-model-id", kv_id]
    serve += ["--dtype", draft_dtype] if mode in ("lossy-remote", "vericache") else ["--dtype", "float32"]
    threads = cores
    if mode == "vericache":
        threads = max(cores // 2, 1)  # two engines share this machine's cores
        procs.start("verify", "verifier", [*vc, "serve", "--role", "verifier", "--model", model, "--dtype", "float32",
                                           "--host", "127.0.0.1",
                                           "--grpc-port", str(netlab.SERVICE_PORTS["verify"]), "--prefix-store", near],
                    max(cores - threads, 1))
        procs.wait_line("verifier", "verifier ")
        serve += ["--role", "drafter", "--verifier", f"grpc://{ep['verifier_from_draft']}", "--mode", "vericache",
                  "--prefix-store", far, "--prefix-link", "slow", "--prefill-chunk", "128"]
    elif mode == "recompute":
        serve += ["--mode", "full"]
    else:
        serve += ["--mode", "full" if mode == "full-remote" else "lossy", "--prefix-store", far, "--prefix-link", "slow"]
    procs.start("draft", f"drafter-{mode}", serve, threads)
    before = netlab.link_bytes()
    r = subprocess.run(netlab.exec_in("draft", sys.executable, "-m", "vericache.bench.prefix_client",
                                      "http://127.0.0.1:8000", str(work / "prompts.json"), str(max_tokens)),
                       capture_output=True, text=True)
    after = netlab.link_bytes()
    procs.stop()
    if r.returncode:
        raise RuntimeError(f"client failed in mode {mode}: {r.stderr[-2000:]}")
    res = json.loads(r.stdout)
    bad = [x for x in res if x["status"] != 200 or "error" in x["stats"]]
    if bad:
        raise RuntimeError(f"mode {mode}: {len(bad)} requests failed: {bad[0]['stats']}")
    moved = {k: after[k] - before[k] for k in after}
    n_tokens = sum(x["stats"].get("completion_tokens", 0) for x in res)
    makespan = max(x["e2e_s"] for x in res)
    st = [x["stats"] for x in res]
    row = {"mode": mode, "ttft_s": round(sum(x["ttft_s"] for x in res) / len(res), 3),
           "e2e_s": round(sum(x["e2e_s"] for x in res) / len(res), 3), "makespan_s": round(makespan, 3),
           "tokens_per_s": round(n_tokens / makespan, 2),
           "slow_link_bytes": moved["slow-store"] + moved["slow-verify"], "fast_link_bytes": moved["fast"],
           "prefix_tokens": [s.get("prefix_tokens", 0) for s in st], "threads": threads,
           "weights": draft_dtype if mode in ("lossy-remote", "vericache") else "float32",
           "timeline": [{"ttft_s": x["ttft_s"], "e2e_s": x["e2e_s"], "chunk_times": x["chunk_times"]} for x in res],
           "texts": [x["text"] for x in res]}
    if mode == "vericache":
        rounds = sum(s.get("rounds", 0) for s in st)
        row["verifier_prefix_tokens"] = [s.get("verifier_prefix_tokens", 0) for s in st]
        row["tokens_per_round"] = round((n_tokens - len(res)) / rounds, 2) if rounds else 0.0
    return row


def prefix_markdown(res: dict) -> str:
    from vericache.bench.common import markdown_table

    net = res["network"]
    links = "; ".join(f"{k}: {v['gbps']} Gbps, RTT {v['rtt_ms']} ms (shaped {v['shaped_gbps']} Gbps"
                      f"{', ' + str(v['shaped_rtt_ms']) + ' ms' if v['shaped_rtt_ms'] else ''})" for k, v in net.items())
    rows = [{**{k: v for k, v in r.items() if k not in ("timeline", "prefix_tokens", "verifier_prefix_tokens")},
             "slow_link_MB": round(r["slow_link_bytes"] / 1e6, 1), "fast_link_MB": round(r["fast_link_bytes"] / 1e6, 1)}
            for r in res["rows"]]
    table = markdown_table(rows, ["mode", "ttft_s", "e2e_s", "makespan_s", "tokens_per_s", "identical_to_full",
                                  "slow_link_MB", "fast_link_MB", "threads", "weights"])
    by = {r["mode"]: r for r in res["rows"]}
    ratios = ""
    if "vericache" in by and "full-remote" in by:
        v, f = by["vericache"], by["full-remote"]
        ratios = (f"\n\nVeriCache vs full-remote: TTFT {v['ttft_s'] / f['ttft_s']:.3f}x, end-to-end "
                  f"{f['e2e_s'] / v['e2e_s']:.2f}x faster (makespan {f['makespan_s'] / v['makespan_s']:.2f}x), "
                  f"slow-link bytes {v['slow_link_bytes'] / max(f['slow_link_bytes'], 1):.3f}x; "
                  f"{v.get('tokens_per_round', 0)} tokens per verification round.")
    return (f"Store: {res['store']}. Measured links: {links}. Model {res['model']}, {res['requests']} requests, "
            f"{res['prefix_tokens']}-token prefixes, {res['max_tokens']} new tokens, compressor {res['compressor']}, "
            f"{res['cores']} cores.\n\n{table}{ratios}")


def plot_prefix(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"recompute": "tab:gray", "full-remote": "tab:blue", "lossy-remote": "tab:orange", "vericache": "tab:green"}
    fig, axes = plt.subplots(len(res["rows"]), 1, figsize=(9, 1.6 + 1.3 * len(res["rows"])), sharex=True)
    for ax, row in zip(axes, res["rows"]):
        for i, req in enumerate(row["timeline"]):
            ax.barh(i, req["ttft_s"], color="lightgray", height=0.6)
            ax.barh(i, req["e2e_s"] - req["ttft_s"], left=req["ttft_s"], color=colors.get(row["mode"]), height=0.6)
            ax.plot(req["chunk_times"], [i] * len(req["chunk_times"]), "k|", markersize=5)
        ax.set_ylabel(row["mode"], rotation=0, ha="right", va="center")
        ax.set_yticks([])
    axes[-1].set_xlabel("seconds since the requests were sent (gray: waiting for the first token; ticks: tokens)")
    fig.suptitle(f"Remote prefix caching: {res['requests']} requests x {res['prefix_tokens']}-token stored prefixes, "
                 f"{res['compressor']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
