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
from pathlib import Path

from setuptools import setup

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
    """(ext_modules, cmdclass) compiling both kernels per ISA into ``vericache/kernels/prebuilt/``."""
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:   # an isolated build (plain `pip install .`): a wheel that compiles at first use, as a checkout
        print("setup.py: torch is not importable here, so this wheel carries no compiled kernels (they compile at "
              "first use); `make wheel` (pip wheel --no-build-isolation) builds one that does", file=sys.stderr)
        return [], {}
    # kernels/__init__ and linear_op import the CPU-feature reader and the layouts by their names (they need
    # nothing but the standard library): registered under those names first, the imports find them without
    # vericache/__init__
    sys.modules.setdefault("vericache.kernels.cpu", kernel_module("cpu"))
    sys.modules.setdefault("vericache.kernels.layouts", kernel_module("layouts"))
    sys.modules["vericache.kernels.layouts"].check_headers()   # the numbers both sides pass by position agree
    kernels, linear_op, prebuilt = (kernel_module(n) for n in ("__init__", "linear_op", "prebuilt"))
    HERE, PACKED_CFLAGS, PACKED_SOURCES = kernels.HERE, kernels.PACKED_CFLAGS, kernels.PACKED_SOURCES
    ISA_FLAGS, compile_linear = linear_op.ISA_FLAGS, linear_op.compile_linear
    packed_module_name, write_manifest = prebuilt.packed_module_name, prebuilt.write_manifest

    isas = [i for i in os.environ.get("VERICACHE_WHEEL_ISAS", ",".join(ISA_FLAGS)).split(",") if i]
    unknown = sorted(set(isas) - set(ISA_FLAGS))
    if unknown:
        raise SystemExit(f"VERICACHE_WHEEL_ISAS names {unknown}; the variants are {', '.join(ISA_FLAGS)}")
    cpp = [str(s.relative_to(ROOT)) for s in PACKED_SOURCES if s.suffix == ".cpp"]
    modules = [CppExtension(f"vericache.kernels.prebuilt.{packed_module_name(isa)}", cpp,
                            include_dirs=[str(HERE)], extra_link_args=["-fopenmp", "-s"],
                            # the build at first use's flags (-g0: no debug info, 24 MB -> 0.7 MB; same code)
                            extra_compile_args=PACKED_CFLAGS + ISA_FLAGS[isa] + ["-g0"]) for isa in isas]

    class BuildKernels(BuildExtension):
        """Each extension in its own temp folder (they share sources: one object path would serve four
        ISAs), then the linear op per ISA and the manifest beside them."""

        def build_extension(self, ext):
            temp = self.build_temp
            self.build_temp = os.path.join(temp, ext.name)
            try:
                super().build_extension(ext)
            finally:
                self.build_temp = temp

        def run(self):
            super().run()
            folder = Path(self.build_lib) / "vericache" / "kernels" / "prebuilt"
            folder.mkdir(parents=True, exist_ok=True)
            files = {}
            for isa, ext in zip(isas, modules):
                files[f"packed-{isa}"] = Path(self.get_ext_filename(ext.name)).name
                files[f"linear-{isa}"] = compile_linear(isa, folder / f"linear-{isa}.so").name
            write_manifest(folder, files)

    return modules, {"build_ext": BuildKernels}


ext_modules, cmdclass = kernel_build() if BUILDS_KERNELS else ([], {})
setup(ext_modules=ext_modules, cmdclass=cmdclass)
