"""Build hooks (everything else is in pyproject.toml): a wheel carries the native kernels compiled for
every x86-64 variant, so running it needs no compiler (issue 52; ``vericache/kernels/prebuilt.py`` says
how they are chosen at load).

The torch extension is compiled against the torch of the building environment, so a wheel is built
without build isolation, in an environment holding the torch it will run with: ``make wheel`` (``pip
wheel --no-build-isolation --no-deps . -w dist``); an isolated build (a plain ``pip install .``) has no torch
and makes a wheel whose kernels compile at first use. ``$VERICACHE_WHEEL_ISAS`` (comma-separated) builds
fewer variants (a test builds the one its CPU runs). Editable installs and metadata steps compile
nothing: a checkout builds its kernels at first use, as before.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import sysconfig
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).parent
BUILDS_KERNELS = any(c in sys.argv for c in ("bdist_wheel", "build_ext", "build")) and "editable_wheel" not in sys.argv


def kernel_module(name: str):
    """``vericache/kernels/<name>.py`` loaded on its own: importing it through the package would run
    ``vericache/__init__`` and need every runtime dependency at build time (these need torch only)."""
    path = ROOT / "backend" / "vericache" / "kernels" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_vericache_build_{name.strip('_')}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


def kernel_build():
    """(distclass, cmdclass) compiling both kernels per ISA into ``vericache/kernels/prebuilt/``."""
    try:
        import torch  # noqa: F401  (the packed kernels link it)
    except ImportError:   # an isolated build (plain `pip install .`): a wheel that compiles at first use, as a checkout
        print("setup.py: torch is not importable here, so this wheel carries no compiled kernels (they compile at "
              "first use); `make wheel` (pip wheel --no-build-isolation) builds one that does", file=sys.stderr)
        return Distribution, {}
    # the kernels' modules import each other by their names (they need nothing but the standard library and
    # torch): registered under those names, in order, the imports find them without vericache/__init__
    for name in ("cpu", "layouts", "build", "prebuilt", "linear_op"):
        sys.modules.setdefault(f"vericache.kernels.{name}", kernel_module(name))
    cpu, linear_op, prebuilt, build = (sys.modules[f"vericache.kernels.{n}"] for n in ("cpu", "linear_op", "prebuilt",
                                                                                       "build"))
    kernels = kernel_module("__init__")
    isas = [i for i in os.environ.get("VERICACHE_WHEEL_ISAS", ",".join(cpu.ISA_FLAGS)).split(",") if i]
    unknown = sorted(set(isas) - set(cpu.ISA_FLAGS))
    if unknown:
        raise SystemExit(f"VERICACHE_WHEEL_ISAS names {unknown}; the variants are {', '.join(cpu.ISA_FLAGS)}")

    class BuildKernels(build_ext):
        """Both kernels per ISA, built as at first use (``build.place_library``: compiled, or the kernel cache's
        build of the same sources and flags), and the manifest."""

        def run(self):
            folder = Path(self.build_lib) / "vericache" / "kernels" / "prebuilt"
            folder.mkdir(parents=True, exist_ok=True)
            files = {}
            ext = sysconfig.get_config_var("EXT_SUFFIX")   # a module's file name as Python imports it
            for variant in dict.fromkeys(cpu.PACKED_VARIANT[isa] for isa in isas):   # each module once
                packed = kernels.packed_library(variant)
                files[f"packed-{variant}"] = build.place_library(packed, folder / f"{packed.name}{ext}",
                                                                 verbose=True).name
            for isa in isas:
                files[f"linear-{isa}"] = build.place_library(linear_op.linear_library(isa),
                                                             folder / f"linear-{isa}.so", verbose=True).name
            prebuilt.write_manifest(folder, files)

    class PlatformWheel(Distribution):
        """A wheel tagged for this platform and Python (it carries native code), though setuptools builds no
        extension of its own."""

        def has_ext_modules(self):
            return True

    return PlatformWheel, {"build_ext": BuildKernels}


distclass, cmdclass = kernel_build() if BUILDS_KERNELS else (Distribution, {})
setup(distclass=distclass, cmdclass=cmdclass)
