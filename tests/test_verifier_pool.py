"""A pool of verifiers for the drafter (issue 55 item 2): prefixes placed by rendezvous hashing, and a
verifier killed in the middle of a request's rounds moving the request to the next verifier with its
tokens unchanged. Real processes: two ``vericache serve --role verifier`` on loopback, SIGKILLed; the
gateway's /metrics counts the failover."""

from __future__ import annotations

import threading
import time
from collections import Counter

import openai
import pytest
import requests as http
import uvicorn

from test_remote import Verifier
from vericache.engine.engine import Engine
from vericache.engine.requests import State
from vericache.remote.client import VerifierUnavailable
from vericache.remote.pool import VerifierPool, placement_key, rendezvous_order
from vericache.remote.prefixes import model_id
from vericache.sampling import SamplingParams
from vericache.serving.service import BackgroundService
from vericache_gateway.app import create_app

MAX_TOKENS = 40


def test_rendezvous_hashing_spreads_prefixes_and_moves_only_a_removed_verifiers():
    urls = [f"grpc://10.0.0.{i}:50051" for i in range(3)]
    keys = [f"prefix-{i}" for i in range(3000)]
    first = {k: rendezvous_order(urls, k)[0] for k in keys}
    share = Counter(first.values())
    assert all(800 < share[u] < 1200 for u in urls), share                  # about a third each
    assert all(rendezvous_order(list(reversed(urls)), k)[0] == first[k] for k in keys[:200])   # any order given
    without = [u for u in urls if u != urls[1]]
    moved = [k for k in keys if rendezvous_order(without, k)[0] != first[k]]
    assert moved and all(first[k] == urls[1] for k in moved)                 # only the removed one's prefixes
    assert all(rendezvous_order(without, k)[0] == rendezvous_order(urls, k)[1] for k in moved)   # to their next
    ids = list(range(1000, 1400))
    assert placement_key("m", ids) == placement_key("m", ids[:256] + [7] * 50) != placement_key("m", ids[1:])
    assert placement_key("m", ids[:10]) != placement_key("m", ids[:11])      # short prompts: the whole prompt
    with pytest.raises(ValueError, match="distinct"):
        VerifierPool(urls[:1] * 2, "m")
    with pytest.raises(ValueError, match="at least one"):
        VerifierPool([], "m")


class ScriptedSession:
    """A verifier session that answers from a script (the pool's bookkeeping under test, not gRPC)."""

    def __init__(self, client, prompt_ids, max_tokens, compressor) -> None:
        self.client, self.prompt_ids, self.max_tokens = client, list(prompt_ids), max_tokens
        self.sent: list = []
        self.in_flight, self.closed = True, False
        self.replies = [({}, {"op": "opened", "token": client.next_token(prompt_ids)}, 0.0)]

    def verify(self, start, tokens) -> None:
        self.sent.append((start, list(tokens)))
        self.replies.append(({}, {"op": "verified", "accepted": len(tokens) - 1, "token": 99}, 0.0))

    def poll(self):
        if self.client.dead:
            raise VerifierUnavailable(f"{self.client.url} gone")
        return self.replies.pop(0) if self.replies else None

    def close(self) -> None:
        self.closed = True


class ScriptedClient:
    def __init__(self, url: str, next_token) -> None:
        self.url, self.next_token, self.dead, self.sessions = url, next_token, False, []

    def session(self, prompt_ids, max_tokens, compressor=""):
        self.sessions.append(ScriptedSession(self, prompt_ids, max_tokens, compressor))
        return self.sessions[-1]


def test_a_pooled_session_reopens_over_the_committed_tokens_and_refuses_a_disagreeing_verifier():
    """The failover's bookkeeping: the next verifier opens over prompt + output less the last token,
    its first token is checked against that last token, the round in flight is sent again; a verifier
    whose reopened token disagrees (a broken reopen, here: one that answers something else) fails the
    request instead of emitting a wrong token."""
    from vericache.remote.pool import PooledSession

    prompt = [1, 2, 3]
    for honest in (True, False):
        a = ScriptedClient("grpc://a:1", lambda ids: 7)
        b = ScriptedClient("grpc://b:1", lambda ids, honest=honest: 99 if honest else 8)   # after [..., 5, 6]: 99
        pool = VerifierPool.__new__(VerifierPool)
        pool.events = []
        s = PooledSession(pool, [a, b], prompt, 10, "")
        assert s.poll()[1]["token"] == 7 and s.tokens == [1, 2, 3, 7]
        s.verify(3, [7, 5, 6])
        assert s.poll()[1]["op"] == "verified" and s.tokens == [1, 2, 3, 7, 5, 6, 99]
        s.verify(6, [99, 4])
        a.dead = True                                     # the round [99, 4] is out at a
        if not honest:
            with pytest.raises(VerifierUnavailable, match="not the committed 99"):
                s.poll()
            continue
        assert s.poll()[1] == {"op": "verified", "accepted": 1, "token": 99}
        reopened = b.sessions[0]
        assert reopened.prompt_ids == [1, 2, 3, 7, 5, 6] and reopened.max_tokens == 10 - 4 + 1
        assert reopened.sent == [(6, [99, 4])] and pool.events == [("verifier_failover",
                                                                    {"from": "grpc://a:1", "to": "grpc://b:1"})]
        b.dead = True
        with pytest.raises(VerifierUnavailable, match="b:1 gone"):   # no verifier left
            s.poll()


@pytest.fixture()
def two_verifiers(llm, redis_server, free_port):
    mid = model_id(llm.loaded)
    pair = [Verifier(free_port(), redis_server.url) for _ in range(2)]
    try:
        for v in pair:
            v.wait_ready(mid)
        yield pair
    finally:
        for v in pair:
            v.stop()


def _reference(llm, ids: list[int]) -> list[int]:
    engine = llm.engine
    return engine.generate([engine.new_sequence(0, ids, SamplingParams(max_tokens=MAX_TOKENS))], "full")[0].token_ids


def _kill(v: Verifier) -> None:
    v.proc.kill()
    v.proc.wait()


def test_a_verifier_killed_mid_round_moves_its_request_to_the_next_with_the_same_tokens(llm, code_prompts,
                                                                                      two_verifiers):
    mid = model_id(llm.loaded)
    by_url = {v.url: v for v in two_verifiers}
    pool = VerifierPool(list(by_url), mid)
    engine = Engine(llm.loaded, mode="vericache", compressor="snapkv:ratio=0.125", draft_len=4, verifier=pool)
    loop = engine.loop
    ids = llm.tokenizer.encode(code_prompts["long"])[:500]
    reference = _reference(llm, ids)
    own, fallback = (by_url[c.url] for c in pool.order(ids))
    rid = loop.add_request(ids, SamplingParams(max_tokens=MAX_TOKENS))
    req, deadline = loop.requests[rid], time.time() + 60
    while not (req.state == State.AWAITING_VERIFIER and len(req.seq.output_ids) >= 6):
        assert time.time() < deadline, "no round went out"
        loop.step()
    session = req.remote.session
    assert session.url == own.url
    _kill(own)                                       # a round is out at it
    deadline = time.time() + 60
    while loop.has_unfinished():
        assert time.time() < deadline, "the drafter hung after its verifier died"
        loop.step()
    assert req.error is None and req.seq.output_ids == reference    # full decoding's tokens
    assert session.closed and session.url == fallback.url
    assert engine.take_events()["prefix"] == [("verifier_failover", {"from": own.url, "to": fallback.url})]
    assert loop.device.used_bytes == 0

    # before its first token (the open itself fails over), and with no verifier left: a clear 503
    again = loop.add_request(list(reversed(ids)), SamplingParams(max_tokens=8))
    _kill(fallback)
    deadline = time.time() + 60
    while loop.has_unfinished():
        assert time.time() < deadline, "the drafter hung with every verifier dead"
        loop.step()
    failed = loop.requests[again]
    assert failed.state == State.FAILED and failed.error_status == 503 and "verifier unavailable" in failed.error
    assert loop.device.used_bytes == 0


def test_the_gateway_counts_a_failover_and_streams_full_decodings_text(llm, code_prompts, two_verifiers, free_port):
    mid = model_id(llm.loaded)
    by_url = {v.url: v for v in two_verifiers}
    pool = VerifierPool(list(by_url), mid)
    service = BackgroundService(Engine(llm.loaded, mode="vericache", compressor="snapkv:ratio=0.125", draft_len=4,
                                       verifier=pool))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(service, model_name="tiny"), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    ids = llm.tokenizer.encode(code_prompts["long"])[:500]
    prompt = llm.tokenizer.decode(ids)
    ids = llm.tokenizer.encode(prompt)   # what the gateway sees
    own = by_url[pool.order(ids)[0].url]
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=60)
    try:
        stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                           stream=True)
        text = ""
        for i, chunk in enumerate(stream):
            text += chunk.choices[0].text if chunk.choices else ""
            if i == 2:
                _kill(own)           # mid-request: its next rounds go to the other verifier
        assert text == llm.tokenizer.decode(_reference(llm, ids))
        metrics = http.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        line = next(x for x in metrics.splitlines() if x.startswith("vericache_verifier_failovers_total"))
        assert line.endswith(" 1.0"), line
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        service.shutdown(drain_timeout=2)
