// GGUF blocks as stored: the formats, and a block -> fp32 dequantizer that gives exactly the `gguf`
// package's values. Shared by linear.cpp (the exact op) and linear_q8.cpp (the drafts' integer dots).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__AVX2__) || defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

#define VC_INLINE inline __attribute__((always_inline))

namespace vc_gguf {

// the formats by number: layouts.py's FORMATS (checked before any build)
enum Fmt { F32 = 0, F16 = 1, BF16 = 2, Q4_0 = 3, Q4_1 = 4, Q5_0 = 5, Q5_1 = 6, Q8_0 = 7, Q4_K = 8, Q5_K = 9, Q6_K = 10 };

// elements per block and bytes per block, by format
inline int block_elems(int f) { return f <= BF16 ? 1 : (f >= Q4_K ? 256 : 32); }
inline int block_bytes(int f) {
  static const int BLOCK_BYTES[] = {4, 2, 2, 18, 20, 22, 24, 34, 144, 176, 210};   // layouts.py's BLOCK
  return BLOCK_BYTES[f];
}

VC_INLINE float half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000 | (man << 13);                  // inf / nan
  } else if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {                                                  // subnormal: normalise (exact)
      int e = -1;
      uint32_t m = man;
      do { m <<= 1; ++e; } while (!(m & 0x400));
      bits = sign | (uint32_t)(127 - 15 - e) << 23 | (m & 0x3ff) << 13;
    }
  } else {
    bits = sign | (exp + 112) << 23 | man << 13;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

VC_INLINE uint16_t rd16(const uint8_t* p) { uint16_t v; std::memcpy(&v, p, 2); return v; }
VC_INLINE float rdh(const uint8_t* p) { return half_to_float(rd16(p)); }

// K-quants' 6-bit scale and min of sub-block j (gguf's Q4_K.get_scale_min)
VC_INLINE void scale_min_k4(const uint8_t* s, int j, int* sc, int* mn) {
  if (j < 4) {
    *sc = s[j] & 63; *mn = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 2) & 0x30);
    *mn = (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30);
  }
}

// One block -> fp32 out[block_elems]. Scalar and exact: an int converts to fp32 exactly, then one
// multiply (and one add or subtract) rounds once, as numpy does; vectorising it changes no bits.
inline void dequant_block(int f, const uint8_t* b, float* out) {
  switch (f) {
    case F32: std::memcpy(out, b, 4); break;
    case F16: out[0] = rdh(b); break;
    case BF16: { uint32_t v = (uint32_t)rd16(b) << 16; std::memcpy(out, &v, 4); break; }
    case Q4_0: {
      const float d = rdh(b);
      for (int j = 0; j < 16; ++j) {
        out[j] = d * (float)((int)(b[2 + j] & 0x0f) - 8);
        out[j + 16] = d * (float)((int)(b[2 + j] >> 4) - 8);
      }
      break;
    }
    case Q4_1: {
      const float d = rdh(b), m = rdh(b + 2);
      for (int j = 0; j < 16; ++j) {
        out[j] = d * (float)(b[4 + j] & 0x0f) + m;
        out[j + 16] = d * (float)(b[4 + j] >> 4) + m;
      }
      break;
    }
    case Q5_0: case Q5_1: {
      const bool has_min = f == Q5_1;
      const float d = rdh(b), m = has_min ? rdh(b + 2) : 0.0f;
      uint32_t qh;
      std::memcpy(&qh, b + (has_min ? 4 : 2), 4);
      const uint8_t* qs = b + (has_min ? 8 : 6);
      for (int j = 0; j < 32; ++j) {
        const int lo = j < 16 ? (qs[j] & 0x0f) : (qs[j - 16] >> 4);
        const int q = lo | (int)((qh >> j) & 1) << 4;
        out[j] = has_min ? d * (float)q + m : d * (float)(q - 16);
      }
      break;
    }
    case Q8_0: {
      const float d = rdh(b);
      for (int j = 0; j < 32; ++j) out[j] = (float)(int8_t)b[2 + j] * d;
      break;
    }
    case Q4_K: case Q5_K: {
      const float d = rdh(b), dmin = rdh(b + 2);
      const uint8_t* scales = b + 4;
      const uint8_t* qh = b + 16;                               // Q5_K only
      const uint8_t* qs = b + (f == Q5_K ? 48 : 16);
      for (int j = 0; j < 8; ++j) {
        int sc, mn;
        scale_min_k4(scales, j, &sc, &mn);
        const float dj = d * (float)sc, mj = dmin * (float)mn;
        const uint8_t* q = qs + 32 * (j / 2);
        for (int l = 0; l < 32; ++l) {
          int v = (j & 1) ? (q[l] >> 4) : (q[l] & 0x0f);
          if (f == Q5_K) v |= ((qh[l] >> j) & 1) << 4;
          out[32 * j + l] = dj * (float)v - mj;
        }
      }
      break;
    }
    case Q6_K: {
      const uint8_t *ql = b, *qh = b + 128;
      const int8_t* sc = (const int8_t*)(b + 192);
      const float d = rdh(b + 208);
      for (int e = 0; e < 256; ++e) {
        const int h = e / 128, r = e % 128;
        const int lo = (ql[64 * h + r % 64] >> (4 * (r / 64))) & 0x0f;
        const int hi = (qh[32 * h + r % 32] >> (2 * (r / 32))) & 3;
        out[e] = (d * (float)sc[e / 16]) * (float)((lo | hi << 4) - 32);
      }
      break;
    }
  }
}

// Row n of W -> fp32 out[kp] (kp = K rounded up to 16, zero tail).
inline void dequant_row(int f, const uint8_t* row, int64_t K, int64_t kp, float* out) {
  if (f == F32) {
    std::memcpy(out, row, K * 4);
  } else {
    const int be = block_elems(f), bb = block_bytes(f);
    for (int64_t k = 0; k < K; k += be) dequant_block(f, row + (k / be) * bb, out + k);
  }
  for (int64_t k = K; k < kp; ++k) out[k] = 0.0f;
}

}  // namespace vc_gguf
