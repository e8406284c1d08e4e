"""scripts/system-deps: nothing to do when every command is there; without root, a missing one stops it
at once with the exact command to run (as `make test` meets it before any test starts)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "system-deps"
PACKAGES = ROOT / "scripts" / "system-packages.txt"


def _run(target: str, packages: Path = PACKAGES, as_user: bool = False) -> subprocess.CompletedProcess:
    env = {**os.environ, "VERICACHE_SYSTEM_PACKAGES": str(packages)}
    cmd = ["bash", "-s", target]  # the script on stdin: an unprivileged user need not reach the checkout
    if as_user and os.geteuid() == 0:  # root (CI): run it as an unprivileged user
        cmd = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *cmd]
    with open(SCRIPT) as script:
        return subprocess.run(cmd, stdin=script, capture_output=True, text=True, env=env, timeout=60)


def test_every_listed_command_is_present_after_it_runs():
    """After `make test` ran it, nothing is missing (as root it installs what is; CI is root)."""
    r = _run("test")
    assert r.returncode == 0, r.stderr
    listed = [ln.split()[0] for ln in PACKAGES.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    assert listed and all(shutil.which(c) for c in listed), [c for c in listed if not shutil.which(c)]


def test_without_root_a_missing_command_stops_with_the_install_command():
    if os.geteuid() == 0 and shutil.which("setpriv") is None:
        pytest.fail("setpriv (util-linux) is needed to run the script unprivileged")
    folder = Path(tempfile.mkdtemp(prefix="vc-sysdeps-", dir="/tmp"))   # readable by the unprivileged user
    os.chmod(folder, 0o755)
    listed = folder / "packages.txt"
    listed.write_text("# command package needed-by\nvc-no-such-command  vc-no-such-package  test  a test\n"
                      "g++  g++  install  the kernels\n")
    os.chmod(listed, 0o644)
    r = _run("test", listed, as_user=True)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "missing system packages for 'make test': vc-no-such-package" in r.stderr
    assert "sudo apt-get update && sudo apt-get install -y --no-install-recommends vc-no-such-package" in r.stderr
    assert _run("install", listed, as_user=True).returncode == 0     # `install` does not need the test packages
    assert _run("bogus").returncode == 2
    shutil.rmtree(folder)
