"""Build hooks (everything else is in pyproject.toml): a wheel carries the native kernels compiled for
every x86-64 variant, so running it needs no compiler (issue 52; ``vericache/kernels/prebuilt.py`` says
how they are chosen at load).

The torch extension is compiled against the torch of the building environment, so a wheel is built
without build isolation, in an environment holding the torch it will run with: ``make wheel`` (``pip
wheel --no-build-isolation --no-deps . -w dist``). ``$VERICACHE_WHEEL_ISAS`` (comma-separated) builds
fewer variants (a test builds the one its CPU runs). Editable installs and metadata steps compile
nothing: a checkout builds its kernels at first use, as before.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).parent
BUILDS_KERNELS = any(c in sys.argv for c in ("bdist_wheel", "build_ext", "build")) and "editable_wheel" not in sys.argv


def kernel_build():
    """(ext_modules, cmdclass) compiling both kernels per ISA into ``vericache/kernels/prebuilt/``."""
    sys.path.insert(0, str(ROOT / "backend"))
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        raise SystemExit("vericache's wheel compiles its kernels against torch: build it without isolation in an "
                         "environment with torch installed (make wheel: pip wheel --no-build-isolation --no-deps .)")
    from vericache.kernels import HERE, PACKED_CFLAGS, PACKED_SOURCES
    from vericache.kernels.linear_op import ISA_FLAGS, compile_linear
    from vericache.kernels.prebuilt import packed_module_name, write_manifest

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
