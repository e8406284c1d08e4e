"""Native kernels: the package's own builds where it carries them (a wheel from ``make wheel``:
``prebuilt.py``), else compiled on first use (and by ``make install``) with the machine's g++.

- ``packed_kernels()``: ``packed_attention.cpp``, the forward's attention: one call per layer for
  every sequence of a step and all its parts, reading dense (fp32/fp16/bf16) and quantized parts as
  stored (``quant_format.h``); ``step.cpp``: the row ops (``row_ops.h``: RMSNorm, SiLU x up) and every
  decoder layer of a step in one call (``model/native_step.py``); ``guide_select.cpp``, a guided store's trades
  (``drafting/guide.py``); ``bindings.cpp`` makes them a Python module linking torch. Built without
  ``-ffast-math`` and with ``-ffp-contract=off``, so its results are the same bits in every build: AMX,
  AVX-512 (VNNI), AVX2 (what an AMD EPYC without AVX-512 runs) and portable (baseline x86-64), the ISAs
  of ``linear_op``.
- ``linear_op.linear_op()``: ``linear.cpp`` (+ ``linear_q8.cpp``), the batch-invariant linear over
  GGUF blocks, plain C loaded with ctypes (``linear_op.py`` says how).

Both are built the one way ``build.py`` says (g++ per ISA, into ``~/.cache/vericache/kernels``, under a
lock the OS releases if the builder is stopped), differing only in their sources and flags.

``python -m vericache.kernels`` builds them ahead of time.
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType

from vericache.kernels.build import Library, import_extension, load_cached, torch_extension_flags
from vericache.kernels.cpu import ISA_FLAGS, PACKED_VARIANT, best_isa

HERE = Path(__file__).parent
PACKED_SOURCES = [HERE / "packed_attention.cpp", HERE / "step.cpp", HERE / "guide_select.cpp", HERE / "bindings.cpp",
                  HERE / "step.h", HERE / "quant_format.h",
                  HERE / "exp_neg.h", HERE / "int_scores.h", HERE / "row_ops.h", HERE / "layouts.h"]
# exact, reproducible IEEE arithmetic: explicit fma only, no reassociation
PACKED_CFLAGS = ["-O3", "-fopenmp", "-ffp-contract=off", "-fno-math-errno"]


def extension_library(name: str, sources: list[Path], cflags: list[str]) -> Library:
    """The Python extension module ``name`` (linking torch) from ``sources`` with ``cflags``."""
    torch_cflags, torch_ldflags = torch_extension_flags(name)
    return Library(name, tuple(sources), (*cflags, *torch_cflags), ("-fopenmp", *torch_ldflags))


def packed_library(isa: str) -> Library:
    """The packed kernels' extension module an ``isa`` CPU runs (its ``PACKED_VARIANT``'s flags,
    ``cpu.ISA_FLAGS``)."""
    from vericache.kernels.prebuilt import packed_module_name

    variant = PACKED_VARIANT[isa]
    return extension_library(packed_module_name(variant), PACKED_SOURCES, PACKED_CFLAGS + ISA_FLAGS[variant])


def load_extension(name: str, sources: list[Path], cflags: list[str], verbose: bool = False) -> ModuleType:
    """Build (or find built) in the kernel cache and import the extension module ``name`` (``build.py``)."""
    return load_cached(extension_library(name, sources, cflags), lambda path: import_extension(path, name), verbose)


def packed_kernels(isa: str | None = None, verbose: bool = False):
    """The packed kernels an ``isa`` CPU runs ("amx", "avx512vnni", "avx512", "avx2" or "portable": baseline x86-64,
    no AVX; ``PACKED_VARIANT``); default ``cpu.best_isa()``, the widest this CPU runs (``VERICACHE_ISA``
    overrides)."""
    isa = isa or best_isa()
    if isa not in ISA_FLAGS:
        raise ValueError(f"unknown ISA {isa!r}; choose one of {', '.join(ISA_FLAGS)}")
    return _packed_build(PACKED_VARIANT[isa], verbose)


@functools.cache
def _packed_build(variant: str, verbose: bool):
    """The package's build of the ``variant`` module (``prebuilt``), else one built here at first use."""
    from vericache.kernels.prebuilt import packed_module_name, prebuilt_file

    packaged = prebuilt_file("packed", variant)
    if packaged is not None:
        return import_extension(packaged, packed_module_name(variant))
    return load_cached(packed_library(variant), lambda path: import_extension(path, packed_module_name(variant)),
                       verbose)
