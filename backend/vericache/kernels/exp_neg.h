// exp(x) for x <= 0, the same bits in every build: a scalar reference and its AVX-512 / AVX2 forms
// (the same IEEE operations in the same order). Shared by the attention op and the row ops.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace vc_exp {

// exp(x) for x <= 0 in plain IEEE steps (Cephes' expf polynomial, ~1 ulp), the same in every build.
inline float exp_neg(float x) {
  x = std::max(x, -87.0f);
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;   // round(x / ln 2)
  float r = std::fma(n, -0.693359375f, x);
  r = std::fma(n, 2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = std::fma(p, r, 1.3981999507e-3f);
  p = std::fma(p, r, 8.3334519073e-3f);
  p = std::fma(p, r, 4.1665795894e-2f);
  p = std::fma(p, r, 1.6666665459e-1f);
  p = std::fma(p, r, 5.0000001201e-1f);
  const float y = std::fma(p, r * r, r) + 1.0f;
  const int32_t bits = ((int32_t)n + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return y * scale;
}

#if defined(__AVX512F__)
// exp_neg on 16 lanes: the same IEEE operations in the same order, so the same bits; y * 2^n as one
// `vscalefps` (n is an integer >= -126: 2^n is the normal float the scalar code builds from bits, and both
// round the one product; checked for every float x <= 0, -inf included).
inline __m512 exp_neg_512(__m512 x) {
  const auto c = [](float f) { return _mm512_set1_ps(f); };
  x = _mm512_max_ps(x, c(-87.0f));
  const __m512 n = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(x, c(1.44269504088896341f)), c(12582912.0f)),
                                 c(12582912.0f));
  __m512 r = _mm512_fmadd_ps(n, c(-0.693359375f), x);
  r = _mm512_fmadd_ps(n, c(2.12194440e-4f), r);
  __m512 p = c(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, c(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, c(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, c(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, c(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, c(5.0000001201e-1f));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), c(1.0f));
  return _mm512_scalef_ps(y, n);
}
#elif defined(__AVX2__) && defined(__FMA__)
// exp_neg on 8 lanes (AVX2): the same IEEE operations in the same order, so the same bits.
inline __m256 exp_neg_256(__m256 x) {
  const auto c = [](float f) { return _mm256_set1_ps(f); };
  x = _mm256_max_ps(x, c(-87.0f));
  const __m256 n = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(x, c(1.44269504088896341f)), c(12582912.0f)),
                                 c(12582912.0f));
  __m256 r = _mm256_fmadd_ps(n, c(-0.693359375f), x);
  r = _mm256_fmadd_ps(n, c(2.12194440e-4f), r);
  __m256 p = c(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, c(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, c(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, c(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, c(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, c(5.0000001201e-1f));
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), c(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}
#endif

// x[i] = exp_neg(x[i]) for i < n, 16 or 8 lanes at a time where the build has them (the same bits)
inline void exp_neg_all(float* x, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(x + i, exp_neg_512(_mm512_loadu_ps(x + i)));
  if (i < n) {   // the last n - i lanes (the others read as 0 and are not stored)
    const __mmask16 k = (__mmask16)((1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(x + i, k, exp_neg_512(_mm512_maskz_loadu_ps(k, x + i)));
    return;
  }
#elif defined(__AVX2__) && defined(__FMA__)
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, exp_neg_256(_mm256_loadu_ps(x + i)));
#endif
  for (; i < n; ++i) x[i] = exp_neg(x[i]);
}

}  // namespace vc_exp
