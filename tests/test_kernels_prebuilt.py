"""The kernels a wheel carries (issue 52, ``kernels/prebuilt.py``, ``setup.py``): which packaged build is
taken, and a real wheel built, installed into a fresh venv and run with no compiler reachable."""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from vericache.kernels import PACKED_VARIANT, prebuilt
from vericache.kernels.cpu import best_isa

ROOT = Path(__file__).resolve().parents[1]


def fake_packaged(folder: Path, isa: str, **manifest) -> None:
    """A folder laid out as a wheel's ``prebuilt/`` (the files' contents are not what is tested here)."""
    folder.mkdir(parents=True, exist_ok=True)
    files = {f"linear-{isa}": f"linear-{isa}.so", f"packed-{isa}": f"{prebuilt.packed_module_name(isa)}.so"}
    for name in files.values():
        (folder / name).write_bytes(b"\x7fELF")
    prebuilt.write_manifest(folder, files)
    if manifest:
        path = folder / prebuilt.MANIFEST
        path.write_text(json.dumps(json.loads(path.read_text()) | manifest))


def test_a_packaged_build_is_taken_only_where_it_fits(tmp_path, monkeypatch):
    monkeypatch.delenv(prebuilt.ENV, raising=False)
    assert prebuilt.prebuilt_file("linear", "avx2", tmp_path / "none") is None     # nothing packaged
    fits = tmp_path / "fits"
    fake_packaged(fits, "avx2")
    assert prebuilt.prebuilt_file("linear", "avx2", fits) == fits / "linear-avx2.so"
    assert prebuilt.prebuilt_file("packed", "avx2", fits).name == "vericache_packed_attention_avx2.so"
    assert prebuilt.prebuilt_file("linear", "avx512", fits) is None                 # that ISA not built
    monkeypatch.setenv(prebuilt.ENV, "jit")                                         # a developer's switch
    assert prebuilt.prebuilt_file("linear", "avx2", fits) is None
    monkeypatch.delenv(prebuilt.ENV)
    stale = tmp_path / "stale"
    fake_packaged(stale, "avx2", sources="0" * 64)                                  # sources changed since
    assert prebuilt.prebuilt_file("linear", "avx2", stale) is None
    other_torch = tmp_path / "torch"
    fake_packaged(other_torch, "avx2", torch="1.0.0")                               # the extension links torch
    assert prebuilt.prebuilt_file("linear", "avx2", other_torch) is not None
    assert prebuilt.prebuilt_file("packed", "avx2", other_torch) is None
    with pytest.raises(ValueError, match="'step'"):
        prebuilt.prebuilt_file("step", "avx2", fits)


def test_the_digest_covers_every_kernel_source():
    names = {p.name for p in prebuilt.kernel_sources()}
    assert {"packed_attention.cpp", "step.cpp", "linear.cpp", "linear_q8.cpp", "gguf_blocks.h", "quant_format.h"} <= names


GENERATE = """
import json, shutil, sys
import vericache
from vericache import LLM, SamplingParams
llm = LLM("tiny", mode=sys.argv[1])
out = llm.generate(["def fibonacci(n):"], SamplingParams(max_tokens=12))[0]
print(json.dumps({"file": vericache.__file__, "compiler": shutil.which("g++") or shutil.which("c++"),
                  "tokens": out.token_ids, "describe": llm.engine.describe()}))
"""


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory):
    """The checkout built into a wheel (this CPU's variant only, to keep the suite short: ``make wheel``
    builds all four) and installed into a fresh venv whose dependencies come from this one."""
    if shutil.which("g++") is None:
        pytest.skip("building the wheel compiles the kernels: no g++ here")
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        if (ROOT / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, src / rel)
    env = {**os.environ, "VERICACHE_WHEEL_ISAS": best_isa()}
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps", str(src),
                    "-w", str(tmp / "dist")], env=env, check=True, timeout=900)
    wheel = next((tmp / "dist").glob("vericache-*.whl"))
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    venv_site = next(venv.glob("lib/python*/site-packages"))
    (venv_site / "deps.pth").write_text(site.getsitepackages()[0] + "\n")   # torch & co., not our package
    subprocess.run([venv / "bin" / "python", "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                   check=True, timeout=300)
    bare = tmp / "bin"                  # PATH for the runs: the venv's python and nothing else (no g++, no c++)
    bare.mkdir()
    (bare / "python").symlink_to(venv / "bin" / "python")
    (tmp / "generate.py").write_text(GENERATE)
    return tmp, wheel, venv_site


def run_bare(tmp: Path, mode: str, **env) -> subprocess.CompletedProcess:
    home = tmp / f"home-{mode}-{len(env)}"
    home.mkdir()
    return subprocess.run([str(tmp / "venv" / "bin" / "python"), str(tmp / "generate.py"), mode], capture_output=True, text=True,
                          env={"PATH": str(tmp / "bin"), "HOME": str(home), **env}, timeout=300)


def test_the_wheel_carries_its_kernels_and_runs_without_a_compiler(wheel_venv):
    tmp, wheel, venv_site = wheel_venv
    isa = best_isa()
    names = zipfile.ZipFile(wheel).namelist()
    manifest = json.loads(zipfile.ZipFile(wheel).read("vericache/kernels/prebuilt/manifest.json"))
    assert set(manifest["files"]) == {f"linear-{isa}", f"packed-{PACKED_VARIANT[isa]}"}   # amx, vnni: avx512's module
    assert all(f"vericache/kernels/prebuilt/{f}" in names for f in manifest["files"].values())
    from vericache import LLM, SamplingParams

    for mode in ("full", "vericache"):
        done = run_bare(tmp, mode)
        assert done.returncode == 0, done.stderr[-3000:]
        got = json.loads(done.stdout.strip().splitlines()[-1])
        assert got["file"].startswith(str(venv_site)) and got["compiler"] is None
        assert got["describe"]["build"] == isa and got["describe"]["build_origin"] == "prebuilt"
        here = LLM("tiny", mode=mode).generate(["def fibonacci(n):"], SamplingParams(max_tokens=12))[0]
        assert got["tokens"] == here.token_ids                   # the wheel's build, the checkout's bits
        assert not any(tmp.glob(f"home-{mode}-0/**/kernels"))   # nothing written: no kernel cache made


def test_without_its_kernels_and_a_compiler_the_error_says_what_to_do(wheel_venv):
    """The negative control: told to build here (``VERICACHE_KERNEL_BUILD=jit``) with no compiler, the
    same venv fails with a clear error, so the run above did use the packaged build."""
    tmp, _, _ = wheel_venv
    done = run_bare(tmp, "full", VERICACHE_KERNEL_BUILD="jit")
    assert done.returncode != 0
    assert "no g++ to build it" in done.stderr or "no C++ compiler" in done.stderr, done.stderr[-3000:]
