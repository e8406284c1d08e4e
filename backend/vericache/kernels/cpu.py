"""What this CPU can run: its feature flags, read once from /proc/cpuinfo, and the kernel builds they
allow. The one reader and the one choice: every kernel build (its flags, ``ISA_FLAGS``; its cache
digest), which builds this CPU runs (``supported_isas``, ``best_isa``; the packed kernels' module for
each, ``PACKED_VARIANT``), and the benches' CPU name."""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path


def _first_line(key: str) -> str:
    path = Path("/proc/cpuinfo")
    if not path.exists():
        return ""
    return next((ln for ln in path.read_text().splitlines() if ln.startswith(key)), "")


@functools.cache
def flags_line() -> str:
    """/proc/cpuinfo's first "flags" line as written ("" where there is none): hashed into build tags."""
    return _first_line("flags")


def model_name() -> str:
    """The CPU's model name ("AMD EPYC" ...; "" where /proc/cpuinfo says none), named beside every figure."""
    return _first_line("model name").partition(":")[2].strip()


def cpu_flags() -> frozenset[str]:
    """The flags themselves ("avx2", "avx512_vnni", "amx_int8" ...)."""
    return frozenset(flags_line().split(":", 1)[-1].split())


# Linux's arch_prctl: a process asks once for the AMX tile data state before its first tile instruction
_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA = 158, 0x1023, 18


@functools.cache
def amx_permitted() -> bool:
    """Whether this process may use AMX tiles: the CPU has them and Linux grants the request (asked once a
    process; an older kernel or a sandbox refuses it, and the amx build is then not offered)."""
    if not {"amx_tile", "amx_int8"} <= cpu_flags():
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0


# The builds of the native kernels, one per instruction set, and the CPU flags each needs
_AVX512 = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"]
ISA_FLAGS = {
    # the q8 numerics' many-row calls as AMX tile multiplies (same bits; the tiles need the kernel's leave)
    "amx": [*_AVX512, "-mavx512vnni", "-mamx-tile", "-mamx-int8"],
    "avx512vnni": [*_AVX512, "-mavx512vnni"],   # the q8 numerics' integer dots in one `dpbusd` (same bits)
    "avx512": _AVX512,
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "portable": ["-march=x86-64", "-mtune=generic"],
}
ISA_CPU_FLAGS = {"amx": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "f16c", "avx512_vnni", "amx_tile",
                          "amx_int8"},
                 "avx512vnni": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "f16c", "avx512_vnni"},
                 "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "f16c"},
                 "avx2": {"avx2", "fma", "f16c"}, "portable": set()}
# The packed kernels' code has AVX-512, AVX2 and portable paths only (VNNI and AMX are the linear op's
# integer dots; g++ 12 compiled the three from the same instructions, checked with objdump): an amx or
# avx512vnni CPU runs the avx512 module, built once, not three times.
PACKED_VARIANT = {"amx": "avx512", "avx512vnni": "avx512", "avx512": "avx512", "avx2": "avx2", "portable": "portable"}


def supported_isas() -> list[str]:
    """The variants this CPU can run, widest first (an AVX-512 machine runs the AVX2 build too; the amx
    build only where Linux also grants this process the tiles' state)."""
    flags = cpu_flags()
    return [isa for isa in ISA_FLAGS if ISA_CPU_FLAGS[isa] <= flags and (isa != "amx" or amx_permitted())]


@functools.cache
def best_isa() -> str:
    """$VERICACHE_ISA when set (``avx2`` times the AVX2 build on an AVX-512 machine), else the widest;
    read once per process (every attention call asks)."""
    forced = os.environ.get("VERICACHE_ISA")
    if forced:
        if forced not in supported_isas():
            raise ValueError(f"VERICACHE_ISA={forced!r}: this CPU runs {', '.join(supported_isas())}")
        return forced
    return supported_isas()[0]
