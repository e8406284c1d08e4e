"""The CPU images as a user runs them (issue 52): `scripts/docker-build` (what `make docker` runs) builds
vericache/gateway:local and vericache/triton-cpu:local (this CPU's kernel variant only, to keep the
suite short); the gateway container serves the official `openai` client a streamed completion identical
to the embedded engine's, the Triton container answers `tritonclient` with the same text; both run as a
non-root user with no compiler, report healthy, and stop cleanly on `docker stop` within 30 s."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from docker_env import docker_ready
from vericache.kernels.cpu import best_isa

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "def quicksort(items):"
MAX_TOKENS = 16


def docker(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout, check=check)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def images():
    reason = docker_ready()
    if reason:
        pytest.skip(reason)
    env = {**os.environ, "WHEEL_ISAS": best_isa(), "TARGETS": "gateway triton-cpu"}
    t0 = time.perf_counter()
    done = subprocess.run([str(ROOT / "scripts" / "docker-build")], env=env, capture_output=True, text=True,
                          timeout=3000)
    assert done.returncode == 0, done.stderr[-4000:]
    print(f"images built in {time.perf_counter() - t0:.0f} s")
    return {"gateway": "vericache/gateway:local", "triton": "vericache/triton-cpu:local"}


@pytest.fixture(scope="module")
def reference_text(smollm):
    from vericache import SamplingParams

    return smollm.generate(PROMPT, SamplingParams(max_tokens=MAX_TOKENS))[0].text


class Container:
    """A detached container on a free port of 127.0.0.1; ``stop`` times `docker stop`."""

    def __init__(self, image: str, container_port: int, *command: str) -> None:
        self.port = free_port()
        self.id = docker("run", "-d", "-p", f"127.0.0.1:{self.port}:{container_port}", image, *command).stdout.strip()
        self.started = time.perf_counter()

    def wait_healthy(self, timeout: float = 300) -> float:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            state = json.loads(docker("inspect", self.id).stdout)[0]["State"]
            assert state["Running"], self.logs()
            health = state.get("Health", {}).get("Status")
            if health == "healthy":
                return time.perf_counter() - self.started
            assert health != "unhealthy", self.logs()
            time.sleep(1)
        raise AssertionError("not healthy in time: " + self.logs())

    def logs(self) -> str:
        done = docker("logs", self.id, check=False)
        return (done.stdout + done.stderr)[-3000:]

    def exec(self, *cmd: str) -> subprocess.CompletedProcess:
        return docker("exec", self.id, *cmd, check=False)

    def stop(self) -> tuple[float, int]:
        t0 = time.perf_counter()
        docker("stop", "-t", "30", self.id, timeout=60)
        code = json.loads(docker("inspect", self.id).stdout)[0]["State"]["ExitCode"]
        docker("rm", "-f", self.id, check=False)
        return time.perf_counter() - t0, code

    def remove(self) -> None:
        docker("rm", "-f", self.id, check=False)


def assert_runtime_hardened(c: Container) -> None:
    assert c.exec("id", "-u").stdout.strip() == "10001"                    # non-root
    compilers = c.exec("sh", "-c", "command -v g++ gcc c++ cc || true").stdout.strip()
    assert compilers == ""                                                 # no compiler in the runtime image
    described = c.exec("python", "-c", "from vericache.kernels.prebuilt import origin; from vericache.kernels."
                       "linear_op import best_isa; print(best_isa(), origin(best_isa()))").stdout.split()
    assert described == [best_isa(), "prebuilt"]


def test_the_gateway_image_serves_the_engines_text(images, reference_text):
    import openai

    c = Container(images["gateway"], 8000)
    try:
        healthy_s = c.wait_healthy()
        assert_runtime_hardened(c)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{c.port}/v1", api_key="none", max_retries=0)
        stream = client.completions.create(model="smollm2-135m", prompt=PROMPT, max_tokens=MAX_TOKENS,
                                           temperature=0.0, stream=True)
        text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        first_completion_s = time.perf_counter() - c.started
        assert text == reference_text
        stop_s, code = c.stop()
        print(f"gateway: healthy {healthy_s:.0f} s, first completion {first_completion_s:.0f} s after docker run, "
              f"stopped in {stop_s:.1f} s (exit {code})")
        assert stop_s < 30 and code == 0
    finally:
        c.remove()


def test_the_triton_image_answers_tritonclient(images, reference_text):
    import queue

    import numpy as np
    import tritonclient.grpc as grpcclient

    c = Container(images["triton"], 8001)
    try:
        c.wait_healthy(timeout=600)
        assert_runtime_hardened(c)
        client, answers = grpcclient.InferenceServerClient(f"127.0.0.1:{c.port}"), queue.Queue()
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        inputs = [grpcclient.InferInput("text_input", [1], "BYTES"), grpcclient.InferInput("max_tokens", [1], "INT32")]
        inputs[0].set_data_from_numpy(np.array([PROMPT.encode()], dtype=np.object_))
        inputs[1].set_data_from_numpy(np.array([MAX_TOKENS], dtype=np.int32))
        client.async_stream_infer("vericache", inputs, enable_empty_final_response=True)
        texts = []
        while True:
            result, error = answers.get(timeout=120)
            assert error is None, error
            text = result.as_numpy("text_output")   # None: a final flag alone
            if text is not None:
                texts.append(text[0].decode())
            final = result.get_response().parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                break
        client.stop_stream()
        assert "".join(texts) == reference_text
        stop_s, code = c.stop()
        print(f"triton: stopped in {stop_s:.1f} s (exit {code})")
        assert stop_s < 30
    finally:
        c.remove()


def compose_command() -> list[str] | None:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    done = subprocess.run(["docker", "compose", "version"], capture_output=True)
    return ["docker", "compose"] if done.returncode == 0 else None


def compose_health(cmd: list[str], env: dict) -> dict[str, str | None]:
    """service -> its health ("healthy", "starting", ...), or "exited N" for a container that has stopped."""
    ids = subprocess.run([*cmd, "ps", "-q"], env=env, capture_output=True, text=True).stdout.split()
    if not ids:
        return {}
    return {c["Config"]["Labels"]["com.docker.compose.service"]:
            c["State"].get("Health", {}).get("Status") if c["State"]["Running"] else f"exited {c['State']['ExitCode']}"
            for c in json.loads(docker("inspect", *ids).stdout)}


def test_the_compose_stack_runs_healthy_and_prometheus_scrapes_it(images):
    """`docker compose --profile remote up` on images built here: gateway, Triton, a 3-master 3-replica
    Redis Cluster (formed by a one-shot that exits 0), two verifiers and a drafter healthy; the drafter's
    greedy text (verified remotely) equals the gateway's, its prompt's blocks are stored across the three
    masters, and Prometheus (Debian's package on the same base) scrapes the gateway's vericache_* series."""
    import httpx

    compose = compose_command()
    if compose is None:
        pytest.skip("neither docker-compose nor the compose plugin is installed (scripts/system-deps installs docker-compose)")
    env = {**os.environ, "WHEEL_ISAS": best_isa(), "TARGETS": "redis prometheus"}
    built = subprocess.run([str(ROOT / "scripts" / "docker-build")], env=env, capture_output=True, text=True, timeout=900)
    assert built.returncode == 0, built.stderr[-3000:]
    base = subprocess.run([str(ROOT / "scripts" / "docker-base")], capture_output=True, text=True, check=True).stdout.strip()
    cmd = [*compose, "-p", "vericachetest", "-f", str(ROOT / "docker" / "compose.yaml"), "--profile", "remote"]
    env = {**os.environ, "VERICACHE_BASE": base, "VERICACHE_TORCH_SOURCE": "wheels"}
    try:
        up = subprocess.run([*cmd, "up", "-d"], env=env, capture_output=True, text=True, timeout=600)
        assert up.returncode == 0, up.stderr[-3000:]
        services = {"gateway", "triton", "verifier-1", "verifier-2", "drafter", "prometheus",
                    *(f"redis-{n}" for n in range(1, 7))}
        end, health = time.monotonic() + 900, {}   # five engines starting at once on 2 cores

        def ready(health: dict) -> bool:
            return (health.get("redis-cluster") == "exited 0"
                    and all(health.get(s) == "healthy" for s in services))

        while time.monotonic() < end:
            health = compose_health(cmd, env)
            if ready(health):
                break
            assert "unhealthy" not in health.values() and health.get("redis-cluster", "exited 0") in (
                None, "exited 0"), health
            time.sleep(3)
        assert ready(health), health
        # a prompt of three 256-token blocks: the verifier it is placed on stores them (--store-prefixes)
        prompt = "".join(f"def f{i}(x):\n    return x * {i} + {i + 1}\n\n" for i in range(48)) + PROMPT
        texts = {}
        for name, port in (("gateway", 8000), ("drafter", 8010)):
            r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=300,
                           json={"model": "smollm2-135m", "prompt": prompt, "max_tokens": 8, "temperature": 0})
            assert r.status_code == 200, (name, r.text)
            texts[name] = r.json()["choices"][0]["text"]
        assert texts["drafter"] == texts["gateway"] and texts["gateway"], texts
        ls = subprocess.run([*cmd, "exec", "-T", "verifier-1", "vericache", "prefix", "ls", "--redis",
                             "redis://redis-1:6379", "--json"], env=env, capture_output=True, text=True, timeout=300)
        assert ls.returncode == 0, ls.stderr[-3000:]
        listed = json.loads(ls.stdout.strip().splitlines()[-1])
        assert len(set(listed["masters"])) == 3 and all(m.startswith("redis-") for m in listed["masters"]), listed
        assert listed["prefixes"], listed
        query = "http://127.0.0.1:9090/api/v1/query?query=vericache_generation_tokens_total"
        end, scraped = time.monotonic() + 60, 0.0
        while time.monotonic() < end and scraped < 16:
            result = httpx.get(query, timeout=5).json()["data"]["result"]
            scraped = sum(float(x["value"][1]) for x in result)
            time.sleep(2)
        assert scraped >= 16     # the 8 + 8 tokens just generated, scraped from the gateway and the drafter
    finally:
        subprocess.run([*cmd, "down", "-v", "-t", "30"], env=env, capture_output=True, timeout=120)
