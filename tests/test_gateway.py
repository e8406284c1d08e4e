"""The OpenAI-compatible gateway on a real socket, driven by the official openai client and httpx."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn

from vericache import SamplingParams
from vericache.engine.engine import Engine
from vericache.kernels.cpu import supported_isas
from vericache.serving.service import BackgroundService
from vericache_gateway.app import create_app

SPEC = "snapkv:ratio=0.125"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, llm, api_key=None, max_queue=64, budget=1 << 30, model_name="tiny", max_per_key=0):
        # the server's own engine: defaults but the compressor, the budget (so every row runs natively) and a
        # fixed draft length (with "auto" the cost model may find no round paying for tiny: a machine's call)
        engine = Engine(llm.loaded, mode="vericache", compressor=SPEC, device_budget_gb=budget / (1 << 30), draft_len=4)
        self.service = BackgroundService(engine, max_queue=max_queue)
        self.app = create_app(self.service, model_name=model_name, api_key=api_key, max_per_key=max_per_key)
        self.port = _free_port()
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started and time.time() < deadline:
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"

    def close(self):
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.service.shutdown(drain_timeout=5)


@pytest.fixture(scope="module")
def server(llm):
    s = Server(llm)
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_completion_equals_the_engine(llm, client):
    prompt = "def parse_args(argv):\n    parser = "
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
    ref = llm.generate(prompt, SamplingParams(max_tokens=12))[0]
    assert r.choices[0].text == ref.text and r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.completion_tokens == len(ref.token_ids)
    assert r.model_extra["vericache"]["rounds"] >= 1


def test_continuous_usage_counts_every_token_of_a_round_and_ignore_eos_decodes_max_tokens(llm, client):
    """vLLM's extensions: with ``continuous_usage_stats`` each chunk carries the tokens so far (a VeriCache
    delta may hold a whole round's), so a client can count tokens, not chunks; ``ignore_eos`` decodes
    ``max_tokens`` past the model's end. The streamed text is the engine's, token for token."""
    prompt = "def add(a, b):\n    return a + b\n" * 8
    chunks = list(client.completions.create(
        model="tiny", prompt=prompt, max_tokens=40, temperature=0, stream=True,
        extra_body={"ignore_eos": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}))
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts == sorted(counts) and counts[-1] == 40 == chunks[-1].usage.completion_tokens
    assert max(b - a for a, b in zip([0] + counts, counts)) > 1      # a round's tokens came in one chunk
    ref = llm.generate(prompt, SamplingParams(max_tokens=40, ignore_eos=True))[0]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text and len(ref.token_ids) == 40


def test_a_request_is_validated_and_resolved_once(server, client, monkeypatch):
    """One intake (issue 54, item 5): the gateway's request is checked and its options resolved once, on
    the way in; the service and the engine take the ``Intake`` as it is."""
    from vericache.engine import options

    calls = []
    for name in ("check_prompt", "resolve_options"):
        real = getattr(options, name)
        monkeypatch.setattr(options, name, lambda *a, _real=real, _name=name: (calls.append(_name), _real(*a))[1])
    client.completions.create(model="tiny", prompt="def f(x):\n    return", max_tokens=4, temperature=0,
                              extra_body={"vericache": {"draft_len": 3}})
    assert sorted(calls) == ["check_prompt", "resolve_options"]


def test_per_request_vericache_options(llm, server, client):
    """The ``vericache`` extension field picks mode, compressor and draft length per request."""
    prompt = "def load(path):\n"
    ref = llm.generate(prompt, SamplingParams(max_tokens=12))[0].text
    full = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                     extra_body={"vericache": {"mode": "full"}})
    assert full.choices[0].text == ref and full.model_extra["vericache"]["rounds"] == 0
    assert full.model_extra["vericache"]["mode"] == "full"
    own = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                    extra_body={"vericache": {"compressor": "kivi:bits=2", "draft_len": 3}})
    stats = own.model_extra["vericache"]
    assert own.choices[0].text == ref and stats["mode"] == "vericache" and stats["compressor"].startswith("kivi")
    assert 0 < stats["drafted_tokens"] <= 3 * stats["rounds"]
    plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                      extra_body={"vericache": {"lookup": False, "draft_len": 4}})
    assert plain.choices[0].text == ref and plain.model_extra["vericache"]["lookup_proposed_tokens"] == 0
    for bad, param in (({"draft_len": 0}, "vericache.draft_len"), ({"mode": "turbo"}, "vericache.mode"),
                       ({"compressor": "kivi:bits=3"}, "vericache.compressor"), ({"lookup": "yes"}, "vericache.lookup"),
                       ({"compressor": "snapkv:guided=maybe"}, "vericache.compressor")):
        r = httpx.post(server.url + "/v1/completions", timeout=30,
                       json={"model": "tiny", "prompt": prompt, "max_tokens": 4, "vericache": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (bad, r.text)
    text = httpx.get(server.url + "/metrics").text
    assert 'vericache_request_success_total{compressor="",finished_reason="length",mode="full",model="tiny"}' in text


def test_streaming_chat_with_usage(client):
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "write a function"}], max_tokens=10, temperature=0,
        stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len(text) > 0


def test_raw_sse_ends_with_done(server):
    with httpx.stream("POST", server.url + "/v1/completions", json={"model": "tiny", "prompt": "import os\n",
                      "max_tokens": 5, "stream": True}, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)


@pytest.mark.parametrize("body, status, needle", [
    ({"model": "tiny", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"model": "nope", "prompt": "x"}, 400, "model 'nope' does not exist"),
    ({"model": "tiny"}, 400, "prompt"),
    ({"model": "tiny", "prompt": "x", "vericache": {"compressor": "zip"}}, 400, "unknown compressor"),
    ({"model": "tiny", "prompt": "x" * 5, "max_tokens": 70000}, 400, "context limit"),
    # strict types: what the schema says, nothing pydantic would coerce (0.0 for false, 2.0 for 2)
    ({"model": "tiny", "prompt": "x", "stream": 0.0}, 400, "stream"),
    ({"model": "tiny", "prompt": "x", "max_tokens": 2.0}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "x", "stream_options": {"include_usage": 0}}, 400, "include_usage"),
])
def test_errors_are_openai_shaped_400s(server, body, status, needle):
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == status
    err = r.json()["error"]
    assert needle in err["message"] and set(err) == {"message", "type", "param", "code"}


def test_too_long_prompt_gives_count_and_limit(server, llm):
    prompt = "x = 1\n" * 20000
    r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 8}, timeout=60)
    n = len(llm.tokenizer.encode(prompt))
    assert r.status_code == 400 and f"prompt ({n} tokens)" in r.json()["error"]["message"]
    assert str(llm.engine.max_context) in r.json()["error"]["message"]


def test_oversized_body_is_413(server):
    r = httpx.post(server.url + "/v1/completions", content=b"{" + b" " * (2 << 20) + b"}",
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 413 and "exceeds" in r.json()["error"]["message"]


def test_oversized_chunked_body_is_413_and_small_chunked_bodies_pass(server):
    """Without a Content-Length (chunked transfer) the limit holds too, and a body under it still works."""
    def chunks(total: int):   # JSON with ``total`` bytes of whitespace between its fields
        yield b'{"model": "tiny", "prompt": "def f(x):",'
        for _ in range(total // 65536):
            yield b" " * 65536
        yield b'"max_tokens": 2}'

    r = httpx.post(server.url + "/v1/completions", content=chunks(4 << 20),
                   headers={"content-type": "application/json"}, timeout=30)
    assert "content-length" not in r.request.headers and r.request.headers["transfer-encoding"] == "chunked"
    assert r.status_code == 413 and "without a length" in r.json()["error"]["message"]
    ok = httpx.post(server.url + "/v1/completions", content=chunks(65536 * 2),
                    headers={"content-type": "application/json"}, timeout=60)
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("length", "stop")
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_per_key_concurrency_limit_is_429_with_retry_after(llm):
    """With at most one generation per key, a key's second concurrent request gets 429 + Retry-After while
    another key is served; once the first ends the key is served again."""
    s = Server(llm, max_per_key=1)
    try:
        # greedy "class Parser:\n" runs the whole 2000 tokens on tiny (~20 s on 2 cores): still going below
        body = {"model": "tiny", "prompt": "class Parser:\n", "max_tokens": 2000, "temperature": 0, "stream": True}
        with httpx.Client(timeout=60) as c:
            with c.stream("POST", s.url + "/v1/completions", json=body, headers={"authorization": "Bearer a"}) as first:
                lines = first.iter_lines()    # kept: a dropped iterator closes the stream
                assert first.status_code == 200 and next(lines).startswith("data: ")   # key "a" is generating
                again = c.post(s.url + "/v1/completions", json={**body, "stream": False, "max_tokens": 2},
                               headers={"authorization": "Bearer a"})
                assert again.status_code == 429 and again.headers["retry-after"] == "1"
                assert again.json()["error"]["type"] == "rate_limit_error"
                other = c.post(s.url + "/v1/completions", json={**body, "stream": False, "max_tokens": 2},
                               headers={"authorization": "Bearer b"})
                assert other.status_code == 200
            deadline = time.time() + 20          # the server notices the hang-up and frees the slot
            while s.app.state.gateway.in_flight and time.time() < deadline:
                time.sleep(0.05)
            assert s.app.state.gateway.in_flight == {}
            later = c.post(s.url + "/v1/completions", json={**body, "stream": False, "max_tokens": 2},
                           headers={"authorization": "Bearer a"})
            assert later.status_code == 200
        assert s.app.state.gateway.in_flight == {}
    finally:
        s.close()
    with pytest.raises(ValueError, match="max_per_key"):
        create_app(s.service, max_per_key=-1)


def test_api_key(llm):
    s = Server(llm, api_key="s3cret")
    try:
        bad = openai.OpenAI(base_url=s.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        good = openai.OpenAI(base_url=s.url + "/v1", api_key="s3cret", max_retries=0)
        models = good.models.list()
        assert [m.id for m in models] == ["tiny"]
        described = models.data[0].model_extra["vericache"]   # what the engine computes with
        assert described["numerics"] == llm.loaded.numerics and described["build"] in supported_isas()
        assert described["build_origin"] == "built here"      # a checkout: no wheel's kernels
        assert httpx.get(s.url + "/health").status_code == 200  # health needs no key
    finally:
        s.close()


def test_queue_full_is_429_with_retry_after(llm):
    s = Server(llm, max_queue=0)
    try:
        r = httpx.post(s.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2}, timeout=30)
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "rate_limit_error"
    finally:
        s.close()


def test_disconnects_abort_and_free_kv(server):
    """200 clients that hang up mid-stream: their requests are aborted and all KV returns."""
    for _ in range(200):
        with httpx.stream("POST", server.url + "/v1/completions", json={
                "model": "tiny", "prompt": "class Parser:\n", "max_tokens": 2000, "stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    break  # hang up after the first chunk
    deadline = time.time() + 20
    loop = server.service.engine.loop
    while time.time() < deadline and (server.service.num_running() or loop.device.used_blocks):
        time.sleep(0.05)
    assert server.service.num_running() == 0 and loop.device.used_blocks == 0 and loop.host.used_blocks == 0


def test_metrics_exported(server, client):
    client.completions.create(model="tiny", prompt="def f():\n", max_tokens=20, temperature=0)
    text = httpx.get(server.url + "/metrics").text
    for name in ("vericache_num_requests_running", "vericache_spec_decode_num_drafts_total",
                 "vericache_spec_decode_num_accepted_tokens_per_pos_total", "vericache_kv_cache_bytes",
                 "vericache_time_to_first_token_seconds_bucket", "vericache_request_success_total",
                 "vericache_link_bytes_total", "vericache_prompt_tokens_total", "vericache_generation_tokens_total"):
        assert name in text, name
    assert 'tier="host"' in text and 'mode="vericache"' in text
    from vericache.model.exact_linear import resident_weight_bytes

    weights = [ln for ln in text.splitlines() if ln.startswith("vericache_model_weight_bytes{")]
    assert len(weights) == 1 and float(weights[0].rsplit(" ", 1)[1]) == resident_weight_bytes(server.service.engine.loaded.model)


def test_graceful_shutdown_drains_in_flight_requests(llm):
    """Shutdown stops accepting new requests but lets the running ones finish."""
    service = BackgroundService(Engine(llm.loaded, mode="vericache", compressor=SPEC, device_budget_gb=1))
    stream = service.submit(llm.tokenizer.encode("def main():\n"), SamplingParams(max_tokens=40, ignore_eos=True))
    service.shutdown(drain_timeout=60)
    got, last = [], None
    while last is None or not last.finished:
        last = stream.get(timeout=5)
        got += last.token_ids
    assert len(got) == 40 and last.finish_reason == "length"
    from vericache.serving.service import ServiceStopped

    with pytest.raises(ServiceStopped):
        service.submit([1, 2, 3], SamplingParams(max_tokens=2))


def test_chat_template_from_tokenizer_config(tmp_path, llm):
    import json
    import shutil

    from vericache.model.tokenizer import Tokenizer
    from vericache_gateway.protocol import ChatMessage, chat_prompt

    shutil.copy(llm.loaded.path / "tokenizer.json", tmp_path / "tokenizer.json")
    msgs = [ChatMessage(role="system", content="be brief"), ChatMessage(role="user", content="hi")]
    plain = chat_prompt(msgs, Tokenizer(tmp_path / "tokenizer.json"))
    assert plain == "### System:\nbe brief\n### User:\nhi\n### Assistant:\n"
    tpl = ("{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
           "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": tpl, "bos_token": "<s>"}))
    assert chat_prompt(msgs, Tokenizer(tmp_path / "tokenizer.json")) == "<s><|system|>be brief\n<|user|>hi\n<|assistant|>"


def test_chat_on_the_real_model_uses_its_template_and_stops_at_im_end(smollm):
    """SmolLM2 behind the gateway, the official openai client: the prompt is the model's ChatML
    template, the answer is the full-KV answer (VeriCache mode), and it ends at <|im_end|>."""
    from vericache.chat import render_chat

    messages = [{"role": "user", "content": "Write a Python function that reverses a string."}]
    s = Server(smollm, model_name="smollm2-135m")
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        r = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=256, temperature=0)
    finally:
        s.close()
    prompt = render_chat(smollm.tokenizer, messages)
    # the template adds its default system turn when the conversation has none
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM") and \
        prompt.endswith("<|im_end|>\n<|im_start|>user\nWrite a Python function that reverses a string.<|im_end|>\n"
                        "<|im_start|>assistant\n")
    ref = smollm.generate(prompt, SamplingParams(max_tokens=256))[0]
    # (a question with one right answer in both numerics: "the capital of France" is a near tie at its
    # first token that the q8 numerics, and the KV's dtype, tip away from "The capital ... Paris")
    assert r.choices[0].message.content == ref.text and "[::-1]" in ref.text
    assert r.choices[0].finish_reason == "stop" and r.model_extra["vericache"]["mode"] == "vericache"


def test_an_engine_fault_is_a_500_and_the_server_goes_on(llm, server, client, monkeypatch):
    """A step that raises fails only its requests: an OpenAI-shaped 500 (streamed or not), /health
    stays 200, and the next request is served, equal to the engine's output."""
    bad = "zqxjkv zqxjkv"
    sentinel = llm.tokenizer.encode(bad)[0]
    model = server.service.engine.loaded.model
    forward = model.forward

    def faulty(tokens, *args, **kwargs):
        if bool((tokens == sentinel).any()):
            raise RuntimeError("injected fault")
        return forward(tokens, *args, **kwargs)
    monkeypatch.setattr(model, "forward", faulty)
    for stream in (False, True):
        r = httpx.post(server.url + "/v1/completions", timeout=30,
                       json={"model": "tiny", "prompt": bad, "max_tokens": 4, "stream": stream})
        assert r.status_code == 500, r.text
        err = r.json()["error"]
        assert err["type"] == "server_error" and "injected fault" in err["message"]
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    prompt = "def main():\n"
    ok = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0)
    assert ok.choices[0].text == llm.generate(prompt, SamplingParams(max_tokens=6))[0].text
    assert server.service.num_running() == 0


def test_four_hundred_cancelled_streams_leave_nothing_behind(server):
    """400 streaming requests at concurrency 32 (`vericache bench serve --soak` runs such load for minutes), each cut at a random point (before the first chunk
    up to a few chunks in): afterwards no request runs, no KV block is held, and the gauges read zero."""
    import asyncio
    import random

    rng = random.Random(7)
    cuts = [rng.randint(0, 6) for _ in range(400)]

    async def one(client: httpx.AsyncClient, cut: int, gate: asyncio.Semaphore) -> None:
        async with gate:
            body = {"model": "tiny", "prompt": f"def f{cut}(x):\n", "max_tokens": 64, "stream": True}
            async with client.stream("POST", server.url + "/v1/completions", json=body) as r:
                assert r.status_code == 200
                seen = 0
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        seen += 1
                    if seen >= cut:
                        break   # hang up here

    async def run_all() -> None:
        gate = asyncio.Semaphore(32)
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=32)) as client:
            await asyncio.gather(*(one(client, cut, gate) for cut in cuts))

    asyncio.run(run_all())
    deadline, loop = time.time() + 30, server.service.engine.loop
    while time.time() < deadline and (server.service.num_running() or loop.device.used_blocks or loop.host.used_blocks):
        time.sleep(0.05)
    assert server.service.num_running() == 0 and loop.device.used_blocks == 0 and loop.host.used_blocks == 0
    gauges = {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in httpx.get(server.url + "/metrics").text.splitlines()
              if ln.startswith(("vericache_num_requests_running", "vericache_kv_cache_bytes"))}
    assert gauges and all(v == 0 for v in gauges.values()), gauges


# greedy, and seeded sampling with top-p and with top-k (tests/test_identity.py's settings)
SAMPLING = {"greedy": {"temperature": 0}, "T0.7-top_p": {"temperature": 0.7, "top_p": 0.9},
            "T1.0-top_k": {"temperature": 1.0, "top_k": 20}}


def _family_prompts(code_prompts) -> list[str]:
    return [code_prompts["medium"] + f"\n\ndef helper_{i}(x):\n    " + "y = x + 1\n    " * (i % 5) for i in range(16)]


def _body(prompt: str, mode: str, sampling: str, seed: int, spec: str | None = None, max_tokens: int = 24) -> dict:
    opts = {"mode": mode, **({"compressor": spec} if spec else {})}
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "vericache": opts, "seed": seed,
            **SAMPLING[sampling]}


def _texts(url: str, bodies: list[dict]) -> list[str]:
    """The completions of ``bodies``, sent concurrently."""
    import asyncio

    async def run() -> list[str]:
        async with httpx.AsyncClient(timeout=300) as c:
            replies = await asyncio.gather(*(c.post(url + "/v1/completions", json=b) for b in bodies))
        assert all(r.status_code == 200 for r in replies), [r.text for r in replies if r.status_code != 200]
        return [r.json()["choices"][0]["text"] for r in replies]

    return asyncio.run(run())


@pytest.mark.parametrize("sampling", list(SAMPLING))
def test_every_family_decodes_full_decodings_text_alone_and_among_fifteen_others(server, code_prompts, sampling):
    """Through the gateway, each compressor family's VeriCache request (the server's draft length) gives full
    decoding's text for its seed, bit for bit, alone and among 15 concurrent requests of other prompts,
    lengths, modes and sampling: the forward is batch-invariant and a sampled token is a function of
    (seed, position) only (coupled sampling)."""
    import random

    from test_identity import COMPRESSORS

    prompts = _family_prompts(code_prompts)
    full = [_texts(server.url, [_body(prompts[i], "full", sampling, 100 + i)])[0] for i in range(len(COMPRESSORS))]
    targets = [_body(prompts[i], "vericache", sampling, 100 + i, spec) for i, spec in enumerate(COMPRESSORS)]
    alone = [_texts(server.url, [b])[0] for b in targets]
    rng = random.Random(sampling)
    others = [_body(prompts[i], rng.choice(["full", "vericache", "lossy"]), rng.choice(list(SAMPLING)), i,
                    max_tokens=rng.randint(8, 40)) for i in range(len(targets), 16)]
    among = _texts(server.url, targets + others)
    assert all(full) and alone == full
    assert among[: len(targets)] == full
    assert len(set(among)) > 8          # the others really decoded other things beside them


def test_two_server_processes_give_the_same_seeded_text(server, code_prompts):
    """Two ``vericache serve`` processes (own loads, own kernels, own random state) answer a seeded
    request with the same text, and it is seeded full decoding's on this test's own server."""
    from vericache_lab.bench.serve import LaunchedServer

    prompts = _family_prompts(code_prompts)[:4]
    bodies = [_body(p, "vericache", sampling, 7 + i, spec) for i, (p, sampling, spec) in enumerate(
        zip(prompts, ["T0.7-top_p", "T1.0-top_k"] * 2, ["snapkv:ratio=0.1", "kivi:bits=2", "h2o:ratio=0.1", "int4"]))]
    full = _texts(server.url, [{**b, "vericache": {"mode": "full"}} for b in bodies])
    procs = [LaunchedServer("tiny", extra=["--dtype", "float32"], log=lambda m: None) for _ in range(2)]
    try:
        answers = [_texts(p.url, bodies) for p in procs]
    finally:
        for p in procs:
            p.close()
    assert answers[0] == answers[1] == full


def test_a_q8qk_server_answers_vericache_requests_with_its_full_decodings_text(code_prompts):
    """``vericache serve --numerics q8qk`` (a process of its own, the openai client): the model list names
    its numerics, and seeded and greedy VeriCache requests, sent concurrently, get its full decoding's
    text (every full cache of its engine keeps key codes; verification codes rows as full decoding does)."""
    from vericache_lab.bench.serve import LaunchedServer

    prompts = _family_prompts(code_prompts)[:3]
    proc = LaunchedServer("tiny", extra=["--dtype", "float32", "--numerics", "q8qk"], log=lambda m: None)
    try:
        client = openai.OpenAI(base_url=proc.url + "/v1", api_key="none", max_retries=0)
        assert client.models.list().data[0].model_extra["vericache"]["numerics"] == "q8qk"
        bodies = [_body(p, "vericache", sampling, 3 + i, spec) for i, (p, sampling, spec) in enumerate(
            zip(prompts, ["T0.7-top_p", "greedy", "T1.0-top_k"], ["snapkv:ratio=0.1", "kivi:bits=2", "h2o:ratio=0.1"]))]
        full = _texts(proc.url, [{**b, "vericache": {"mode": "full"}} for b in bodies])
        assert _texts(proc.url, bodies) == full and all(full)
    finally:
        proc.close()
