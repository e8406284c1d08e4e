"""Kernel builds that survive interruption (``kernels/build.py``): a build stopped mid-way by SIGTERM or
SIGKILL leaves nothing that blocks the next one, which finishes in the same directory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vericache.kernels.build import build_lock

BUILD = "from vericache.kernels import packed_kernels; packed_kernels('portable'); print('built')"


def _start(kernel_dir: Path) -> subprocess.Popen:
    env = {**os.environ, "VERICACHE_KERNEL_DIR": str(kernel_dir)}
    return subprocess.Popen([sys.executable, "-c", BUILD], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def _wait_for(cond, timeout: float) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.1)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_build_stopped_midway_does_not_block_the_next(tmp_path, sig):
    first = _start(tmp_path)
    # torch's lock file appears when the build starts; compilers run a moment later
    _wait_for(lambda: any(tmp_path.glob("*/lock")), 120)
    time.sleep(2.0)
    os.killpg(first.pid, sig)                      # the builder and its compilers, as a stop would
    first.wait(30)
    assert any(tmp_path.glob("*/lock"))            # what used to make every later start sleep forever
    again = _start(tmp_path)
    out, err = again.communicate(timeout=600)
    assert again.returncode == 0 and out.strip().endswith("built"), err[-2000:]
    assert not any(tmp_path.glob("*/lock"))


def test_a_waiter_says_whose_build_it_waits_for(tmp_path, capsys, monkeypatch):
    import vericache.kernels.build as build

    monkeypatch.setattr(build, "WAIT_NOTICE_S", 0.2)
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, sys, time; f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); "
        "time.sleep(1.5)"), str(tmp_path / "tag.flock")], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    t0 = time.monotonic()
    with build_lock(tmp_path / "tag"):
        waited = time.monotonic() - t0
    holder.wait(10)
    assert waited > 0.5 and "waiting for another process's kernel build" in capsys.readouterr().err
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys; f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.LOCK_EX); os.kill(os.getpid(), 9)"),
        str(tmp_path / "tag.flock")])
    holder.wait(10)                                 # killed while holding it: the OS released it
    with build_lock(tmp_path / "tag"):
        pass
