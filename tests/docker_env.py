"""Whether the Docker tests can build and run images here: one answer for `make test`'s image step
(scripts/docker-test-images, run as a script) and for tests/test_docker.py (imported)."""

from __future__ import annotations

import shutil
import subprocess
import sys

# what building the images takes under Docker's data root on a clean machine: the build stages (~3.4 GB),
# gateway and Triton (1.8 + 2.1 GB unique), redis, prometheus and the base (0.7 GB), and room to unpack
NEEDS_FREE_BYTES = 10 << 30


def docker_ready() -> str | None:
    """Why the Docker tests cannot run here, or None."""
    if shutil.which("docker") is None:
        return "no docker CLI (scripts/system-deps installs docker.io for make test)"
    done = subprocess.run(["docker", "info", "--format", "{{.DockerRootDir}}"], capture_output=True, text=True)
    if done.returncode != 0:
        return f"no Docker daemon answers: {done.stderr.strip()[-300:]}"
    free = shutil.disk_usage(done.stdout.strip() or "/").free
    if free < NEEDS_FREE_BYTES:   # a build that fills the disk fails midway and leaves layers behind
        return (f"{free / 2**30:.1f} GiB free under Docker's data root {done.stdout.strip()}; building the images "
                f"needs {NEEDS_FREE_BYTES / 2**30:.0f} GiB")
    return None


if __name__ == "__main__":   # exit 0 when the images can be built here, else 1 with the reason on stdout
    reason = docker_ready()
    print(reason or "ready")
    sys.exit(1 if reason else 0)
