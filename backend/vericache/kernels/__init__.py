"""Native kernels: the package's own builds where it carries them (a wheel from ``make wheel``:
``prebuilt.py``), else compiled on first use (and by ``make install``) with the machine's g++.

- ``packed_kernels()``: ``packed_attention.cpp``, the forward's attention: one call per layer for
  every sequence of a step and all its parts, reading dense (fp32/fp16/bf16) and quantized parts as
  stored (``quant_format.h``); ``step.cpp``: the row ops (``row_ops.h``: RMSNorm, SiLU x up) and every
  decoder layer of a step in one call (``model/native_step.py``); ``guide_select.cpp``, a guided store's trades
  (``drafting/guide.py``). Built without ``-ffast-math`` and
  with ``-ffp-contract=off``, so its results are the same bits in every build: AVX-512, AVX2 (what an
  AMD EPYC without AVX-512 runs) and portable (baseline x86-64), the ISAs of ``linear_op``. Built with
  torch's C++ extension tooling into ``~/.cache/vericache/kernels/<tag>`` (the tag covers the CPU
  flags, torch version, flags and sources: a build is only reused where it fits), under a lock the OS
  releases if the builder is stopped (``build.py``).
- ``linear_op.linear_op()``: ``linear.cpp`` (+ ``linear_q8.cpp``), the batch-invariant linear over
  GGUF blocks, plain C built by g++ per ISA (``linear_op.py`` says how).

``python -m vericache.kernels`` builds them ahead of time.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
from pathlib import Path

import torch

from vericache.kernels.cpu import flags_line

HERE = Path(__file__).parent
PACKED_SOURCES = [HERE / "packed_attention.cpp", HERE / "step.cpp", HERE / "guide_select.cpp", HERE / "bindings.cpp",
                  HERE / "step.h", HERE / "quant_format.h",
                  HERE / "exp_neg.h", HERE / "row_ops.h", HERE / "layouts.h"]
# exact, reproducible IEEE arithmetic: explicit fma only, no reassociation
PACKED_CFLAGS = ["-O3", "-fopenmp", "-ffp-contract=off", "-fno-math-errno"]


def _build_dir(cflags: list[str], sources: list[Path]) -> Path:
    flags = flags_line()
    text = "".join(s.read_bytes().hex() for s in sources)
    tag = hashlib.sha1(f"{flags}|{torch.__version__}|{cflags}|{text}".encode()).hexdigest()[:12]
    root = Path(os.environ.get("VERICACHE_KERNEL_DIR", Path.home() / ".cache" / "vericache" / "kernels"))
    path = root / tag
    path.mkdir(parents=True, exist_ok=True)
    return path


def load_extension(name: str, sources: list[Path], cflags: list[str], verbose: bool = False):
    """Build (or find built) and import the torch extension ``name`` from ``sources`` (``.cpp`` compiled,
    headers hashed into the tag), in its tagged directory under the stop-proof lock (``build.py``)."""
    from torch.utils.cpp_extension import load

    try:  # torch runs `ninja` from PATH; the PyPI package's binary works where the venv is not on PATH
        import ninja

        bin_dir = getattr(ninja, "BIN_DIR", None)
        if bin_dir and bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass
    from vericache.kernels.build import load_guarded
    from vericache.kernels.layouts import check_headers

    check_headers()   # the numbers both sides pass by position agree (else a RuntimeError naming them)
    cpp = [str(s) for s in sources if s.suffix == ".cpp"]
    build = _build_dir(cflags, sources)
    try:
        return load_guarded(build, lambda: load(name=name, sources=cpp, build_directory=str(build), extra_cflags=cflags,
                                                extra_ldflags=["-fopenmp"], extra_include_paths=[str(HERE)],
                                                verbose=verbose))
    except (ImportError, OSError, RuntimeError) as exc:
        compiler = os.environ.get("CXX", "c++")
        if shutil.which(compiler) is None:
            raise RuntimeError(f"{name} is not packaged here (vericache.kernels.prebuilt) and there is no C++ compiler "
                               f"({compiler}) to build it: install a wheel built with its kernels (make wheel) or g++"
                               ) from exc
        raise


def packed_kernels(isa: str | None = None, verbose: bool = False):
    """The packed attention op built for ``isa`` ("amx", "avx512vnni", "avx512", "avx2" or "portable": baseline x86-64, no
    AVX); default ``linear_op.best_isa()``, the widest this CPU runs (``VERICACHE_ISA`` overrides)."""
    from vericache.kernels.linear_op import ISA_FLAGS, best_isa

    isa = isa or best_isa()
    if isa not in ISA_FLAGS:
        raise ValueError(f"unknown ISA {isa!r}; choose one of {', '.join(ISA_FLAGS)}")
    return _packed_build(isa, verbose)


@functools.cache
def _packed_build(isa: str, verbose: bool):
    """The package's build for ``isa`` (``prebuilt``), else one built here at first use."""
    from vericache.kernels.linear_op import ISA_FLAGS
    from vericache.kernels.prebuilt import import_packed, packed_module_name, prebuilt_file

    packaged = prebuilt_file("packed", isa)
    if packaged is not None:
        return import_packed(packaged, isa)
    return load_extension(packed_module_name(isa), PACKED_SOURCES, PACKED_CFLAGS + ISA_FLAGS[isa], verbose)
