"""Verifier failover, over and over (issue 55's target: 0 wrong tokens, 0 hung requests over 50 kills).

Two ``vericache serve --role verifier`` processes on loopback (model ``tiny``) and a drafter engine here
with both in its pool. Each round: a request of ``--max-tokens`` goes out, once a few of its tokens are
in (a round out at its verifier) that verifier is SIGKILLed and started again in the background; the
request must finish on the other with full decoding's tokens, within ``--timeout`` seconds. Prints a line
per kill and a summary (JSON with --json).

    python scripts/failover_soak.py [--kills 50] [--max-tokens 40]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from vericache import LLM, SamplingParams
from vericache.engine.engine import Engine
from vericache.engine.requests import State
from vericache.remote.client import VerifierClient, VerifierUnavailable
from vericache.remote.pool import VerifierPool
from vericache.remote.prefixes import model_id
from vericache_lab.redis_local import free_port


def start_verifier(port: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "vericache.cli", "serve", "--role", "verifier", "--model", "tiny",
                             "--dtype", "float32", "--device", "cpu", "--grpc-port", str(port), "--metrics-port", "0"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


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


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kills", type=int, default=50)
    ap.add_argument("--max-tokens", type=int, default=40)
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    llm = LLM("tiny", device="cpu", dtype="float32", mode="full")
    mid = model_id(llm.loaded)
    ports = [free_port(), free_port()]
    urls = [f"grpc://127.0.0.1:{p}" for p in ports]
    procs = {u: start_verifier(p) for u, p in zip(urls, ports)}
    base = llm.tokenizer.encode(open(__file__).read())
    results = {"kills": 0, "wrong": 0, "hung": 0, "failed": 0, "failovers": 0, "seconds": []}
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
            deadline = time.time() + args.timeout
            while engine.has_unfinished() and time.time() < deadline:
                engine.step()
            if engine.has_unfinished():
                results["hung"] += 1
                engine.abort(rid)
            elif req.error is not None:
                results["failed"] += 1
            elif req.seq.output_ids != ref:
                results["wrong"] += 1
            results["failovers"] += sum(1 for e, _ in engine.take_events()["prefix"] if e == "verifier_failover")
            results["seconds"].append(round(time.time() - t0, 2))
            print(f"kill {i + 1}: {victim}; {'identical' if req.seq.output_ids == ref else 'DIFFERENT'} "
                  f"{time.time() - t0:.1f} s", file=sys.stderr, flush=True)
            procs[victim] = start_verifier(int(victim.rsplit(":", 1)[1]))
    finally:
        for p in procs.values():
            p.kill()
    summary = {k: v for k, v in results.items() if k != "seconds"}
    summary["max_request_s"] = max(results["seconds"], default=0)
    print(json.dumps(summary) if args.json else summary)
    return 0 if not (results["wrong"] or results["hung"] or results["failed"]) else 1


if __name__ == "__main__":
    sys.exit(main())
