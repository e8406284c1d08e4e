"""Kernel builds that survive interruption (``kernels/build.py``): a build stopped mid-way by SIGTERM or
SIGKILL leaves nothing that blocks the next one, which finishes in the same cache. The builds here go
through the kernels' own build path (``load_extension``, ``load_cached``) with a small pybind11 module
(a compile long enough to stop mid-way) or a plain library, so they take seconds, not the packed
kernels' minute."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vericache.kernels.build import build_lock

SOURCE = """#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <vector>
std::vector<int> squares(int n) { std::vector<int> v; for (int i = 0; i < n; ++i) v.push_back(i * i); return v; }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("squares", &squares); }
"""
BUILD = ("import sys; from pathlib import Path; from vericache.kernels import load_extension; "
         "m = load_extension('vc_build_test', [Path(sys.argv[1])], ['-O2']); print('built', sum(m.squares(4)))")

PLAIN_SOURCE = 'extern "C" int squares_sum(int n) { int s = 0; for (int i = 0; i < n; ++i) s += i * i; return s; }\n'
PLAIN_BUILD = ("import ctypes, sys; from pathlib import Path; from vericache.kernels.build import Library, load_cached; "
               "lib = Library('vc_build_test', (Path(sys.argv[1]),), ('-O2',)); "
               "print('built', load_cached(lib, lambda path: ctypes.CDLL(str(path))).squares_sum(4))")


def _start(kernel_dir: Path, source: Path, build: str = BUILD) -> subprocess.Popen:
    env = {**os.environ, "VERICACHE_KERNEL_DIR": str(kernel_dir)}
    return subprocess.Popen([sys.executable, "-c", build, str(source)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_build_stopped_midway_does_not_block_the_next(tmp_path, sig):
    source = tmp_path / "ext.cpp"
    source.write_text(SOURCE)
    kernels = tmp_path / "kernels"
    first = _start(kernels, source)
    end = time.monotonic() + 120
    while not any(kernels.glob("*.build")):         # the builder's scratch folder: the build has started
        assert first.poll() is None and time.monotonic() < end, first.communicate()
        time.sleep(0.05)
    time.sleep(0.5)                                 # the compiler is running
    os.killpg(first.pid, sig)                       # the builder and its compilers, as a stop would
    first.wait(30)
    assert any(kernels.glob("*.build")) and not any(kernels.glob("*.so"))   # a dead builder's leftovers, no library
    again = _start(kernels, source)
    out, err = again.communicate(timeout=300)
    assert again.returncode == 0 and out.strip() == "built 14", err[-2000:]
    assert not any(kernels.glob("*.build")) and len(list(kernels.glob("*.so"))) == 1


def test_a_library_that_does_not_load_is_built_again(tmp_path):
    """A cached file that is no library (overwritten, say: the builds themselves are renamed into place
    whole) is removed and built again, once, and says so. A plain library loaded by ctypes, as the linear
    op's is (the same ``load_cached``; no pybind11 headers, so each build takes a fraction of a second)."""
    source, kernels = tmp_path / "sums.cpp", tmp_path / "kernels"
    source.write_text(PLAIN_SOURCE)
    out, err = _start(kernels, source, PLAIN_BUILD).communicate(timeout=300)
    assert out.strip() == "built 14", err[-2000:]
    built = next(kernels.glob("vc_build_test-*.so"))
    built.write_bytes(b"not a shared library")
    out, err = _start(kernels, source, PLAIN_BUILD).communicate(timeout=300)
    assert out.strip() == "built 14" and "does not load" in err, err[-2000:]
    assert built.stat().st_size > 1000


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
