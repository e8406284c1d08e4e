"""Kernel builds that survive being stopped (issue 43).

torch's extension loader guards a build directory with a lock *file* (``FileBaton``: ``<dir>/lock``),
which a builder stopped mid-build (SIGTERM from ``docker stop`` or a supervisor, SIGKILL) leaves
behind: every later start then sleeps on it forever, without a word. Here a build directory is held
with ``fcntl.flock`` on ``<dir>.flock`` instead, which the OS releases when its holder dies, whatever
killed it; whoever holds it removes a baton no live builder owns, then lets torch build (or find the
build up to date). A build that does not load (a ``.so`` cut off mid-write) is built again from
scratch, once, instead of failing the start. A start waiting for another process's build says so on
stderr, with the directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

WAIT_NOTICE_S = 10.0   # waiting longer than this for another builder is said on stderr


@contextlib.contextmanager
def build_lock(build_dir: Path, poll_s: float = 0.2) -> Iterator[None]:
    """Hold ``build_dir`` for this process (an OS lock on ``<build_dir>.flock``, released on death)."""
    with open(build_dir.with_name(build_dir.name + ".flock"), "a") as f:
        waited, said = 0.0, False
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if waited >= WAIT_NOTICE_S and not said:
                    print(f"vericache: waiting for another process's kernel build in {build_dir} (a live builder "
                          f"holds {f.name}; a stopped one would have released it)", file=sys.stderr, flush=True)
                    said = True
                time.sleep(poll_s)
                waited += poll_s
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def load_guarded(build_dir: Path, load: Callable[[], object]):
    """``load()`` (torch's ``cpp_extension.load`` into ``build_dir``) under ``build_lock``: a stale baton is
    removed first; a build that fails (a cut-off object or ``.so``) is wiped and built once more, and a
    second failure is raised."""
    with build_lock(build_dir):
        (build_dir / "lock").unlink(missing_ok=True)   # torch's baton: no live builder holds it now
        try:
            return load()
        except (ImportError, OSError, RuntimeError) as exc:   # RuntimeError: a link over a cut-off object
            print(f"vericache: the kernel build in {build_dir} does not load ({exc}); building it again",
                  file=sys.stderr, flush=True)
            shutil.rmtree(build_dir, ignore_errors=True)
            build_dir.mkdir(parents=True, exist_ok=True)
            return load()
