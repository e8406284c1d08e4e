"""exp_neg.h: the attention's exp(x) for x <= 0 gives the scalar reference's bits in its vector forms, for
every float x <= 0 (2^31 values: -0 down to -inf, the clamp at -87 included), checked exhaustively in C++."""

import shutil
import subprocess
from pathlib import Path

import pytest

from vericache.kernels.cpu import cpu_flags

HEADER = Path(__file__).parents[1] / "backend" / "vericache" / "kernels" / "exp_neg.h"

# every float with the sign bit set, up to -inf, through the vector form against exp_neg's scalar steps
PROGRAM = r"""
#include "exp_neg.h"
#include <cstdio>
using namespace vc_exp;
int main() {
  long differ = 0;
  alignas(64) uint32_t in[16];
  alignas(64) float vec[16];
  for (uint64_t u = 0x80000000u; u <= 0xFF800000u; u += 16) {
    for (int i = 0; i < 16; ++i) in[i] = (uint32_t)std::min<uint64_t>(u + i, 0xFF800000u);
#if defined(__AVX512F__)
    _mm512_store_ps(vec, exp_neg_512(_mm512_castsi512_ps(_mm512_load_si512(in))));
#else
    for (int h = 0; h < 16; h += 8)
      _mm256_store_ps(vec + h, exp_neg_256(_mm256_castsi256_ps(_mm256_load_si256((const __m256i*)(in + h)))));
#endif
    for (int i = 0; i < 16; ++i) {
      float x, ref;
      std::memcpy(&x, in + i, 4);
      ref = exp_neg(x);
      if (std::memcmp(&ref, vec + i, 4) != 0) {
        printf("x=%08x scalar %a vector %a\n", in[i], ref, vec[i]);
        if (++differ == 3) break;
      }
    }
    if (differ == 3) break;
  }
  printf("differ %ld\n", differ);
  return differ != 0;
}
"""

BUILDS = {"avx512": (["-mavx512f", "-mavx512dq", "-mfma"], {"avx512f", "avx512dq", "fma"}),
          "avx2": (["-mavx2", "-mfma"], {"avx2", "fma"})}


def run_exhaustive(tmp_path: Path, header_text: str, build: str) -> subprocess.CompletedProcess:
    flags, needs = BUILDS[build]
    if not needs <= cpu_flags():
        pytest.skip(f"this CPU lacks {sorted(needs - cpu_flags())} for the {build} form")
    if shutil.which("g++") is None:
        pytest.skip("no g++")
    (tmp_path / "exp_neg.h").write_text(header_text)
    (tmp_path / "check.cpp").write_text(PROGRAM)
    exe = tmp_path / "check"
    subprocess.run(["g++", "-O3", "-std=c++17", "-ffp-contract=off", *flags, str(tmp_path / "check.cpp"), "-o",
                    str(exe)], check=True, capture_output=True)
    return subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("build", list(BUILDS))
def test_every_vector_form_gives_the_scalar_bits_for_every_negative_float(tmp_path, build):
    done = run_exhaustive(tmp_path, HEADER.read_text(), build)
    assert done.returncode == 0 and done.stdout.strip().endswith("differ 0"), done.stdout


def test_the_check_fails_a_vector_form_one_ulp_off(tmp_path):
    """A vector form whose last constant of the polynomial is one ulp off is caught."""
    build = "avx512" if BUILDS["avx512"][1] <= cpu_flags() else "avx2"
    lanes = "_mm512" if build == "avx512" else "_mm256"
    text = HEADER.read_text()
    good = f"p = {lanes}_fmadd_ps(p, r, c(5.0000001201e-1f));"
    assert good in text
    done = run_exhaustive(tmp_path, text.replace(good, f"p = {lanes}_fmadd_ps(p, r, c(5.0000007e-1f));"), build)
    assert done.returncode != 0 and "differ 0" not in done.stdout
