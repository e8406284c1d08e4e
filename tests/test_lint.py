"""Lint and types in the suite (issue 54, item 3): ruff with the project's rules (pyproject.toml's
[tool.ruff]) over every Python file, and mypy (pyproject.toml's [tool.mypy]) over the library's typed
packages. Both are the real tools, pinned in the dev extras; each test also shows once that it fails
on a file with the kind of fault it exists for."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ["backend", "gateway", "tests", "model_repository", "setup.py"]


def tool(name: str) -> str:
    path = Path(sys.executable).with_name(name)
    if not path.exists():
        pytest.fail(f"{name} is not installed in this venv: pip install -e '.[dev]' (make test does)")
    return str(path)


def run(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), cwd=cwd, capture_output=True, text=True, timeout=600)


def test_ruff_finds_nothing(tmp_path):
    done = run(tool("ruff"), "check", "--output-format", "concise", *SOURCES)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    bad = tmp_path / "bad.py"
    bad.write_text("import os\nimport sys\n\n\ndef f():\n    return undefined_name\n")
    caught = run(tool("ruff"), "check", "--config", str(ROOT / "pyproject.toml"), "--output-format", "concise",
                 str(bad))
    assert caught.returncode == 1 and "F401" in caught.stdout and "F821" in caught.stdout


def test_mypy_finds_nothing_in_the_typed_packages(tmp_path):
    done = run(tool("mypy"))   # files and strictness: pyproject.toml's [tool.mypy]
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    bad = tmp_path / "bad.py"
    bad.write_text("def length(x: list[int]) -> int:\n    return x\n")
    caught = run(tool("mypy"), "--config-file", str(ROOT / "pyproject.toml"), str(bad), cwd=tmp_path)
    assert caught.returncode == 1 and "Incompatible return value" in caught.stdout
    # the engine, kv and drafting packages are strict: an unannotated function there is an error
    probe = tmp_path / "strict" / "vericache" / "engine"
    probe.mkdir(parents=True)
    for init in (probe / "__init__.py", probe.parent / "__init__.py"):
        init.write_text("")
    (probe / "probe.py").write_text("def f(x):\n    return x\n")
    caught = run(tool("mypy"), "--config-file", str(ROOT / "pyproject.toml"), "vericache/engine/probe.py",
                 cwd=tmp_path / "strict")
    assert caught.returncode == 1 and "no-untyped-def" in caught.stdout, caught.stdout
