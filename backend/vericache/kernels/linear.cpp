// The batch-invariant linear op over weights as stored: y[M, N] = x[M, K] W[N, K]^T (+ bias).
//
// W is read in its GGUF blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) or as F16, BF16, F32
// rows: row n of W is row_bytes bytes at w + n * row_bytes. Each block is dequantized to exactly the
// fp32 values the `gguf` package gives (its multiply and add; fused only where that rounds the same:
// see mul_add), then
//
//   y[m, n] = lane_sum(acc) (+ bias[n]),  acc[l] = fma(x[m, k], w[n, k], acc[l]) for k = l, l+16, ...
//
// 16 lanes in ascending k, then a fixed halving tree over the lanes. That is the whole contract:
// every output is one fixed sequence of IEEE operations over K whatever M is, which rows share a
// tile, how N is split between threads and how many threads there are (K is never split). The
// portable build (scalar, std::fma), the AVX2 build (two 8-lane registers) and the AVX-512 build
// (one 16-lane register) run the same sequence, so they give the same bits. Compiled with
// -ffp-contract=off and without -ffast-math so the compiler keeps it that way.
//
// Plain C ABI (ctypes): no torch headers, so each ISA variant builds in seconds.
#include <vector>
#include <omp.h>

#include "gguf_blocks.h"

namespace {

using namespace vc_gguf;
constexpr int LANES = 16;

// 16 fp32 lanes: one AVX-512 register, two AVX2 registers, or an array. Only fma and a fixed
// halving lane sum: the operations every build performs identically.
#if defined(__AVX512F__)
struct V16 {
  __m512 v;
  VC_INLINE static V16 zero() { return {_mm512_setzero_ps()}; }
  VC_INLINE static V16 load(const float* p) { return {_mm512_loadu_ps(p)}; }
  VC_INLINE void fma(const V16& a, const V16& b) { v = _mm512_fmadd_ps(a.v, b.v, v); }
  VC_INLINE void store(float* p) const { _mm512_storeu_ps(p, v); }
};
#elif defined(__AVX2__) && defined(__FMA__)
struct V16 {
  __m256 lo, hi;
  VC_INLINE static V16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  VC_INLINE static V16 load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  VC_INLINE void fma(const V16& a, const V16& b) { lo = _mm256_fmadd_ps(a.lo, b.lo, lo); hi = _mm256_fmadd_ps(a.hi, b.hi, hi); }
  VC_INLINE void store(float* p) const { _mm256_storeu_ps(p, lo); _mm256_storeu_ps(p + 8, hi); }
};
#else
struct V16 {
  float v[LANES];
  VC_INLINE static V16 zero() { V16 r; for (float& x : r.v) x = 0.0f; return r; }
  VC_INLINE static V16 load(const float* p) { V16 r; std::memcpy(r.v, p, sizeof r.v); return r; }
  VC_INLINE void fma(const V16& a, const V16& b) { for (int l = 0; l < LANES; ++l) v[l] = std::fma(a.v[l], b.v[l], v[l]); }
  VC_INLINE void store(float* p) const { std::memcpy(p, v, sizeof v); }
};
#endif

// Block k0 / 32 of a row (32 elements, Q4_0 / Q4_1 / Q8_0) straight into two V16 registers, the same
// values as dequant_block; other formats go through dequant_block and memory. mul_add(q, d, m) is
// d * q + m in one fma where dequant_block rounds twice: the same bits, because d * q is exact (an
// fp16 scale has 11 significant bits, a 4-bit code 4: the product fits fp32's 24), so the only
// rounding either way is the one of the sum.
#if defined(__AVX512F__)
VC_INLINE V16 cvt16(__m512i q) { return {_mm512_cvtepi32_ps(q)}; }
VC_INLINE V16 mul_add(V16 q, float d, const float* m) {
  if (m) return {_mm512_fmadd_ps(q.v, _mm512_set1_ps(d), _mm512_set1_ps(*m))};   // see mul_add's note
  return {_mm512_mul_ps(q.v, _mm512_set1_ps(d))};
}
VC_INLINE void nibbles(const uint8_t* qs, int bias, V16* lo, V16* hi) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)qs));
  const __m512i off = _mm512_set1_epi32(bias);
  *lo = cvt16(_mm512_sub_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x0f)), off));
  *hi = cvt16(_mm512_sub_epi32(_mm512_srli_epi32(b, 4), off));
}
VC_INLINE V16 bytes16(const uint8_t* q) { return cvt16(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)q))); }
#elif defined(__AVX2__) && defined(__FMA__)
VC_INLINE V16 mul_add(V16 q, float d, const float* m) {
  const __m256 dv = _mm256_set1_ps(d);
  if (m) {
    const __m256 mv = _mm256_set1_ps(*m);
    return {_mm256_fmadd_ps(q.lo, dv, mv), _mm256_fmadd_ps(q.hi, dv, mv)};
  }
  return {_mm256_mul_ps(q.lo, dv), _mm256_mul_ps(q.hi, dv)};
}
VC_INLINE void nibbles(const uint8_t* qs, int bias, V16* lo, V16* hi) {
  const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)qs));
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(qs + 8)));
  const __m256i mask = _mm256_set1_epi32(0x0f), off = _mm256_set1_epi32(bias);
  auto f = [&](__m256i v) { return _mm256_cvtepi32_ps(_mm256_sub_epi32(v, off)); };
  *lo = {f(_mm256_and_si256(a, mask)), f(_mm256_and_si256(b, mask))};
  *hi = {f(_mm256_srli_epi32(a, 4)), f(_mm256_srli_epi32(b, 4))};
}
VC_INLINE V16 bytes16(const uint8_t* q) {
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)q))),
          _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(q + 8))))};
}
#endif

VC_INLINE void load_block(int f, const uint8_t* b, V16* w0, V16* w1) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  if (f == Q4_1) {
    const float d = rdh(b), m = rdh(b + 2);
    nibbles(b + 4, 0, w0, w1);
    *w0 = mul_add(*w0, d, &m); *w1 = mul_add(*w1, d, &m);
    return;
  }
  if (f == Q4_0) {
    const float d = rdh(b);
    nibbles(b + 2, 8, w0, w1);
    *w0 = mul_add(*w0, d, nullptr); *w1 = mul_add(*w1, d, nullptr);
    return;
  }
  if (f == Q8_0) {   // q * d: multiplication commutes, so the same bits as gguf's x * d
    const float d = rdh(b);
    *w0 = mul_add(bytes16(b + 2), d, nullptr); *w1 = mul_add(bytes16(b + 18), d, nullptr);
    return;
  }
#endif
  alignas(64) float t[32];
  dequant_block(f, b, t);
  *w0 = V16::load(t); *w1 = V16::load(t + 16);
}

// The fixed lane sum: halve 16 -> 8 -> 4 -> 2 -> 1, lane i + lane i + w (shuffles in the vector
// builds, the same additions in the same order).
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
VC_INLINE float sum8(__m256 s8) {                       // lanes i + i+4, then i + i+2, then 0 + 1
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}
#endif
VC_INLINE float lane_sum(const V16& a) {
#if defined(__AVX512F__)
  const __m256 lo = _mm512_castps512_ps256(a.v);
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a.v), 1));
  return sum8(_mm256_add_ps(lo, hi));
#elif defined(__AVX2__) && defined(__FMA__)
  return sum8(_mm256_add_ps(a.lo, a.hi));
#else
  float t[LANES];
  a.store(t);
  for (int w = LANES / 2; w >= 1; w /= 2)
    for (int i = 0; i < w; ++i) t[i] = t[i] + t[i + w];
  return t[0];
#endif
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// AVX2: a V16's two halves are independent sums (lanes 0-7 see k % 16 < 8, lanes 8-15 the rest), so
// each half runs as its own pass over K with one register per output: twice the outputs per tile in
// AVX2's 16 registers. The halves meet in lane_sum's first step (lane i + lane i+8), as everywhere.
template <int MT, int NT>
void tile(const float* const* xs, const float* panel, int64_t kp, const float* bias, int64_t n0,
          float* const* ys) {
  __m256 halves[2][MT][NT];
  for (int h = 0; h < 2; ++h) {
    __m256 acc[MT][NT];
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m)
#pragma GCC unroll 8
      for (int n = 0; n < NT; ++n) acc[m][n] = _mm256_setzero_ps();
    for (int64_t k = 8 * h; k < kp; k += LANES) {
      __m256 w[NT];
#pragma GCC unroll 8
      for (int n = 0; n < NT; ++n) w[n] = _mm256_loadu_ps(panel + n * kp + k);
#pragma GCC unroll 8
      for (int m = 0; m < MT; ++m) {
        const __m256 x = _mm256_loadu_ps(xs[m] + k);
#pragma GCC unroll 8
        for (int n = 0; n < NT; ++n) acc[m][n] = _mm256_fmadd_ps(x, w[n], acc[m][n]);
      }
    }
    for (int m = 0; m < MT; ++m)
      for (int n = 0; n < NT; ++n) halves[h][m][n] = acc[m][n];
  }
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) {
      const float s = sum8(_mm256_add_ps(halves[0][m][n], halves[1][m][n]));
      ys[m][n0 + n] = bias ? s + bias[n0 + n] : s;
    }
}
#else
// MT rows of x times NT dequantized rows of W: acc[m][n] over k in 16-lane steps, in k order.
template <int MT, int NT>
void tile(const float* const* xs, const float* panel, int64_t kp, const float* bias, int64_t n0,
          float* const* ys) {
  V16 acc[MT][NT];
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) acc[m][n] = V16::zero();
  for (int64_t k = 0; k < kp; k += LANES) {
    V16 w[NT];
#pragma GCC unroll 8
    for (int n = 0; n < NT; ++n) w[n] = V16::load(panel + n * kp + k);
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m) {
      const V16 x = V16::load(xs[m] + k);
#pragma GCC unroll 8
      for (int n = 0; n < NT; ++n) acc[m][n].fma(x, w[n]);
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) {
      const float s = lane_sum(acc[m][n]);
      ys[m][n0 + n] = bias ? s + bias[n0 + n] : s;
    }
}
#endif

#ifndef VC_PF
#define VC_PF 2
#endif
constexpr int PF = VC_PF;   // tiles of weight rows prefetched ahead

// Few rows (decode): each 32-element block of NT weight rows is dequantized into registers and used
// by the MT rows at once, never stored; acc[m][n] sees k in the same order as ``tile``.
template <int MT, int NT>
void tile_direct(int f, const uint8_t* w, int64_t row_bytes, int64_t K, const float* const* xs, const float* bias,
                 int64_t n0, float* const* ys) {
  V16 acc[MT][NT];
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) acc[m][n] = V16::zero();
  const int bb = block_bytes(f);
  // Software prefetch of the weight rows PF tiles ahead, spread over this tile's steps: one core's
  // hardware prefetcher alone streamed Q8_0 rows from DRAM at ~4.5 GB/s.
  const char* ahead = (const char*)(w + (n0 + PF * NT) * row_bytes);
  const int64_t steps = K / 32, lines = (NT * row_bytes + 63) / 64, per_step = (lines + steps - 1) / steps;
  for (int64_t k = 0; k < K; k += 32) {
    for (int64_t j = 0; j < per_step; ++j) __builtin_prefetch(ahead + ((k / 32) * per_step + j) * 64);
    V16 w0[NT], w1[NT];
#pragma GCC unroll 8
    for (int n = 0; n < NT; ++n) load_block(f, w + (n0 + n) * row_bytes + (k / 32) * bb, &w0[n], &w1[n]);
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m) {
      const V16 x0 = V16::load(xs[m] + k), x1 = V16::load(xs[m] + k + 16);
#pragma GCC unroll 8
      for (int n = 0; n < NT; ++n) acc[m][n].fma(x0, w0[n]);
#pragma GCC unroll 8
      for (int n = 0; n < NT; ++n) acc[m][n].fma(x1, w1[n]);
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) {
      const float s = lane_sum(acc[m][n]);
      ys[m][n0 + n] = bias ? s + bias[n0 + n] : s;
    }
}

// Register tile of the panel path (a tile's shape changes which outputs share loads, never the bits).
#if defined(VC_MT) && defined(VC_NT)
constexpr int MT = VC_MT, NT = VC_NT;
#elif defined(__AVX512F__)
constexpr int MT = 4, NT = 4;
#elif defined(__AVX2__)
constexpr int MT = 4, NT = 3;
#else
constexpr int MT = 2, NT = 2;
#endif
constexpr int MC = 128;      // rows of x per pass (stay in L2 while every weight tile passes by)
constexpr int NB = 16;       // weight rows per work item (a multiple of NT)

template <int NTT>
void rows_tile(int mt, const float* const* xs, const float* panel, int64_t kp, const float* bias, int64_t n0,
               float* const* ys) {
  switch (mt) {
    case 1: tile<1, NTT>(xs, panel, kp, bias, n0, ys); break;
    case 2: tile<2 <= MT ? 2 : 1, NTT>(xs, panel, kp, bias, n0, ys); break;
    case 3: tile<3 <= MT ? 3 : 1, NTT>(xs, panel, kp, bias, n0, ys); break;
    default: tile<MT, NTT>(xs, panel, kp, bias, n0, ys); break;
  }
}

}  // namespace

extern "C" {

const char* vc_linear_isa() {
#if defined(__AMX_INT8__)
  return "amx";
#elif defined(__AVX512VNNI__)
  return "avx512vnni";
#elif defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "portable";
#endif
}

// out[i, :K] = row rows[i] of W dequantized (embedding lookups, tests, draft copies).
int vc_dequant_rows(int fmt, const uint8_t* w, int64_t row_bytes, int64_t K, const int64_t* rows, int64_t n_rows,
                    float* out) {
  if (fmt < 0 || fmt > Q6_K || K % block_elems(fmt)) return -1;
  for (int64_t i = 0; i < n_rows; ++i) dequant_row(fmt, w + rows[i] * row_bytes, K, K, out + i * K);
  return 0;
}

// y[m * ldy + n] = x[m * ldx + :K] . W[n] (+ bias[n]) for m < M, n < N. x rows must be readable up to
// K rounded up to 16 with zeros there (the caller pads when K % 16 != 0).
int vc_linear(int fmt, const uint8_t* w, int64_t row_bytes, int64_t N, int64_t K, const float* x, int64_t ldx,
              int64_t M, const float* bias, float* y, int64_t ldy, int n_threads) {
  if (fmt < 0 || fmt > Q6_K || K % block_elems(fmt) || ldx < K || ldy < N || M < 0) return -1;
  if (M == 0 || N == 0) return 0;
  const int64_t kp = (K + LANES - 1) / LANES * LANES;
  const int64_t items = (N + NB - 1) / NB;
  if (M <= 2 && (fmt == Q4_0 || fmt == Q4_1 || fmt == Q8_0)) {   // decode: no panel, blocks in registers
#pragma omp parallel for schedule(dynamic, 1) num_threads(n_threads > 0 ? n_threads : omp_get_max_threads())
    for (int64_t it = 0; it < items; ++it) {
      const int64_t n0 = it * NB, nb = N - n0 < NB ? N - n0 : NB;
      const float* xs[2] = {x, x + ldx};
      float* ys[2] = {y, y + ldy};
      int64_t n = n0;
      for (; n + 4 <= n0 + nb; n += 4) (M == 1 ? tile_direct<1, 4> : tile_direct<2, 4>)(fmt, w, row_bytes, K, xs, bias, n, ys);
      for (; n < n0 + nb; ++n) (M == 1 ? tile_direct<1, 1> : tile_direct<2, 1>)(fmt, w, row_bytes, K, xs, bias, n, ys);
    }
    return 0;
  }
  // dynamic: on a shared machine a descheduled thread's items go to the other (bits do not depend on
  // who computes an output)
  for (int64_t m0 = 0; m0 < M; m0 += MC) {
    const int64_t mc = M - m0 < MC ? M - m0 : MC;
#pragma omp parallel num_threads(n_threads > 0 ? n_threads : omp_get_max_threads())
    {
      std::vector<float> panel(NB * kp);
      const float* xs[MT];
      float* ys[MT];
#pragma omp for schedule(dynamic, 1)
      for (int64_t it = 0; it < items; ++it) {
        const int64_t n0 = it * NB, nb = N - n0 < NB ? N - n0 : NB;
        for (int64_t n = 0; n < nb; ++n) dequant_row(fmt, w + (n0 + n) * row_bytes, K, kp, panel.data() + n * kp);
        for (int64_t m = 0; m < mc; m += MT) {
          const int mt = (int)(mc - m < MT ? mc - m : MT);
          for (int i = 0; i < mt; ++i) {
            xs[i] = x + (m0 + m + i) * ldx;
            ys[i] = y + (m0 + m + i) * ldy;
          }
          int64_t n = 0;
          for (; n + NT <= nb; n += NT) rows_tile<NT>(mt, xs, panel.data() + n * kp, kp, bias, n0 + n, ys);
          for (; n < nb; ++n) rows_tile<1>(mt, xs, panel.data() + n * kp, kp, bias, n0 + n, ys);
        }
      }
    }
  }
  return 0;
}

}  // extern "C"
