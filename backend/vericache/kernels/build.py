"""How every native kernel is built: one path, the machine's g++ per instruction set (issue 54).

A kernel is a ``Library``: its sources (``.cpp`` files compiled, headers only hashed) and its compile
and link flags; the linear op's (plain C, loaded with ctypes: ``linear_op.linear_library``) and the
packed kernels' (a Python extension module linking torch: ``kernels.packed_library``) differ only in
those. ``compile_library`` compiles each ``.cpp`` to an object, one compiler a core at once, links them,
and renames the result into place, so no reader ever loads a half-written library. Builds made at
first use go to the kernel cache (``cached_library``: the file's name carries a digest of the sources,
the flags, the CPU's flags and torch's version, so a build is reused only where it fits); a wheel's
builds go to its ``prebuilt/`` folder (``setup.py``), by the same function with the same flags (or as
a copy of the cache's build with the same digest: ``place_library``).

Builds that survive being stopped (issue 43): a cache entry is built under ``fcntl.flock`` on
``<file>.flock``, which the OS releases when its holder dies, whatever killed it (SIGTERM from ``docker
stop``, SIGKILL); the next builder removes what a dead one left (``<file>.<pid>.build/``) and builds
again. A start waiting for another live process's build says so on stderr. A cached file that does not
load (overwritten, say) is built again, once, instead of failing the start.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TypeVar

from vericache.kernels.cpu import flags_line

WAIT_NOTICE_S = 10.0   # waiting longer than this for another builder is said on stderr
COMPILER = "g++"
T = TypeVar("T")


@dataclass(frozen=True)
class Library:
    """A shared library to build: ``name`` (its file's stem; an extension module's import name),
    ``sources`` (``.cpp`` compiled, the rest hashed), flags for each compile and for the link."""

    name: str
    sources: tuple[Path, ...]
    cflags: tuple[str, ...]
    ldflags: tuple[str, ...] = ()

    def digest(self) -> str:
        """12 hex digits over what decides the build's bits and loadability: the sources' bytes, the flags,
        this CPU's flags and torch's version."""
        import torch

        h = hashlib.sha1(repr((self.name, self.cflags, self.ldflags, flags_line(), torch.__version__)).encode())
        for s in self.sources:
            h.update(s.name.encode() + b"\0" + s.read_bytes())
        return h.hexdigest()[:12]


def torch_extension_flags(name: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(compile, link) flags for a Python extension module ``name`` that links this environment's torch:
    torch's and Python's headers, torch's libraries (what torch's own extension builder passes)."""
    from torch.utils.cpp_extension import include_paths, library_paths

    includes = [*include_paths(), sysconfig.get_paths()["include"]]
    cflags = (f"-DTORCH_EXTENSION_NAME={name}", "-DTORCH_API_INCLUDE_EXTENSION_H", "-std=c++20",
              *(f"-isystem{p}" for p in includes))
    ldflags = (*(f"-L{p}" for p in library_paths()), "-lc10", "-ltorch_cpu", "-ltorch", "-ltorch_python")
    return cflags, ldflags


def compile_library(lib: Library, out: Path, verbose: bool = False) -> Path:
    """Build ``lib`` into ``out``: every ``.cpp`` compiled in a scratch folder beside it (as many
    compilers at once as cores), linked, renamed into place. No compiler: a RuntimeError saying what to
    do; a failed compile: a RuntimeError with the compiler's message."""
    from vericache.kernels.layouts import check_headers

    check_headers()   # the numbers both sides pass by position agree (else a RuntimeError naming them)
    if shutil.which(COMPILER) is None:
        raise RuntimeError(f"{lib.name} is not packaged here and there is no C++ compiler ({COMPILER}) to build "
                           "it: install a wheel built with its kernels (make wheel) or g++")
    scratch = out.with_name(f"{out.name}.{os.getpid()}.build")
    scratch.mkdir(parents=True, exist_ok=True)
    try:
        cpp = [s for s in lib.sources if s.suffix == ".cpp"]
        objects = [scratch / f"{s.stem}.o" for s in cpp]
        compiles = [[COMPILER, *lib.cflags, "-fPIC", "-c", str(s), "-o", str(o)] for s, o in zip(cpp, objects)]
        _run_all(compiles, os.cpu_count() or 1, lib.name, verbose)
        linked = scratch / out.name
        _run_all([[COMPILER, "-shared", "-s", *map(str, objects), *lib.ldflags, "-o", str(linked)]], 1, lib.name,
                 verbose)
        linked.rename(out)   # atomic: a reader sees the whole library or none
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return out


def _run_all(commands: list[list[str]], jobs: int, name: str, verbose: bool) -> None:
    """Run ``commands``, ``jobs`` at a time; the first failure raises with its stderr (the rest finish)."""
    failed: list[str] = []
    pending = list(commands)
    running: list[subprocess.Popen] = []
    while pending or running:
        while pending and len(running) < jobs:
            cmd = pending.pop(0)
            if verbose:
                print(" ".join(cmd), file=sys.stderr, flush=True)
            running.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        proc = running.pop(0)
        _, err = proc.communicate()
        if proc.returncode:
            failed.append(err[-4000:])
    if failed:
        raise RuntimeError(f"building {name} failed:\n{failed[0]}")


def place_library(lib: Library, out: Path, verbose: bool = False) -> Path:
    """``lib`` built into ``out`` (a wheel's ``prebuilt/``): a copy of the kernel cache's build where it
    holds one with the same digest (the same sources and flags: the same bytes), else compiled."""
    cached = cached_file(lib)
    if not cached.exists():
        return compile_library(lib, out, verbose)
    if verbose:
        print(f"{out.name}: the kernel cache's build {cached}", file=sys.stderr, flush=True)
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    shutil.copyfile(cached, tmp)
    tmp.rename(out)
    return out


def kernel_cache() -> Path:
    """Where builds made at first use live: ``$VERICACHE_KERNEL_DIR``, else ~/.cache/vericache/kernels."""
    return Path(os.environ.get("VERICACHE_KERNEL_DIR", Path.home() / ".cache" / "vericache" / "kernels"))


def cached_file(lib: Library) -> Path:
    return kernel_cache() / f"{lib.name}-{lib.digest()}.so"


@contextlib.contextmanager
def build_lock(target: Path, poll_s: float = 0.2) -> Iterator[None]:
    """Hold ``target``'s build for this process (an OS lock on ``<target>.flock``, released on death)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_name(target.name + ".flock"), "a") as f:
        waited, said = 0.0, False
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if waited >= WAIT_NOTICE_S and not said:
                    print(f"vericache: waiting for another process's kernel build of {target} (a live builder "
                          f"holds {f.name}; a stopped one would have released it)", file=sys.stderr, flush=True)
                    said = True
                time.sleep(poll_s)
                waited += poll_s
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def load_cached(lib: Library, load: Callable[[Path], T], verbose: bool = False) -> T:
    """``load`` of ``lib``'s file in the kernel cache, built first if it is not there (under
    ``build_lock``; scratch folders a stopped builder left are removed). A file that does not load is
    removed and built once more; a second failure is raised."""
    out = cached_file(lib)
    with build_lock(out):
        for stale in out.parent.glob(f"{out.name}.*.build"):   # a dead builder's (the lock says none is alive)
            shutil.rmtree(stale, ignore_errors=True)
        if not out.exists():
            compile_library(lib, out, verbose)
        try:
            return load(out)
        except (ImportError, OSError) as exc:   # not a library (the file overwritten, say)
            print(f"vericache: the kernel build {out} does not load ({exc}); building it again", file=sys.stderr,
                  flush=True)
            out.unlink(missing_ok=True)
            compile_library(lib, out, verbose)
            return load(out)


def import_extension(path: Path, name: str) -> ModuleType:
    """The Python extension module ``name`` built at ``path`` (torch imported first: it links torch)."""
    import torch  # noqa: F401  (the extension's symbols come from libtorch)

    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path} is not a loadable extension module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
