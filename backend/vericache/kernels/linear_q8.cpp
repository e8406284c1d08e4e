// The draft rows' linear: y[M, N] ~= x[M, K] W^T (+ bias) with free numerics, on the same stored blocks
// as the exact op (no weight copy).
//
// A draft is only a proposal that the exact forward verifies, so its matmuls may be approximate, as
// llama.cpp's are: each row of x is quantized per block of 32 to int8 codes a with one fp32 scale dx
// (dx = max|x| / 127), and each weight block's codes q meet them in integer dot products:
//   Q4_1 (w = dw q + mw):   dw dx sum(q a) + mw dx sum(a)
//   Q4_0 (w = dw (q - 8)):  dw (dx sum(q a) - 8 dx sum(a))
//   Q8_0 (w = dw q):        dw dx sum(q a)
// AVX2 (the AVX-512 build runs it too): 32 codes x 32 activations in one `maddubs` (u8 x s8 pairs to
// int16: 15 * 127 * 2 and 128 * 127 * 2 stay below 32767, no saturation) and one `madd` to int32, as
// ggml's vec_dot kernels do; the portable build sums the same integers into the same 8 lanes in
// scalar code, so every build gives the same bits. Formats without
// an integer path here return -2 and the caller runs the exact op.
#include <vector>
#include <omp.h>

#include "gguf_blocks.h"

namespace {

using namespace vc_gguf;

// One row of x -> int8 codes [K], per block of 32: scale dx and dx * sum(codes).
void quantize_row(const float* x, int64_t K, int8_t* q, float* d, float* ds) {
  for (int64_t b = 0; b < K / 32; ++b) {
    const float* xb = x + 32 * b;
    float amax = 0.0f;
    for (int i = 0; i < 32; ++i) amax = std::fmax(amax, std::fabs(xb[i]));
    const float dx = amax / 127.0f, inv = dx > 0.0f ? 1.0f / dx : 0.0f;
    int sum = 0;
    for (int i = 0; i < 32; ++i) {
      const int v = (int)std::nearbyint(xb[i] * inv);
      q[32 * b + i] = (int8_t)v;
      sum += v;
    }
    d[b] = dx;
    ds[b] = dx * (float)sum;
  }
}

struct QRows {           // MT quantized rows of x
  const int8_t* q[4];
  const float* d[4];
  const float* ds[4];
};

#if defined(__AVX2__)
VC_INLINE __m256i codes(int F, const uint8_t* blk) {   // 32 codes: 4-bit (low nibbles, then high) or int8
  if (F == Q8_0) return _mm256_loadu_si256((const __m256i*)(blk + 2));
  const __m128i b = _mm_loadu_si128((const __m128i*)(blk + (F == Q4_1 ? 4 : 2)));
  const __m128i mask = _mm_set1_epi8(0x0f);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), mask), _mm_and_si128(b, mask));
}

VC_INLINE __m256 int_dot(int F, __m256i w, __m256i a) {   // 8 int32 partial sums of w . a, as fp32
  const __m256i u = F == Q8_0 ? _mm256_sign_epi8(w, w) : w;    // maddubs wants the unsigned side first
  const __m256i s = F == Q8_0 ? _mm256_sign_epi8(a, w) : a;
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}

VC_INLINE float hsum(__m256 v) {
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}
#endif

template <int F, int MT, int NT>
void q8_tile(const uint8_t* w, int64_t row_bytes, int64_t K, const QRows& x, const float* bias, int64_t n0,
             float* const* ys) {
  const int bb = block_bytes(F);
  float extra[MT][NT] = {};
#if defined(__AVX2__)
  __m256 acc[MT][NT];
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) acc[m][n] = _mm256_setzero_ps();
#else
  float acc[MT][NT][8] = {};   // the AVX2 lanes: lane l sums elements 4l..4l+3 of each block
#endif
  const char* ahead = (const char*)(w + (n0 + 2 * NT) * row_bytes);   // prefetch two tiles ahead
  const int64_t blocks = K / 32, per_block = (NT * row_bytes / 64 + blocks) / blocks;
  for (int64_t b = 0; b < blocks; ++b) {
    for (int64_t j = 0; j < per_block; ++j) __builtin_prefetch(ahead + (b * per_block + j) * 64);
    float dw[NT], mw[NT];
#if defined(__AVX2__)
    __m256i q[NT];
#endif
#pragma GCC unroll 8
    for (int n = 0; n < NT; ++n) {
      const uint8_t* blk = w + (n0 + n) * row_bytes + b * bb;
      dw[n] = rdh(blk);
      mw[n] = F == Q4_1 ? rdh(blk + 2) : 0.0f;
#if defined(__AVX2__)
      q[n] = codes(F, blk);
#endif
    }
#pragma GCC unroll 4
    for (int m = 0; m < MT; ++m) {
      const int8_t* a = x.q[m] + 32 * b;
      const float dx = x.d[m][b], ds = x.ds[m][b];
#if defined(__AVX2__)
      const __m256i av = _mm256_loadu_si256((const __m256i*)a);
#endif
#pragma GCC unroll 8
      for (int n = 0; n < NT; ++n) {
#if defined(__AVX2__)
        acc[m][n] = _mm256_fmadd_ps(int_dot(F, q[n], av), _mm256_set1_ps(dw[n] * dx), acc[m][n]);
#else
        const uint8_t* blk = w + (n0 + n) * row_bytes + b * bb;
        for (int l = 0; l < 8; ++l) {
          int s = 0;
          for (int i = 4 * l; i < 4 * l + 4; ++i) {
            const int c = F == Q8_0 ? (int)(int8_t)blk[2 + i]
                                    : ((blk[(F == Q4_1 ? 4 : 2) + i % 16] >> (4 * (i / 16))) & 0x0f);
            s += c * a[i];
          }
          acc[m][n][l] = std::fma((float)s, dw[n] * dx, acc[m][n][l]);
        }
#endif
        if (F == Q4_1) extra[m][n] += mw[n] * ds;
        if (F == Q4_0) extra[m][n] -= 8.0f * dw[n] * ds;
      }
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) {
#if defined(__AVX2__)
      const float s = hsum(acc[m][n]) + extra[m][n];
#else
      float t[8];
      for (int l = 0; l < 8; ++l) t[l] = acc[m][n][l];
      for (int h = 4; h >= 1; h /= 2)      // hsum's order: lanes i + i+4, i + i+2, 0 + 1
        for (int i = 0; i < h; ++i) t[i] = t[i] + t[i + h];
      const float s = t[0] + extra[m][n];
#endif
      ys[m][n0 + n] = bias ? s + bias[n0 + n] : s;
    }
}

template <int F>
void q8_rows(int mt, const uint8_t* w, int64_t row_bytes, int64_t K, const QRows& x, const float* bias,
             int64_t n0, int64_t nb, float* const* ys) {
  int64_t n = n0;
  for (; n + 4 <= n0 + nb; n += 4) {
    switch (mt) {
      case 1: q8_tile<F, 1, 4>(w, row_bytes, K, x, bias, n, ys); break;
      default: q8_tile<F, 2, 4>(w, row_bytes, K, x, bias, n, ys); break;
    }
  }
  for (; n < n0 + nb; ++n) {
    switch (mt) {
      case 1: q8_tile<F, 1, 1>(w, row_bytes, K, x, bias, n, ys); break;
      default: q8_tile<F, 2, 1>(w, row_bytes, K, x, bias, n, ys); break;
    }
  }
}

}  // namespace

extern "C" {

// Returns 0, -1 for bad arguments, -2 for a format without an integer path (the caller runs the exact op).
int vc_linear_q8(int fmt, const uint8_t* w, int64_t row_bytes, int64_t N, int64_t K, const float* x, int64_t ldx,
                 int64_t M, const float* bias, float* y, int64_t ldy, int n_threads) {
  if (fmt != Q4_0 && fmt != Q4_1 && fmt != Q8_0) return -2;
  if (K % 32 || ldx < K || ldy < N || M < 0) return -1;
  if (M == 0 || N == 0) return 0;
  const int64_t nblk = K / 32;
  std::vector<int8_t> q(M * K);
  std::vector<float> d(M * nblk), ds(M * nblk);
  for (int64_t m = 0; m < M; ++m) quantize_row(x + m * ldx, K, q.data() + m * K, d.data() + m * nblk, ds.data() + m * nblk);
  constexpr int64_t NB = 16;
  const int64_t items = (N + NB - 1) / NB;
#pragma omp parallel for schedule(dynamic, 1) num_threads(n_threads > 0 ? n_threads : omp_get_max_threads())
  for (int64_t it = 0; it < items; ++it) {
    const int64_t n0 = it * NB, nb = N - n0 < NB ? N - n0 : NB;
    for (int64_t m = 0; m < M; m += 2) {
      const int mt = M - m < 2 ? 1 : 2;
      QRows rows{};
      float* ys[2];
      for (int i = 0; i < mt; ++i) {
        rows.q[i] = q.data() + (m + i) * K;
        rows.d[i] = d.data() + (m + i) * nblk;
        rows.ds[i] = ds.data() + (m + i) * nblk;
        ys[i] = y + (m + i) * ldy;
      }
      switch (fmt) {
        case Q4_0: q8_rows<Q4_0>(mt, w, row_bytes, K, rows, bias, n0, nb, ys); break;
        case Q4_1: q8_rows<Q4_1>(mt, w, row_bytes, K, rows, bias, n0, nb, ys); break;
        default: q8_rows<Q8_0>(mt, w, row_bytes, K, rows, bias, n0, nb, ys); break;
      }
    }
  }
  return 0;
}

}  // extern "C"
