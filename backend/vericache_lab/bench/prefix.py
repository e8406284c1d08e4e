"""``vericache bench prefix``: the remote prefix-caching scenario on a real shaped network.

Namespaces from ``remote.netlab``: Redis in vc-store, the verifier in vc-verify (fast link to the
store), the drafter and the client in vc-draft (slow links to both). Each of ``--requests``
prompts is its own stored prefix (``--prefix-tokens``, put beforehand with ``vericache prefix put``
from the verifier's side) plus a short request suffix. One server set per run; each engine gets
``--threads-per-device`` threads (a device each), except full-remote-all's (all the machine's):
  recompute       the drafter prefills everything itself (full KV, no store)
  full-remote     the drafter fetches the full KV over the slow link, then decodes (LMCache-style)
  full-remote-all the same with every core
  lossy-remote  the drafter fetches the compressed KV over the slow link and decodes from it alone
  vericache     the drafter fetches the compressed KV over the slow link and drafts; the verifier
                fetches the full KV over the fast link, prefills the tail, sends the first token,
                and verifies every round
``identical_to_full`` compares each output with full-remote's (full-KV decoding of the same stored
KV). Link bytes are the veth counters of the links during each run (sampled for the timeline); each
engine writes its events to a trace (``serve --trace``), from which come its busy share (forward
seconds / the run's wall seconds), its store fetch rate and the plot. After the runs the step costs
are measured here at the same threads, and ``sim.remote_prefix`` predicts every row.
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

from vericache.serving.trace import read_trace
from vericache_lab import netlab
from vericache_lab.bench.prefix_timeline import (
    LinkSampler,
    busy_share,
    fetch_rate_gbps,
    link_rates,
    sessions_per_forward,
    spans,
)

MODES = ["recompute", "full-remote", "full-remote-all", "lossy-remote", "vericache"]


def _prompts(model: str, n: int, prefix_tokens: int) -> tuple[list[str], list[str], list[int], str]:
    """Each request's prefix text and prompt, the prefix's token count, and the model's KV id."""
    from vericache.model.loader import load_model
    from vericache.remote.prefixes import model_id
    from vericache_lab.eval.run_model_eval import heldout_tokens

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

    def start(self, role: str, name: str, cmd: list[str], threads: int, stdin=None) -> subprocess.Popen:
        # THP_MEM_ALLOC_ENABLE: PyTorch's large buffers (a session's KV) on huge pages, far fewer page faults
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1", "THP_MEM_ALLOC_ENABLE": "1"}
        log = open(self.log_dir / f"{name}.log", "w")
        p = subprocess.Popen(netlab.exec_in(role, *cmd), stdout=log, stderr=subprocess.STDOUT, env=env, stdin=stdin)
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


STORES = ["redis", "cluster"]


def run_prefix_bench(model: str, prefix_tokens: int, requests: int, max_tokens: int, shape: netlab.Shape,
                     compressor: str, modes: list[str] = MODES, draft_dtype: str = "float32",
                     threads_per_device: int = 1, predict: bool = True, stores: list[str] = STORES[:1],
                     log=print) -> dict:
    """The modes, side by side in one run, on each of ``stores`` in turn ("redis": one server;
    "cluster": a 3-master Redis Cluster, its nodes announcing the fast link's address and reached by
    the drafter through a relay each on the slow link). Exact outputs (recompute, full-remote, the
    verifier) come from fp32 weights; the drafter's weights (lossy-remote, vericache's drafter) are
    ``draft_dtype``: its output is a draft, so a cheaper dtype only costs acceptance."""
    bad = sorted(set(modes) - set(MODES)) + sorted(set(stores) - set(STORES))
    if bad or threads_per_device < 1 or not stores:
        raise ValueError(f"modes must be among {MODES}, stores among {STORES} (got {bad}; stores {stores}) "
                         f"and threads_per_device >= 1 (got {threads_per_device})")
    reason = netlab.available()
    if reason:
        raise RuntimeError(f"bench prefix needs network namespaces: {reason}")
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        raise RuntimeError("bench prefix needs redis-server and redis-cli (apt-get install redis-server)")
    vc = [sys.executable, "-m", "vericache.cli"]
    cores = os.cpu_count() or 2
    work = Path(tempfile.mkdtemp(prefix="vericache-prefix-bench-"))
    log(f"netlab up: slow {shape.slow_gbps} Gbps / {shape.rtt_ms} ms RTT, fast {shape.fast_gbps} Gbps")
    lab = netlab.up(shape)
    try:
        measured = netlab.measure(lab)
        log(f"measured links: {json.dumps(measured)}")
        prefixes, prompts, lens, kv_id = _prompts(model, requests, prefix_tokens)
        (work / "prompts.json").write_text(json.dumps(prompts))
        rows, described = [], {}
        for store in stores:
            store_procs = Procs(work)
            try:
                near, far, described[store] = _start_store(store, store_procs, lab, work)
                _put_prefixes(vc, model, compressor, near, prefixes, lens, work, cores, log)
                store_rows, outputs = [], {}
                for mode in modes:
                    log(f"{store}: mode {mode} ...")
                    threads = cores if mode == "full-remote-all" else threads_per_device
                    store_rows.append(_run_mode(mode, Procs(work), vc, model, compressor, near, far, lab.endpoints,
                                                threads, work, max_tokens, kv_id, draft_dtype, measured["fast"]["gbps"]))
                    store_rows[-1]["store"] = store
                    outputs[mode] = store_rows[-1].pop("texts")
                    row = store_rows[-1]
                    log(f"  TTFT {row['ttft_s']} s, end to end {row['e2e_s']} s, {row['tokens_per_s']} tokens/s, "
                        f"slow link {row['slow_link_bytes'] / 1e6:.1f} MB, fast link {row['fast_link_bytes'] / 1e6:.1f} MB")
            finally:
                store_procs.stop()
            _mark_identical(store_rows, outputs)
            if predict:
                from vericache_lab.bench.prefix_model import add_predictions
                add_predictions(store_rows, model, compressor, measured, requests, prefix_tokens, max_tokens,
                                threads_per_device, cores, log)
            rows += store_rows
        return {"threads_per_device": threads_per_device, "stores": described, "network": measured, "model": model,
                "compressor": compressor, "draft_dtype": draft_dtype,
                "prefix_tokens": prefix_tokens, "requests": requests, "max_tokens": max_tokens, "cores": cores,
                "rows": rows, "work_dir": str(work)}
    finally:
        netlab.down()


def _mark_identical(rows: list[dict], outputs: dict[str, list[str]]) -> None:
    """Each row's identical_to_full: its texts against full-remote's (full-KV decoding of the same stored KV)."""
    ref = outputs.get("full-remote", outputs.get("full-remote-all"))
    for row in rows:
        row["identical_to_full"] = None if ref is None else outputs[row["mode"]] == ref


def _start_store(store: str, procs: Procs, lab: netlab.Lab, work: Path) -> tuple[str, str, str]:
    """The store in vc-store: (the verifier's URL over the fast link, the drafter's over the slow one,
    what it is). A cluster's nodes announce the fast link's address; the drafter reaches each through
    its own slow-link relay, which its URL's ``remap`` names (``remote.shards.split_remap``)."""
    near_host = lab.endpoints["store_from_verify"].split(":")[0]
    version = subprocess.run(["redis-server", "--version"], capture_output=True, text=True).stdout.split()[2]
    if store == "redis":
        port = netlab.SERVICE_PORTS["store"]
        procs.start("store", "redis", ["redis-server", "--port", str(port), "--bind", "127.0.0.1", near_host,
                                       "--save", "", "--appendonly", "no", "--protected-mode", "no", "--dir", str(work)], 1)
        procs.wait_line("redis", "Ready to accept connections")
        return (f"redis://{near_host}:{port}", f"redis://{lab.endpoints['store_from_draft']}",
                f"one redis-server {version.removeprefix('v=')}")
    node_dir = work / "cluster"
    node_dir.mkdir(exist_ok=True)
    proc = procs.start("store", "cluster", [sys.executable, "-m", "vericache_lab.redis_local", str(node_dir),
                                            "--host", near_host, "--masters", "3", "--replicas", "0"], 1,
                       stdin=subprocess.PIPE)
    procs.wait_line("cluster", '"masters"', timeout_s=60)
    if proc.poll() is not None:
        raise RuntimeError(f"the store cluster did not start; see {work / 'cluster.log'}")
    masters = json.loads((work / "cluster.log").read_text().splitlines()[-1])["masters"]
    relays = {port: netlab.slow_relay(lab, "store", port) for port in masters}
    remap = ",".join(f"{near_host}:{port}={relays[port]}" for port in masters)
    return (f"redis://{near_host}:{masters[0]}", f"redis://{relays[masters[0]]}?remap={remap}",
            f"a {len(masters)}-master Redis Cluster {version.removeprefix('v=')}")


def _put_prefixes(vc, model, compressor, near, prefixes, lens, work, cores, log) -> None:
    """Each prefix's full and compressed KV put in the store from the verifier's side."""
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
        log(f"stored prefix {i + 1}/{len(prefixes)}: {entry['tokens']} of {lens[i]} tokens, "
            f"{entry['bytes'] / 1e6:.1f} MB, {time.perf_counter() - t0:.1f} s")


def _client_command(work: Path, max_tokens: int) -> list[str]:
    """``prefix_client`` in the drafter's namespace, its timeout scaled to the work: a reply may wait for
    every prompt's prefill on one shared core, so allow ~20 prompt tokens/s (~4 characters a token) for all."""
    prompts = json.loads((work / "prompts.json").read_text())
    timeout_s = 120 + sum(len(p) for p in prompts) / 4 / 20
    return netlab.exec_in("draft", sys.executable, "-m", "vericache_lab.bench.prefix_client", "http://127.0.0.1:8000",
                          str(work / "prompts.json"), str(max_tokens), str(round(timeout_s)))


def _client_results(r: subprocess.CompletedProcess, mode: str) -> tuple[list[dict], float]:
    """The client's rows and send time; a failed client or request fails the mode saying what happened."""
    if r.returncode:
        raise RuntimeError(f"client failed in mode {mode}: {r.stderr[-2000:]}")
    out = json.loads(r.stdout)
    res = out["requests"]
    bad = [x for x in res if x["status"] != 200 or "error" in x["stats"]]
    if bad:
        raise RuntimeError(f"mode {mode}: {len(bad)} of {len(res)} requests failed (statuses "
                           f"{sorted({str(x['status']) for x in bad})}): {bad[0]['stats'].get('error', bad[0]['stats'])}")
    return res, out["sent_at"]


def _run_mode(mode, procs: Procs, vc, model, compressor, near, far, ep, threads, work, max_tokens, kv_id,
              draft_dtype, fast_gbps) -> dict:
    traces = {"drafter": work / f"trace-{mode}-drafter.jsonl", "verifier": work / f"trace-{mode}-verifier.jsonl"}
    serve = [*vc, "serve", "--model", model, "--host", "127.0.0.1", "--port", "8000", "--compressor", compressor,
             "--prefix-model-id", kv_id, "--trace", str(traces["drafter"])]
    serve += ["--dtype", draft_dtype] if mode in ("lossy-remote", "vericache") else ["--dtype", "float32"]
    if mode == "vericache":
        procs.start("verify", "verifier", [*vc, "serve", "--role", "verifier", "--model", model, "--dtype", "float32",
                                           "--host", "127.0.0.1", "--trace", str(traces["verifier"]),
                                           "--grpc-port", str(netlab.SERVICE_PORTS["verify"]), "--prefix-store", near],
                    threads)
        procs.wait_line("verifier", "verifier ")
        serve += ["--role", "drafter", "--verifier", f"grpc://{ep['verifier_from_draft']}", "--mode", "vericache",
                  "--prefix-store", far, "--prefix-link", "slow", "--prefill-chunk", "128"]
    elif mode == "recompute":
        serve += ["--mode", "full"]
    else:
        serve += ["--mode", "lossy" if mode == "lossy-remote" else "full", "--prefix-store", far, "--prefix-link", "slow"]
    procs.start("draft", f"drafter-{mode}", serve, threads)
    before, sampler = netlab.link_bytes(), LinkSampler().start()
    r = subprocess.run(_client_command(work, max_tokens), capture_output=True, text=True)
    samples, after = sampler.stop(), netlab.link_bytes()
    procs.stop()
    res, sent_at = _client_results(r, mode)
    moved = {k: after[k] - before[k] for k in after}
    n_tokens = sum(x["stats"].get("completion_tokens", 0) for x in res)
    makespan = max(x["e2e_s"] for x in res)
    st = [x["stats"] for x in res]
    role_spans = {role: spans(read_trace(str(path)), sent_at, sent_at + makespan) for role, path in traces.items()}
    row = {"mode": mode, "ttft_s": round(sum(x["ttft_s"] for x in res) / len(res), 3),
           "e2e_s": round(sum(x["e2e_s"] for x in res) / len(res), 3), "makespan_s": round(makespan, 3),
           "tokens_per_s": round(n_tokens / makespan, 2),
           "slow_link_bytes": moved["slow-store"] + moved["slow-verify"], "fast_link_bytes": moved["fast"],
           "prefix_tokens": [s.get("prefix_tokens", 0) for s in st],
           "tail_tokens": [s.get("prompt_tokens", 0) - s.get("prefix_tokens", 0) for s in st], "threads": threads,
           "weights": draft_dtype if mode in ("lossy-remote", "vericache") else "float32",
           "drafter_busy": busy_share(role_spans["drafter"], makespan),
           "drafter_fetch_bytes": sum(s["bytes"] for s in role_spans["drafter"] if s["event"] == "prefix"),
           "timeline": [{"ttft_s": x["ttft_s"], "e2e_s": x["e2e_s"], "chunk_times": x["chunk_times"]} for x in res],
           "link_gbps": link_rates(samples, sent_at), "drafter_spans": role_spans["drafter"],
           "texts": [x["text"] for x in res]}
    if mode == "vericache":
        rounds = sum(s.get("rounds", 0) for s in st)
        fetch = fetch_rate_gbps(role_spans["verifier"])
        row |= {"verifier_prefix_tokens": [s.get("verifier_prefix_tokens", 0) for s in st],
                "tokens_per_round": round((n_tokens - len(res)) / rounds, 2) if rounds else 0.0,
                "drafted_per_round": round(sum(s.get("drafted_tokens", 0) for s in st) / rounds, 2) if rounds else 0.0,
                "verifier_busy": busy_share(role_spans["verifier"], makespan), "verifier_fetch_gbps": fetch,
                "sessions_per_verify": sessions_per_forward(role_spans["verifier"]),
                "fetch_over_fast_link": round(fetch / fast_gbps, 2) if fetch else None,
                "verifier_spans": role_spans["verifier"]}
    return row


def prefix_markdown(res: dict) -> str:
    from vericache_lab.report import markdown_table

    net = res["network"]
    links = "; ".join(f"{k}: {v['gbps']} Gbps, RTT {v['rtt_ms']} ms (shaped {v['shaped_gbps']} Gbps"
                      f"{', ' + str(v['shaped_rtt_ms']) + ' ms' if v['shaped_rtt_ms'] else ''})" for k, v in net.items())
    rows = [{**r, "slow_link_MB": round(r["slow_link_bytes"] / 1e6, 1), "fast_link_MB": round(r["fast_link_bytes"] / 1e6, 1)}
            for r in res["rows"]]
    table = markdown_table(rows, ["store", "mode", "ttft_s", "predicted_ttft_s", "e2e_s", "predicted_e2e_s",
                                  "e2e_over_predicted", "tokens_per_s", "identical_to_full", "slow_link_MB", "fast_link_MB",
                                  "threads", "drafter_busy", "verifier_busy", "verifier_fetch_gbps", "fetch_over_fast_link"])
    ratios, fetch = "", {}
    for store in res["stores"]:
        by = {r["mode"]: r for r in res["rows"] if r["store"] == store}
        fetch[store] = by.get("vericache", {}).get("verifier_fetch_gbps")
        for base in ("full-remote", "full-remote-all"):
            if "vericache" in by and base in by:
                v, f = by["vericache"], by[base]
                ratios += (f"\n\n{store}: VeriCache vs {base} ({f['threads']} threads): TTFT {v['ttft_s'] / f['ttft_s']:.3f}x, "
                           f"end-to-end {f['e2e_s'] / v['e2e_s']:.2f}x faster (makespan {f['makespan_s'] / v['makespan_s']:.2f}x), "
                           f"slow-link bytes {v['slow_link_bytes'] / max(f['slow_link_bytes'], 1):.3f}x; "
                           f"{v.get('tokens_per_round', 0)} tokens per verification round "
                           f"({v.get('drafted_per_round', 0)} drafted).")
    if fetch.get("redis") and fetch.get("cluster"):
        ratios += (f"\n\nThe verifier's full-prefix fetch: cluster {fetch['cluster']} Gbit/s over one server's "
                   f"{fetch['redis']}: {fetch['cluster'] / fetch['redis']:.2f}x.")
    stores = "; ".join(f"{k}: {v}" for k, v in res["stores"].items())
    return (f"Stores: {stores}. Measured links: {links}. Model {res['model']}, {res['requests']} requests, "
            f"{res['prefix_tokens']}-token prefixes, {res['max_tokens']} new tokens, compressor {res['compressor']}, "
            f"{res['cores']} cores.\n\n{table}{ratios}")
