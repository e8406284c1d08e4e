// Attention scores as exact integer dot products (the "q8qk" numerics; packed_attention.cpp's dense
// parts). Integer sums are exact, so every unit below (scalar, AVX2 and AVX-512 `maddubs`, VNNI `dpbusd`,
// AMX `tdpbssd`) gives the same int32 for every (row, key), and one fp32 formula turns it into the score:
//   a query row x (one query head's row, already scaled by 1/sqrt(D)) and a key t (one KV head's stored
//   row, widened exactly to fp32) are each quantized alone:
//     d = max_j |x_j| / 127,  a_j = nearbyint(x_j * (1 / d)) in [-127, 127]   (all 0 when max |x| = 0)
//   s[x][t] = fma(float(sum_j a_j c_j), dq[x] * dk[t], qmu[x])  (|sum| <= 127^2 D < 2^24: exact as a float)
// where the rows are not coded as they are but in their head's fixed key coding (model constants,
// ``model/key_coding.py``): a key as (k_j - mu_j) / s_j and a query as x_j * s_j. The offset mu (a
// channel's mean) keeps a biased channel from spending a key's 8 bits, and qmu[x] = sum_j x_j mu_j (fp32
// fmas in j order) gives each row its share back; the channel scale s (powers of two: exact) moves a
// key channel's range into the queries' and back (SmoothQuant's balance), so neither side's outlier
// channel takes the other channels' bits. The product is unchanged: sum_j (x_j s_j)((k_j - mu_j) / s_j)
// + x . mu = x . k. mu = 0 and s = 1 give the plain product's bits.
// The value pass likewise: a value row (one KV head's) is coded as a key is (codes v_c, scale dv), and a
// row's probabilities over a block of KB keys (p_t = exp(s_t - m), 0 past what it sees) are coded with
// each key's value scale folded in:
//     w_t = p_t * dv[t],  dw = max_t w_t / 255,  u_t = nearbyint(w_t * (1 / dw)) in [0, 255]
//   pv[c] = sum_t u_t v_t[c] (exact int32), and the row's accumulator: acc[c] = fma(float(pv[c]), dw,
//   acc[c] * alpha) (alpha: the online softmax's rescale); its denominator stays the fp32 sum of p_t.
// A row's scores and weights depend on its own codes and its keys' and values' alone, never on which
// rows share its tile, its chunk or its batch: batch invariance by construction, the same bits in every
// build.
//
// Units (``Unit``; chosen at load from the CPU, ``kernels.cpu``): the build's own vector code (AVX-512
// or AVX2 `maddubs`, or scalar in the portable build), VNNI and AMX (compiled into the AVX-512 build by
// target attributes, run only where the CPU has them and, for AMX, Linux granted the tiles).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#include <sys/syscall.h>
#include <unistd.h>

namespace vc_int_scores {

constexpr int KB = 64;          // keys a block (the op's BLK)
constexpr int ROWS = 64;        // query rows scored at once (a multiple of AMX's 16 tile rows)
constexpr int MAXD = 256;       // the op's largest head dim

enum Unit { FP32 = 0, BUILD = 1, VNNI = 2, AMX = 3 };   // FP32: the fp32 scores (not this file's)

// The codes of one block of keys, laid out for the matrix units: for each group of 16 keys, D/4 lines
// of 64 bytes, line j4 holding channels 4 j4 .. 4 j4 + 3 of each of the group's 16 keys (AMX's B tile,
// the `dpbusd` / `maddubs` operand); per key its scale and its codes' sum (VNNI's +128 correction).
// Keys past the block's end: codes 0, scale 0 (their scores are 0).
struct KeyCodes {
  alignas(64) int8_t c[KB * MAXD];
  alignas(64) float dk[KB];
  alignas(64) int32_t sum[KB];
};

// A block's codes where they lie: a ``KeyCodes`` made for the call, or the slice of a cache's codes (the
// same layout, kept from step to step: ``kv.full.FullKVCache``'s key codes)
struct KeyView {
  int8_t* c;
  float* dk;
  int32_t* sum;
};

// a [D] = x's codes; returns its scale d (the rule above). D a multiple of 8.
inline float quantize_row(const float* x, int64_t D, int8_t* a) {
  float amax = 0.0f;
#if defined(__AVX512F__)
  if (D % 16 == 0) {
    __m512 m = _mm512_setzero_ps();
    for (int64_t j = 0; j < D; j += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(x + j)));
    amax = _mm512_reduce_max_ps(m);   // a max is exact: any order
    const float d = amax / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
    const __m512 vi = _mm512_set1_ps(inv);   // cvtps rounds to nearest even, as nearbyint does
    for (int64_t j = 0; j < D; j += 16)
      _mm_storeu_si128((__m128i*)(a + j), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + j), vi))));
    return d;
  }
#elif defined(__AVX2__)
  {
    __m256 m = _mm256_setzero_ps();
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t j = 0; j < D; j += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + j)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    const float d = amax / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
    const __m256 vi = _mm256_set1_ps(inv);
    alignas(32) int32_t v[8];
    for (int64_t j = 0; j < D; j += 8) {
      _mm256_store_si256((__m256i*)v, _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + j), vi)));
      for (int i = 0; i < 8; ++i) a[j + i] = (int8_t)v[i];
    }
    return d;
  }
#endif
  for (int64_t j = 0; j < D; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float d = amax / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
  for (int64_t j = 0; j < D; ++j) a[j] = (int8_t)(int)std::nearbyint(x[j] * inv);
  return d;
}

// Key t's codes (a [D]) into the block layout, with its scale and sum.
inline void place_key(const int8_t* a, float d, int64_t t, int64_t D, const KeyView& kv) {
  int8_t* base = kv.c + (t / 16) * 16 * D + (t % 16) * 4;   // group t / 16: D / 4 lines of 64 bytes
  int32_t sum = 0;
  for (int64_t j4 = 0; j4 < D / 4; ++j4) std::memcpy(base + 64 * j4, a + 4 * j4, 4);
  for (int64_t j = 0; j < D; ++j) sum += a[j];
  kv.dk[t] = d;
  kv.sum[t] = sum;
}

// Keys t0 .. bt - 1 of a block (fp32 rows, ``rows[t]``) in the key coding (offset ``mu`` [D], channel
// scale ``sc`` [D]) coded into kv.
inline void code_keys(const float* const* rows, int64_t t0, int64_t bt, int64_t D, const float* mu,
                      const float* sc, const KeyView& kv) {
  alignas(64) int8_t a[MAXD];
  alignas(64) float x[MAXD];
  for (int64_t t = t0; t < bt; ++t) {
#pragma omp simd
    for (int64_t j = 0; j < D; ++j) x[j] = (rows[t][j] - mu[j]) / sc[j];
    place_key(a, quantize_row(x, D, a), t, D, kv);
  }
}

// A query row x [D] (scaled by 1/sqrt(D)) coded in the key coding: codes of x * sc into a, its scale
// into *dq and its share of the offset, sum_j x_j mu_j (fp32 fmas in j order: every build the same
// bits), into *qmu.
inline void code_query(const float* x, int64_t D, const float* mu, const float* sc, int8_t* a, float* dq,
                       float* qmu) {
  alignas(64) float y[MAXD];
  float share = 0.0f;
  for (int64_t j = 0; j < D; ++j) share = std::fma(x[j], mu[j], share);
#pragma omp simd
  for (int64_t j = 0; j < D; ++j) y[j] = x[j] * sc[j];
  *dq = quantize_row(y, D, a);
  *qmu = share;
}

// The block's first bt keys coded into kc, the rest zero; returns kc's view.
inline KeyView quantize_keys(const float* const* rows, int64_t bt, int64_t D, const float* mu, const float* sc,
                             KeyCodes& kc) {
  const KeyView kv{kc.c, kc.dk, kc.sum};
  code_keys(rows, 0, bt, D, mu, sc, kv);
  alignas(64) int8_t a[MAXD] = {};
  for (int64_t t = bt; t < KB; ++t) place_key(a, 0.0f, t, D, kv);
  return kv;
}

// The values of one block the same way, laid out for the value pass's units: for each group of 16
// channels, KB/4 lines of 64 bytes, line t4 holding keys 4 t4 .. 4 t4 + 3 of each of the 16 channels
// (AMX's B tile, the `dpbusd` / `maddubs` operand); per key its scale.
struct ValueCodes {
  alignas(64) int8_t c[KB * MAXD];
  alignas(64) float dv[KB];
};

struct ValueView {
  int8_t* c;
  float* dv;
};

// Key t's value codes (a [D]) into the block layout, with its scale.
inline void place_value(const int8_t* a, float d, int64_t t, int64_t D, const ValueView& vv) {
  int8_t* base = vv.c + (t / 4) * 64 + t % 4;   // channel j at (j / 16) lines-of-the-group + (j % 16) * 4
  for (int64_t j = 0; j < D; ++j) base[(j / 16) * 16 * KB + (j % 16) * 4] = a[j];
  vv.dv[t] = d;
}

// Values t0 .. bt - 1 of a block (fp32 rows) coded into vv.
inline void code_values(const float* const* rows, int64_t t0, int64_t bt, int64_t D, const ValueView& vv) {
  alignas(64) int8_t a[MAXD];
  for (int64_t t = t0; t < bt; ++t) place_value(a, quantize_row(rows[t], D, a), t, D, vv);
}

// The block's first bt values coded into vc, the rest zero; returns vc's view.
inline ValueView quantize_values(const float* const* rows, int64_t bt, int64_t D, ValueCodes& vc) {
  const ValueView vv{vc.c, vc.dv};
  code_values(rows, 0, bt, D, vv);
  alignas(64) int8_t a[MAXD] = {};
  for (int64_t t = bt; t < KB; ++t) place_value(a, 0.0f, t, D, vv);
  return vv;
}

// The largest of a row's weights w_t = p_t dv[t] over a block (p [KB], 0 past what it sees).
inline float weights_max(const float* p, const float* dv) {
#if defined(__AVX512F__)
  __m512 mx = _mm512_setzero_ps();
  for (int c = 0; c < KB / 16; ++c)   // w >= 0: a max is exact in any order
    mx = _mm512_max_ps(mx, _mm512_mul_ps(_mm512_loadu_ps(p + 16 * c), _mm512_loadu_ps(dv + 16 * c)));
  return _mm512_reduce_max_ps(mx);
#else
  float lanes[8] = {};   // 8 running maxima: no chain of 64 dependent max instructions
  for (int t = 0; t < KB; ++t) lanes[t % 8] = std::max(lanes[t % 8], p[t] * dv[t]);
  float amax = 0.0f;
  for (float x : lanes) amax = std::max(amax, x);
  return amax;
#endif
}

// A row's weights' codes u [KB], nearbyint(w_t * inv) (inv = 1 / its scale, 0 for a zero scale).
inline void code_weights_at(const float* p, const float* dv, float inv, uint8_t* u) {
#if defined(__AVX512F__)
  const __m512 vi = _mm512_set1_ps(inv);
  for (int c = 0; c < KB / 16; ++c) {
    const __m512 w = _mm512_mul_ps(_mm512_loadu_ps(p + 16 * c), _mm512_loadu_ps(dv + 16 * c));
    _mm_storeu_si128((__m128i*)(u + 16 * c), _mm512_cvtusepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(w, vi))));
  }
#else
  for (int t = 0; t < KB; ++t) u[t] = (uint8_t)(int)std::nearbyint((p[t] * dv[t]) * inv);
#endif
}

// A chunk's probabilities as the value pass's unsigned codes with the values' scales folded in (the rule
// above): row x's p = s[x] [KB] into u[x * KB ..], its scale into dw[x], for x < nr. In three passes over
// the rows (each row's max, the scales, the codes), not row by row: a row's chain (a reduction, two
// divisions, the codes) is then independent of the next row's, and the CPU overlaps them. Each row's
// operations are the one-row rule's: the same bits.
inline void code_weights(int nr, const float (*s)[KB], const float* dv, float* dw, uint8_t* u) {
  alignas(64) float inv[ROWS];
  for (int x = 0; x < nr; ++x) dw[x] = weights_max(s[x], dv) / 255.0f;
  for (int x = 0; x < nr; ++x) inv[x] = dw[x] > 0.0f ? 1.0f / dw[x] : 0.0f;
  for (int x = 0; x < nr; ++x) code_weights_at(s[x], dv, inv[x], u + x * KB);
}

// ---------------------------------------------------------------- the integer dots: dots[x][t], x < nr
// A: [ROWS][D] codes of nr rows (rows past nr: zeros); every unit fills dots[x][0 .. KB) for x < nr.

inline void dots_scalar(const int8_t* A, int nr, const KeyView& kc, int64_t D, int32_t (*dots)[KB]) {
  for (int x = 0; x < nr; ++x)
    for (int t = 0; t < KB; ++t) {
      const int8_t* k = kc.c + (t / 16) * 16 * D + (t % 16) * 4;
      int32_t s = 0;
      for (int64_t j4 = 0; j4 < D / 4; ++j4)
        for (int i = 0; i < 4; ++i) s += (int32_t)A[x * D + 4 * j4 + i] * k[64 * j4 + i];
      dots[x][t] = s;
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// `maddubs` takes unsigned x signed bytes: |c| against a with c's sign (|a|, |c| <= 127, so a pair
// sums to at most 2 * 127^2 < 2^15: never saturates), then `madd` by ones to int32.
inline void dots_build(const int8_t* A, int nr, const KeyView& kc, int64_t D, int32_t (*dots)[KB]) {
  const __m512i ones = _mm512_set1_epi16(1), zero = _mm512_setzero_si512();
  for (int g = 0; g < KB / 16; ++g) {
    const int8_t* kg = kc.c + g * 16 * D;
    for (int x0 = 0; x0 < nr; x0 += 4) {
      __m512i acc[4] = {zero, zero, zero, zero};
      for (int64_t j4 = 0; j4 < D / 4; ++j4) {
        const __m512i k = _mm512_loadu_si512(kg + 64 * j4);
        const __m512i u = _mm512_abs_epi8(k);
        const __mmask64 neg = _mm512_movepi8_mask(k);
#pragma GCC unroll 4
        for (int x = 0; x < 4; ++x) {
          int32_t four;
          std::memcpy(&four, A + (x0 + x) * D + 4 * j4, 4);
          const __m512i a = _mm512_set1_epi32(four);
          const __m512i s = _mm512_mask_sub_epi8(a, neg, zero, a);
          acc[x] = _mm512_add_epi32(acc[x], _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), ones));
        }
      }
      for (int x = 0; x < 4 && x0 + x < nr; ++x) _mm512_storeu_si512(dots[x0 + x] + 16 * g, acc[x]);
    }
  }
}
#elif defined(__AVX2__)
inline void dots_build(const int8_t* A, int nr, const KeyView& kc, int64_t D, int32_t (*dots)[KB]) {
  const __m256i ones = _mm256_set1_epi16(1);
  for (int h = 0; h < KB / 8; ++h) {   // 8 keys: half of a 16-key group's line
    const int8_t* kh = kc.c + (h / 2) * 16 * D + 32 * (h % 2);
    for (int x0 = 0; x0 < nr; x0 += 4) {
      __m256i acc[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
      for (int64_t j4 = 0; j4 < D / 4; ++j4) {
        const __m256i k = _mm256_loadu_si256((const __m256i*)(kh + 64 * j4));
        const __m256i u = _mm256_abs_epi8(k);
#pragma GCC unroll 4
        for (int x = 0; x < 4; ++x) {
          int32_t four;
          std::memcpy(&four, A + (x0 + x) * D + 4 * j4, 4);
          const __m256i s = _mm256_sign_epi8(_mm256_set1_epi32(four), k);
          acc[x] = _mm256_add_epi32(acc[x], _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), ones));
        }
      }
      for (int x = 0; x < 4 && x0 + x < nr; ++x) _mm256_storeu_si256((__m256i*)(dots[x0 + x] + 8 * h), acc[x]);
    }
  }
}
#else
inline void dots_build(const int8_t* A, int nr, const KeyView& kc, int64_t D, int32_t (*dots)[KB]) {
  dots_scalar(A, nr, kc, D, dots);
}
#endif

#if defined(__AVX512F__) && defined(__GNUC__) && __GNUC__ >= 11
#define VC_INT_SCORES_UNITS 1
// acc + u8(a) . s8(b) per int32 lane (`vpdpbusd`) in inline asm: with the intrinsic, GCC 12 copies each of
// a register tile's 16 accumulators to another register and back around every `vpdpbusd` (~2 moves a
// multiply; 117 against 83 cycles for a 4 x 4 tile's 16 steps, measured), the asm's "+v" keeps each in one
// register. The same instruction: the same bits.
__attribute__((target("avx512f,avx512vnni"))) inline __m512i dpbusd(__m512i acc, __m512i a, __m512i b) {
  __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "vm"(b));
  return acc;
}

// VNNI: `dpbusd` multiplies unsigned by signed bytes, so the rows go in as a + 128 (1 .. 255) and each
// key's 128 * sum_j c_j comes off after: exact in int32.
// Register tiles of 4 rows x the block's 4 groups of 16 keys (16 accumulators): each step over 4 channels
// loads the 4 groups' lines once and broadcasts each row's 4 codes once, for 16 `dpbusd`. (A tile of one
// group, as the build's unit has, reloads the rows' codes for every group: a broadcast and a bias per
// `dpbusd`, and the CPU spent most of its time on those.) Integer sums are exact, so the order changes no bit.
__attribute__((target("avx512f,avx512bw,avx512vnni"))) inline void dots_vnni(const int8_t* A, int nr,
                                                                            const KeyView& kc, int64_t D,
                                                                            int32_t (*dots)[KB]) {
  static_assert(KB == 64, "a tile holds the block's 4 groups of 16 keys");
  const __m512i bias = _mm512_set1_epi8((char)0x80);
  const int8_t* kg = kc.c;   // group g's line j4 at kg + g * 16 * D + 64 * j4
  // rows past nr are zeros (A has ROWS rows), computed and stored (dots has ROWS rows: nr <= ROWS, a multiple
  // of 4), never read: a store the tile's last rows skipped made GCC shuffle its accumulators between registers
  for (int x0 = 0; x0 < nr; x0 += 4) {
    __m512i acc[4][4];
#pragma GCC unroll 4
    for (int x = 0; x < 4; ++x)
#pragma GCC unroll 4
      for (int g = 0; g < 4; ++g) acc[x][g] = _mm512_setzero_si512();
    for (int64_t j4 = 0; j4 < D / 4; ++j4) {
      __m512i k[4];
#pragma GCC unroll 4
      for (int g = 0; g < 4; ++g) k[g] = _mm512_loadu_si512(kg + g * 16 * D + 64 * j4);
#pragma GCC unroll 4
      for (int x = 0; x < 4; ++x) {
        int32_t four;
        std::memcpy(&four, A + (x0 + x) * D + 4 * j4, 4);
        const __m512i a = _mm512_xor_si512(_mm512_set1_epi32(four), bias);
#pragma GCC unroll 4
        for (int g = 0; g < 4; ++g) acc[x][g] = dpbusd(acc[x][g], a, k[g]);
      }
    }
    for (int g = 0; g < 4; ++g) {
      const __m512i corr = _mm512_slli_epi32(_mm512_loadu_si512(kc.sum + 16 * g), 7);
      for (int x = 0; x < 4; ++x) _mm512_storeu_si512(dots[x0 + x] + 16 * g, _mm512_sub_epi32(acc[x][g], corr));
    }
  }
}

struct alignas(64) TileConfig {
  uint8_t palette_id = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Whether this process may run the unit: the CPU has VNNI; Linux grants the AMX tiles (asked once a process,
// as ``kernels.cpu.amx_permitted`` does; without the grant a tile instruction is an illegal instruction).
inline bool unit_permitted(Unit unit) {
  if (unit == VNNI) return __builtin_cpu_supports("avx512vnni");
  if (unit != AMX) return true;
  static const bool granted = [] {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;   // refused without AMX
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return granted;
}

// AMX: tiles 0-3 hold C for the block's 4 groups of 16 keys (16 rows x 16 int32), 4 A (16 rows x 64
// channels), 5 B (a group's 16 lines for 64 channels). This thread's tiles: configured per call.
__attribute__((target("amx-tile,amx-int8"))) inline void amx_configure() {
  TileConfig c;
  for (int t = 0; t < 6; ++t) {
    c.rows[t] = 16;
    c.colsb[t] = 64;
  }
  // ldtilecfg with the whole config as its operand: GCC 12's _tile_loadconfig names only its first 8
  // bytes, so the stores of the rows and widths could be dropped as dead
  __asm__ volatile("ldtilecfg %0" ::"m"(c));
}

__attribute__((target("amx-tile,amx-int8"))) inline void amx_release() { _tile_release(); }

// D a multiple of 64 (else the VNNI unit: the same bits)
__attribute__((target("avx512f,amx-tile,amx-int8"))) inline void dots_amx(const int8_t* A, int nr,
                                                                          const KeyView& kc, int64_t D,
                                                                          int32_t (*dots)[KB]) {
  for (int x0 = 0; x0 < nr; x0 += 16) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t c0 = 0; c0 < D; c0 += 64) {
      _tile_loadd(4, A + x0 * D + c0, D);
      const int8_t* b = kc.c + (c0 / 4) * 64;   // group 0's lines for channels c0 .. c0 + 63
      _tile_loadd(5, b, 64);
      _tile_dpbssd(0, 4, 5);
      _tile_loadd(5, b + 16 * D, 64);
      _tile_dpbssd(1, 4, 5);
      _tile_loadd(5, b + 32 * D, 64);
      _tile_dpbssd(2, 4, 5);
      _tile_loadd(5, b + 48 * D, 64);
      _tile_dpbssd(3, 4, 5);
    }
    _tile_stored(0, dots[x0], KB * 4);
    _tile_stored(1, dots[x0] + 16, KB * 4);
    _tile_stored(2, dots[x0] + 32, KB * 4);
    _tile_stored(3, dots[x0] + 48, KB * 4);
  }
}
#endif

// The unit this build runs for ``unit`` (the same bits whichever it is)
inline Unit runnable(Unit unit, int64_t D) {
#if defined(VC_INT_SCORES_UNITS)
  if (unit == AMX && D % 64 != 0) return VNNI;
  return unit;
#else
  (void)D;
  return unit == FP32 ? FP32 : BUILD;
#endif
}

// Scores s[x][t] = fma(float(dots), dq[x] * dk[t], qmu[x]) for x < nr (<= ROWS) and the block's KB keys; A as
// above with ROWS rows (rows past nr zero: AMX multiplies whole tiles), ``dots`` scratch. AMX: the caller
// configured this thread's tiles (``amx_configure``).
inline void block_scores(Unit unit, const int8_t* A, const float* dq, const float* qmu, int nr, const KeyView& kc,
                         int64_t D, int32_t (*dots)[KB], float (*s)[KB]) {
  switch (runnable(unit, D)) {
#if defined(VC_INT_SCORES_UNITS)
    case AMX: dots_amx(A, nr, kc, D, dots); break;
    case VNNI: dots_vnni(A, nr, kc, D, dots); break;
#endif
    default: dots_build(A, nr, kc, D, dots); break;
  }
  for (int x = 0; x < nr; ++x) {
#if defined(__AVX512F__)
    const __m512 q = _mm512_set1_ps(dq[x]), m = _mm512_set1_ps(qmu[x]);
    for (int t = 0; t < KB; t += 16)
      _mm512_store_ps(s[x] + t, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(dots[x] + t)),
                                                _mm512_mul_ps(q, _mm512_loadu_ps(kc.dk + t)), m));
#else
    for (int t = 0; t < KB; ++t) s[x][t] = std::fma((float)dots[x][t], dq[x] * kc.dk[t], qmu[x]);
#endif
  }
}

// ---------------------------------------------------------------- the value dots: pv[x][c], x < nr
// U: [ROWS][KB] weight codes of nr rows (rows past nr: zeros); each unit fills pv[x][0 .. D) for x < nr.

inline void pv_scalar(const uint8_t* U, int nr, const ValueView& vv, int64_t D, int32_t (*pv)[MAXD]) {
  for (int x = 0; x < nr; ++x)
    for (int64_t c = 0; c < D; ++c) {
      const int8_t* v = vv.c + (c / 16) * 16 * KB + (c % 16) * 4;
      int32_t s = 0;
      for (int t = 0; t < KB; ++t) s += (int32_t)U[x * KB + t] * v[(t / 4) * 64 + t % 4];
      pv[x][c] = s;
    }
}

// The build's own unit: u8 weights times s8 values as int16 pairs (`madd`: a pair's sum is exact in int32;
// `maddubs` would saturate on 255 x 127 pairs). Each row's weights are widened once, and each slice of the
// block's values once for all rows. A value line (4 keys of each channel) widened to int16 holds channel
// c's 4 keys side by side, so `madd` with the weights (u0, u1, u2, u3) repeated gives per channel two int32
// partial sums, (k0, k1) and (k2, k3), added pairwise at the end.
inline void widen_weights(const uint8_t* U, int nr, int16_t (*w16)[KB]) {
  for (int x = 0; x < nr; ++x)
    for (int t = 0; t < KB; ++t) w16[x][t] = U[x * KB + t];
}

inline int64_t four_weights(const int16_t* w) {   // weights t .. t + 3 as one 64-bit lane
  int64_t four;
  std::memcpy(&four, w, 8);
  return four;
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
inline void pv_build(const uint8_t* U, int nr, const ValueView& vv, int64_t D, int32_t (*pv)[MAXD]) {
  alignas(64) int16_t w16[ROWS][KB];
  alignas(64) __m512i v16[KB / 4][2];   // a group's lines as int16: channels 0-7, 8-15
  widen_weights(U, nr, w16);
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  for (int64_t g = 0; g < D / 16; ++g) {
    const int8_t* vg = vv.c + g * 16 * KB;
    for (int t4 = 0; t4 < KB / 4; ++t4) {
      const __m512i v = _mm512_loadu_si512(vg + 64 * t4);
      v16[t4][0] = _mm512_cvtepi8_epi16(_mm512_castsi512_si256(v));
      v16[t4][1] = _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(v, 1));
    }
    for (int x = 0; x < nr; ++x) {
      __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
      for (int t4 = 0; t4 < KB / 4; ++t4) {
        const __m512i w = _mm512_set1_epi64(four_weights(w16[x] + 4 * t4));
        lo = _mm512_add_epi32(lo, _mm512_madd_epi16(v16[t4][0], w));   // channel c's (k0 k1), (k2 k3): lanes 2c, 2c + 1
        hi = _mm512_add_epi32(hi, _mm512_madd_epi16(v16[t4][1], w));
      }
      const __m512i sum = _mm512_add_epi32(_mm512_permutex2var_epi32(lo, even, hi),
                                           _mm512_permutex2var_epi32(lo, odd, hi));
      _mm512_storeu_si512(pv[x] + 16 * g, sum);
    }
  }
}
#elif defined(__AVX2__)
inline void pv_build(const uint8_t* U, int nr, const ValueView& vv, int64_t D, int32_t (*pv)[MAXD]) {
  alignas(64) int16_t w16[ROWS][KB];
  alignas(32) __m256i v16[KB / 4][2];   // a slice's lines as int16: channels 0-3, 4-7
  widen_weights(U, nr, w16);
  for (int64_t h = 0; h < D / 8; ++h) {   // 8 channels: half of a 16-channel group's line
    const int8_t* vh = vv.c + (h / 2) * 16 * KB + 32 * (h % 2);
    for (int t4 = 0; t4 < KB / 4; ++t4) {
      const __m256i v = _mm256_loadu_si256((const __m256i*)(vh + 64 * t4));
      v16[t4][0] = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(v));
      v16[t4][1] = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(v, 1));
    }
    for (int x = 0; x < nr; ++x) {
      __m256i lo = _mm256_setzero_si256(), hi = _mm256_setzero_si256();
      for (int t4 = 0; t4 < KB / 4; ++t4) {
        const __m256i w = _mm256_set1_epi64x(four_weights(w16[x] + 4 * t4));
        lo = _mm256_add_epi32(lo, _mm256_madd_epi16(v16[t4][0], w));
        hi = _mm256_add_epi32(hi, _mm256_madd_epi16(v16[t4][1], w));
      }
      // per 128-bit lane [c0 c1 c4 c5 | c2 c3 c6 c7] after the pairwise add; 64-bit pairs reordered
      _mm256_storeu_si256((__m256i*)(pv[x] + 8 * h), _mm256_permute4x64_epi64(_mm256_hadd_epi32(lo, hi), 0xD8));
    }
  }
}
#else
inline void pv_build(const uint8_t* U, int nr, const ValueView& vv, int64_t D, int32_t (*pv)[MAXD]) {
  pv_scalar(U, nr, vv, D, pv);
}
#endif

#if defined(VC_INT_SCORES_UNITS)
// VNNI's value dots for NG groups of 16 channels from group g0: register tiles of 4 rows x NG groups,
// each step over 4 keys loading the groups' lines once and broadcasting each row's 4 weight codes once.
template <int NG>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) inline void pv_vnni_groups(const uint8_t* U, int nr,
                                                                                  const int8_t* vc, int64_t g0,
                                                                                  int32_t (*pv)[MAXD]) {
  for (int x0 = 0; x0 < nr; x0 += 4) {   // rows past nr: zeros (U has ROWS rows), stored as dots_vnni's, never read
    __m512i acc[4][NG];
#pragma GCC unroll 4
    for (int x = 0; x < 4; ++x)
#pragma GCC unroll 4
      for (int g = 0; g < NG; ++g) acc[x][g] = _mm512_setzero_si512();
    for (int t4 = 0; t4 < KB / 4; ++t4) {
      __m512i v[NG];
#pragma GCC unroll 4
      for (int g = 0; g < NG; ++g) v[g] = _mm512_loadu_si512(vc + (g0 + g) * 16 * KB + 64 * t4);
#pragma GCC unroll 4
      for (int x = 0; x < 4; ++x) {
        int32_t four;
        std::memcpy(&four, U + (x0 + x) * KB + 4 * t4, 4);
        const __m512i w = _mm512_set1_epi32(four);
#pragma GCC unroll 4
        for (int g = 0; g < NG; ++g) acc[x][g] = dpbusd(acc[x][g], w, v[g]);
      }
    }
    for (int x = 0; x < 4; ++x)
#pragma GCC unroll 4
      for (int g = 0; g < NG; ++g) _mm512_storeu_si512(pv[x0 + x] + 16 * (g0 + g), acc[x][g]);
  }
}

__attribute__((target("avx512f,avx512bw,avx512vnni"))) inline void pv_vnni(const uint8_t* U, int nr,
                                                                          const ValueView& vv, int64_t D,
                                                                          int32_t (*pv)[MAXD]) {
  int64_t g0 = 0;
  for (; g0 + 4 <= D / 16; g0 += 4) pv_vnni_groups<4>(U, nr, vv.c, g0, pv);
  switch (D / 16 - g0) {   // D a multiple of 16 (the unit's condition): 0 .. 3 groups left
    case 3: pv_vnni_groups<3>(U, nr, vv.c, g0, pv); break;
    case 2: pv_vnni_groups<2>(U, nr, vv.c, g0, pv); break;
    case 1: pv_vnni_groups<1>(U, nr, vv.c, g0, pv); break;
    default: break;
  }
}

// AMX: C tile 0 (16 rows x 16 channels) += A tile 4 (16 rows x 64 weight codes) . B tile 5 (a channel
// group's 16 lines), unsigned x signed (`tdpbusd`); the tiles as ``amx_configure`` left them.
__attribute__((target("avx512f,amx-tile,amx-int8"))) inline void pv_amx(const uint8_t* U, int nr,
                                                                        const ValueView& vv, int64_t D,
                                                                        int32_t (*pv)[MAXD]) {
  for (int x0 = 0; x0 < nr; x0 += 16) {
    _tile_loadd(4, U + x0 * KB, KB);
    for (int64_t g = 0; g < D / 16; ++g) {
      _tile_zero(0);
      _tile_loadd(5, vv.c + g * 16 * KB, 64);
      _tile_dpbusd(0, 4, 5);
      _tile_stored(0, pv[x0] + 16 * g, MAXD * 4);
    }
  }
}
#endif

// pv[x][c] for x < nr (<= ROWS) and c < D; U as above with ROWS rows (rows past nr zero).
inline void block_values(Unit unit, const uint8_t* U, int nr, const ValueView& vv, int64_t D, int32_t (*pv)[MAXD]) {
  switch (runnable(unit, D)) {
#if defined(VC_INT_SCORES_UNITS)
    case AMX: pv_amx(U, nr, vv, D, pv); break;
    case VNNI: pv_vnni(U, nr, vv, D, pv); break;
#endif
    default: pv_build(U, nr, vv, D, pv); break;
  }
}

}  // namespace vc_int_scores
