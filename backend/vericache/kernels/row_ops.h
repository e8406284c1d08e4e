// Row-wise ops of the exact CPU forward: RMSNorm and SiLU(gate) x up, one row at a time, each output
// one fixed sequence of IEEE operations (explicit fma, a fixed 16-lane sum, exp_neg.h's exp), so the
// AVX-512, AVX2 and portable builds give the same bits and a row's result never depends on the rows
// beside it. Both the PyTorch module's CPU path and the native step (step.cpp) call these, so the two
// agree bit for bit.
#pragma once
#include <cmath>
#include <cstdint>

#include "exp_neg.h"

namespace vc_rows {

using namespace vc_exp;

// sum over j of x[j]^2: lane l (of 16) takes j = l, l + 16, ... by fma in j order (a short last step
// reads zeros), then lanes fold in halves: l + (l + 8), + 4, + 2, + 1.
inline float sum_squares(const float* x, int64_t K) {
  alignas(64) float tail[16] = {};
  const int64_t full = K - K % 16;
  for (int64_t j = full; j < K; ++j) tail[j - full] = x[j];
#if defined(__AVX512F__)
  __m512 a = _mm512_setzero_ps();
  for (int64_t j = 0; j < full; j += 16) {
    const __m512 v = _mm512_loadu_ps(x + j);
    a = _mm512_fmadd_ps(v, v, a);
  }
  if (full < K) a = _mm512_fmadd_ps(_mm512_load_ps(tail), _mm512_load_ps(tail), a);
  const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();   // lanes 0-7, 8-15
  for (int64_t j = 0; j < full; j += 16) {
    const __m256 v0 = _mm256_loadu_ps(x + j), v1 = _mm256_loadu_ps(x + j + 8);
    a0 = _mm256_fmadd_ps(v0, v0, a0);
    a1 = _mm256_fmadd_ps(v1, v1, a1);
  }
  if (full < K) {
    const __m256 v0 = _mm256_load_ps(tail), v1 = _mm256_load_ps(tail + 8);
    a0 = _mm256_fmadd_ps(v0, v0, a0);
    a1 = _mm256_fmadd_ps(v1, v1, a1);
  }
  const __m256 s8 = _mm256_add_ps(a0, a1);
#endif
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
#else
  float a[16] = {};
  for (int64_t j = 0; j < full; j += 16)
    for (int l = 0; l < 16; ++l) a[l] = std::fma(x[j + l], x[j + l], a[l]);
  if (full < K)
    for (int l = 0; l < 16; ++l) a[l] = std::fma(tail[l], tail[l], a[l]);
  for (int w = 8; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) a[l] = a[l] + a[l + w];
  return a[0];
#endif
}

// y[j] = w[j] * (x[j] * r), r = 1 / sqrt(mean(x^2) + eps): one row of K.
inline void rms_norm_row(const float* x, const float* w, int64_t K, float eps, float* y) {
  const float r = 1.0f / std::sqrt(sum_squares(x, K) / (float)K + eps);
  for (int64_t j = 0; j < K; ++j) y[j] = w[j] * (x[j] * r);   // two roundings, vectorised or not
}

// SiLU(g) = g / (1 + e^-g), written with e = exp(-|g|) <= 1 (exp_neg's range):
// g >= 0: g / (1 + e); g < 0: (g * e) / (1 + e).
inline float silu(float g) {
  const float e = exp_neg(-std::fabs(g));
  return (g < 0.f ? g * e : g) / (1.0f + e);
}

// y[j] = SiLU(gu[j]) * gu[F + j] for j < F: one row of the fused gate/up output.
inline void silu_mul_row(const float* gu, int64_t F, float* y) {
  int64_t j = 0;
#if defined(__AVX512F__)
  for (; j + 16 <= F; j += 16) {
    const __m512 g = _mm512_loadu_ps(gu + j);
    const __m512 e = exp_neg_512(_mm512_castsi512_ps(                     // -|g|
        _mm512_or_si512(_mm512_castps_si512(g), _mm512_set1_epi32((int)0x80000000u))));
    const __mmask16 neg = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
    const __m512 num = _mm512_mask_mul_ps(g, neg, g, e);
    const __m512 s = _mm512_div_ps(num, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
    _mm512_storeu_ps(y + j, _mm512_mul_ps(s, _mm512_loadu_ps(gu + F + j)));
  }
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (; j + 8 <= F; j += 8) {
    const __m256 g = _mm256_loadu_ps(gu + j);
    const __m256 e = exp_neg_256(_mm256_or_ps(g, sign));                  // -|g|
    const __m256 neg = _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_LT_OQ);
    const __m256 num = _mm256_blendv_ps(g, _mm256_mul_ps(g, e), neg);
    const __m256 s = _mm256_div_ps(num, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
    _mm256_storeu_ps(y + j, _mm256_mul_ps(s, _mm256_loadu_ps(gu + F + j)));
  }
#endif
  for (; j < F; ++j) y[j] = silu(gu[j]) * gu[F + j];
}

}  // namespace vc_rows
