"""``vericache triton-server``: start a real ``tritonserver`` on our model repository.

It uses ``tritonserver`` from PATH, or the one inside the ``nvidia-pytriton`` wheel (which runs on
CPU). What the wheel's Python backend needs, each learned the hard way:
- the stub built for the running Python copied next to ``libtriton_python.so``;
- ``LD_LIBRARY_PATH`` naming the wheel's ``nvidia_pytriton.libs`` and the directory of libpython;
- the stub ignores PYTHONPATH: the model's ``EXECUTION_ENV_PATH`` parameter points it at this
  interpreter's environment (a virtual environment) so ``import vericache`` works;
- bound to 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

DEFAULT_REPOSITORY = Path(__file__).resolve().parents[3] / "model_repository"



def pytriton_dir() -> str:
    """The installed nvidia-pytriton package's directory (it carries tritonserver and its stubs)."""
    path = sys.modules["pytriton"].__file__
    if path is None:
        raise FileNotFoundError("nvidia-pytriton has no package directory (a namespace package?)")
    return str(Path(path).parent)

def find_tritonserver() -> tuple[Path, Path | None]:
    """(tritonserver binary, the pytriton 'tritonserver' folder or None for a system install)."""
    on_path = shutil.which("tritonserver")
    if on_path:
        return Path(on_path), None
    try:
        import pytriton  # noqa: F401 - only to locate the wheel
    except ImportError:
        raise FileNotFoundError("no tritonserver on PATH and nvidia-pytriton is not installed "
                                "(pip install 'vericache[triton]')") from None
    root = Path(pytriton_dir()) / "tritonserver"
    binary = root / "bin" / "tritonserver"
    if not binary.exists():
        raise FileNotFoundError(f"tritonserver not found in the nvidia-pytriton wheel at {binary}")
    return binary, root


def prepare(repository: Path, workdir: Path) -> tuple[list[str], dict[str, str], Path]:
    """Backend directory, patched model repository and environment for the server process."""
    binary, root = find_tritonserver()
    env = dict(os.environ)
    args = [str(binary)]
    repo = workdir / "model_repository"
    shutil.copytree(repository, repo, dirs_exist_ok=True)
    venv = sys.prefix  # the stub runs inside this interpreter's environment
    for cfg in repo.glob("*/config.pbtxt"):
        text = cfg.read_text()
        if "EXECUTION_ENV_PATH" not in text:
            text += f'\nparameters: {{ key: "EXECUTION_ENV_PATH", value: {{ string_value: "{venv}" }} }}\n'
        cfg.write_text(text)
    if root is not None:
        backends = workdir / "backends"
        python_backend = backends / "python"
        python_backend.mkdir(parents=True, exist_ok=True)
        for f in (root / "backends" / "python").iterdir():
            dst = python_backend / f.name
            if not dst.exists():
                (shutil.copytree if f.is_dir() else shutil.copy2)(f, dst)
        ver = f"{sys.version_info.major}.{sys.version_info.minor}"
        stub = root / "python_backend_stubs" / ver / "triton_python_backend_stub"
        if not stub.exists():
            raise FileNotFoundError(f"the nvidia-pytriton wheel has no Python backend stub for Python {ver} ({stub})")
        shutil.copy2(stub, python_backend / "triton_python_backend_stub")
        libs = Path(pytriton_dir()).parent / "nvidia_pytriton.libs"
        ld = [str(libs), sysconfig.get_config_var("LIBDIR") or "", env.get("LD_LIBRARY_PATH", "")]
        env["LD_LIBRARY_PATH"] = ":".join(p for p in ld if p)
        args.append(f"--backend-directory={backends}")
    return args, env, repo


def start_triton(repository: Path | str = DEFAULT_REPOSITORY, host: str = "127.0.0.1", http_port: int = 8000,
                 grpc_port: int = 8001, metrics_port: int = 8002, workdir: Path | None = None,
                 log_file=None) -> subprocess.Popen:
    workdir = Path(workdir or tempfile.mkdtemp(prefix="vericache-triton-"))
    args, env, repo = prepare(Path(repository), workdir)
    args += [f"--model-repository={repo}", f"--http-port={http_port}", f"--grpc-port={grpc_port}",
             f"--metrics-port={metrics_port}", f"--http-address={host}", f"--grpc-address={host}",
             f"--metrics-address={host}", "--log-verbose=0"]
    # its own process group, so stop_triton also ends the Python backend stubs it spawned
    return subprocess.Popen(args, env=env, stdout=log_file or subprocess.DEVNULL, stderr=subprocess.STDOUT,
                            start_new_session=True)


def stop_triton(proc: subprocess.Popen, timeout: float = 40.0) -> None:
    """Terminate the server and everything in its process group (model stubs included)."""
    import signal

    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            os.killpg(proc.pid, signal.SIGKILL)  # stragglers (stubs) after a clean server exit
        except (subprocess.TimeoutExpired, ProcessLookupError):
            continue
        return
