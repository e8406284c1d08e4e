"""A real Triton Inference Server (the nvidia-pytriton wheel's, on CPU) serving model_repository/ (the
real default model, SmolLM2-135M-Instruct), reached with tritonclient over gRPC streaming."""

from __future__ import annotations

import queue
import time

import httpx
import numpy as np
import pytest

from vericache import SamplingParams
from vericache.serving.triton_launcher import start_triton, stop_triton
from vericache_lab.bench.triton_streams import LaunchedTriton, free_ports

g = pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc] is part of the dev extra")


@pytest.fixture(scope="module")
def triton(tmp_path_factory):
    try:
        server = LaunchedTriton(tmp_path_factory.mktemp("triton"), log=lambda m: None, ready_timeout_s=180)
    except RuntimeError as exc:
        pytest.fail(str(exc))
    yield {"grpc": server.grpc, "metrics": server.metrics, "server": server}
    server.close()


@pytest.fixture(autouse=True)
def _triton_outlives_each_test(request):
    """The module's server still running after each test that used it: a test that crashed it fails
    itself, with the server's log (not the tests after it, with a dead server's symptoms)."""
    yield
    if "triton" in request.fixturenames:
        server = request.getfixturevalue("triton")["server"]
        assert server.proc.poll() is None, (f"tritonserver exited (code {server.proc.returncode}) during this "
                                            f"test; its log ends:\n{server.log_tail()}")


def _inputs(text: str, max_tokens: int, stream: bool = True, **extra):
    def t(name, arr, dt):
        x = g.InferInput(name, list(arr.shape), dt)
        x.set_data_from_numpy(arr)
        return x

    ins = [t("text_input", np.array([text.encode()], dtype=np.object_), "BYTES"),
           t("max_tokens", np.array([max_tokens], dtype=np.int32), "INT32"),
           t("stream", np.array([stream]), "BOOL")]
    for name, dtype, triton_type in (("temperature", np.float32, "FP32"), ("top_p", np.float32, "FP32"),
                                     ("top_k", np.int32, "INT32"), ("random_seed", np.uint64, "UINT64")):
        if name in extra:
            ins.append(t(name, np.array([extra[name]], dtype=dtype), triton_type))
    for name in ("mode", "compressor"):
        if name in extra:
            ins.append(t(name, np.array([extra[name].encode()], dtype=np.object_), "BYTES"))
    if "draft_len" in extra:
        ins.append(t("draft_len", np.array([extra["draft_len"]], dtype=np.int32), "INT32"))
    if "lookup" in extra:
        ins.append(t("lookup", np.array([extra["lookup"]]), "BOOL"))
    return ins


def _stream(url: str, inputs, limit: int | None = None):
    client = g.InferenceServerClient(url)
    q: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    client.async_stream_infer("vericache", inputs, enable_empty_final_response=True)
    texts, error = [], None
    while True:
        result, error = q.get(timeout=120)
        if error is not None:
            break
        text = result.as_numpy("text_output")   # the last text comes with the final flag; a cancelled
        if text is not None:                     # request's final flag comes alone
            texts.append(text[0].decode())
        final = result.get_response().parameters.get("triton_final_response")
        if (final is not None and final.bool_param) or (limit is not None and len(texts) >= limit):
            break
    client.stop_stream(cancel_requests=limit is not None)
    return texts, error


def _metric(url: str, name: str) -> float:
    for line in httpx.get(url, timeout=10).text.splitlines():
        if line.startswith(name):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exported")


def test_streamed_text_equals_the_embedded_engine(triton, smollm):
    prompt = "def read_config(path):\n"
    texts, error = _stream(triton["grpc"], _inputs(prompt, 16))
    assert error is None and len(texts) >= 2  # deltas, not one blob
    assert "".join(texts) == smollm.generate(prompt, SamplingParams(max_tokens=16))[0].text


def test_unary_style_request_returns_whole_text(triton, smollm):
    texts, error = _stream(triton["grpc"], _inputs("import os\n", 8, stream=False))
    assert error is None and texts == [smollm.generate("import os\n", SamplingParams(max_tokens=8))[0].text]


def test_per_request_options(triton, smollm):
    """A full-mode request, a request with its own compressor and draft length, one without lookup, on the
    same model instance: each equals the full-KV text; an unknown compressor is INVALID_ARG."""
    prompt = "class Cache:\n"
    ref = smollm.generate(prompt, SamplingParams(max_tokens=12))[0].text
    for extra in ({"mode": "full"}, {"compressor": "kivi:bits=2", "draft_len": 3}, {"lookup": False, "draft_len": 5}):
        texts, error = _stream(triton["grpc"], _inputs(prompt, 12, **extra))
        assert error is None and "".join(texts) == ref, extra
    _, error = _stream(triton["grpc"], _inputs(prompt, 4, compressor="zip"))
    assert error is not None and "unknown compressor" in str(error)


def test_seeded_sampling_equals_seeded_full_decoding(triton, smollm):
    """The Triton parameters ``random_seed``, ``temperature``, ``top_p`` / ``top_k`` reach coupled
    sampling: a seeded VeriCache request's text is the embedded engine's seeded full decoding's."""
    prompt = "def merge_sorted(a, b):\n"
    for seed, extra in ((5, {"temperature": 0.7, "top_p": 0.9}), (6, {"temperature": 1.0, "top_k": 20})):
        params = SamplingParams(max_tokens=16, seed=seed, **extra)
        ref = smollm.generate(prompt, params)[0].text
        texts, error = _stream(triton["grpc"], _inputs(prompt, 16, random_seed=seed, **extra))
        assert error is None and "".join(texts) == ref, (seed, extra)


def test_bad_input_is_invalid_arg(triton):
    _, error = _stream(triton["grpc"], _inputs("x = 1", 0))
    assert error is not None and "max_tokens must be >= 1" in str(error)


def test_cancelled_stream_frees_kv(triton):
    texts, error = _stream(triton["grpc"], _inputs("class Parser:\n", 3000), limit=1)
    assert error is None and len(texts) == 1
    # the engine frees the KV when it aborts the request; the model's thread counts the cancellation
    # after that, so all three are waited for (under load the gauges came first: CI of 9517f6f)
    deadline = time.time() + 60   # ~1 s alone (the watcher's sweep); slower only while the machine is starved
    while time.time() < deadline:
        if (_metric(triton["metrics"], 'vericache_triton_kv_cache_bytes{tier="device"}') == 0
                and _metric(triton["metrics"], "vericache_triton_num_requests_running") == 0
                and _metric(triton["metrics"], 'vericache_triton_requests_total{outcome="cancelled"}') >= 1):
            break
        time.sleep(0.2)
    assert _metric(triton["metrics"], 'vericache_triton_kv_cache_bytes{tier="device"}') == 0
    assert _metric(triton["metrics"], 'vericache_triton_kv_cache_bytes{tier="host"}') == 0
    assert _metric(triton["metrics"], 'vericache_triton_requests_total{outcome="cancelled"}') >= 1


def test_custom_metrics_on_tritons_endpoint(triton):
    _stream(triton["grpc"], _inputs("def f():\n", 6))
    assert _metric(triton["metrics"], 'vericache_triton_requests_total{outcome="success"}') >= 1
    assert _metric(triton["metrics"], "vericache_triton_accepted_tokens_total") >= 0


class _Gateway:
    """The gateway over Triton on a free port, in a thread. ``stop`` shuts it down as `vericache serve` does
    (its Triton client closed, then the thread joined): a Triton stopped after it has no client stream left
    open to wait its 30 s exit timeout for."""

    def __init__(self, triton_grpc: str, free_port) -> None:
        import threading

        import uvicorn

        from vericache_gateway.app import create_app
        from vericache_gateway.backends import TritonBackend

        backend = TritonBackend(triton_grpc)
        app = create_app(backend, model_name="smollm2-135m")
        app.router.on_shutdown.append(backend.close)
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def _gateway(triton_grpc: str, free_port) -> tuple[_Gateway, str]:
    gateway = _Gateway(triton_grpc, free_port)
    return gateway, gateway.url


def test_gateway_over_triton_streams_the_same_text(triton, smollm, free_port):
    import openai

    server, url = _gateway(triton["grpc"], free_port)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        chunks = list(client.completions.create(model="smollm2-135m", prompt="def main():\n", max_tokens=12, temperature=0,
                                                stream=True))
        text = "".join(c.choices[0].text for c in chunks)
        assert text == smollm.generate("def main():\n", SamplingParams(max_tokens=12))[0].text
        assert chunks[-1].choices[0].finish_reason == "length"
        r = httpx.post(url + "/v1/completions", json={"model": "smollm2-135m", "prompt": "x", "max_tokens": 0}, timeout=30)
        assert r.status_code == 400
    finally:
        server.stop()


def test_chat_completion_over_triton_uses_the_models_template(triton, smollm, free_port):
    """The official openai client -> gateway -> Triton: the ChatML prompt, the full-KV answer, and
    generation ending at <|im_end|>."""
    import openai

    from vericache.chat import render_chat

    messages = [{"role": "user", "content": "Name one primary color. Answer in one word."}]
    server, url = _gateway(triton["grpc"], free_port)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        r = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=40, temperature=0)
    finally:
        server.stop()
    ref = smollm.generate(render_chat(smollm.tokenizer, messages), SamplingParams(max_tokens=40))[0]
    assert r.choices[0].message.content == ref.text and ref.finish_reason == "stop"
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens < 40


def test_our_grpc_clients_cap_their_reconnect_backoff_and_the_gateway_keeps_tritonclients_options():
    """gRPC's reconnect backoff grows to 120 s: without a cap the gateway stayed 503 ~27 s after a Triton
    that came up late was ready (the test below under load), and a drafter would leave a restarted
    verifier unused as long. Passing channel options replaces all of tritonclient's, so its message sizes
    and keepalive are kept beside the cap."""
    import tritonclient.grpc.aio as aio

    from vericache.remote.client import VerifierClient
    from vericache_gateway.backends import triton_channel_args

    args = dict(triton_channel_args(aio))
    assert args["grpc.max_reconnect_backoff_ms"] <= 5000
    drafter = VerifierClient("grpc://127.0.0.1:9", "m")   # no connection is made until a call
    assert dict(drafter.channel_options)["grpc.max_reconnect_backoff_ms"] <= 5000
    drafter.channel.close()
    assert args["grpc.max_receive_message_length"] == args["grpc.max_send_message_length"] == aio.MAX_GRPC_MESSAGE_SIZE
    assert args["grpc.keepalive_time_ms"] == aio.KeepAliveOptions().keepalive_time_ms


def test_gateway_503_while_triton_is_down_then_recovers(tmp_path, free_port):
    http, grpc, metrics = free_ports(3)
    server, url = _gateway(f"127.0.0.1:{grpc}", free_port)
    proc = None
    try:
        assert httpx.get(url + "/health", timeout=10).status_code == 503
        r = httpx.post(url + "/v1/completions", json={"model": "smollm2-135m", "prompt": "x", "max_tokens": 2}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
        proc = start_triton(http_port=http, grpc_port=grpc, metrics_port=metrics, workdir=tmp_path)
        deadline = time.time() + 180
        while time.time() < deadline and httpx.get(url + "/health", timeout=10).status_code != 200:
            time.sleep(0.5)
        r = httpx.post(url + "/v1/completions", json={"model": "smollm2-135m", "prompt": "x = ", "max_tokens": 3, "temperature": 0}, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"  # no gateway restart
    finally:
        server.stop()
        if proc is not None:
            stop_triton(proc)


def _gateway_process(triton_grpc: str, port: int):
    """``vericache serve --backend triton`` in its own process, healthy."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "vericache.cli", "serve", "--backend", "triton", "--triton-url",
                             triton_grpc, "--model", "smollm2-135m", "--host", "127.0.0.1", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while True:
        assert proc.poll() is None, proc.stderr.read()[-2000:]
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if time.time() > deadline:
            proc.kill()
            pytest.fail("the gateway did not become healthy in 120 s; its log ends:\n" + proc.communicate()[1][-2000:])
        time.sleep(0.3)


def test_a_killed_gateway_leaves_no_orphaned_requests_in_triton(triton, free_port):
    """The gateway process SIGKILLed with long streams running through it: its gRPC streams to Triton
    die with it, Triton cancels them, the engine behind it aborts them (no request running, no KV
    held), and a restarted gateway serves again."""
    import threading

    port = free_port()
    gw = _gateway_process(triton["grpc"], port)
    running = 'vericache_triton_num_requests_running'

    def stream_forever(i: int) -> None:
        try:
            with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                              json={"model": "smollm2-135m", "prompt": f"def f{i}(x):\n", "max_tokens": 3000,
                                    "stream": True, "temperature": 0}) as r:
                for _ in r.iter_lines():
                    pass
        except httpx.HTTPError:
            pass   # the gateway is killed under it
    clients = [threading.Thread(target=stream_forever, args=(i,), daemon=True) for i in range(3)]
    for c in clients:
        c.start()
    deadline = time.time() + 60
    while _metric(triton["metrics"], running) < 3:
        assert time.time() < deadline, "the streams did not reach Triton"
        time.sleep(0.2)
    gw.kill()
    gw.wait()
    deadline = time.time() + 60
    while _metric(triton["metrics"], running) or _metric(triton["metrics"], 'vericache_triton_kv_cache_bytes{tier="device"}'):
        assert time.time() < deadline, "Triton kept the dead gateway's requests"
        time.sleep(0.2)
    assert _metric(triton["metrics"], 'vericache_triton_kv_cache_bytes{tier="host"}') == 0
    gw = _gateway_process(triton["grpc"], port)
    try:
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                       json={"model": "smollm2-135m", "prompt": "x = ", "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    finally:
        gw.terminate()
        gw.wait(timeout=30)


def test_bench_triton_streams_against_the_embedded_engine(triton, capsys):
    """``vericache bench triton`` (short): 4 gRPC streams and 4 embedded ones decode the same texts, and
    the report carries each side's tokens/s and their ratio."""
    import json

    from vericache.cli import main

    assert main(["bench", "triton", "--grpc-url", triton["grpc"], "--streams", "4", "--requests", "1",
                 "--max-tokens", "8", "--repeats", "1", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["identical_texts"] and [r["mode"] for r in res["rows"]] == ["triton-grpc", "embedded"]
    assert all(r["requests"] == 4 and r["tokens"] > 4 and r["tokens_per_s"] > 0 for r in res["rows"])
    assert all(0 <= r["accepted_tokens"] <= r["drafted_tokens"] for r in res["rows"])   # rounds vs full steps, per side
    assert res["triton_over_embedded"] > 0


def test_bench_triton_at_the_benches_load_measures_each_mode_on_both_sides(triton, capsys):
    """``--prompt-tokens``: one long prompt a stream, each request mode in turn on each side; the texts
    are the same on both sides and in both modes, and each side's VeriCache is given over its full mode.
    A bad mode is a clear error naming it, before any server is asked."""
    import json

    from vericache.cli import main

    args = ["bench", "triton", "--grpc-url", triton["grpc"], "--streams", "2", "--max-tokens", "8", "--repeats", "1",
            "--prompt-tokens", "300", "--json"]
    assert main(args) == 0
    res = json.loads(capsys.readouterr().out)
    assert [(r["mode"], r["request_mode"]) for r in res["rows"]] == [
        ("triton-grpc", "full"), ("embedded", "full"), ("triton-grpc", "vericache"), ("embedded", "vericache")]
    assert res["identical_texts"] and all(r["requests"] == 2 and r["decode_tokens_per_s"] > 0 for r in res["rows"])
    assert res["rows"][0]["drafted_tokens"] == res["rows"][1]["drafted_tokens"] == 0   # full mode drafts nothing
    assert set(res["x_full"]) == {"triton-grpc full", "triton-grpc vericache", "embedded full", "embedded vericache"}
    assert res["x_full"]["embedded full"] == 1.0 and res["x_full"]["triton-grpc vericache"] > 0
    assert main(args[:-1] + ["--modes", "full,fastest"]) == 2
    assert "unknown mode 'fastest'" in capsys.readouterr().err
