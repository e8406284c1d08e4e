// The q8 numerics' linear: y[M, N] = x[M, K] W^T (+ bias) as int8 activations in integer dot products
// with the stored codes (no weight copy). Integer sums are exact, so every build (AVX2 `maddubs`, the
// AVX-512 build, VNNI's `dpbusd`, portable scalar code) gets the same integers, and one fixed fp32
// combine over them gives the same bits whatever M is, which rows share a tile, and the threads.
//
// The contract, for row m of x and output n (blocks of 32 elements along K):
//   x's block b:  dx = max|x| / 127, a_i = nearbyint(x_i * (1 / dx)) in [-127, 127] (all 0 when
//                 max|x| = 0), sa = sum a_i, ds = dx * float(sa)            (llama.cpp's q8 rule)
//   W's block b:  integer codes c_i, a scale ws and, for formats with a min, wm: w_i = ws c_i + wm
//                 Q4_0 c = q - 8 | Q4_1 c = q, wm = m | Q5_0 c = q - 16 | Q5_1 c = q, wm = m | Q8_0 c = q
//                 Q4_K/Q5_K sub-block j: ws = d sc_j, wm = -(dmin m_j), c = q
//                 Q6_K: ws = d, c_i = sc(i / 16) (q_i - 32) (its two 16-element scales are integers)
//   s = sum_i c_i a_i, an exact int32 (|s| < 2^24, so float(s) is exact too).
//   acc = 0; for b = 0, 1, ...: acc = fma(float(s), ws * dx, acc), then for a min format
//   acc = fma(wm, ds, acc). y = acc (+ bias).
// One output's blocks are summed in order, so vector code puts outputs in lanes, never K:
//   few rows (decode): each of 8 weight rows' block meets the row's block in `maddubs` + `madd`
//     (8 int32 partial sums), a transposing `hadd` tree turns 8 such into the 8 outputs' s;
//   many rows (verification, prefill, batches): 16 weight rows are decoded once a call into a panel
//     whose 32-byte vectors hold 4 codes of each of 8 outputs; a row's 4 activations broadcast meet
//     them in `maddubs`, summed in int16 across a block's steps while no lane can overflow (4-bit
//     codes: the whole block), then `madd` to int32. VNNI's `dpbusd` does both in one instruction.
//   the VNNI build, any row count on packed panels: a 64-byte panel line holds 4 codes of 16 outputs,
//     one zmm `dpbusd` meets a row's 4 activations broadcast, 8 rows a tile (``vnni_tile``); its panels
//     keep codes of up to 6 bits packed and the blocks' fp16 scales, about the blocks' size, so even one
//     row reads them faster than the blocks.
// `maddubs` sums two u8 x s8 products into a saturating int16: codes are fed unsigned (|c| with the
// sign moved onto a, or q with the offset subtracted as 8 sa or 16 sa) and at most 128, and |a| <= 127,
// so a pair stays within 2 * 128 * 127 = 32512 and never saturates; int16 sums stop before 32767.
//
// F32/F16/BF16 weights have no codes: the call returns -2 and the caller runs the fp32 op (linear.cpp).
#include <algorithm>
#include <vector>
#include <omp.h>

#include "gguf_blocks.h"

namespace {

using namespace vc_gguf;

// How a format's codes meet the activations: unsigned with an offset (c = u - off), signed (sign
// trick), or signed with Q6_K's two integer scales a block
enum Kind { UNSIGNED, SIGNED, SCALED };
constexpr Kind kind_of(int F) { return F == Q8_0 ? SIGNED : F == Q6_K ? SCALED : UNSIGNED; }
constexpr int offset_of(int F) { return F == Q4_0 ? 8 : F == Q5_0 ? 16 : 0; }
constexpr bool has_min(int F) { return F == Q4_1 || F == Q5_1 || F == Q4_K || F == Q5_K; }
bool integer_format(int f) { return f >= Q4_0 && f <= Q6_K; }

// int16 steps of 4 codes a block can sum before a lane could overflow (see the header)
constexpr int steps16(int F) {
  return F == Q8_0 ? 1 : (F == Q4_0 || F == Q4_1 || F == Q4_K) ? 8 : 4;
}

// Bits a code of the format takes
constexpr int code_bits(int F) {
  return F == Q8_0 ? 8 : F == Q6_K ? 6 : (F == Q5_0 || F == Q5_1 || F == Q5_K) ? 5 : 4;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && !defined(__AMX_INT8__)
#define VC_HAS_VNNI_TILES 1   // the avx512vnni build's own tiles and panel layout (vnni_tile below)
#endif

#if defined(VC_HAS_VNNI_TILES)
constexpr int VNNI_ROWS = 8;   // rows of x a tile: 8 fp32 + 16 int32 accumulators (two chains a row) of 32 zmm

// The activations again in the VNNI tiles' order: rows in groups of VNNI_ROWS and, within a group, each
// block's rows side by side ([groups][nb][VNNI_ROWS] blocks of 32 codes, and so each number), so a tile
// reads block b of all its rows from one pointer at fixed offsets. (With a pointer a row GCC ran out of
// registers and reloaded them from the stack: three loads a row and block in the combine.)
struct TileActs {
  std::vector<int8_t> a;         // [groups, nb, VNNI_ROWS, 32]
  std::vector<float> dx, ds;     // [groups, nb, VNNI_ROWS]
  std::vector<int32_t> sa, sh;   // [groups, nb, VNNI_ROWS]
};
#endif

// The activations of M rows, quantized once a call
struct QActs {
  int64_t nb = 0;               // blocks a row
  std::vector<int8_t> a;        // [M, 32 nb]
  std::vector<float> dx, ds;    // [M, nb]
  std::vector<int32_t> sa;      // [M, nb]
  std::vector<int32_t> sh;      // [M, nb]: the sum of a block's first 16 (VNNI's Q6_K takes its halves apart)
#if defined(VC_HAS_VNNI_TILES)
  TileActs tiles;               // the same values in the VNNI tiles' order
#endif
};

// x's blocks -> a, dx, ds, sa, sh. The vector builds compute exactly the scalar loop's values: max is exact,
// and a vector conversion rounds to nearest even like nearbyint (the default rounding mode)
void quantize_row(const float* x, int64_t nb, int8_t* a, float* dx, float* ds, int32_t* sa, int32_t* sh) {
  for (int64_t b = 0; b < nb; ++b) {
    const float* xb = x + 32 * b;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
    const float d = amax / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
    const __m512i v0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, _mm512_set1_ps(inv)));
    const __m512i v1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, _mm512_set1_ps(inv)));
    _mm_storeu_si128((__m128i*)(a + 32 * b), _mm512_cvtepi32_epi8(v0));
    _mm_storeu_si128((__m128i*)(a + 32 * b + 16), _mm512_cvtepi32_epi8(v1));
    const int lo = _mm512_reduce_add_epi32(v0), sum = lo + _mm512_reduce_add_epi32(v1);
#elif defined(__AVX2__)
    __m256 xs[4], m = _mm256_setzero_ps();
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int k = 0; k < 4; ++k) {
      xs[k] = _mm256_loadu_ps(xb + 8 * k);
      m = _mm256_max_ps(m, _mm256_and_ps(xs[k], abs_mask));
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
    const float d = amax / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
    __m256i v[4];
    for (int k = 0; k < 4; ++k) v[k] = _mm256_cvtps_epi32(_mm256_mul_ps(xs[k], _mm256_set1_ps(inv)));
    // int32 -> int8 (every value in [-127, 127]): packs keep 128-bit lanes, the permute restores order
    const __m256i w = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
    _mm256_storeu_si256((__m256i*)(a + 32 * b), _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    alignas(32) int32_t t[8];
    _mm256_store_si256((__m256i*)t, _mm256_add_epi32(v[0], v[1]));
    int lo = 0;
    for (int j = 0; j < 8; ++j) lo += t[j];
    _mm256_store_si256((__m256i*)t, _mm256_add_epi32(v[2], v[3]));
    int sum = lo;
    for (int j = 0; j < 8; ++j) sum += t[j];
#else
    float amax = 0.0f;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(xb[i]));   // inlined (fmax is a libm call)
    const float d = amax / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
    int sum = 0, lo = 0;
    for (int i = 0; i < 32; ++i) {
      const int v = (int)std::nearbyint(xb[i] * inv);
      a[32 * b + i] = (int8_t)v;
      sum += v;
      if (i == 15) lo = sum;
    }
#endif
    dx[b] = d;
    sa[b] = sum;
    sh[b] = lo;
    ds[b] = d * (float)sum;
  }
}

#if defined(__AVX2__)
// 32 bits -> 32 bytes, byte j all ones where bit j is set (llama.cpp's bytes_from_bits_32): byte j
// takes byte j / 8 of x, ORed with all bits but bit j % 8
VC_INLINE __m256i bits_to_bytes(uint32_t x) {
  const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
  const __m256i bytes = _mm256_or_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)x), shuf),
                                        _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  return _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1));
}

// 16 bytes of nibbles -> 32 codes, the low nibbles then the high ones (Q4_0/Q4_1/Q5_0/Q5_1's order)
VC_INLINE __m256i nibbles32(const uint8_t* qs) {
  const __m128i q = _mm_loadu_si128((const __m128i*)qs), mask = _mm_set1_epi8(0x0f);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), mask), _mm_and_si128(q, mask));
}

// (p[i] >> shift) & mask for 32 bytes: the 16-bit shift brings the next byte's bits in at 8 - shift and
// up, which every mask used here (below 1 << (8 - shift)) clears
VC_INLINE __m256i field32(const uint8_t* p, int shift, int mask) {
  return _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256((const __m256i*)p), shift), _mm256_set1_epi8((char)mask));
}
#endif

// Block b of a row (K-quants: sub-block b % 8 of super-block b / 8) -> 32 codes, ws, wm, sc. The AVX2
// build decodes 32 codes in a few vector instructions, the scalar loop is the reference (the same codes:
// tests compare every build's outputs bit for bit).
template <int F>
VC_INLINE void decode_block(const uint8_t* row, int64_t b, uint8_t* u, float* ws, float* wm, int32_t* sc) {
  *wm = 0.0f;
  *sc = 0;
  if (F == Q4_0 || F == Q4_1) {
    const uint8_t* blk = row + b * block_bytes(F);
    const uint8_t* qs = blk + (F == Q4_1 ? 4 : 2);
    *ws = rdh(blk);
    if (F == Q4_1) *wm = rdh(blk + 2);
#if defined(__AVX2__)
    _mm256_storeu_si256((__m256i*)u, nibbles32(qs));
#else
    for (int j = 0; j < 16; ++j) { u[j] = qs[j] & 0x0f; u[j + 16] = qs[j] >> 4; }
#endif
  } else if (F == Q5_0 || F == Q5_1) {
    const uint8_t* blk = row + b * block_bytes(F);
    *ws = rdh(blk);
    if (F == Q5_1) *wm = rdh(blk + 2);
    uint32_t qh;
    std::memcpy(&qh, blk + (F == Q5_1 ? 4 : 2), 4);
    const uint8_t* qs = blk + (F == Q5_1 ? 8 : 6);
#if defined(__AVX2__)   // code j's fifth bit is bit j of qh
    _mm256_storeu_si256((__m256i*)u, _mm256_or_si256(nibbles32(qs), _mm256_and_si256(bits_to_bytes(qh),
                                                                                     _mm256_set1_epi8(0x10))));
#else
    for (int j = 0; j < 32; ++j)
      u[j] = (uint8_t)((j < 16 ? (qs[j] & 0x0f) : (qs[j - 16] >> 4)) | ((qh >> j) & 1) << 4);
#endif
  } else if (F == Q8_0) {
    const uint8_t* blk = row + b * block_bytes(F);
    *ws = rdh(blk);
    std::memcpy(u, blk + 2, 32);
  } else if (F == Q4_K || F == Q5_K) {
    const uint8_t* blk = row + (b / 8) * block_bytes(F);
    const int j = (int)(b % 8);
    int s, m;
    scale_min_k4(blk + 4, j, &s, &m);
    *ws = rdh(blk) * (float)s;           // exact: 11 x 6 significant bits
    *wm = -(rdh(blk + 2) * (float)m);
    const uint8_t* q = blk + (F == Q5_K ? 48 : 16) + 32 * (j / 2);
#if defined(__AVX2__)   // sub-block j: the low (even j) or high nibbles of 32 bytes; Q5_K: bit j of qh's bytes
    __m256i v = field32(q, (j & 1) ? 4 : 0, 0x0f);
    if (F == Q5_K) v = _mm256_or_si256(v, _mm256_slli_epi16(field32(blk + 16, j, 1), 4));
    _mm256_storeu_si256((__m256i*)u, v);
#else
    for (int l = 0; l < 32; ++l) {
      int v = (j & 1) ? (q[l] >> 4) : (q[l] & 0x0f);
      if (F == Q5_K) v |= ((blk[16 + l] >> j) & 1) << 4;
      u[l] = (uint8_t)v;
    }
#endif
  } else {   // Q6_K
    const uint8_t* blk = row + (b / 8) * block_bytes(F);
    const uint8_t *ql = blk, *qh = blk + 128;
    const int8_t* scales = (const int8_t*)(blk + 192);
    *ws = rdh(blk + 208);
#if defined(__AVX2__)   // sub-block s: element 32 s + i is half h = s / 4's position r = 32 (s % 4) + i, so
    // its low 4 bits are nibble r / 64 of ql[64 h + r % 64] and its high 2 bits field s % 4 of qh[32 h + i]
    const int sb = (int)(b % 8), h = sb / 4, r0 = 32 * (sb % 4);
    const __m256i lo = field32(ql + 64 * h + r0 % 64, 4 * (r0 / 64), 0x0f);
    const __m256i hi = field32(qh + 32 * h, 2 * (sb % 4), 3);
    _mm256_storeu_si256((__m256i*)u, _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)),
                                                     _mm256_set1_epi8(32)));
#else
    for (int i = 0; i < 32; ++i) {
      const int e = 32 * (int)(b % 8) + i, h = e / 128, r = e % 128;
      const int lo = (ql[64 * h + r % 64] >> (4 * (r / 64))) & 0x0f, hi = (qh[32 * h + r % 32] >> (2 * (r / 32))) & 3;
      u[i] = (uint8_t)(int8_t)((lo | hi << 4) - 32);
    }
#endif
    const int e0 = 32 * (int)(b % 8);
    *sc = (int32_t)(uint16_t)(int16_t)scales[e0 / 16] | (int32_t)((uint32_t)(uint16_t)(int16_t)scales[e0 / 16 + 1] << 16);
  }
}


#if defined(__AVX2__)
// Formats whose scale (and min) are the block's first fp16s: the few-row path converts 8 rows' at once
constexpr bool scales_first(int F) { return F == Q4_0 || F == Q4_1 || F == Q5_0 || F == Q5_1 || F == Q8_0; }

// Block b of a row as 32 codes in a register (and ws, wm, Q6_K's scales; ``scales_first`` formats leave
// those to the caller)
template <int F>
VC_INLINE __m256i load_codes(const uint8_t* row, int64_t b, float* ws, float* wm, int32_t* sc) {
  if (F == Q4_0 || F == Q4_1) return nibbles32(row + b * block_bytes(F) + (F == Q4_1 ? 4 : 2));
  if (F == Q5_0 || F == Q5_1) {
    const uint8_t* blk = row + b * block_bytes(F);
    uint32_t qh;
    std::memcpy(&qh, blk + (F == Q5_1 ? 4 : 2), 4);
    return _mm256_or_si256(nibbles32(blk + (F == Q5_1 ? 8 : 6)),
                           _mm256_and_si256(bits_to_bytes(qh), _mm256_set1_epi8(0x10)));
  }
  if (F == Q8_0) {
    const uint8_t* blk = row + b * block_bytes(F);
    return _mm256_loadu_si256((const __m256i*)(blk + 2));
  }
  alignas(32) uint8_t u[32];
  decode_block<F>(row, b, u, ws, wm, sc);
  return _mm256_load_si256((const __m256i*)u);
}

VC_INLINE __m256i q6k_mul(int32_t sc) {   // madd's multipliers: the first 16 codes' scale, then the second's
  return _mm256_set_m128i(_mm_set1_epi16((int16_t)(sc >> 16)), _mm_set1_epi16((int16_t)(sc & 0xffff)));
}

// 8 int32 partial sums of one block's c . a (split over lanes; their sum is the contract's s)
template <int F>
VC_INLINE __m256i block_dot(__m256i u, __m256i a, int32_t sc) {
  if (kind_of(F) != UNSIGNED) {      // |c| unsigned, c's sign moved onto a
    a = _mm256_sign_epi8(a, u);
    u = _mm256_sign_epi8(u, u);
  }
  if (kind_of(F) == SCALED) return _mm256_madd_epi16(_mm256_maddubs_epi16(u, a), q6k_mul(sc));
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, a);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, a), _mm256_set1_epi16(1));
#endif
}

// v[j] (8 lanes each) -> lane j = the sum of v[j]'s lanes
VC_INLINE __m256i reduce8(const __m256i* v) {
  const __m256i g0 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i g1 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(g0, g1, 0x20), _mm256_permute2x128_si256(g0, g1, 0x31));
}

// acc (8 outputs) += block b of row m: s (8 outputs) with the scales ws, wm of those outputs
template <int F>
VC_INLINE __m256 combine(__m256 acc, __m256i s, __m256 ws, __m256 wm, const QActs& X, int64_t m, int64_t b) {
  const int64_t i = m * X.nb + b;
  if (offset_of(F)) s = _mm256_sub_epi32(s, _mm256_set1_epi32(offset_of(F) * X.sa[i]));
  acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(ws, _mm256_set1_ps(X.dx[i])), acc);
  if (has_min(F)) acc = _mm256_fmadd_ps(wm, _mm256_set1_ps(X.ds[i]), acc);
  return acc;
}

VC_INLINE void store_outputs(__m256 acc, float* y, int64_t n0, int valid, const float* bias) {
  alignas(32) float t[8];
  _mm256_store_ps(t, bias && valid == 8 ? _mm256_add_ps(acc, _mm256_loadu_ps(bias + n0)) : acc);
  for (int j = 0; j < valid; ++j) y[n0 + j] = bias && valid < 8 ? t[j] + bias[n0 + j] : t[j];
}

// The fp16 at byte `at` of 8 blocks -> 8 floats (one conversion for the 8)
VC_INLINE __m256 halves8(const uint8_t* const* blk, int at) {
  __m128i h = _mm_setzero_si128();
  h = _mm_insert_epi16(h, rd16(blk[0] + at), 0); h = _mm_insert_epi16(h, rd16(blk[1] + at), 1);
  h = _mm_insert_epi16(h, rd16(blk[2] + at), 2); h = _mm_insert_epi16(h, rd16(blk[3] + at), 3);
  h = _mm_insert_epi16(h, rd16(blk[4] + at), 4); h = _mm_insert_epi16(h, rd16(blk[5] + at), 5);
  h = _mm_insert_epi16(h, rd16(blk[6] + at), 6); h = _mm_insert_epi16(h, rd16(blk[7] + at), 7);
  return _mm256_cvtph_ps(h);
}

constexpr int PF_ROWS = 16;   // decode: weight rows read ahead (software prefetch; see linear.cpp's PF)

// Few rows: MT rows (from m0) x 8 weight rows from n0 (valid of them; the rest repeat the last row),
// read straight from their blocks
template <int F, int MT>
void direct_tile(const uint8_t* w, int64_t row_bytes, int64_t n0, int valid, int64_t n_end, const QActs& X,
                 int64_t m0, float* const* ys, const float* bias) {
  constexpr bool simple = scales_first(F);
  const uint8_t* rows[8];
  for (int j = 0; j < 8; ++j) rows[j] = w + (n0 + (j < valid ? j : valid - 1)) * row_bytes;
  const int64_t ahead = std::min<int64_t>(PF_ROWS, n_end - 1 - n0) * row_bytes;
  const int bb = block_bytes(F);
  __m256 acc[MT];
  for (int i = 0; i < MT; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < X.nb; ++b) {
    alignas(32) float ws[8], wm[8];
    __m256i v[MT][8];
    const uint8_t* blk[8];
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      blk[j] = rows[j] + b * bb;
      if (simple && (b * bb) % 64 < bb) __builtin_prefetch(blk[j] + ahead + 64);
      int32_t sc = 0;
      const __m256i u = load_codes<F>(rows[j], b, &ws[j], &wm[j], &sc);
#pragma GCC unroll 4
      for (int i = 0; i < MT; ++i)
        v[i][j] = block_dot<F>(u, _mm256_loadu_si256((const __m256i*)(X.a.data() + ((m0 + i) * X.nb + b) * 32)), sc);
    }
    const __m256 wsv = simple ? halves8(blk, 0) : _mm256_load_ps(ws);
    const __m256 wmv = (F == Q4_1 || F == Q5_1) ? halves8(blk, 2) : simple ? _mm256_setzero_ps() : _mm256_load_ps(wm);
    for (int i = 0; i < MT; ++i) acc[i] = combine<F>(acc[i], reduce8(v[i]), wsv, wmv, X, m0 + i, b);
  }
  for (int i = 0; i < MT; ++i) store_outputs(acc[i], ys[m0 + i], n0, valid, bias);
}

// Many rows: 8 weight rows decoded so a 32-byte vector holds codes 4t..4t+3 of each of the 8 rows. A work
// item's 16 rows are G = 2 such groups side by side, so a 64-byte line holds codes 4t..4t+3 of all 16
// (an AMX tile row). Its panel is laid out part after part in one buffer, so the same bytes
// come either from a decode in the call or from a model's panels packed once at load (``vc_q8_pack``:
// verification rows and batches then read its lines instead of decoding every weight each call)
constexpr int64_t G = 2;   // groups of 8 weight rows a work item (its 16 outputs)

// The VNNI build keeps its panels near the blocks' size, since rows of a verification or a batch are
// bound by reading them: codes of up to 6 bits packed, a line's 64 codes as 32 bytes of nibbles (byte
// i: code i low, code 32 + i high) and a 64-bit mask a higher bit (Q6_K's codes as q = c + 32,
// unsigned); the blocks' own fp16 scales (and mins) where a block has them first; Q6_K's integer scales
// as int8. A few instructions a line rebuild it, shared by a tile's rows: ~0.7-0.95 bytes a code against
// ~1.1-1.4. Panels are therefore a build's own (``vc_q8_panel_bytes`` differs).
#if defined(VC_HAS_VNNI_TILES)
constexpr bool VNNI_PANELS = true;
#else
constexpr bool VNNI_PANELS = false;
#endif

template <int F>
struct PanelLayout {
  static constexpr bool compact = VNNI_PANELS && code_bits(F) <= 6;       // codes packed
  static constexpr bool half_scales = VNNI_PANELS && scales_first(F);     // ws, wm as fp16
  static constexpr int64_t line = !compact ? 64 : 32 + 8 * (code_bits(F) - 4);   // bytes a line of 64 codes
  static constexpr int64_t WS = half_scales ? 16 : 32, WM = has_min(F) ? WS : 0;
  static constexpr int64_t U = 8 * line / G, SC = F != Q6_K ? 0 : VNNI_PANELS ? 16 : 64;
  static constexpr int64_t per_block = U + WS + WM + SC;   // bytes a group's block
};

struct Panel {                  // a view: u [nb, 8 steps t, G, 8 rows, 4 codes], ws/wm [nb, G, 8 rows] fp32,
  int64_t nb = 0;               // sc [nb, G, 2 halves, 16] int16 (Q6_K's scale of each int16 pair)
  const uint8_t* u = nullptr;
  const float *ws = nullptr, *wm = nullptr;   // wm: formats with a min only
  const int16_t* sc = nullptr;                // Q6_K only
  // the VNNI layout: ws/wm [nb, G, 8 rows] as fp16 (``half_scales``), Q6_K's sc [nb, 2 halves, 16 outputs] int8
  const uint16_t *ws16 = nullptr, *wm16 = nullptr;
  const int8_t* sc8 = nullptr;
};

template <int F>
Panel panel_at(const uint8_t* base, int64_t nb) {
  using L = PanelLayout<F>;
  const int64_t n = G * nb;
  Panel P;
  P.nb = nb;
  P.u = base;
  const uint8_t *ws = base + n * L::U, *wm = ws + n * L::WS, *sc = wm + n * L::WM;
  if (L::half_scales) {
    P.ws16 = (const uint16_t*)ws;
    P.wm16 = L::WM ? (const uint16_t*)wm : nullptr;
  } else {
    P.ws = (const float*)ws;
    P.wm = L::WM ? (const float*)wm : nullptr;
  }
  if (VNNI_PANELS) P.sc8 = L::SC ? (const int8_t*)sc : nullptr;
  else P.sc = L::SC ? (const int16_t*)sc : nullptr;
  return P;
}

// A block's 8 lines of 64 codes -> the panel's bytes at ``out`` (as they are, or packed: ``PanelLayout``)
template <int F>
void store_lines(const uint8_t (&lines)[8][64], uint8_t* out) {
  using L = PanelLayout<F>;
  for (int t = 0; t < 8; ++t) {
    uint8_t* p = out + L::line * t;
    if (!L::compact) {
      std::memcpy(p, lines[t], 64);
      continue;
    }
#if defined(VC_HAS_VNNI_TILES)   // (compact only in this build) the codes unsigned: Q6_K's c + 32
    __m512i q = _mm512_loadu_si512(lines[t]);
    if (F == Q6_K) q = _mm512_add_epi8(q, _mm512_set1_epi8(32));
    const __m512i lo = _mm512_and_si512(q, _mm512_set1_epi8(0x0f));
    const __m256i nib = _mm256_or_si256(_mm512_castsi512_si256(lo),
                                        _mm256_slli_epi16(_mm512_extracti64x4_epi64(lo, 1), 4));
    _mm256_storeu_si256((__m256i*)p, nib);
    for (int bit = 4; bit < code_bits(F); ++bit) {
      const uint64_t mask = _cvtmask64_u64(_mm512_test_epi8_mask(q, _mm512_set1_epi8((char)(1 << bit))));
      std::memcpy(p + 32 + 8 * (bit - 4), &mask, 8);
    }
#endif
  }
}

// Rows n0 .. n0 + rows (<= 8 G) of W, the last repeated up to 8 G, into a panel at ``out``
template <int F>
void decode_panel(const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t rows, int64_t nb, uint8_t* out) {
  using L = PanelLayout<F>;
  const int64_t n = G * nb;
  uint8_t *pws = out + n * L::U, *pwm = pws + n * L::WS, *psc = pwm + n * L::WM;
  for (int64_t b = 0; b < nb; ++b) {
    alignas(64) uint8_t lines[8][64];   // line t: codes 4t..4t+3 of the item's 16 rows
    for (int64_t r = 0; r < 8 * G; ++r) {
      const int64_t g = r / 8, j = r % 8, gb = b * G + g;
      const uint8_t* row = w + (n0 + std::min(r, rows - 1)) * row_bytes;
      alignas(32) uint8_t u[32];
      int32_t sc;
      float ws, wm;
      decode_block<F>(row, b, u, &ws, &wm, &sc);
      if (L::half_scales) {   // the block's own fp16s (ws, then a min format's wm)
        const uint8_t* blk = row + b * block_bytes(F);
        std::memcpy(pws + 2 * (gb * 8 + j), blk, 2);
        if (L::WM) std::memcpy(pwm + 2 * (gb * 8 + j), blk + 2, 2);
      } else {
        std::memcpy(pws + 4 * (gb * 8 + j), &ws, 4);
        if (L::WM) std::memcpy(pwm + 4 * (gb * 8 + j), &wm, 4);
      }
      for (int t = 0; t < 8; ++t) std::memcpy(&lines[t][4 * r], u + 4 * t, 4);
      for (int h = 0; L::SC && h < 2; ++h) {   // Q6_K: each half's integer scale
        const int16_t v = (int16_t)(h ? sc >> 16 : sc & 0xffff);
        if (VNNI_PANELS) {
          psc[b * 32 + 16 * h + r] = (uint8_t)(int8_t)v;   // [nb, 2 halves, 16 outputs]
        } else {   // int16 pairs: only its madd multipliers differ from 1
          int16_t* p16 = (int16_t*)psc;
          p16[gb * 32 + 16 * h + 2 * j] = p16[gb * 32 + 16 * h + 2 * j + 1] = v;
        }
      }
    }
    store_lines<F>(lines, out + b * G * L::U);
  }
}

// Steps t0 .. t0 + T16 of block b: MT rows x NG groups of 8 outputs, summed in int16 (or by VNNI in
// int32), then as int32 into si
template <int F, int MT, int NG, int T16>
VC_INLINE void panel_steps(const uint8_t* pu, const int8_t* const* ab, int t0, const int16_t* psc, int64_t scs,
                           __m256i (&si)[MT][NG]) {
  __m256i s16[MT][NG];
  for (int i = 0; i < MT; ++i)
    for (int g = 0; g < NG; ++g) s16[i][g] = _mm256_setzero_si256();
#pragma GCC unroll 8
  for (int t = t0; t < t0 + T16; ++t) {
    __m256i a[MT];
    for (int i = 0; i < MT; ++i) {
      int32_t four;
      std::memcpy(&four, ab[i] + 4 * t, 4);
      a[i] = _mm256_set1_epi32(four);
    }
#pragma GCC unroll 4
    for (int g = 0; g < NG; ++g) {
      const __m256i c = _mm256_loadu_si256((const __m256i*)(pu + t * 32 * G));
      const __m256i u = kind_of(F) == UNSIGNED ? c : _mm256_sign_epi8(c, c);
#pragma GCC unroll 4
      for (int i = 0; i < MT; ++i) {
        const __m256i ai = kind_of(F) == UNSIGNED ? a[i] : _mm256_sign_epi8(a[i], c);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
        if (kind_of(F) != SCALED) { si[i][g] = _mm256_dpbusd_epi32(si[i][g], u, ai); continue; }
#endif
        s16[i][g] = _mm256_add_epi16(s16[i][g], _mm256_maddubs_epi16(u, ai));
      }
    }
  }
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  if (kind_of(F) != SCALED) return;
#endif
  for (int g = 0; g < NG; ++g) {
    const __m256i mul = kind_of(F) == SCALED ? _mm256_loadu_si256((const __m256i*)(psc + g * scs + 16 * (t0 / 4)))
                                             : _mm256_set1_epi16(1);
    for (int i = 0; i < MT; ++i) si[i][g] = _mm256_add_epi32(si[i][g], _mm256_madd_epi16(s16[i][g], mul));
  }
}

// MT rows (from m0) x NG groups of 8 panel rows (from g0)
template <int F, int MT, int NG>
void panel_tile(const Panel& P, int64_t g0, const QActs& X, int64_t m0, float* const* ys, int64_t n0, int64_t valid,
                const float* bias) {
  static_assert(NG == 1, "one group a tile: more spill AVX2's 16 registers");
  static_assert(!PanelLayout<F>::compact, "AVX2's tiles read whole lines");
  constexpr int T16 = steps16(F);
  const int64_t nb = P.nb;
  __m256 acc[MT];
  for (int i = 0; i < MT; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t* ab[MT];
    for (int i = 0; i < MT; ++i) ab[i] = X.a.data() + ((m0 + i) * nb + b) * 32;
    const int64_t gb = b * G + g0;
    __m256i si[MT][1];
    for (int i = 0; i < MT; ++i) si[i][0] = _mm256_setzero_si256();
    for (int t0 = 0; t0 < 8; t0 += T16)
      panel_steps<F, MT, 1, T16>(P.u + b * 256 * G + 32 * g0, ab, t0, P.sc ? P.sc + gb * 32 : nullptr, 0, si);
    const __m256 ws = _mm256_loadu_ps(P.ws + gb * 8), wm = P.wm ? _mm256_loadu_ps(P.wm + gb * 8) : _mm256_setzero_ps();
    for (int i = 0; i < MT; ++i) acc[i] = combine<F>(acc[i], si[i][0], ws, wm, X, m0 + i, b);
  }
  const int64_t left = valid - 8 * g0;
  for (int i = 0; i < MT; ++i)
    if (left > 0) store_outputs(acc[i], ys[m0 + i], n0 + 8 * g0, left < 8 ? (int)left : 8, bias);
}

constexpr int64_t DIRECT_ROWS = 3;   // up to this many rows read the blocks directly,
constexpr bool PANELS_FROM_ONE_ROW = VNNI_PANELS;   // but not where the VNNI build has its panels
constexpr int64_t NB = 8 * G;        // weight rows a work item
constexpr int MT = 2;                // rows of x a panel tile

#if defined(__AVX512F__)
// 16 outputs (the AMX and VNNI tiles): acc += one block of a row (its scales dx, ds), its exact s in the
// contract's fp32 chain
template <int F>
VC_INLINE __m512 combine16(__m512 acc, __m512i s, __m512 ws, __m512 wm, float dx, float ds) {
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(ws, _mm512_set1_ps(dx)), acc);
  return has_min(F) ? _mm512_fmadd_ps(wm, _mm512_set1_ps(ds), acc) : acc;
}

// A row's 16 outputs (``valid`` of them) from n0, with the bias
VC_INLINE void store16(__m512 acc, float* y, int64_t n0, int64_t valid, const float* bias) {
  alignas(64) float t[16];
  _mm512_store_ps(t, acc);
  for (int64_t j = 0; j < valid; ++j) y[n0 + j] = bias ? t[j] + bias[n0 + j] : t[j];
}
#endif

#if defined(__AMX_INT8__) && defined(__AVX512F__)
// AMX (the amx build): 16 rows of x and an item's 16 outputs a tile, one block of 32 codes a tile
// multiply: C[16 x 16] int32 = A[16 rows x 32 activations] . B[8 steps x 16 outputs x 4 codes], B being
// the panel's 64-byte lines as they lie. C is the contract's s for 16 x 16 pairs, exact like every other
// build's, and the combine is the same fp32 chain in 16-lane vectors. Q6_K multiplies each half block
// (16 codes, its own integer scale) apart and sums sc0 C0 + sc1 C1 in int32, as madd does.
#define VC_HAS_AMX 1
constexpr int64_t AMX_ROWS = 16;   // rows of x a tile (the activations are padded to a multiple)

struct alignas(64) TileConfig {
  uint8_t palette_id = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// This thread's tiles (ldtilecfg is per thread): 0, 1 C (Q6_K: a half each); 2 A, 3 B; 4, 5 A's halves and
// 6, 7 B's halves (Q6_K)
void load_tiles() {
  TileConfig c;
  const int shape[8][2] = {{16, 64}, {16, 64}, {16, 32}, {8, 64}, {16, 16}, {16, 16}, {4, 64}, {4, 64}};
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = (uint8_t)shape[t][0];
    c.colsb[t] = (uint16_t)shape[t][1];
  }
  // the whole config as ldtilecfg's operand: GCC 12's _tile_loadconfig names only its first 8 bytes,
  // so the stores of the rows and widths may be dropped as dead (int_scores.h's amx_configure alike)
  __asm__ volatile("ldtilecfg %0" ::"m"(c));
}

template <int F>
void amx_item(const Panel& P, const QActs& X, int64_t M, float* const* ys, int64_t n0, int64_t valid,
              const float* bias) {
  const int64_t nb = X.nb, K = 32 * nb;
  alignas(64) int32_t c0[AMX_ROWS][16], c1[AMX_ROWS][16];
  alignas(64) int32_t sc[2][16];
  for (int64_t m0 = 0; m0 < M; m0 += AMX_ROWS) {
    const int64_t rows = std::min(AMX_ROWS, M - m0);   // the rest of the tile: padding, not combined
    __m512 acc[AMX_ROWS];
    for (int i = 0; i < AMX_ROWS; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const int8_t* a = X.a.data() + m0 * K + 32 * b;
      const uint8_t* u = P.u + b * 256 * G;
      _tile_zero(0);
      if (F == Q6_K) {
        _tile_zero(1);
        _tile_loadd(4, a, K);
        _tile_loadd(5, a + 16, K);
        _tile_loadd(6, u, 64);
        _tile_loadd(7, u + 256, 64);
        _tile_dpbssd(0, 4, 6);
        _tile_dpbssd(1, 5, 7);
        _tile_stored(1, c1, 64);
        for (int n = 0; n < 16; ++n)   // the panel's int16 pairs: output n's scale of each half
          for (int h = 0; h < 2; ++h) sc[h][n] = P.sc[(b * G + n / 8) * 32 + 16 * h + 2 * (n % 8)];
      } else {
        _tile_loadd(2, a, K);
        _tile_loadd(3, u, 64);
        if (kind_of(F) == UNSIGNED) _tile_dpbsud(0, 2, 3);   // signed activations . unsigned codes
        else _tile_dpbssd(0, 2, 3);
      }
      _tile_stored(0, c0, 64);
      const __m512 ws = _mm512_loadu_ps(P.ws + b * 16);
      const __m512 wm = has_min(F) ? _mm512_loadu_ps(P.wm + b * 16) : _mm512_setzero_ps();
      for (int i = 0; i < rows; ++i) {
        __m512i si = _mm512_load_si512(c0[i]);
        if (F == Q6_K)
          si = _mm512_add_epi32(_mm512_mullo_epi32(si, _mm512_load_si512(sc[0])),
                                _mm512_mullo_epi32(_mm512_load_si512(c1[i]), _mm512_load_si512(sc[1])));
        const int64_t x = (m0 + i) * nb + b;
        if (offset_of(F)) si = _mm512_sub_epi32(si, _mm512_set1_epi32(offset_of(F) * X.sa[x]));
        acc[i] = combine16<F>(acc[i], si, ws, wm, X.dx[x], X.ds[x]);
      }
    }
    for (int64_t i = 0; i < rows; ++i) store16(acc[i], ys[m0 + i], n0, valid, bias);
  }
}
#endif

#if defined(VC_HAS_VNNI_TILES)
// VNNI (the avx512vnni build): an item's 16 outputs lie in one 64-byte panel line per step of 4 codes,
// so one zmm `dpbusd` takes codes 4t..4t+3 of all 16 against a row's 4 activations broadcast. MR rows
// a tile keep their accumulators in registers over the whole K. `dpbusd` multiplies unsigned codes by
// signed activations and never saturates, so Q8_0's signed codes go in as c + 128 (their top bit
// flipped) and 128 sa comes off the int32 sum; Q6_K's are packed as c + 32, and 32 times each half's sum
// of activations comes off that half's before its integer scale: the contract's s exactly, and the
// combine is the same fp32 chain in 16-lane vectors.
// Q6_K: the 16 outputs' integer scale of half h of block b, as int32
VC_INLINE __m512i q6k_scales(const Panel& P, int64_t b, int h) {
  return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(P.sc8 + b * 32 + 16 * h)));
}

// The 16 outputs' ws (or wm) of block b: fp32, or the blocks' fp16 widened (exact)
template <int F>
VC_INLINE __m512 panel_scales(const float* f32, const uint16_t* f16, int64_t b) {
  if (PanelLayout<F>::half_scales) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(f16 + b * 16)));
  return _mm512_loadu_ps(f32 + b * 16);
}

// Line t of a block's panel bytes ``u`` as its 64 codes (packed lines: the nibbles' low half, then their
// high half, and each higher bit added where its mask has it)
template <int F>
VC_INLINE __m512i panel_line(const uint8_t* u, int t) {
  using L = PanelLayout<F>;
  const uint8_t* p = u + L::line * t;
  if (!L::compact) return _mm512_loadu_si512(p);
  const __m512i n = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)p));
  __m512i c = _mm512_and_si512(_mm512_mask_srli_epi16(n, 0xffff0000u, n, 4), _mm512_set1_epi8(0x0f));
  for (int bit = 4; bit < code_bits(F); ++bit) {
    uint64_t mask;
    std::memcpy(&mask, p + 32 + 8 * (bit - 4), 8);
    c = _mm512_mask_add_epi8(c, _cvtu64_mask64(mask), c, _mm512_set1_epi8((char)(1 << bit)));
  }
  return c;
}

// acc + u8(c) . s8(the 4 bytes at a, broadcast) per int32 lane: one `vpdpbusd` with its broadcast operand
// (GCC 12 loads the intrinsic's set1 apart, and may shuffle an accumulator between registers around it)
VC_INLINE __m512i dpbusd_bcast(__m512i acc, __m512i c, const int32_t* a) {
  __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(c), "m"(*a));
  return acc;
}

// Rows m0 .. m0 + MR - 1 against an item's 16 outputs; they lie in one group of VNNI_ROWS (``TileActs``):
// ``vnni_item`` starts its tiles of 8 and 4 at multiples of 8 and the smaller ones within the last group
template <int F, int MR>
void vnni_tile(const Panel& P, const QActs& X, int64_t m0, float* const* ys, int64_t n0, int64_t valid,
               const float* bias) {
  // packed Q6_K codes are q = c + 32, unsigned; Q8_0's are signed bytes
  constexpr bool flip = kind_of(F) != UNSIGNED && !PanelLayout<F>::compact;
  constexpr int off = flip ? 128 : F == Q6_K ? 32 : offset_of(F);
  const int64_t nb = X.nb, at = m0 / VNNI_ROWS * nb * VNNI_ROWS + m0 % VNNI_ROWS;   // block 0's row 0
  const int8_t* a = X.tiles.a.data() + at * 32;   // block b's row i at a + (b * VNNI_ROWS + i) * 32
  const float *dx = X.tiles.dx.data() + at, *ds = X.tiles.ds.data() + at;   // [b * VNNI_ROWS + i]
  const int32_t *sa = X.tiles.sa.data() + at, *sh = X.tiles.sh.data() + at;
  __m512 acc[MR];
  for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* u = P.u + b * PanelLayout<F>::U * G;
    const int32_t* ab = (const int32_t*)(a + b * VNNI_ROWS * 32);   // row i's dword t: ab[8 i + t] (32 bytes a row)
    __m512i s0[MR], s1[MR];
    for (int i = 0; i < MR; ++i) s0[i] = s1[i] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) {
      __m512i c = panel_line<F>(u, t);
      if (flip) c = _mm512_xor_si512(c, _mm512_set1_epi8((char)0x80));
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {   // two chains a row (Q6_K: its halves; else even and odd steps)
        if (F == Q6_K ? t >= 4 : t % 2) s1[i] = dpbusd_bcast(s1[i], c, ab + 8 * i + t);
        else s0[i] = dpbusd_bcast(s0[i], c, ab + 8 * i + t);
      }
    }
    const __m512 ws = panel_scales<F>(P.ws, P.ws16, b);
    const __m512 wm = has_min(F) ? panel_scales<F>(P.wm, P.wm16, b) : _mm512_setzero_ps();
    __m512i sc0 = _mm512_setzero_si512(), sc1 = sc0;
    if (F == Q6_K) { sc0 = q6k_scales(P, b, 0); sc1 = q6k_scales(P, b, 1); }
    for (int i = 0; i < MR; ++i) {
      const int64_t x = b * VNNI_ROWS + i;
      __m512i s;
      if (F == Q6_K) {
        const int32_t lo = sh[x], hi = sa[x] - lo;
        s = _mm512_add_epi32(_mm512_mullo_epi32(_mm512_sub_epi32(s0[i], _mm512_set1_epi32(off * lo)), sc0),
                             _mm512_mullo_epi32(_mm512_sub_epi32(s1[i], _mm512_set1_epi32(off * hi)), sc1));
      } else {
        s = _mm512_add_epi32(s0[i], s1[i]);
        if (off) s = _mm512_sub_epi32(s, _mm512_set1_epi32(off * sa[x]));
      }
      acc[i] = combine16<F>(acc[i], s, ws, wm, dx[x], ds[x]);
    }
  }
  for (int i = 0; i < MR; ++i) store16(acc[i], ys[m0 + i], n0, valid, bias);
}

// All M rows of one item: tiles of 8, the rest in one tile of as many rows (each tile reads the item's
// whole panel: 3 rows as 2 + 1 read it twice, 7 as 4 + 2 + 1 three times; a row's sums are its own, so
// how rows are tiled changes no bit)
template <int F>
void vnni_item(const Panel& P, const QActs& X, int64_t M, float* const* ys, int64_t n0, int64_t valid,
               const float* bias) {
  int64_t m = 0;
  for (; m + VNNI_ROWS <= M; m += VNNI_ROWS) vnni_tile<F, VNNI_ROWS>(P, X, m, ys, n0, valid, bias);
  switch (M - m) {
    case 1: vnni_tile<F, 1>(P, X, m, ys, n0, valid, bias); break;
    case 2: vnni_tile<F, 2>(P, X, m, ys, n0, valid, bias); break;
    case 3: vnni_tile<F, 3>(P, X, m, ys, n0, valid, bias); break;
    case 4: vnni_tile<F, 4>(P, X, m, ys, n0, valid, bias); break;
    case 5: vnni_tile<F, 5>(P, X, m, ys, n0, valid, bias); break;
    case 6: vnni_tile<F, 6>(P, X, m, ys, n0, valid, bias); break;
    case 7: vnni_tile<F, 7>(P, X, m, ys, n0, valid, bias); break;
    default: break;
  }
}
#endif

// The bytes of a work item's panel (its NB rows) and of a matrix's packed panels (``vc_q8_pack``)
template <int F>
int64_t item_panel_bytes(int64_t nb) { return G * nb * PanelLayout<F>::per_block; }

// Output rows n0 .. n0 + nb. ``packed``: the matrix's panels packed at load (null: decode them here into
// ``scratch``, one item's bytes)
template <int F>
void q8_item(const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t nb, int64_t n_total, const QActs& X, int64_t M,
             float* const* ys, const float* bias, const uint8_t* packed, uint8_t* scratch) {
  if (M <= DIRECT_ROWS && !(packed && PANELS_FROM_ONE_ROW)) {
    for (int64_t n = n0; n < n0 + nb; n += 8) {
      const int valid = (int)std::min<int64_t>(8, n0 + nb - n);
      switch (M) {
        case 1: direct_tile<F, 1>(w, row_bytes, n, valid, n_total, X, 0, ys, bias); break;
        case 2: direct_tile<F, 2>(w, row_bytes, n, valid, n_total, X, 0, ys, bias); break;
        default: direct_tile<F, 3>(w, row_bytes, n, valid, n_total, X, 0, ys, bias); break;
      }
    }
    return;
  }
  const uint8_t* base = packed ? packed + n0 / NB * item_panel_bytes<F>(X.nb) : scratch;
  if (!packed) decode_panel<F>(w, row_bytes, n0, nb, X.nb, scratch);
  const Panel P = panel_at<F>(base, X.nb);
#if defined(VC_HAS_AMX)
  amx_item<F>(P, X, M, ys, n0, nb, bias);
#elif defined(VC_HAS_VNNI_TILES)
  vnni_item<F>(P, X, M, ys, n0, nb, bias);
#else
  int64_t m = 0;
  for (; m + MT <= M; m += MT)
    for (int64_t g = 0; g < G; ++g) panel_tile<F, MT, 1>(P, g, X, m, ys, n0, nb, bias);
  for (; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) panel_tile<F, 1, 1>(P, g, X, m, ys, n0, nb, bias);
#endif
}

// W [N, K] -> its panels, item after item (``item_panel_bytes`` each), for ``q8_item``'s ``packed``
template <int F>
void pack_panels(const uint8_t* w, int64_t row_bytes, int64_t N, int64_t nb, uint8_t* out, int threads) {
  const int64_t items = (N + NB - 1) / NB, bytes = item_panel_bytes<F>(nb);
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t it = 0; it < items; ++it)
    decode_panel<F>(w, row_bytes, it * NB, std::min(NB, N - it * NB), nb, out + it * bytes);
}
#define VC_HAS_PANELS 1
#else
// The contract in scalar code: the portable build, and the reference every other build matches
constexpr int64_t NB = 16, DIRECT_ROWS = 0;

template <int F>
int64_t item_panel_bytes(int64_t) { return 0; }   // no panels: the scalar loop reads the blocks

template <int F>
void q8_item(const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t nb, int64_t n_total, const QActs& X, int64_t M,
             float* const* ys, const float* bias, const uint8_t*, uint8_t*) {
  for (int64_t n = n0; n < n0 + nb; ++n) {
    const uint8_t* row = w + n * row_bytes;
    for (int64_t m = 0; m < M; ++m) {
      float acc = 0.0f;
      for (int64_t b = 0; b < X.nb; ++b) {
        uint8_t u[32];
        float ws, wm;
        int32_t sc;
        decode_block<F>(row, b, u, &ws, &wm, &sc);
        const int8_t* a = X.a.data() + (m * X.nb + b) * 32;
        int32_t s = 0;
        for (int e = 0; e < 32; ++e) {
          const int c = kind_of(F) == UNSIGNED ? (int)u[e] - offset_of(F) : (int)(int8_t)u[e];
          const int mul = kind_of(F) == SCALED ? (int)(int16_t)(e < 16 ? (sc & 0xffff) : (sc >> 16)) : 1;
          s += mul * c * a[e];
        }
        const int64_t i = m * X.nb + b;
        acc = std::fma((float)s, ws * X.dx[i], acc);
        if (has_min(F)) acc = std::fma(wm, X.ds[i], acc);
      }
      ys[m][n] = bias ? acc + bias[n] : acc;
    }
  }
}
#endif

template <int F>
void q8_linear(const uint8_t* w, int64_t row_bytes, int64_t N, const QActs& X, int64_t M, const float* bias,
               float* y, int64_t ldy, int threads, const uint8_t* packed) {
  const int64_t items = (N + NB - 1) / NB;
  std::vector<float*> ys(M);
  for (int64_t m = 0; m < M; ++m) ys[m] = y + m * ldy;
  // dynamic: on a shared machine a descheduled thread's items go to the other (bits do not depend on
  // who computes an output)
#pragma omp parallel num_threads(threads)
  {
    // the many-row path without packed panels decodes each item's into this (16-byte aligned floats)
    std::vector<float> scratch(M > DIRECT_ROWS && !packed ? (item_panel_bytes<F>(X.nb) + 3) / 4 : 0);
#if defined(VC_HAS_AMX)
    if (M > DIRECT_ROWS) load_tiles();
#endif
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < items; ++it) {
      const int64_t n0 = it * NB;
      q8_item<F>(w, row_bytes, n0, std::min(NB, N - n0), N, X, M, ys.data(), bias, packed,
                 (uint8_t*)scratch.data());
    }
#if defined(VC_HAS_AMX)
    if (M > DIRECT_ROWS) _tile_release();
#endif
  }
}

}  // namespace

// CALL(F) for the q8 format ``fmt`` names: each format is its own template instance
#define VC_Q8_FORMATS(CALL)                                                                                      \
  switch (fmt) {                                                                                               \
    case Q4_0: CALL(Q4_0); break;                                                                              \
    case Q4_1: CALL(Q4_1); break;                                                                              \
    case Q5_0: CALL(Q5_0); break;                                                                              \
    case Q5_1: CALL(Q5_1); break;                                                                              \
    case Q8_0: CALL(Q8_0); break;                                                                              \
    case Q4_K: CALL(Q4_K); break;                                                                              \
    case Q5_K: CALL(Q5_K); break;                                                                              \
    default: CALL(Q6_K); break;                                                                                \
  }

extern "C" {

// Bytes of W [N, K]'s packed panels in this build (0: the build has no panel path; -1: not a q8 format).
// A build reads only panels of its own layout, and the layouts of a format differ in size, so a caller
// checks a weight's panels against this before handing them over.
int64_t vc_q8_panel_bytes(int fmt, int64_t N, int64_t K) {
  if (!integer_format(fmt) || K % block_elems(fmt) || N <= 0) return -1;
  int64_t per_item = 0;
#define VC_ITEM_BYTES(F) per_item = item_panel_bytes<F>(K / 32)
  VC_Q8_FORMATS(VC_ITEM_BYTES)
#undef VC_ITEM_BYTES
  return (N + NB - 1) / NB * per_item;
}

// W's panels into ``out`` (vc_q8_panel_bytes of them): what every many-row call would decode, once
int vc_q8_pack(int fmt, const uint8_t* w, int64_t row_bytes, int64_t N, int64_t K, uint8_t* out, int n_threads) {
  if (vc_q8_panel_bytes(fmt, N, K) <= 0) return -1;
  const int threads = n_threads > 0 ? n_threads : omp_get_max_threads();
#if defined(VC_HAS_PANELS)
#define VC_PACK(F) pack_panels<F>(w, row_bytes, N, K / 32, out, threads)
  VC_Q8_FORMATS(VC_PACK)
#undef VC_PACK
#else
  (void)w; (void)row_bytes; (void)out; (void)threads;
#endif
  return 0;
}

// Returns 0, -1 for bad arguments, -2 for a format without integer codes (the caller runs the fp32 op).
// ``packed``: W's panels from vc_q8_pack (or null): the same bits either way, fewer instructions with them.
int vc_linear_q8_packed(int fmt, const uint8_t* w, const uint8_t* packed, int64_t row_bytes, int64_t N, int64_t K,
                        const float* x, int64_t ldx, int64_t M, const float* bias, float* y, int64_t ldy,
                        int n_threads) {
  if (fmt >= 0 && fmt <= Q6_K && !integer_format(fmt)) return -2;
  if (!integer_format(fmt) || K % block_elems(fmt) || ldx < K || ldy < N || M < 0) return -1;
  if (M == 0 || N == 0) return 0;
  const int threads = n_threads > 0 ? n_threads : omp_get_max_threads();
  QActs X;
  X.nb = K / 32;
#if defined(VC_HAS_AMX)   // whole tiles of rows: the padding rows are zeros, computed and never stored
  const int64_t rows = (M + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS;
#else
  const int64_t rows = M;
#endif
  X.a.resize(rows * K);
  X.dx.resize(rows * X.nb);
  X.ds.resize(rows * X.nb);
  X.sa.resize(rows * X.nb);
  X.sh.resize(rows * X.nb);
#if defined(VC_HAS_VNNI_TILES)
  const int64_t tile_rows = (M + VNNI_ROWS - 1) / VNNI_ROWS * VNNI_ROWS;
  X.tiles.a.resize(tile_rows * K);
  for (auto* v : {&X.tiles.dx, &X.tiles.ds}) v->resize(tile_rows * X.nb);
  for (auto* v : {&X.tiles.sa, &X.tiles.sh}) v->resize(tile_rows * X.nb);
#endif
  auto quantize = [&](int64_t m) {
    quantize_row(x + m * ldx, X.nb, X.a.data() + m * K, X.dx.data() + m * X.nb, X.ds.data() + m * X.nb,
                 X.sa.data() + m * X.nb, X.sh.data() + m * X.nb);
#if defined(VC_HAS_VNNI_TILES)
    for (int64_t b = 0; b < X.nb; ++b) {   // row m's blocks in the tiles' order
      const int64_t from = m * X.nb + b, to = (m / VNNI_ROWS * X.nb + b) * VNNI_ROWS + m % VNNI_ROWS;
      std::memcpy(X.tiles.a.data() + to * 32, X.a.data() + from * 32, 32);
      X.tiles.dx[to] = X.dx[from];
      X.tiles.ds[to] = X.ds[from];
      X.tiles.sa[to] = X.sa[from];
      X.tiles.sh[to] = X.sh[from];
    }
#endif
  };
  if (M < 16) {   // a few rows: not worth a parallel region
    for (int64_t m = 0; m < M; ++m) quantize(m);
  } else {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t m = 0; m < M; ++m) quantize(m);
  }
#define VC_RUN(F) q8_linear<F>(w, row_bytes, N, X, M, bias, y, ldy, threads, packed)
  VC_Q8_FORMATS(VC_RUN)
#undef VC_RUN
  return 0;
}

int vc_linear_q8(int fmt, const uint8_t* w, int64_t row_bytes, int64_t N, int64_t K, const float* x, int64_t ldx,
                 int64_t M, const float* bias, float* y, int64_t ldy, int n_threads) {
  return vc_linear_q8_packed(fmt, w, nullptr, row_bytes, N, K, x, ldx, M, bias, y, ldy, n_threads);
}

}  // extern "C"
