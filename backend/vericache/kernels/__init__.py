"""Native kernels, compiled on first use (and by ``make install``) with the machine's g++.

``cpu_kernels()`` builds ``quant_attention.cpp`` with torch's C++ extension tooling into
``~/.cache/vericache/kernels/<cpu+torch tag>`` (``-march=native``: a build is only reused on the
same CPU flags and torch version) and returns the loaded module. ``python -m vericache.kernels``
builds it ahead of time.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("quant_attention.cpp")
# -ffast-math lets glibc vectorize expf; the kernel uses finite sentinels, never infinities
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math"]


def _build_dir() -> Path:
    flags = ""
    if Path("/proc/cpuinfo").exists():
        flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
    tag = hashlib.sha1(f"{flags}|{torch.__version__}|{CFLAGS}|{SOURCE.read_bytes().hex()}".encode()).hexdigest()[:12]
    root = Path(os.environ.get("VERICACHE_KERNEL_DIR", Path.home() / ".cache" / "vericache" / "kernels"))
    path = root / tag
    path.mkdir(parents=True, exist_ok=True)
    return path


@functools.cache
def cpu_kernels(verbose: bool = False):
    """The compiled CPU kernel module (built once per machine, then loaded from the cache)."""
    from torch.utils.cpp_extension import load

    try:  # torch runs `ninja` from PATH; the PyPI package's binary works where the venv is not on PATH
        import ninja

        bin_dir = getattr(ninja, "BIN_DIR", None)
        if bin_dir and bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass
    return load(name="vericache_quant_attention", sources=[str(SOURCE)], build_directory=str(_build_dir()),
                extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"], verbose=verbose)
