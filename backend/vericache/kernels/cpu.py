"""What this CPU can run: its feature flags, read once from /proc/cpuinfo. The one reader every kernel
build and ISA choice asks (``linear_op.supported_isas``, the extensions' build tags), and the benches'
CPU name."""

from __future__ import annotations

import ctypes
import functools
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
