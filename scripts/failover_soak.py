"""Failover, over and over (issue 55's target: 0 wrong tokens, 0 hung requests over 50 kills).

``--kill verifier`` (default): two ``vericache serve --role verifier`` processes on loopback (model
``tiny``) and a drafter engine here with both in its pool. Each round: a request of ``--max-tokens`` goes
out, once a few of its tokens are in (a round out at its verifier) that verifier is SIGKILLed and started
again in the background; the request must finish on the other with full decoding's tokens, within
``--timeout`` seconds.

``--kill master``: a 3-master, 3-replica Redis Cluster on loopback holding a 1,536-token prefix (six
256-token blocks over the three masters; full and
SnapKV forms), a verifier process and a drafter engine here both reading it. Each round a request over
that prefix goes out and, after 0-4 of the drafter's steps (0: before either fetch, which both run in
the first step; else mid-decode, where the verifier's next session would read the store again), a
master is SIGKILLed (a kill mid-reply is tests/test_prefix_cluster.py's SIGSTOP test); the request must finish
with full decoding's tokens (lost blocks are computed), then the cluster fails over and the killed node
comes back as a replica, so every round kills a live master.

Prints a line per kill and a summary (JSON with --json).

    python scripts/failover_soak.py [--kill verifier|master] [--kills 50] [--max-tokens 40]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time

from vericache import LLM, SamplingParams
from vericache.engine.engine import Engine
from vericache.engine.requests import State
from vericache.remote.client import VerifierClient, VerifierUnavailable
from vericache.remote.fetch import PrefixFetcher
from vericache.remote.pool import VerifierPool
from vericache.remote.prefixes import model_id, put_prompt
from vericache.remote.store import PrefixStore
from vericache_lab.redis_local import LocalRedisCluster, free_port


def start_verifier(port: int, store_url: str | None = None) -> subprocess.Popen:
    store = ["--prefix-store", store_url] if store_url else []
    return subprocess.Popen([sys.executable, "-m", "vericache.cli", "serve", "--role", "verifier", "--model", "tiny",
                             "--dtype", "float32", "--device", "cpu", "--grpc-port", str(port), "--metrics-port", "0",
                             *store], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_ready(url: str, mid: str, timeout_s: float = 120) -> None:
    client, deadline = VerifierClient(url, mid), time.time() + timeout_s
    while True:
        try:
            client.health(timeout_s=1)
            return
        except VerifierUnavailable:
            if time.time() > deadline:
                raise RuntimeError(f"verifier {url} did not start") from None
            time.sleep(0.2)


def finish(engine: Engine, req, ref: list[int], timeout_s: float, results: dict) -> str:
    """Steps ``engine`` until request ``req`` ends or ``timeout_s`` passes; counts it in ``results``."""
    rid, deadline = req.id, time.time() + timeout_s
    while engine.has_unfinished() and time.time() < deadline:
        engine.step()
    if engine.has_unfinished():
        results["hung"] += 1
        engine.abort(rid)
        return "HUNG"
    if req.error is not None:
        results["failed"] += 1
        return f"FAILED ({req.error})"
    if req.seq.output_ids != ref:
        results["wrong"] += 1
        return "DIFFERENT"
    return "identical"


def soak_verifiers(args, llm: LLM, mid: str, base: list[int], results: dict) -> None:
    ports = [free_port(), free_port()]
    urls = [f"grpc://127.0.0.1:{p}" for p in ports]
    procs = {u: start_verifier(p) for u, p in zip(urls, ports)}
    try:
        for u in urls:
            wait_ready(u, mid)
        pool = VerifierPool(urls, mid)
        engine = Engine(llm.loaded, mode="vericache", compressor="snapkv:ratio=0.25", draft_len=4, verifier=pool)
        for i in range(args.kills):
            ids = base[i * 7 % 300: i * 7 % 300 + 400]
            ref = llm.engine.generate([llm.engine.new_sequence(0, ids, SamplingParams(max_tokens=args.max_tokens))],
                                      "full")[0].token_ids
            for u in urls:            # both up before each kill (the one killed last round restarted)
                wait_ready(u, mid)
            t0 = time.time()
            rid = engine.loop.add_request(ids, SamplingParams(max_tokens=args.max_tokens))
            req = engine.loop.requests[rid]
            while not (req.state == State.AWAITING_VERIFIER and len(req.seq.output_ids) >= 3) and not req.done:
                engine.step()
            victim = req.remote.session.url if req.remote.session is not None else urls[0]
            procs[victim].kill()
            procs[victim].wait()
            results["kills"] += 1
            verdict = finish(engine, req, ref, args.timeout, results)
            results["failovers"] += sum(1 for e, _ in engine.take_events()["prefix"] if e == "verifier_failover")
            results["seconds"].append(round(time.time() - t0, 2))
            print(f"kill {i + 1}: {victim}; {verdict} {time.time() - t0:.1f} s", file=sys.stderr, flush=True)
            procs[victim] = start_verifier(int(victim.rsplit(":", 1)[1]))
    finally:
        for p in procs.values():
            p.kill()


def soak_masters(args, llm: LLM, mid: str, base: list[int], results: dict) -> None:
    import redis

    spec = "snapkv:ratio=0.25"
    with tempfile.TemporaryDirectory() as tmp, LocalRedisCluster(tmp) as nodes:
        prefix = base[:1536]
        put_prompt(llm.engine, PrefixStore(nodes.url, mid), prefix, [spec])
        for port in nodes.masters():   # every block on its replica before any master goes
            redis.Redis(port=port).execute_command("WAIT", 1, 5000)
        port = free_port()
        url, proc = f"grpc://127.0.0.1:{port}", start_verifier(port, nodes.url)
        try:
            wait_ready(url, mid)
            engine = Engine(llm.loaded, mode="vericache", compressor=spec, draft_len=4, verifier=VerifierPool([url], mid),
                            prefix=PrefixFetcher(PrefixStore(nodes.url, mid, timeout_s=2)))
            entry = int(nodes.url.rsplit(":", 1)[1])   # the node the store is found through stays up
            for i in range(args.kills):
                ids = prefix + base[1536 + i * 5 % 200: 1536 + i * 5 % 200 + 60]
                ref = llm.engine.generate([llm.engine.new_sequence(0, ids, SamplingParams(max_tokens=args.max_tokens))],
                                          "full")[0].token_ids
                t0 = time.time()
                rid = engine.loop.add_request(ids, SamplingParams(max_tokens=args.max_tokens))
                req = engine.loop.requests[rid]
                for _ in range(i % 5):
                    engine.step()
                victim = [m for m in nodes.masters() if m != entry][i % 2]
                nodes.kill(victim)
                results["kills"] += 1
                verdict = finish(engine, req, ref, args.timeout, results)
                stats = req.seq.stats
                results["seconds"].append(round(time.time() - t0, 2))
                print(f"kill {i + 1}: master {victim} after {i % 5} steps; {verdict} {time.time() - t0:.1f} s; prefix "
                      f"blocks fetched: drafter {stats.get('prefix_tokens', 0) // 256}, verifier "
                      f"{stats.get('verifier_prefix_tokens', 0) // 256}", file=sys.stderr, flush=True)
                nodes.wait_ok()            # its replica serves its slots
                nodes.restart(victim)      # back as that replica's replica
                engine.take_events()
        finally:
            proc.kill()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kill", choices=["verifier", "master"], default="verifier")
    ap.add_argument("--kills", type=int, default=50)
    ap.add_argument("--max-tokens", type=int, default=40)
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    llm = LLM("tiny", device="cpu", dtype="float32", mode="full")
    base = llm.tokenizer.encode(open(__file__).read())
    results = {"kill": args.kill, "kills": 0, "wrong": 0, "hung": 0, "failed": 0, "failovers": 0, "seconds": []}
    soak = soak_verifiers if args.kill == "verifier" else soak_masters
    soak(args, llm, model_id(llm.loaded), base, results)
    summary = {k: v for k, v in results.items() if k != "seconds"}
    summary["max_request_s"] = max(results["seconds"], default=0)
    print(json.dumps(summary) if args.json else summary)
    return 0 if not (results["wrong"] or results["hung"] or results["failed"]) else 1


if __name__ == "__main__":
    sys.exit(main())
