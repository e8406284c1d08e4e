"""Kernels compiled when the package is built (issue 52), so running needs no compiler.

A wheel (``make wheel``; ``setup.py``) carries, in ``vericache/kernels/prebuilt/``, every x86-64 variant
of both native kernels, compiled by the build machine's g++ exactly as a build at first use is
(``build.compile_library`` with ``kernels.packed_library`` and ``linear_op.linear_library``):

- ``linear-<isa>.so``: the linear op (plain C, loaded with ctypes);
- ``vericache_packed_attention_<isa>.<abi>.so``: the attention/step extension (built against torch's
  headers, so tied to the torch version that built it);
- ``manifest.json``: the torch version, a digest of the kernels' sources and the ISAs built.

At load the variant is chosen by the CPU's features exactly as for builds made here (``linear_op.
best_isa``). A packaged variant is used only where the manifest matches the running sources (an
editable checkout whose sources changed builds afresh) and, for the torch extension, the running
torch; everything else, and ``$VERICACHE_KERNEL_BUILD=jit`` (development), builds at first use into the
kernel cache as before (``kernels.load_extension``, ``linear_op._build``). Every build gives the same
bits (the kernels' arithmetic is fixed; ``tests/test_kernels_prebuilt.py`` compares a wheel's tokens
with the checkout's).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path

from vericache.kernels.cpu import PACKED_VARIANT

HERE = Path(__file__).parent
FOLDER = HERE / "prebuilt"
MANIFEST = "manifest.json"
KINDS = ("linear", "packed")
ENV = "VERICACHE_KERNEL_BUILD"      # "jit": ignore packaged builds (a developer changing the kernels)


def kernel_sources() -> list[Path]:
    """Every file the kernels are compiled from: the C++ sources and headers beside this module."""
    return sorted([*HERE.glob("*.cpp"), *HERE.glob("*.h")])


@functools.cache
def sources_digest() -> str:
    """sha256 over the kernels' sources (names and bytes): a packaged build fits only these sources. Read
    once a process (``origin`` is asked on every ``describe``, e.g. each ``/v1/models``)."""
    h = hashlib.sha256()
    for p in kernel_sources():
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def packed_module_name(isa: str) -> str:
    return f"vericache_packed_attention_{isa}"


def read_manifest(folder: Path = FOLDER) -> dict | None:
    path = folder / MANIFEST
    return json.loads(path.read_text()) if path.is_file() else None


def prebuilt_file(kind: str, isa: str, folder: Path = FOLDER) -> Path | None:
    """The packaged build of ``kind`` ("linear" or "packed") for ``isa``, or None where there is none
    that fits: no manifest, ``$VERICACHE_KERNEL_BUILD=jit``, sources changed since, or (the torch
    extension) another torch."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if os.environ.get(ENV, "") == "jit":
        return None
    manifest = read_manifest(folder)
    if manifest is None or manifest.get("sources") != sources_digest():
        return None
    if kind == "packed":
        import torch

        if manifest.get("torch") != torch.__version__:
            return None
    name = manifest.get("files", {}).get(f"{kind}-{isa}")
    return folder / name if name and (folder / name).is_file() else None


def origin(isa: str) -> str:
    """Where this process's kernels for ``isa`` come from: "prebuilt" (the package's) or "built here"."""
    packaged = prebuilt_file("linear", isa) and prebuilt_file("packed", PACKED_VARIANT[isa])
    return "prebuilt" if packaged else "built here"


def write_manifest(folder: Path, files: dict[str, str]) -> Path:
    """``manifest.json`` for the builds in ``folder`` (``files``: "<kind>-<isa>" -> file name)."""
    import torch

    path = folder / MANIFEST
    path.write_text(json.dumps({"torch": torch.__version__, "sources": sources_digest(), "files": files}, indent=1))
    return path
