// Attention for every sequence of a step in one call per layer, over all of each sequence's parts
// (a full-KV prefix with the chunk's own keys, a compressed store, a residual), merged by
// log-sum-exp inside the op.
//
// q: [Hq, N, D] fp32, any row/head strides, last dim contiguous: the forward's packed rows; sequence
//    s owns rows row0[s] .. row0[s] + T[s] - 1.
// A part p belongs to one sequence and holds n keys per KV head, dense ([Hkv, >= n, D], last dim
// contiguous; fp32, fp16 or bf16: half-size rows are widened to fp32 exactly, block by block) or
// quantized (quant_format.h). Causal parts (diag >= 0): query i of the chunk sees
// key j iff j <= i + diag (a full cache at start s: n = s + T, diag = s); other parts are seen whole.
// Returns out [N, Hq, D] fp32 (the forward's packed order: o_proj reads it as [N, Hq*D]).
//
// Batch invariance, by construction: work items are (part, KV head, split of SPLIT keys); key blocks
// and splits are fixed by key index, so a query row sees the same blocks whatever its chunk, its
// step's other sequences or the thread count; each row's arithmetic is a fixed sequence of IEEE
// operations (explicit fma, -ffp-contract=off, no -ffast-math, fixed-order lane sums, a polynomial
// exp), so the vectorised build and a portable one (-march=x86-64) give the same bits.
// GQA folded: a block of K/V is loaded once for the G query heads of its group and all T queries.
//
// A score is dot8(q, k) (see there): 8 lanes over the channels, so keys are read in their stored
// row layout; a decode row reads each key once, with no transposes, and a chunk's rows run the
// very same arithmetic (a row's bits never depend on how many rows share its block).
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "exp_neg.h"
#include "int_scores.h"
#include "layouts.h"
#include "quant_format.h"
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

using namespace vc_quant;
using namespace vc_exp;
constexpr int BLK = 64;          // keys per block (one score vector per query row)
constexpr int SPLIT = 8 * BLK;   // keys per work item
constexpr float NEG = -1e30f;    // "no key seen yet": finite, so exp(NEG - m) is exactly 0

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// lanes t < n of the 8 starting at key t0 (an all-ones mask) and zero beyond
inline __m256 first_lanes(int64_t n, int t0) {
  const __m256i idx = _mm256_add_epi32(_mm256_set1_epi32(t0), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)std::min<int64_t>(n, BLK)), idx));
}
#endif

// The sum of 64 lanes in a fixed tree (halving), so no build reorders it.
inline float lane_sum(float* x) {
  for (int w = BLK / 2; w >= 1; w /= 2) {
#pragma omp simd
    for (int l = 0; l < w; ++l) x[l] = x[l] + x[l + w];
  }
  return x[0];
}

// x[t] = exp(x[t] - m) for t < n, 0 beyond; returns their sum in lane_sum's order.
inline float exp_block(float* x, int64_t n, float m) {
#if defined(__AVX512F__)
  __m512 e[4];
  for (int c = 0; c < 4; ++c) {
    const int64_t left = n - 16 * c;
    const __mmask16 k = left >= 16 ? (__mmask16)0xffff : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1);
    e[c] = _mm512_maskz_mov_ps(k, exp_neg_512(_mm512_sub_ps(_mm512_load_ps(x + 16 * c), _mm512_set1_ps(m))));
    _mm512_store_ps(x + 16 * c, e[c]);
  }
  // lane_sum's tree: lanes l + l + 32, then + 16, 8, 4, 2, 1
  const __m512 b = _mm512_add_ps(_mm512_add_ps(e[0], e[2]), _mm512_add_ps(e[1], e[3]));
  const __m256 c8 = _mm256_add_ps(_mm512_castps512_ps256(b), _mm512_extractf32x8_ps(b, 1));
  const __m128 c4 = _mm_add_ps(_mm256_castps256_ps128(c8), _mm256_extractf128_ps(c8, 1));
  const __m128 c2 = _mm_add_ps(c4, _mm_movehl_ps(c4, c4));
  return _mm_cvtss_f32(_mm_add_ss(c2, _mm_movehdup_ps(c2)));
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 e[8];
  for (int c = 0; c < 8; ++c) {
    e[c] = _mm256_and_ps(first_lanes(n, 8 * c), exp_neg_256(_mm256_sub_ps(_mm256_load_ps(x + 8 * c), _mm256_set1_ps(m))));
    _mm256_store_ps(x + 8 * c, e[c]);
  }
  // lane_sum's tree on 8-lane chunks: chunk c + chunk c+4 (lanes l + l+32), then c + c+2 (+16), then + 8, 4, 2, 1
  const __m256 c8 = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(e[0], e[4]), _mm256_add_ps(e[2], e[6])),
                                  _mm256_add_ps(_mm256_add_ps(e[1], e[5]), _mm256_add_ps(e[3], e[7])));
  const __m128 c4 = _mm_add_ps(_mm256_castps256_ps128(c8), _mm256_extractf128_ps(c8, 1));
  const __m128 c2 = _mm_add_ps(c4, _mm_movehl_ps(c4, c4));
  return _mm_cvtss_f32(_mm_add_ss(c2, _mm_movehdup_ps(c2)));
#else
#pragma omp simd
  for (int t = 0; t < BLK; ++t) x[t] = t < n ? exp_neg(x[t] - m) : 0.f;
  alignas(64) float e[BLK];
  std::memcpy(e, x, sizeof(e));
  return lane_sum(e);
#endif
}

// The largest of x[t] for t < n (NEG if n = 0). Max is exact, so lanes may combine in any order.
inline float block_max(const float* x, int64_t n) {
#if defined(__AVX512F__)
  __m512 m = _mm512_set1_ps(NEG);
  for (int t = 0; t < BLK; t += 16) {
    const int64_t left = n - t;
    if (left <= 0) break;
    const __mmask16 k = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
    m = _mm512_mask_max_ps(m, k, m, _mm512_load_ps(x + t));
  }
  return _mm512_reduce_max_ps(m);
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 m = _mm256_set1_ps(NEG);
  for (int t = 0; t < BLK && t < n; t += 8)
    m = _mm256_max_ps(m, _mm256_blendv_ps(_mm256_set1_ps(NEG), _mm256_load_ps(x + t), first_lanes(n, t)));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  return _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
#else
  float m[8] = {NEG, NEG, NEG, NEG, NEG, NEG, NEG, NEG};
  for (int t = 0; t < BLK; ++t)
    if (t < n) m[t % 8] = std::max(m[t % 8], x[t]);
  for (int w = 4; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) m[l] = std::max(m[l], m[l + w]);
  return m[0];
#endif
}

enum Elt { F32, F16, BF16 };        // a dense part's element type

struct Part {
  int64_t seq, n, diag;
  bool dense;
  bool exact;                    // scores in the model's numerics (0: a drafter's part, fp32 scores)
  Elt elt;
  const char* k; const char* v; int64_t k_h, k_t, v_h, v_t;    // dense rows (byte strides)
  Format kf, vf;                                                 // quantized
  float* seen; int64_t seen_h;   // optional [Hq, >= n] fp32 output: each key's log-attention estimate
  // a scores-only call's rows' log-sum-exp (``row_lse``, at this part's sequence's first row; row i of
  // query head hq at [hq * lse_n + i]): seen then takes each key's largest log-probability, nothing else runs
  const float* seen_lse; int64_t lse_n;
  // optional q8qk codes of a dense part's keys and values (int_scores.h's layouts, kept by its cache):
  // keys < coded hold them, the op codes the rest of its keys there as it reads them
  int8_t *codes, *vcodes; float *dk, *dv; int32_t* csum; int64_t codes_h, dk_h, coded;
  int64_t* coded_out;            // where ``coded`` lives: advanced to n once the call coded every key
};

#if defined(__AVX2__) && defined(__F16C__)
// Channels j .. j + 7 of a stored row as fp32 (exact widening).
template <Elt E>
inline __m256 load8(const char* row, int64_t j) {
  if (E == F32) return _mm256_loadu_ps((const float*)row + j);
  const __m128i x = _mm_loadu_si128((const __m128i*)((const uint16_t*)row + j));
  if (E == F16) return _mm256_cvtph_ps(x);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(x), 16));
}
#endif

// dst[j] = src[j] as fp32 for j < D (a multiple of 8): exact conversions, so every build's bits agree.
inline void widen_row(Elt e, const char* src, int64_t D, float* __restrict dst) {
  const uint16_t* h = (const uint16_t*)src;
#if defined(__AVX512F__)
  if (D % 16 == 0) {
    for (int64_t j = 0; j < D; j += 16) {
      const __m256i x = _mm256_loadu_si256((const __m256i*)(h + j));
      _mm512_store_ps(dst + j, e == F16 ? _mm512_cvtph_ps(x) : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16)));
    }
    return;
  }
#endif
#if defined(__AVX2__) && defined(__F16C__)
  for (int64_t j = 0; j < D; j += 8) _mm256_store_ps(dst + j, e == F16 ? load8<F16>(src, j) : load8<BF16>(src, j));
#else
  for (int64_t j = 0; j < D; ++j) {
    if (e == F16) {
      dst[j] = half_to_float(at::Half(h[j], at::Half::from_bits()));
    } else {
      const uint32_t b = (uint32_t)h[j] << 16;
      std::memcpy(&dst[j], &b, 4);
    }
  }
#endif
}

struct Work { int64_t part, head, split; };

// Scores: s[x][t] = dot8(q[x], k[t]) for a tile of up to NR query rows and a block's keys, where
//   dot8(q, k) = ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7)),
//   a_l = q[j] * k[j] summed by fma in j order over j = l, l + 8, l + 16, ... < D, from +0.
// Values: acc[x] *= alpha[x] (the online softmax's rescale), then acc[x] = fma(e[x][t], v[t], acc[x])
// for t < vis[x] in t order, channels in lanes.
// Keys and values are read as stored (a row each, 8 channels a vector, half-size rows widened in
// registers): no transposes, one definition in every build. Each row's operations are the same
// whichever rows share its tile, so tiling (which reads each key and value once for NR rows) and
// the choice between reading the cache directly (few rows) or a widened copy (many rows) change no
// bits.
constexpr int NR = 4;

// f(std::integral_constant<int, n>{}) for a tile of n = 1 .. NR rows: each row count its own
// instantiation of a kernel, so its accumulators stay in registers.
template <typename F>
inline void with_tile_rows(int nr, F&& f) {
  switch (nr) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    default: return f(std::integral_constant<int, 4>{});
  }
}

// dot8, the reference every build equals.
inline float dot8_ref(const float* q, const float* k, int64_t D) {
  float a[8] = {};
  for (int64_t j = 0; j < D; j += 8)
    for (int l = 0; l < 8; ++l) a[l] = std::fma(q[j + l], k[j + l], a[l]);
  return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// dot8's lane trees for 8 keys at once (lanes[t]: key t's 8 lanes) -> the 8 scores. hadd adds
// neighbours (a0 + a1, a2 + a3, ...), twice; then each key's low and high 128-bit halves meet.
inline __m256 tree8x8(const __m256* lanes) {
  const __m256 h01 = _mm256_hadd_ps(lanes[0], lanes[1]), h23 = _mm256_hadd_ps(lanes[2], lanes[3]);
  const __m256 h45 = _mm256_hadd_ps(lanes[4], lanes[5]), h67 = _mm256_hadd_ps(lanes[6], lanes[7]);
  const __m256 f0 = _mm256_hadd_ps(h01, h23), f1 = _mm256_hadd_ps(h45, h67);   // [keys 0-3 low | keys 0-3 high]
  return _mm256_add_ps(_mm256_permute2f128_ps(f0, f1, 0x20), _mm256_permute2f128_ps(f0, f1, 0x31));
}

// NRT rows (q: 32-byte aligned fp32) x 8 keys -> s[x][0..7]; two keys at a time, so 2 NRT
// accumulator chains are in flight and each key vector serves every row.
template <Elt E, int NRT, int DFIX>
inline void scores8(const float* const* q, const char* const* krow, int64_t D_, float* const* s) {
  const int64_t D = DFIX ? DFIX : D_;
  __m256 lanes[NRT][8];
#pragma GCC unroll 4
  for (int t = 0; t < 8; t += 2) {
    __m256 a0[NRT], a1[NRT];
#pragma GCC unroll 4
    for (int x = 0; x < NRT; ++x) a0[x] = a1[x] = _mm256_setzero_ps();
#pragma GCC unroll 8
    for (int64_t j = 0; j < D; j += 8) {
      const __m256 k0 = load8<E>(krow[t], j), k1 = load8<E>(krow[t + 1], j);
#pragma GCC unroll 4
      for (int x = 0; x < NRT; ++x) {
        const __m256 qx = _mm256_load_ps(q[x] + j);
        a0[x] = _mm256_fmadd_ps(qx, k0, a0[x]);
        a1[x] = _mm256_fmadd_ps(qx, k1, a1[x]);
      }
    }
#pragma GCC unroll 4
    for (int x = 0; x < NRT; ++x) { lanes[x][t] = a0[x]; lanes[x][t + 1] = a1[x]; }
  }
#pragma GCC unroll 4
  for (int x = 0; x < NRT; ++x) _mm256_storeu_ps(s[x], tree8x8(lanes[x]));
}

// The value pass for NRT rows, W vectors of channels at a time (NRT * W accumulators in registers).
template <Elt E, int NRT, int DFIX>
inline void values(const float (*e)[BLK], const int64_t* vis, const char* const* vrow, const float* alpha,
                   int64_t D_, float* const* acc) {
  const int64_t D = DFIX ? DFIX : D_;
  constexpr int W = NRT == 1 ? 8 : NRT == 2 ? 4 : NRT == 3 ? 4 : 2;
  int64_t common = vis[0];
  for (int x = 1; x < NRT; ++x) common = std::min(common, vis[x]);
  for (int64_t j0 = 0; j0 < D; j0 += 8 * W) {
    const int w = (int)std::min<int64_t>(W, (D - j0) / 8);
    if (w != W) {                                  // a short last stretch (D not a multiple of 8 W)
      for (int x = 0; x < NRT; ++x)
        for (int c = 0; c < w; ++c) {
          float* a = acc[x] + j0 + 8 * c;
          __m256 y = _mm256_mul_ps(_mm256_loadu_ps(a), _mm256_set1_ps(alpha[x]));
          for (int64_t t = 0; t < vis[x]; ++t)
            y = _mm256_fmadd_ps(_mm256_set1_ps(e[x][t]), load8<E>(vrow[t], j0 + 8 * c), y);
          _mm256_storeu_ps(a, y);
        }
      continue;
    }
    __m256 a[NRT][W];
#pragma GCC unroll 4
    for (int x = 0; x < NRT; ++x)
#pragma GCC unroll 8
      for (int c = 0; c < W; ++c) a[x][c] = _mm256_mul_ps(_mm256_loadu_ps(acc[x] + j0 + 8 * c), _mm256_set1_ps(alpha[x]));
    for (int64_t t = 0; t < common; ++t) {
#pragma GCC unroll 8
      for (int c = 0; c < W; ++c) {
        const __m256 v = load8<E>(vrow[t], j0 + 8 * c);
#pragma GCC unroll 4
        for (int x = 0; x < NRT; ++x) a[x][c] = _mm256_fmadd_ps(_mm256_set1_ps(e[x][t]), v, a[x][c]);
      }
    }
#pragma GCC unroll 4
    for (int x = 0; x < NRT; ++x) {
      for (int64_t t = common; t < vis[x]; ++t)    // the causal diagonal: this row's own keys
#pragma GCC unroll 8
        for (int c = 0; c < W; ++c) a[x][c] = _mm256_fmadd_ps(_mm256_set1_ps(e[x][t]), load8<E>(vrow[t], j0 + 8 * c), a[x][c]);
#pragma GCC unroll 8
      for (int c = 0; c < W; ++c) _mm256_storeu_ps(acc[x] + j0 + 8 * c, a[x][c]);
    }
  }
}
#endif

#if defined(__AVX512F__)
// The AVX-512 build: the same per-lane chains as scores8 and values in vectors twice as wide, so its
// bits are every build's. Scores pair two query rows in a vector (row x's 8 lanes low, row x + 1's
// high) against a key's 8 channels broadcast to both halves, then run each row's lane trees as above
// (tree8x8); a tile's query pairs are interleaved once for the block's 64 keys. Values hold 16
// channels a vector. Twice the flops an instruction where verification's chunks are compute-bound.

// Channels j .. j + 7 of a stored row in both 256-bit halves (exact widening).
template <Elt E>
inline __m512 load8_twice(const char* row, int64_t j) {
  if (E == F32) return _mm512_broadcast_f32x8(_mm256_loadu_ps((const float*)row + j));
  const __m256i x = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)((const uint16_t*)row + j)));
  if (E == F16) return _mm512_cvtph_ps(x);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
}

// Channels j .. j + 15 of a stored row as fp32 (exact widening).
template <Elt E>
inline __m512 load16(const char* row, int64_t j) {
  if (E == F32) return _mm512_loadu_ps((const float*)row + j);
  const __m256i x = _mm256_loadu_si256((const __m256i*)((const uint16_t*)row + j));
  if (E == F16) return _mm512_cvtph_ps(x);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
}

// hadd on each 128-bit lane of two row pairs' vectors: [a0 + a1, a2 + a3, b0 + b1, b2 + b3] (an add is
// commutative in IEEE, so this is _mm256_hadd_ps's every bit, on 16 lanes, without its 3 uops).
inline __m512 hadd_lanes(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x88), _mm512_shuffle_ps(a, b, 0xDD));
}

// tree8x8 for two rows at once: z[t] = [row x's 8 lanes | row x + 1's 8 lanes] of key t -> [row x's 8
// scores | row x + 1's 8 scores], each the same adds in the same order as tree8x8.
inline __m512 tree8x8_pairs(const __m512* z) {
  const __m512 f0 = hadd_lanes(hadd_lanes(z[0], z[1]), hadd_lanes(z[2], z[3]));   // 128-bit lanes: [x: keys 0-3
  const __m512 f1 = hadd_lanes(hadd_lanes(z[4], z[5]), hadd_lanes(z[6], z[7]));   // low sums, x: high, x+1: low, x+1: high]
  // low sums + high sums: [x keys 0-3, x+1 keys 0-3, x keys 4-7, x+1 keys 4-7], then rows apart
  const __m512 sum = _mm512_add_ps(_mm512_shuffle_f32x4(f0, f1, 0x88), _mm512_shuffle_f32x4(f0, f1, 0xDD));
  return _mm512_shuffle_f32x4(sum, sum, 0xD8);
}

// NP row pairs x 8 keys -> s[2p], s[2p + 1] [0..7]. qp[p]: the pair's queries interleaved 8 channels
// at a time ([D / 8][16] fp32, 64-byte aligned: row 2p's j .. j + 7, then row 2p + 1's).
template <Elt E, int NP, int DFIX>
inline void scores8_pairs(const float* const* qp, const char* const* krow, int64_t D_, float* const* s) {
  const int64_t D = DFIX ? DFIX : D_;
  __m512 a[NP][8];
#pragma GCC unroll 2
  for (int p = 0; p < NP; ++p)
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) a[p][t] = _mm512_setzero_ps();
#pragma GCC unroll 8
  for (int64_t j = 0; j < D; j += 8) {
    __m512 qv[NP];
#pragma GCC unroll 2
    for (int p = 0; p < NP; ++p) qv[p] = _mm512_load_ps(qp[p] + 2 * j);
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) {
      const __m512 k = load8_twice<E>(krow[t], j);
#pragma GCC unroll 2
      for (int p = 0; p < NP; ++p) a[p][t] = _mm512_fmadd_ps(qv[p], k, a[p][t]);
    }
  }
#pragma GCC unroll 2
  for (int p = 0; p < NP; ++p) {
    const __m512 scores = tree8x8_pairs(a[p]);
    _mm256_storeu_ps(s[2 * p], _mm512_castps512_ps256(scores));
    _mm256_storeu_ps(s[2 * p + 1], _mm512_extractf32x8_ps(scores, 1));
  }
}

// tile_scores (D a multiple of 8): the tile's rows in pairs (an odd last row beside zeros, its
// scores dropped), 8 keys a call.
template <int DFIX>
inline void tile_scores_512(Elt e, int nr, const float* const* q, const char* const* krow, int64_t bt, int64_t D,
                            float (*s)[BLK]) {
  alignas(64) float qpair[NR / 2][2 * MAX_D];
  alignas(64) float dropped[8];
  const int np = (nr + 1) / 2;
  for (int p = 0; p < np; ++p) {
    const float* a = q[2 * p];
    const float* b = 2 * p + 1 < nr ? q[2 * p + 1] : nullptr;
    for (int64_t j = 0; j < D; j += 8) {
      const __m256 hi = b ? _mm256_load_ps(b + j) : _mm256_setzero_ps();
      _mm512_store_ps(qpair[p] + 2 * j, _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_load_ps(a + j)), hi, 1));
    }
  }
  const float* qp[NR / 2] = {qpair[0], qpair[1]};
  for (int t0 = 0; t0 < BLK; t0 += 8) {
    float* out[NR];
    for (int x = 0; x < NR; ++x) out[x] = x < nr ? s[x] + t0 : dropped;
    if (t0 >= bt) {
      for (int x = 0; x < nr; ++x) std::fill(out[x], out[x] + 8, 0.f);
      continue;
    }
    const char* const* kr = krow + t0;
    if (np == 1) {
      if (e == F16) scores8_pairs<F16, 1, DFIX>(qp, kr, D, out);
      else if (e == BF16) scores8_pairs<BF16, 1, DFIX>(qp, kr, D, out);
      else scores8_pairs<F32, 1, DFIX>(qp, kr, D, out);
    } else {
      if (e == F16) scores8_pairs<F16, 2, DFIX>(qp, kr, D, out);
      else if (e == BF16) scores8_pairs<BF16, 2, DFIX>(qp, kr, D, out);
      else scores8_pairs<F32, 2, DFIX>(qp, kr, D, out);
    }
  }
}

// The value pass for NRT rows, 16 channels a vector, W vectors at a time; D a multiple of 16.
template <Elt E, int NRT, int DFIX>
inline void values16(const float (*e)[BLK], const int64_t* vis, const char* const* vrow, const float* alpha,
                     int64_t D_, float* const* acc) {
  const int64_t D = DFIX ? DFIX : D_;
  constexpr int W = 4;   // 4 x NRT accumulators: 16 at NRT = 4, D = 64 in one stretch
  int64_t common = vis[0];
  for (int x = 1; x < NRT; ++x) common = std::min(common, vis[x]);
  for (int64_t j0 = 0; j0 < D; j0 += 16 * W) {
    const int w = (int)std::min<int64_t>(W, (D - j0) / 16);
    __m512 a[NRT][W];
#pragma GCC unroll 4
    for (int x = 0; x < NRT; ++x)
#pragma GCC unroll 4
      for (int c = 0; c < W; ++c)
        if (c < w) a[x][c] = _mm512_mul_ps(_mm512_loadu_ps(acc[x] + j0 + 16 * c), _mm512_set1_ps(alpha[x]));
    for (int64_t t = 0; t < common; ++t) {
#pragma GCC unroll 4
      for (int c = 0; c < W; ++c) {
        if (c >= w) break;
        const __m512 v = load16<E>(vrow[t], j0 + 16 * c);
#pragma GCC unroll 4
        for (int x = 0; x < NRT; ++x) a[x][c] = _mm512_fmadd_ps(_mm512_set1_ps(e[x][t]), v, a[x][c]);
      }
    }
#pragma GCC unroll 4
    for (int x = 0; x < NRT; ++x) {
      for (int64_t t = common; t < vis[x]; ++t)    // the causal diagonal: this row's own keys
#pragma GCC unroll 4
        for (int c = 0; c < W; ++c)
          if (c < w) a[x][c] = _mm512_fmadd_ps(_mm512_set1_ps(e[x][t]), load16<E>(vrow[t], j0 + 16 * c), a[x][c]);
#pragma GCC unroll 4
      for (int c = 0; c < W; ++c)
        if (c < w) _mm512_storeu_ps(acc[x] + j0 + 16 * c, a[x][c]);
    }
  }
}
#endif

// s[x][t] for the tile's nr rows and the block's keys t < bt rounded up to 8 (krow[t] past bt:
// zeros); s[x][t] = 0 beyond. Rows are of type `e` (the portable build: always fp32 copies).
template <int DFIX>
inline void tile_scores(Elt e, int nr, const float* const* q, const char* const* krow, int64_t bt, int64_t D,
                        float (*s)[BLK]) {
#if defined(__AVX512F__)
  return tile_scores_512<DFIX>(e, nr, q, krow, bt, D, s);   // D: a multiple of 8 (checked by the op)
#endif
  for (int t0 = 0; t0 < BLK; t0 += 8) {
    float* out[NR];
    for (int x = 0; x < nr; ++x) out[x] = s[x] + t0;
    if (t0 >= bt) {
      for (int x = 0; x < nr; ++x) std::fill(out[x], out[x] + 8, 0.f);
      continue;
    }
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    with_tile_rows(nr, [&](auto rows) {
      constexpr int NRT = decltype(rows)::value;
      if (e == F16) scores8<F16, NRT, DFIX>(q, krow + t0, D, out);
      else if (e == BF16) scores8<BF16, NRT, DFIX>(q, krow + t0, D, out);
      else scores8<F32, NRT, DFIX>(q, krow + t0, D, out);
    });
#else
    for (int x = 0; x < nr; ++x)
      for (int t = 0; t < 8; ++t) out[x][t] = dot8_ref(q[x], (const float*)krow[t0 + t], D);
#endif
  }
}

template <int DFIX>
inline void tile_values(Elt el, int nr, const float (*e)[BLK], const int64_t* vis, const char* const* vrow,
                        const float* alpha, int64_t D, float* const* acc) {
#if defined(__AVX512F__)
  if (D % 16 == 0) {
    return with_tile_rows(nr, [&](auto rows) {
      constexpr int NRT = decltype(rows)::value;
      if (el == F16) values16<F16, NRT, DFIX>(e, vis, vrow, alpha, D, acc);
      else if (el == BF16) values16<BF16, NRT, DFIX>(e, vis, vrow, alpha, D, acc);
      else values16<F32, NRT, DFIX>(e, vis, vrow, alpha, D, acc);
    });
  }
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  return with_tile_rows(nr, [&](auto rows) {
    constexpr int NRT = decltype(rows)::value;
    if (el == F16) values<F16, NRT, DFIX>(e, vis, vrow, alpha, D, acc);
    else if (el == BF16) values<BF16, NRT, DFIX>(e, vis, vrow, alpha, D, acc);
    else values<F32, NRT, DFIX>(e, vis, vrow, alpha, D, acc);
  });
#else
  for (int x = 0; x < nr; ++x) {
    float* a = acc[x];
    for (int64_t j = 0; j < D; ++j) a[j] *= alpha[x];
    for (int64_t t = 0; t < vis[x]; ++t) {
      const float pt = e[x][t];
      const float* v = (const float*)vrow[t];
      for (int64_t j = 0; j < D; ++j) a[j] = std::fma(pt, v[j], a[j]);
    }
  }
#endif
}

// What the verifier attended to (a guided drafter's selection, ``drafting.guide``): for each key of
// the block, the max over each query head's visible rows of its scaled score (the merge then makes
// them log-attention estimates: ``normalize_seen``). In a scores-only call (``p.seen_lse``) each row's
// log-sum-exp is taken off its scores first: the max is then of log-probabilities (KVzip's scores).
inline void record_seen(const Part& p, const int64_t* rows, int nr, int64_t h, int64_t G, int64_t T,
                        int64_t t0, const int64_t* vis, const float (*s)[BLK]) {
  for (int x = 0; x < nr; ++x) {
    const int64_t hq = h * G + rows[x] / T;
    float* out = p.seen + hq * p.seen_h + t0;
    const float* sx = s[x];
    // a score less the row's lse: one rounding, the same in every build (a max is exact)
    const float b = p.seen_lse ? p.seen_lse[hq * p.lse_n + rows[x] % T] : 0.0f;
    int64_t t = 0;
#if defined(__AVX512F__)
    const __m512 b16 = _mm512_set1_ps(b);
    for (; t + 16 <= vis[x]; t += 16)
      _mm512_storeu_ps(out + t, _mm512_max_ps(_mm512_sub_ps(_mm512_load_ps(sx + t), b16), _mm512_loadu_ps(out + t)));
#endif
#if defined(__AVX2__)
    const __m256 b8 = _mm256_set1_ps(b);
    for (; t + 8 <= vis[x]; t += 8)
      _mm256_storeu_ps(out + t, _mm256_max_ps(_mm256_sub_ps(_mm256_load_ps(sx + t), b8), _mm256_loadu_ps(out + t)));
#endif
    for (; t < vis[x]; ++t) out[t] = std::max(out[t], sx[t] - b);
  }
}

// A query head's seen scores become log-attention estimates: x[j] - log sum_j' exp(x[j']), a softmax
// over the keys of each key's max score over the head's rows (vectorised exp: n keys a layer).
inline void normalize_seen(float* x, int64_t n) {
  float mx = NEG;
  int64_t j = 0;
#if defined(__AVX512F__)   // (a max is exact in any order)
  __m512 m16 = _mm512_set1_ps(NEG);
  for (; j + 16 <= n; j += 16) m16 = _mm512_max_ps(m16, _mm512_loadu_ps(x + j));
  mx = _mm512_reduce_max_ps(m16);
#endif
  for (; j < n; ++j) mx = std::max(mx, x[j]);
  // 8 lane sums (key j in lane j % 8), then the lanes and the tail in order: the same in every build
  alignas(32) float lanes[8] = {};
  j = 0;
#if defined(__AVX512F__)   // 16 keys an exp, each half added to the 8 lanes in turn: the same adds in order
  __m256 acc16 = _mm256_setzero_ps();
  const __m512 m512 = _mm512_set1_ps(mx);
  for (; j + 16 <= n; j += 16) {
    const __m512 e = exp_neg_512(_mm512_sub_ps(_mm512_loadu_ps(x + j), m512));
    acc16 = _mm256_add_ps(_mm256_add_ps(acc16, _mm512_castps512_ps256(e)), _mm512_extractf32x8_ps(e, 1));
  }
  if (j + 8 <= n) {   // 8 more (the upper lanes' exps unused)
    const __m512 e = exp_neg_512(_mm512_sub_ps(_mm512_maskz_loadu_ps(0xff, x + j), m512));
    acc16 = _mm256_add_ps(acc16, _mm512_castps512_ps256(e));
    j += 8;
  }
  _mm256_store_ps(lanes, acc16);
#elif defined(__AVX2__) && defined(__FMA__)   // (exp_neg_256 is the AVX2 build's)
  __m256 acc = _mm256_setzero_ps();
  for (; j + 8 <= n; j += 8)
    acc = _mm256_add_ps(acc, exp_neg_256(_mm256_sub_ps(_mm256_loadu_ps(x + j), _mm256_set1_ps(mx))));
  _mm256_store_ps(lanes, acc);
#else
  for (; j + 8 <= n; j += 8)
    for (int l = 0; l < 8; ++l) lanes[l] = lanes[l] + exp_neg(x[j + l] - mx);
#endif
  float sum = 0.f;
  for (float v : lanes) sum += v;
  for (; j < n; ++j) sum += exp_neg(x[j] - mx);
  const float lse = mx + std::log(sum);
#pragma omp simd
  for (int64_t k = 0; k < n; ++k) x[k] = x[k] - lse;
}

// One work item: rows (g, i) of its sequence for the G query heads of KV head h, over keys
// [split * SPLIT, min(n, (split + 1) * SPLIT)), block by block (online softmax).
// Partial results: m [R], l [R], acc [R, D] with R = G * T (row r = g * T + i).
template <int DFIX>
void run_work(const Work& w, const Part& p, const float* q, int64_t q_h, int64_t q_n, int64_t row0, int64_t T,
              int64_t G, int64_t D_, const float* fp8_lut, float* m, float* l, float* acc) {
  const int64_t D = DFIX ? DFIX : D_;
  const float sm = 1.0f / std::sqrt((float)D);
  alignas(64) float kbuf[BLK][MAX_D];      // widened or dequantized keys (copies: quantized parts, many rows)
  alignas(64) float vbuf[BLK][MAX_D];      // widened or dequantized values
  alignas(64) float s[NR][BLK];            // a tile's scores, then its probabilities
  alignas(64) float qs[NR][MAX_D];         // a tile's queries, scaled by 1/sqrt(D)
  alignas(64) static const float zeros[MAX_D] = {};
  const char* krow[BLK];
  const char* vrow[BLK];
  Affine ka, va;
  const int64_t h = w.head, R = G * T;
  const int64_t lo = w.split * SPLIT, hi = std::min(p.n, lo + SPLIT);
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  constexpr bool in_registers = true;      // half-size rows widen in registers as they are read
#else
  constexpr bool in_registers = false;
#endif
  for (int64_t r = 0; r < R; ++r) { m[r] = NEG; l[r] = 0.f; }
  if (!p.seen_lse) std::fill(acc, acc + R * D, 0.f);   // (a scores-only call has none)
  if (p.seen)   // this item owns keys lo..hi of its KV head's G query heads (no other item writes them)
    for (int64_t g = 0; g < G; ++g) std::fill(p.seen + (h * G + g) * p.seen_h + lo, p.seen + (h * G + g) * p.seen_h + hi, NEG);
  std::vector<int64_t> rows;
  rows.reserve(R);
  for (int64_t t0 = lo; t0 < hi; t0 += BLK) {
    const int64_t bt = std::min<int64_t>(BLK, hi - t0);
    // rows whose causal limit ends before this block see none of it (rows i ascend: first visible)
    int64_t i_first = 0;
    if (p.diag >= 0) i_first = std::max<int64_t>(0, t0 - p.diag);
    if (i_first >= T) break;
    rows.clear();
    for (int64_t g = 0; g < G; ++g)
      for (int64_t i = i_first; i < T; ++i) rows.push_back(g * T + i);
    // dense rows are read where they lie when one tile covers every row (or they are fp32);
    // otherwise they are widened once into kbuf/vbuf for the block's many tiles
    const bool direct = p.dense && (p.elt == F32 || (in_registers && rows.size() <= (size_t)NR));
    const Elt elt = direct ? p.elt : F32;
    // key and value rows (keys past the block's end: zeros)
    const char* kb = p.k + h * p.k_h + t0 * p.k_t;
    const char* vb = p.v + h * p.v_h + t0 * p.v_t;
    if (direct) {
      for (int64_t t = 0; t < bt; ++t) {
        krow[t] = kb + t * p.k_t;
        vrow[t] = vb + t * p.v_t;
      }
    } else {
      for (int64_t t = 0; t < bt; ++t) {
        if (p.dense) {
          widen_row(p.elt, kb + t * p.k_t, D, kbuf[t]);
          if (!p.seen_lse) widen_row(p.elt, vb + t * p.v_t, D, vbuf[t]);   // (a scores-only call reads no value)
        } else {
          dequant_row(p.kf, fp8_lut, h, t0 + t, (int)D, ka, kbuf[t]);
          if (!p.seen_lse) dequant_row(p.vf, fp8_lut, h, t0 + t, (int)D, va, vbuf[t]);
        }
        krow[t] = (const char*)kbuf[t];
        vrow[t] = (const char*)vbuf[t];
      }
    }
    for (int64_t t = bt; t < BLK; ++t) krow[t] = (const char*)zeros;
    for (size_t x0 = 0; x0 < rows.size(); x0 += NR) {
      const int nr = (int)std::min<size_t>(NR, rows.size() - x0);
      const float* qp[NR];
      float* ap[NR];
      int64_t vis[NR];
      float alpha[NR];                               // each row's rescale of its accumulator
      for (int x = 0; x < nr; ++x) {
        const int64_t r = rows[x0 + x], g = r / T, i = r % T;
        const float* qr = q + (h * G + g) * q_h + (row0 + i) * q_n;
#pragma omp simd
        for (int64_t j = 0; j < D; ++j) qs[x][j] = qr[j] * sm;
        qp[x] = qs[x];
        ap[x] = p.seen_lse ? nullptr : acc + r * D;   // (a scores-only call has no acc)
        vis[x] = p.diag >= 0 ? std::min<int64_t>(bt, i + p.diag + 1 - t0) : bt;
      }
      tile_scores<DFIX>(elt, nr, qp, krow, bt, D, s);
      if (p.seen) record_seen(p, rows.data() + x0, nr, h, G, T, t0, vis, s);
      if (p.seen_lse) continue;                      // a scores-only call: no softmax, no values
      for (int x = 0; x < nr; ++x) {                 // online softmax: the block's max, exp, rescale
        const int64_t r = rows[x0 + x], vx = vis[x];
        float* sx = s[x];
        const float mb = block_max(sx, vx);
        const float m_new = std::max(m[r], mb);
        alpha[x] = exp_neg(m[r] - m_new);
        l[r] = std::fma(l[r], alpha[x], exp_block(sx, vx, m_new));
        m[r] = m_new;
      }
      tile_values<DFIX>(elt, nr, s, vis, vrow, alpha, D, ap);
    }
  }
}

// no key coding: offset 0, scale 1 a channel
alignas(64) constexpr std::array<float, MAX_D> NO_OFFSET{};
constexpr std::array<float, MAX_D> UNIT_SCALE = [] {
  std::array<float, MAX_D> a{};
  a.fill(1.0f);
  return a;
}();

// Every query row's codes for the integer scores, made once a call, not once a work item (at 32K a
// verification's 63 rows of a KV head were coded again in each of its 63 items: 14% of the op's samples).
// Row n of query head hq at hq * N + n: its codes [D], scale and share of the key offset (code_query).
struct QueryCodes {
  int64_t n = 0;                 // rows per query head (the call's N)
  std::vector<int8_t> codes;     // [Hq * N * D]
  std::vector<float> dq, qm;     // [Hq * N]
};

QueryCodes code_queries(const at::Tensor& q, int64_t G, const float* offsets, const float* scales) {
  const int64_t Hq = q.size(0), N = q.size(1), D = q.size(2);
  QueryCodes qc{N, std::vector<int8_t>(Hq * N * D), std::vector<float>(Hq * N), std::vector<float>(Hq * N)};
  const float* qp = q.data_ptr<float>();
  const float sm = 1.0f / std::sqrt((float)D);
  at::parallel_for(0, Hq * N, 64, [&](int64_t lo, int64_t hi) {
    alignas(64) float qs[MAX_D];
    for (int64_t at = lo; at < hi; ++at) {
      const int64_t hq = at / N, h = hq / G;   // its KV head's key coding (none: offset 0, scale 1)
      const float* qr = qp + hq * q.stride(0) + (at % N) * q.stride(1);
#pragma omp simd
      for (int64_t j = 0; j < D; ++j) qs[j] = qr[j] * sm;
      vc_int_scores::code_query(qs, D, offsets ? offsets + h * D : NO_OFFSET.data(),
                                scales ? scales + h * D : UNIT_SCALE.data(), qc.codes.data() + at * D,
                                &qc.dq[at], &qc.qm[at]);
    }
  });
  return qc;
}

// The q8qk numerics' work item over a dense part (int_scores.h): per block of keys, their codes (the
// cache's, coding any it lacks, or made here), every row's scores as integer dots, ROWS rows at once; the
// online softmax as in run_work; the weights coded and the value pass as integer dots too.
template <int DFIX>
void run_work_int(const Work& w, const Part& p, const QueryCodes& qc, int64_t row0, int64_t T, int64_t G,
                  int64_t D_, vc_int_scores::Unit unit, const float* offsets, const float* scales,
                  float* m, float* l, float* acc) {
  using namespace vc_int_scores;
  const int64_t D = DFIX ? DFIX : D_;
  alignas(64) float rows32[BLK][MAX_D];    // a block's keys or values as fp32 rows (those it codes)
  KeyCodes kc;                              // codes made here (a part without the cache's)
  ValueCodes vc;
  alignas(64) uint8_t wcodes[ROWS * BLK];  // a chunk's weights' codes [ROWS][BLK]
  alignas(64) float dw[ROWS], alpha[ROWS], m_new[ROWS];
  alignas(64) int32_t dots[ROWS][BLK];
  alignas(64) int32_t pv[ROWS][MAX_D];
  alignas(64) float s[ROWS][BLK];           // the chunk's scores, then probabilities
  const int64_t h = w.head, R = G * T;
  const int64_t lo = w.split * SPLIT, hi = std::min(p.n, lo + SPLIT);
  // this KV head's key coding (int_scores.h; none: offset 0, scale 1)
  const float* mu = offsets ? offsets + h * D : NO_OFFSET.data();
  const float* sc = scales ? scales + h * D : UNIT_SCALE.data();
  for (int64_t r = 0; r < R; ++r) {
    m[r] = NEG;
    l[r] = 0.f;
  }
  if (!p.seen_lse) std::fill(acc, acc + R * D, 0.f);   // (a scores-only call has none)
  if (p.seen)   // this item owns keys lo..hi of its KV head's G query heads (no other item writes them)
    for (int64_t g = 0; g < G; ++g) std::fill(p.seen + (h * G + g) * p.seen_h + lo, p.seen + (h * G + g) * p.seen_h + hi, NEG);
  // fp32 rows t0 + from .. t0 + bt - 1 of K or V (stored rows, widened exactly)
  auto widened = [&](const char* base, int64_t stride, int64_t from, int64_t bt, const float** out) {
    for (int64_t t = from; t < bt; ++t) {
      const char* row = base + t * stride;
      if (p.elt == F32) {
        out[t] = (const float*)row;
      } else {
        widen_row(p.elt, row, D, rows32[t]);
        out[t] = rows32[t];
      }
    }
  };
  std::vector<int64_t> rows, row_i;   // the rows (g T + i) that see the block, and each one's i
  rows.reserve(R);
  row_i.reserve(R);
  // the rows' query codes gathered chunk by chunk ([chunks][ROWS][D], past the last row zeros), with their
  // scales and offset shares: gathered again only when the block's first seeing row changes (a part's
  // own keys, under the causal limit), not every block
  std::vector<int8_t> qcodes;
  std::vector<float> dq, qm;
  int64_t gathered_from = -1;
  for (int64_t t0 = lo; t0 < hi; t0 += BLK) {
    const int64_t bt = std::min<int64_t>(BLK, hi - t0);
    int64_t i_first = 0;   // rows whose causal limit ends before this block see none of it
    if (p.diag >= 0) i_first = std::max<int64_t>(0, t0 - p.diag);
    if (i_first >= T) break;
    if (i_first != gathered_from) {
      rows.clear();
      row_i.clear();
      for (int64_t g = 0; g < G; ++g)
        for (int64_t i = i_first; i < T; ++i) {
          rows.push_back(g * T + i);
          row_i.push_back(i);
        }
      const size_t padded = (rows.size() + ROWS - 1) / ROWS * ROWS;
      qcodes.assign(padded * D, 0);
      dq.assign(padded, 0.f);
      qm.assign(padded, 0.f);
      for (size_t c = 0; c < rows.size(); ++c) {
        const int64_t at = (h * G + rows[c] / T) * qc.n + row0 + rows[c] % T;
        std::memcpy(qcodes.data() + c * D, qc.codes.data() + at * D, D);
        dq[c] = qc.dq[at];
        qm[c] = qc.qm[at];
      }
      gathered_from = i_first;
    }
    const char* kb = p.k + h * p.k_h + t0 * p.k_t;
    const char* vb = p.v + h * p.v_h + t0 * p.v_t;
    const float* f32[BLK];
    KeyView keys;
    ValueView values;
    if (p.codes) {   // the cache's codes, coding the block's keys it lacks (this item's own keys)
      const int64_t from = std::clamp<int64_t>(p.coded - t0, 0, bt);
      if (t0 + BLK < hi) {   // the next block's codes (4 KB of keys and of values at D = 64) on their way
        const int8_t* nk = p.codes + h * p.codes_h + (t0 + BLK) * D;
        const int8_t* nv = p.vcodes + h * p.codes_h + (t0 + BLK) * D;
        for (int64_t at = 0; at < BLK * D; at += 64) {
          __builtin_prefetch(nk + at);
          __builtin_prefetch(nv + at);
        }
      }
      keys = KeyView{p.codes + h * p.codes_h + t0 * D, p.dk + h * p.dk_h + t0, p.csum + h * p.dk_h + t0};
      values = ValueView{p.vcodes + h * p.codes_h + t0 * D, p.dv + h * p.dk_h + t0};
      widened(kb, p.k_t, from, bt, f32);
      code_keys(f32, from, bt, D, mu, sc, keys);
      widened(vb, p.v_t, from, bt, f32);
      code_values(f32, from, bt, D, values);
    } else {
      widened(kb, p.k_t, 0, bt, f32);
      keys = quantize_keys(f32, bt, D, mu, sc, kc);
      if (!p.seen_lse) {   // (a scores-only call reads no value; the cache's codes above stay whole)
        widened(vb, p.v_t, 0, bt, f32);
        values = quantize_values(f32, bt, D, vc);
      }
    }
    for (size_t c0 = 0; c0 < rows.size(); c0 += ROWS) {
      const int nc = (int)std::min<size_t>(ROWS, rows.size() - c0);
      int64_t vis[ROWS];
      for (int c = 0; c < nc; ++c)   // (row_i: rows[] % T was a division a row and block)
        vis[c] = p.diag >= 0 ? std::min<int64_t>(bt, row_i[c0 + c] + p.diag + 1 - t0) : bt;
      block_scores(unit, qcodes.data() + c0 * D, dq.data() + c0, qm.data() + c0, nc, keys, D, dots, s);
      if (p.seen) record_seen(p, rows.data() + c0, nc, h, G, T, t0, vis, s);
      if (p.seen_lse) continue;                      // a scores-only call: no softmax, no values
      // online softmax (the block's max, exp, rescale), then the weights coded: in passes over the chunk's
      // rows, not row by row, so one row's chain of reductions and exps does not stall the next (the same
      // operations a row: the same bits)
      for (int c = 0; c < nc; ++c) {
        const int64_t r = rows[c0 + c];
        m_new[c] = std::max(m[r], block_max(s[c], vis[c]));
        alpha[c] = m[r] - m_new[c];
        m[r] = m_new[c];
      }
      exp_neg_all(alpha, nc);
      for (int c = 0; c < nc; ++c) {
        const int64_t r = rows[c0 + c];
        l[r] = std::fma(l[r], alpha[c], exp_block(s[c], vis[c], m_new[c]));
      }
      code_weights(nc, s, values.dv, dw, wcodes);
      // rows past nc up to the units' last tile (16 rows: AMX's, 4: VNNI's) read as zeros
      std::memset(wcodes + nc * BLK, 0, (std::min(ROWS, (nc + 15) / 16 * 16) - nc) * BLK);
      block_values(unit, wcodes, nc, values, D, pv);
      for (int c = 0; c < nc; ++c) {
        float* a = acc + rows[c0 + c] * D;
        const float al = alpha[c], d = dw[c];
#pragma omp simd
        for (int64_t j = 0; j < D; ++j) a[j] = std::fma((float)pv[c][j], d, a[j] * al);
      }
    }
  }
}

// The part whose ints start at ints[at] and tensors at ts[tat] (layouts.h: PartInt, PartTensor).
Part make_part(const std::vector<int64_t>& ints, size_t at, const std::vector<c10::optional<at::Tensor>>& ts,
               size_t tat, int64_t H, int64_t G, int64_t D) {
  using namespace vc_layout;
  const int64_t* in = ints.data() + at;
  const c10::optional<at::Tensor>* t = ts.data() + tat;
  Part p{};
  if (t[SEEN].has_value()) {
    const at::Tensor& seen = *t[SEEN];
    TORCH_CHECK(seen.scalar_type() == at::kFloat && seen.dim() == 2 && seen.size(0) == H * G &&
                seen.size(1) >= in[N_KEYS] && seen.stride(1) == 1,
                "seen: fp32 [", H * G, ", >= ", in[N_KEYS], "] with a contiguous last dim, got ", seen.sizes());
    p.seen = seen.data_ptr<float>();
    p.seen_h = seen.stride(0);
  }
  p.seq = in[SEQ]; p.n = in[N_KEYS]; p.diag = in[DIAG]; p.exact = in[EXACT] != 0;
  if (t[K_CODES].has_value()) {
    const int64_t cap = (p.n + BLK - 1) / BLK * BLK;   // whole blocks of codes
    TORCH_CHECK(t[V_CODES].has_value() && t[V_DV].has_value(), "key codes come with value codes");
    const at::Tensor &c = *t[K_CODES], &dk = *t[K_DK], &cs = *t[K_CSUM], &vc = *t[V_CODES], &dv = *t[V_DV];
    TORCH_CHECK(vc.sizes() == c.sizes() && vc.strides() == c.strides() && vc.scalar_type() == at::kChar &&
                dv.sizes() == dk.sizes() && dv.strides() == dk.strides() && dv.scalar_type() == at::kFloat,
                "value codes: laid out as the key codes, and their scales as the keys'");
    TORCH_CHECK(t[K_CODED].has_value() && t[K_CODED]->scalar_type() == at::kLong && t[K_CODED]->numel() == 1,
                "key codes come with their count: int64, one element");
    TORCH_CHECK(in[K_KIND] == DENSE && t[K_DK].has_value() && t[K_CSUM].has_value() && c.scalar_type() == at::kChar &&
                dk.scalar_type() == at::kFloat && cs.scalar_type() == at::kInt && c.dim() == 2 && dk.dim() == 2 &&
                cs.dim() == 2 && c.size(0) == H && dk.size(0) == H && cs.size(0) == H && c.size(1) >= cap * D &&
                dk.size(1) >= cap && cs.size(1) >= cap && c.stride(1) == 1 && dk.stride(1) == 1 &&
                cs.stride(1) == 1 && dk.stride(0) == cs.stride(0),
                "key codes: a dense part's int8 [", H, ", >= ", cap * D, "], fp32 and int32 [", H, ", >= ", cap,
                "] (one stride)");
    p.codes = c.data_ptr<int8_t>(); p.dk = dk.data_ptr<float>(); p.csum = cs.data_ptr<int32_t>();
    p.vcodes = vc.data_ptr<int8_t>(); p.dv = dv.data_ptr<float>();
    p.codes_h = c.stride(0); p.dk_h = dk.stride(0);
    p.coded_out = t[K_CODED]->data_ptr<int64_t>();
    p.coded = std::max<int64_t>(*p.coded_out, 0);
  }
  p.dense = in[K_KIND] == DENSE;
  TORCH_CHECK((in[V_KIND] == DENSE) == p.dense, "a part's keys and values are both dense or both quantized");
  if (p.dense) {
    const at::Tensor& k = *t[K_ROWS];
    const at::Tensor& v = *t[V_ROWS];
    const auto st = k.scalar_type();
    for (const at::Tensor* x : {&k, &v}) {
      TORCH_CHECK((st == at::kFloat || st == at::kHalf || st == at::kBFloat16) && x->scalar_type() == st &&
                  x->dim() == 3 && x->stride(2) == 1 && x->size(0) == H && x->size(1) >= p.n && x->size(2) == D,
                  "dense part: K and V fp32, fp16 or bf16 alike, [", H, ", >= ", p.n, ", ", D,
                  "] with a contiguous last dim, got ", x->sizes(), " ", x->scalar_type());
    }
    p.elt = st == at::kFloat ? F32 : st == at::kHalf ? F16 : BF16;
    const int64_t es = k.element_size();
    p.k = (const char*)k.data_ptr(); p.v = (const char*)v.data_ptr();
    p.k_h = k.stride(0) * es; p.k_t = k.stride(1) * es; p.v_h = v.stride(0) * es; p.v_t = v.stride(1) * es;
  } else {
    p.kf = make_format(in[K_KIND], in[K_BITS], in[K_GROUP], *t[K_ROWS], *t[K_SCALE], t[K_ZERO], t[POS]);
    p.vf = make_format(in[V_KIND], in[V_BITS], in[V_GROUP], *t[V_ROWS], *t[V_SCALE], t[V_ZERO], t[POS]);
    TORCH_CHECK(t[K_ROWS]->size(0) == H && t[K_ROWS]->size(1) >= p.n && t[V_ROWS]->size(1) >= p.n,
                "quantized part: codes must hold ", p.n, " tokens for each of the ", H, " heads");
  }
  return p;
}

}  // namespace

// seq_lens [S]; part_ints: PART_INTS per part (layouts.h's PartInt: seq, n, diag, k kind/bits/group, v
// kind/bits/group); part_tensors: PART_TENSORS per part (PartTensor: k or k codes, k scale, k zero, v or v
// codes, v scale, v zero, pos, seen:
// an optional output [Hq, >= n] fp32: per query head, log softmax over keys j < n of the max over the
// head's rows that see j of their scaled score: an estimate of how much the verified rows attended to
// j, in logs; about -1e30 where no row sees j).
// lse (optional, an output) [Hq, N] fp32: each row's log-sum-exp of its scaled scores over all its parts'
// keys (what a caller normalising scores of its own needs: KVzip's scoring pass); -1e30 for a row that
// sees no key.
// row_lse (optional, an input) [Hq, N] fp32: the rows' lse from a call over the same parts; the call is
// then scores-only: each part's seen takes, per query head and key j, the largest log-probability any of
// the head's rows that see j gives it (scaled score less the row's lse, <= 0), the group's max in its
// first head, no normalising; nothing else runs (no softmax, no values: the output is zeros).
at::Tensor attend_packed(const at::Tensor& q, int64_t hkv, const std::vector<int64_t>& seq_lens,
                         const std::vector<int64_t>& part_ints,
                         const std::vector<c10::optional<at::Tensor>>& part_tensors, int64_t score_unit,
                         const c10::optional<at::Tensor>& key_coding, const c10::optional<at::Tensor>& lse,
                         const c10::optional<at::Tensor>& row_lse) {
  TORCH_CHECK(score_unit >= vc_int_scores::FP32 && score_unit <= vc_int_scores::AMX,
              "score_unit must be 0 (fp32), 1 (this build's integer dots), 2 (VNNI) or 3 (AMX), got ", score_unit);
  const auto unit = vc_int_scores::runnable((vc_int_scores::Unit)score_unit, q.size(2));
#if defined(VC_INT_SCORES_UNITS)
  TORCH_CHECK(vc_int_scores::unit_permitted(unit), "score_unit ", score_unit, ": this CPU or kernel does not let this "
              "process run it (VNNI missing, or AMX tiles refused by arch_prctl): use a lower unit");
#endif
  TORCH_CHECK(unit == vc_int_scores::FP32 || q.size(2) % 16 == 0, "integer scores need a head dim that is a "
              "multiple of 16, got ", q.size(2));
  const float *offsets = nullptr, *scales = nullptr;   // q8qk's key coding (int_scores.h; none: 0 and 1)
  if (key_coding.has_value()) {
    const at::Tensor& c = *key_coding;
    TORCH_CHECK(c.scalar_type() == at::kFloat && c.dim() == 3 && c.size(0) == 2 && c.size(1) == hkv &&
                c.size(2) == q.size(2) && c.is_contiguous(), "key_coding: contiguous fp32 [2, ", hkv, ", ",
                q.size(2), "] (offsets, channel scales), got ", c.sizes());
    offsets = c.data_ptr<float>();
    scales = offsets + hkv * q.size(2);
    for (int64_t j = 0; j < hkv * q.size(2); ++j)
      TORCH_CHECK(scales[j] > 0.0f && std::isfinite(scales[j]), "key_coding: channel scales must be positive "
                  "and finite, got ", scales[j], " at ", j);
  }
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.stride(2) == 1, "q: fp32 [Hq, N, D], last dim contiguous");
  const int64_t Hq = q.size(0), N = q.size(1), D = q.size(2), S = (int64_t)seq_lens.size();
  TORCH_CHECK(hkv > 0 && Hq % hkv == 0, "query heads ", Hq, " are not a multiple of KV heads ", hkv);
  TORCH_CHECK(D <= MAX_D && D % 8 == 0, "head dim must be a multiple of 8 and <= 256, got ", D);
  using vc_layout::PART_INTS;
  using vc_layout::PART_TENSORS;
  TORCH_CHECK(part_ints.size() % PART_INTS == 0 && part_tensors.size() == part_ints.size() / PART_INTS * PART_TENSORS,
              PART_INTS, " ints and ", PART_TENSORS, " tensors per part");
  const int64_t G = Hq / hkv, P = (int64_t)part_ints.size() / PART_INTS;
  std::vector<int64_t> row0(S + 1, 0);
  for (int64_t s = 0; s < S; ++s) row0[s + 1] = row0[s] + seq_lens[s];
  TORCH_CHECK(row0[S] == N, "seq_lens sum to ", row0[S], " but q has ", N, " rows");
  float* lse_out = nullptr;
  if (lse.has_value()) {
    TORCH_CHECK(lse->scalar_type() == at::kFloat && lse->dim() == 2 && lse->size(0) == Hq && lse->size(1) == N &&
                lse->is_contiguous(), "lse: contiguous fp32 [", Hq, ", ", N, "], got ", lse->sizes());
    lse_out = lse->data_ptr<float>();
  }
  const float* lse_in = nullptr;
  if (row_lse.has_value()) {
    TORCH_CHECK(row_lse->scalar_type() == at::kFloat && row_lse->dim() == 2 && row_lse->size(0) == Hq &&
                row_lse->size(1) == N && row_lse->is_contiguous(), "row_lse: contiguous fp32 [", Hq, ", ", N,
                "], got ", row_lse->sizes());
    TORCH_CHECK(!lse_out, "lse and row_lse: a call gives the rows' lse, a scores-only call after it takes them");
    lse_in = row_lse->data_ptr<float>();
  }

  std::vector<Part> parts;
  for (int64_t i = 0; i < P; ++i) {
    parts.push_back(make_part(part_ints, PART_INTS * i, part_tensors, PART_TENSORS * i, hkv, G, D));
    TORCH_CHECK(parts.back().seq >= 0 && parts.back().seq < S, "part ", i, ": sequence ", parts.back().seq,
                " out of range");
    if (lse_in && parts.back().seen) {
      parts.back().seen_lse = lse_in + row0[parts.back().seq];
      parts.back().lse_n = N;
    }
  }
  if (lse_in) {
    bool any_seen = false;
    for (const Part& p : parts) any_seen = any_seen || p.seen;
    TORCH_CHECK(any_seen, "row_lse: a scores-only call writes its parts' seen, and no part has one");
  }
  // work items in a fixed order (part, head, split), each with its slot in the partial buffers
  std::vector<Work> work;
  std::vector<int64_t> slot;            // offset of a work item's R rows
  int64_t rows = 0;
  for (int64_t i = 0; i < P; ++i) {
    const int64_t splits = (parts[i].n + SPLIT - 1) / SPLIT;
    for (int64_t h = 0; h < hkv; ++h)
      for (int64_t sp = 0; sp < splits; ++sp) {
        work.push_back({i, h, sp});
        slot.push_back(rows);
        rows += G * seq_lens[parts[i].seq];
      }
  }
  // the work items' partials: m, l [rows] and acc [rows, D], each item writing its own whole. A prefill
  // chunk's acc is large (the 0.5B code model's 512-row chunk at 16K keys: 32 items of 3,584 rows, 58 MB),
  // so it lives in the calling thread's workspace, kept between calls: fresh pages each call (faulted in
  // and zeroed by the kernel) cost the 32K prefill 1.29x (scripts/prefill_bench.py, VNNI Zen 5). It grows
  // to the largest call the thread makes and is freed when the thread ends. A scores-only call keeps no
  // acc (the merge reads an item's acc only where it saw keys: l > 0).
  std::vector<float> pm(rows), pl(rows);
  thread_local std::vector<float> workspace;
  if (!lse_in && workspace.size() < (size_t)(rows * D)) workspace.resize(rows * D);
  float* pacc = lse_in ? nullptr : workspace.data();
  float fp8_lut[256];
  fp8_table(fp8_lut);
  const float* qp = q.data_ptr<float>();
  auto acc_at = [&](int64_t o) { return pacc ? pacc + o * D : nullptr; };
  bool any_int = false;   // a dense exact part under the integer scores (run_work_int's)
  for (const Part& p : parts) any_int = any_int || (p.dense && p.exact);
  const QueryCodes qcodes = unit != vc_int_scores::FP32 && any_int ? code_queries(q, G, offsets, scales) : QueryCodes{};
  at::parallel_for(0, (int64_t)work.size(), 1, [&](int64_t lo, int64_t hi) {
#if defined(VC_INT_SCORES_UNITS)
    if (unit == vc_int_scores::AMX) vc_int_scores::amx_configure();   // this thread's tiles, for this call
#endif
    for (int64_t wi = lo; wi < hi; ++wi) {
      const Work& w = work[wi];
      const Part& p = parts[w.part];
      const int64_t o = slot[wi];
      const int64_t r0 = row0[p.seq], T = seq_lens[p.seq];
      if (lse_in && !p.seen) continue;                          // a scores-only call: this part has none
      if (unit != vc_int_scores::FP32 && p.dense && p.exact) {   // the q8qk numerics
        if (D == 64)
          run_work_int<64>(w, p, qcodes, r0, T, G, D, unit, offsets, scales, &pm[o], &pl[o], acc_at(o));
        else
          run_work_int<0>(w, p, qcodes, r0, T, G, D, unit, offsets, scales, &pm[o], &pl[o], acc_at(o));
      } else if (D == 64) {
        run_work<64>(w, p, qp, q.stride(0), q.stride(1), r0, T, G, D, fp8_lut, &pm[o], &pl[o], acc_at(o));
      } else {
        run_work<0>(w, p, qp, q.stride(0), q.stride(1), r0, T, G, D, fp8_lut, &pm[o], &pl[o], acc_at(o));
      }
    }
#if defined(VC_INT_SCORES_UNITS)
    if (unit == vc_int_scores::AMX) vc_int_scores::amx_release();
#endif
  });
  if (unit != vc_int_scores::FP32)   // every key of every part with codes is coded now
    for (const Part& p : parts)
      if (p.coded_out) *p.coded_out = std::max(*p.coded_out, p.n);

  // merge, per (sequence, KV head), the work items of that sequence in their fixed order
  std::vector<std::vector<int64_t>> items(S * hkv);
  for (int64_t wi = 0; wi < (int64_t)work.size(); ++wi)
    items[parts[work[wi].part].seq * hkv + work[wi].head].push_back(wi);
  at::Tensor out = at::zeros({N, Hq, D}, q.options());
  float* op = out.data_ptr<float>();
  at::parallel_for(0, S * hkv, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t sh = lo; sh < hi; ++sh) {
      const int64_t s = sh / hkv, h = sh % hkv, T = seq_lens[s];
      const auto& its = items[sh];
      for (int64_t r = 0; r < G * T; ++r) {
        const int64_t g = r / T, i = r % T;
        float m = NEG;
        for (int64_t wi : its) m = std::max(m, pm[slot[wi] + r]);
        float l = 0.f;
        float* o = op + ((row0[s] + i) * Hq + h * G + g) * D;
        for (int64_t wi : its) {
          const int64_t at = slot[wi] + r;
          if (pl[at] == 0.f) continue;               // saw no key: as if the item did not exist
          const float c = exp_neg(pm[at] - m);
          l = std::fma(pl[at], c, l);
          const float* a = pacc + at * D;
#pragma omp simd
          for (int64_t j = 0; j < D; ++j) o[j] = std::fma(a[j], c, o[j]);
        }
        if (l > 0.f) {
          const float inv = 1.0f / l;
#pragma omp simd
          for (int64_t j = 0; j < D; ++j) o[j] = o[j] * inv;
        }
        if (lse_out) lse_out[(h * G + g) * N + row0[s] + i] = l > 0.f ? m + std::log(l) : NEG;
      }
      for (const Part& p : parts)
        if (p.seen && p.seq == s) {
          float* first = p.seen + h * G * p.seen_h;   // the group's first query head
          if (!p.seen_lse)   // (a scores-only call's are log-probabilities already)
            for (int64_t g = 0; g < G; ++g) normalize_seen(first + g * p.seen_h, p.n);
          // the group's max into its first row while the rows are hot: guided selection reads one row a
          // KV head (``drafting.guide``), a G-th of the bytes (a max is exact: every build the same bits)
          for (int64_t g = 1; g < G; ++g) {
            const float* x = first + g * p.seen_h;
#pragma omp simd
            for (int64_t j = 0; j < p.n; ++j) first[j] = x[j] > first[j] ? x[j] : first[j];
          }
        }
    }
  });
  return out;
}
