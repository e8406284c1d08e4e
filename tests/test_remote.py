"""The two-role flow (drafter here, verifier in its own process over gRPC) against a real
redis-server: outputs identical to full-KV decoding, cancellation freeing the verifier's KV, and
the faults: verifier gone (503), Redis down (recompute), a missing or corrupt block (recompute
from that block)."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time

import openai
import pytest
import uvicorn

from vericache.engine.engine import Engine
from vericache.engine.requests import State
from vericache.remote.client import VerifierClient, VerifierUnavailable
from vericache.remote.fetch import PrefixFetcher
from vericache.remote.prefixes import model_id, put_prompt
from vericache.remote.store import PrefixStore
from vericache.sampling import SamplingParams
from vericache.serving.service import BackgroundService
from vericache_gateway.app import create_app

MAX_TOKENS = 20
SPECS = ["snapkv:ratio=0.125", "kivi:bits=2", "snapkv:ratio=0.125+kivi:bits=2"]


class Verifier:
    """``vericache serve --role verifier`` in its own process."""

    def __init__(self, port: int, store_url: str, metrics_port: int = 0) -> None:
        self.url = f"grpc://127.0.0.1:{port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vericache.cli", "serve", "--role", "verifier", "--model", "tiny",
             "--dtype", "float32", "--device", "cpu", "--grpc-port", str(port), "--prefix-store", store_url,
             "--metrics-port", str(metrics_port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.client = None

    def wait_ready(self, mid: str) -> None:
        # a process that imports torch, loads the model and times it (a serving engine's calibration):
        # seconds alone, over a minute on a loaded 2-core machine
        deadline = time.time() + 180
        self.client = VerifierClient(self.url, mid)
        while True:
            try:
                self.client.health(timeout_s=1)
                return
            except VerifierUnavailable:
                if time.time() > deadline or self.proc.poll() is not None:
                    if self.proc.poll() is None:
                        self.proc.kill()
                    pytest.fail(f"verifier did not start: {self.proc.communicate()[0][-2000:]}")
                time.sleep(0.2)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="module")
def mid(llm):
    return model_id(llm.loaded)


@pytest.fixture(scope="module")
def verifier(redis_server, free_port, mid):
    v = Verifier(free_port(), redis_server.url)
    v.wait_ready(mid)
    yield v
    v.stop()


@pytest.fixture(scope="module")
def prompts(llm, code_prompts, redis_server, mid):
    """A stored prefix (2 whole blocks), a prompt sharing its first block, and a cold one."""
    ids = llm.tokenizer.encode(code_prompts["long"])
    stored = ids[:600]
    put_prompt(llm.engine, PrefixStore(redis_server.url, mid), stored[:512], SPECS)
    shared = stored[:300] + list(reversed(ids[300:560]))
    cold = list(reversed(ids[:400]))
    return {"stored": stored, "shared": shared, "cold": cold}


@pytest.fixture(scope="module")
def reference(llm, prompts):
    runner, params = llm.engine, SamplingParams(max_tokens=MAX_TOKENS)
    return {k: runner.generate([runner.new_sequence(0, p, params)], "full")[0].token_ids for k, p in prompts.items()}


def drafter_engine(llm, mid, store_url, verifier_url, spec=SPECS[0], mode="vericache") -> Engine:
    fetcher = PrefixFetcher(PrefixStore(store_url, mid, timeout_s=2)) if store_url else None
    client = VerifierClient(verifier_url, mid) if verifier_url else None
    return Engine(llm.loaded, mode=mode, compressor=spec, prefix=fetcher, verifier=client)


def drafter(llm, mid, store_url, verifier_url, spec=SPECS[0], mode="vericache"):
    """The drafter's step loop (these tests watch its requests' states)."""
    return drafter_engine(llm, mid, store_url, verifier_url, spec, mode).loop


def run(loop, prompts: dict, max_tokens=MAX_TOKENS, timeout_s=120, states_seen: set | None = None):
    seqs = {k: loop.runner.new_sequence(0, p, SamplingParams(max_tokens=max_tokens)) for k, p in prompts.items()}
    rids = {k: loop.add_sequence(s) for k, s in seqs.items()}
    deadline = time.time() + timeout_s
    while loop.has_unfinished():
        assert time.time() < deadline, "the drafter hung"
        loop.step()
        if states_seen is not None:
            states_seen |= {r.state for r in loop.requests}
    return seqs, {k: loop.requests[r] for k, r in rids.items()}


@pytest.mark.parametrize("spec", SPECS)
def test_two_roles_equal_full(llm, mid, redis_server, verifier, prompts, reference, spec):
    loop, states = drafter(llm, mid, redis_server.url, verifier.url, spec), set()
    seqs, reqs = run(loop, prompts, states_seen=states)
    for k, seq in seqs.items():
        assert reqs[k].error is None and seq.output_ids == reference[k], k
    # a round out at the verifier is a state of its own; nothing crosses a local link here
    assert State.AWAITING_VERIFIER in states and State.TRANSFERRING not in states
    assert seqs["stored"].stats["prefix_tokens"] == 512            # the drafter's compressed blocks
    assert seqs["stored"].stats["verifier_prefix_tokens"] == 512   # the verifier's full blocks
    assert seqs["shared"].stats["prefix_tokens"] == 256             # the shared leading block only
    assert "prefix_tokens" not in seqs["cold"].stats or seqs["cold"].stats["prefix_tokens"] == 0
    assert seqs["stored"].stats["rounds"] >= 1
    assert seqs["stored"].stats["prefix_fetch_bytes"] > 0
    assert loop.device.used_bytes == 0                                # every block back


def test_full_and_lossy_remote_modes(llm, mid, redis_server, prompts, reference):
    loop = drafter(llm, mid, redis_server.url, None, mode="full")
    seqs, reqs = run(loop, {"stored": prompts["stored"]})
    assert seqs["stored"].output_ids == reference["stored"]
    assert seqs["stored"].stats["prefix_tokens"] == 512
    loop = drafter(llm, mid, redis_server.url, None, mode="lossy")
    seqs, reqs = run(loop, {"stored": prompts["stored"]})
    assert reqs["stored"].error is None and len(seqs["stored"].output_ids) == MAX_TOKENS
    assert seqs["stored"].stats["prefix_tokens"] == 512


def test_cancel_frees_the_verifier_kv(llm, mid, redis_server, verifier, prompts):
    loop = drafter(llm, mid, redis_server.url, verifier.url)
    rid = loop.add_request(prompts["stored"], SamplingParams(max_tokens=200))
    deadline = time.time() + 60
    while len(loop.requests[rid].seq.output_ids) < 3:
        assert time.time() < deadline
        loop.step()
    assert verifier.client.health()["sessions"] == 1
    loop.abort(rid)
    deadline = time.time() + 10
    while verifier.client.health()["sessions"]:
        assert time.time() < deadline, "the verifier kept the aborted request's KV"
        time.sleep(0.05)
    assert loop.device.used_bytes == 0


def test_sampling_is_refused_with_a_remote_verifier(llm, mid, verifier):
    loop = drafter(llm, mid, None, verifier.url)
    with pytest.raises(ValueError, match="temperature"):
        loop.add_request([1, 2, 3], SamplingParams(max_tokens=4, temperature=0.7))
    assert not loop.requests


def test_redis_down_recomputes(llm, mid, verifier, prompts, reference, caplog):
    loop = drafter(llm, mid, "redis://127.0.0.1:1", verifier.url)
    with caplog.at_level(logging.WARNING, logger="vericache.prefix"):
        seqs, reqs = run(loop, {"stored": prompts["stored"]})
    assert seqs["stored"].output_ids == reference["stored"]
    assert any("recomputing" in r.getMessage() for r in caplog.records)
    assert ("store_error", {"role": "drafter"}) in loop.prefix.events


def test_corrupt_and_missing_blocks_recompute_from_there(llm, mid, redis_server, verifier, prompts, reference):
    store = PrefixStore(redis_server.url, mid)
    h = store.hashes(prompts["stored"])
    spec = SPECS[0]
    from vericache.compress.registry import parse_compressor
    keys = [store.key(h[1], parse_compressor(spec).spec()), store.key(h[1], "full")]
    saved = [redis_server.client.get(k) for k in keys]
    try:
        redis_server.client.set(keys[0], saved[0][:-100] + bytes(100))  # corrupt the drafter's block 1
        redis_server.client.delete(keys[1])                            # the verifier's block 1 is gone
        seqs, reqs = run(drafter(llm, mid, redis_server.url, verifier.url, spec), {"stored": prompts["stored"]})
        assert seqs["stored"].output_ids == reference["stored"]
        assert seqs["stored"].stats["prefix_tokens"] == 256
        assert seqs["stored"].stats["verifier_prefix_tokens"] == 256
    finally:
        for k, v in zip(keys, saved):
            redis_server.client.set(k, v)


def test_verifier_gone_is_503(llm, mid, redis_server, free_port, prompts):
    """The gateway in front of a drafter whose verifier dies: 503s, never a hang."""
    v = Verifier(free_port(), redis_server.url)
    v.wait_ready(mid)
    service = BackgroundService(drafter_engine(llm, mid, redis_server.url, v.url))
    app = create_app(service, model_name="tiny")
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=60)
    prompt = llm.tokenizer.decode(prompts["stored"][:300])
    try:
        ok = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
        assert ok.usage.completion_tokens == 8
        v.stop()
        for _ in range(2):
            t0 = time.time()
            with pytest.raises(openai.APIStatusError) as err:
                client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
            assert err.value.status_code == 503 and "verifier unavailable" in err.value.message
            assert time.time() - t0 < 30
        assert service.gauges()["kv_device"] == 0
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        service.shutdown(drain_timeout=2)
        v.stop()


def test_concurrent_opens_share_one_prefill_forward(llm, code_prompts):
    """Tail prefills of sessions that open together run as rows of shared forwards and give the same
    first token, and a cache that verifies the full-KV continuation, as opening one at a time."""
    from vericache.remote.verifier import VerifierCore

    ids = llm.tokenizer.encode(code_prompts["long"])
    prompts = [ids[:300], list(reversed(ids[:420])), ids[500:640]]
    engine = Engine(llm.loaded, mode="full")
    params = SamplingParams(max_tokens=8)
    reference = [engine.generate([engine.new_sequence(0, p, params)], "full")[0].token_ids for p in prompts]

    together = VerifierCore(llm.loaded, autostart=False, prefill_chunk=128)
    opened = [None] * len(prompts)

    def open_one(i):
        opened[i] = together.open(prompts[i], 8)

    threads = [threading.Thread(target=open_one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    deadline = time.time() + 30
    while together.pending() < len(prompts):
        assert time.time() < deadline, "the opens did not queue"
        time.sleep(0.01)
    together.start()
    for t in threads:
        t.join(timeout=60)
    prefills = [f for name, f in together.events if name == "prefill"]
    # chunk j of every tail in forward j: 300, 420 and 140 tokens in chunks of 128
    assert [f["rows"] for f in prefills] == [3, 3, 2, 1]
    assert sum(f["tokens"] for f in prefills) == sum(len(p) for p in prompts)

    alone = VerifierCore(llm.loaded)
    try:
        for i, p in enumerate(prompts):
            sess, token = opened[i]
            solo_sess, solo_token = alone.open(p, 8)
            assert token == solo_token == reference[i][0], i
            # the batched cache verifies the full-KV continuation: every draft accepted, then the bonus
            m, bonus, k, v = together.verify(sess, len(p), reference[i][:5])
            assert (m, bonus) == (4, reference[i][5]), i
            assert k.shape[2] == 5
    finally:
        together.shutdown()
        alone.shutdown()


def test_verifier_killed_mid_round_fails_its_requests_and_frees_memory(llm, mid, redis_server, free_port, prompts):
    """The verifier process SIGKILLed while rounds are out at it: each of the drafter's requests ends
    with an error (503, "verifier unavailable"; no local fallback: the drafter holds no full KV), none
    hangs, and every block of the drafter's memory comes back."""
    v = Verifier(free_port(), redis_server.url)
    v.wait_ready(mid)
    loop = drafter(llm, mid, None, v.url)
    rids = [loop.add_request(p, SamplingParams(max_tokens=200)) for p in prompts.values()]
    deadline = time.time() + 60
    while not any(r.state == State.AWAITING_VERIFIER for r in loop.requests):
        assert time.time() < deadline, "no round went out"
        loop.step()
    v.proc.kill()
    v.proc.wait()
    deadline = time.time() + 30
    while loop.has_unfinished():
        assert time.time() < deadline, "the drafter hung on a dead verifier"
        loop.step()
    for rid in rids:
        req = loop.requests[rid]
        assert req.state == State.FAILED and req.error_status == 503 and "verifier unavailable" in req.error, req.error
    assert loop.device.used_bytes == 0 and loop.host.used_bytes == 0


class CuttingProxy:
    """A TCP proxy in front of Redis: once one connection has carried ``after`` bytes back from Redis, it
    calls ``cut`` (which restarts Redis) and closes that connection, so the store goes away in the
    middle of a reply. Real sockets both ways; only where the cut falls is chosen."""

    def __init__(self, target_port: int, after: int, cut) -> None:
        import socket

        self.target, self.after, self.cut, self.cuts = target_port, after, cut, 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket

        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target))
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, src, dst, from_redis: bool) -> None:
        carried = 0
        try:
            while data := src.recv(65536):
                if from_redis and not self.cuts and carried + len(data) >= self.after:
                    dst.sendall(data[: self.after - carried])
                    self.cuts += 1
                    self.cut()
                    break
                carried += len(data)
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            s.close()

    def close(self) -> None:
        self.sock.close()


def test_redis_restarted_during_a_fetch_recomputes_from_the_first_missing_block(llm, mid, tmp_path, prompts,
                                                                                reference):
    """Redis killed and restarted (empty) while the drafter's fetch of a stored prefix is mid-reply: the
    blocks that arrived whole are used, the rest is computed, the output equals full-KV decoding."""
    from conftest import RedisServer

    redis = RedisServer(tmp_path)
    try:
        store = PrefixStore(redis.url, mid)
        put_prompt(llm.engine, store, prompts["stored"][:512], [])    # the full form of two blocks
        first = redis.client.get(store.key(store.hashes(prompts["stored"])[0], "full"))
        proxy = CuttingProxy(redis.port, after=len(first) + 64, cut=redis.restart)   # block 0 whole, block 1 cut
        loop = drafter(llm, mid, f"redis://127.0.0.1:{proxy.port}", None, mode="full")
        seqs, reqs = run(loop, {"stored": prompts["stored"]})
        assert proxy.cuts == 1 and not redis.client.keys("*")          # it really went away, and came back empty
        assert reqs["stored"].error is None and seqs["stored"].output_ids == reference["stored"]
        assert seqs["stored"].stats["prefix_tokens"] == 256             # block 0 from the store, the rest computed
        assert ("store_error", {"role": "drafter"}) in loop.prefix.events
        proxy.close()
    finally:
        redis.stop()
