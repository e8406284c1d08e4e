// Quantized K/V as stored (kv/quantized.py's layouts): the formats and a row dequantizer, shared by
// packed_attention.cpp. The kinds (layouts.h's StoreKind):
//   0 TOKEN_GROUPS   codes [H, C, D*bits/8] u8, scale/zero [H, C, D/group] fp16 (per token, channel groups)
//   1 CHANNEL_GROUPS codes [H, C, D*bits/8] u8, scale/zero [H, NG, D] fp16; token t uses the row of
//                    group pos[h, t] / group (KIVI keys: per channel over groups of tokens)
//   2 FP8            codes [H, C, D] u8 holding e4m3 bits, scale [H, C, 1] fp16 (per token)
// bits 2 and 4 are packed planar (see unpack).
#pragma once
#include <torch/extension.h>
#include <c10/util/Float8_e4m3fn.h>
#include <immintrin.h>
#include <cstdint>

#include "layouts.h"

namespace vc_quant {

using vc_layout::CHANNEL_GROUPS;
using vc_layout::FP8;
using vc_layout::TOKEN_GROUPS;

constexpr int MAX_D = 256;

struct Format {
  int kind, bits, group;
  const uint8_t* codes; int64_t code_h, code_t;          // strides in bytes
  const at::Half* scale; const at::Half* zero; int64_t sc_h, sc_t;  // strides in elements
  const int32_t* pos; int64_t pos_h;                      // CHANNEL_GROUPS only (nullptr: pos = t)
};

inline Format make_format(int64_t kind, int64_t bits, int64_t group, const at::Tensor& codes, const at::Tensor& scale,
                   const c10::optional<at::Tensor>& zero, const c10::optional<at::Tensor>& pos) {
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.stride(2) == 1, "codes: uint8 with contiguous rows");
  TORCH_CHECK(scale.scalar_type() == at::kHalf && scale.stride(2) == 1, "scale: fp16 with contiguous rows");
  Format f{};
  f.kind = (int)kind; f.bits = (int)bits; f.group = (int)group;
  f.codes = codes.data_ptr<uint8_t>(); f.code_h = codes.stride(0); f.code_t = codes.stride(1);
  f.scale = scale.data_ptr<at::Half>(); f.sc_h = scale.stride(0); f.sc_t = scale.stride(1);
  f.zero = nullptr;
  if (kind != FP8) {
    TORCH_CHECK(zero.has_value() && zero->scalar_type() == at::kHalf && zero->strides() == scale.strides(),
                "zero: fp16 laid out like scale");
    f.zero = zero->data_ptr<at::Half>();
  }
  f.pos = nullptr; f.pos_h = 0;
  if (kind == CHANNEL_GROUPS && pos.has_value()) {
    TORCH_CHECK(pos->scalar_type() == at::kInt && pos->stride(1) == 1, "pos: int32 rows");
    f.pos = pos->data_ptr<int32_t>(); f.pos_h = pos->stride(0);
  }
  return f;
}

// Packing is planar: byte i holds channels i, i + D/PER, i + 2D/PER, ... (PER = 8/bits codes a
// byte, the first in the low bits), so unpacking pass p writes channels p*D/PER .. (p+1)*D/PER - 1
// contiguously: a shift-and-mask the compiler vectorizes, with channels in their natural order.
inline float half_to_float(at::Half h) {
#ifdef __F16C__
  return _cvtsh_ss(h.x);
#else
  return (float)h;
#endif
}

template <int BITS, int N>  // N = D / PER bytes, fixed so each pass is whole vectors
inline void unpack_fixed(const uint8_t* __restrict c, float* __restrict out) {
  constexpr int PER = 8 / BITS, MASK = (1 << BITS) - 1;
#pragma GCC unroll 8
  for (int p = 0; p < PER; ++p) {
#pragma omp simd
    for (int i = 0; i < N; ++i) out[p * N + i] = (float)((c[i] >> (p * BITS)) & MASK);
  }
}

template <int BITS>
inline void unpack(const uint8_t* __restrict c, float* __restrict out, int d) {
  constexpr int PER = 8 / BITS, MASK = (1 << BITS) - 1;
  if (d == 64) return unpack_fixed<BITS, 64 / PER>(c, out);
  if (d == 128) return unpack_fixed<BITS, 128 / PER>(c, out);
  const int n = d / PER;
  for (int p = 0; p < PER; ++p) {
#pragma omp simd
    for (int i = 0; i < n; ++i) out[p * n + i] = (float)((c[i] >> (p * BITS)) & MASK);
  }
}

// Per-channel scale/zero of a position group (kind 1), rebuilt when the (head, group) changes.
struct Affine {
  alignas(64) float s[MAX_D];
  alignas(64) float z[MAX_D];
  int64_t key = -1;
};

// Position group of stored token t (kind 1): groups are powers of two (compress/quant.py checks).
inline int64_t group_row(const Format& f, int64_t h, int64_t t) {
  const int64_t p = f.pos ? f.pos[h * f.pos_h + t] : t;
  return p >> __builtin_ctz((unsigned)f.group);
}

inline void load_affine(const Format& f, int64_t h, int64_t row, int d, Affine& a) {
  const at::Half* s = f.scale + h * f.sc_h + row * f.sc_t;
  const at::Half* z = f.zero + h * f.sc_h + row * f.sc_t;
  int j = 0;
#if defined(__AVX512F__)
  for (; j + 16 <= d; j += 16) {
    _mm512_store_ps(a.s + j, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(s + j))));
    _mm512_store_ps(a.z + j, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(z + j))));
  }
#endif
#if defined(__AVX2__) && defined(__F16C__)
  for (; j + 8 <= d; j += 8) {
    _mm256_store_ps(a.s + j, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(s + j))));
    _mm256_store_ps(a.z + j, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(z + j))));
  }
#endif
  for (; j < d; ++j) {
    a.s[j] = half_to_float(s[j]);
    a.z[j] = half_to_float(z[j]);
  }
  a.key = h * (int64_t(1) << 40) + row;
}

#if defined(__AVX2__) && defined(__F16C__)
// An FP8 row (e4m3 codes, one scale) without the table: the code's bits shifted into an fp16 are its
// value / 256 exactly (sign to bit 15, exponent and mantissa to bits 14-7; the exponent bias
// differs by 8), so out = fp16(bits) * (256 s) is the table's value * s: the same product, the same
// bits. 8 channels a step (d a multiple of 8).
inline void fp8_row(const uint8_t* c, float s, int d, float* __restrict out) {
  const __m256 s256 = _mm256_set1_ps(256.f * s);
  for (int j = 0; j < d; j += 8) {
    const __m128i b = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i*)(c + j)));   // sign-extended
    const __m128i h = _mm_and_si128(_mm_slli_epi16(b, 7), _mm_set1_epi16((short)0xBFFF));
    _mm256_storeu_ps(out + j, _mm256_mul_ps(_mm256_cvtph_ps(h), s256));
  }
}
#endif

#if defined(__AVX512F__)
// dequant_row for D = 64, integer kinds (0, 1), bits 2/4/8, token groups of >= 16 channels: the
// scalar path's operations on 16 lanes at a time (exact int -> float, then a multiply and an add),
// so the same bits. codes16: the 16 codes of channels 16 chunk .. 16 chunk + 15 as floats.
template <int BITS>
inline __m512 codes16(const uint8_t* c, int chunk) {
  if (BITS == 8) return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(c + 16 * chunk))));
  // planar: byte i of pass p holds channel p * N + i (N = 64 / PER); chunk c of 16 channels is
  // pass c / (N / 16), bytes (c % (N / 16)) * 16 ..
  constexpr int PER = 8 / BITS, CH = 64 / PER / 16;   // chunks per pass
  const int p = chunk / CH, i0 = (chunk % CH) * 16;
  const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(c + i0)));
  const __m512i v = _mm512_and_si512(_mm512_srli_epi32(x, p * BITS), _mm512_set1_epi32((1 << BITS) - 1));
  return _mm512_cvtepi32_ps(v);
}

template <int BITS>
inline void dequant64(const Format& f, const uint8_t* c, int64_t h, int64_t t, Affine& a, float* __restrict out) {
  if (f.kind == TOKEN_GROUPS) {
    const at::Half* s = f.scale + h * f.sc_h + t * f.sc_t;
    const at::Half* z = f.zero + h * f.sc_h + t * f.sc_t;
    const int shift = __builtin_ctz((unsigned)f.group);
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) {
      const int g = (16 * k) >> shift;
      const __m512 o = _mm512_mul_ps(codes16<BITS>(c, k), _mm512_set1_ps(half_to_float(s[g])));
      _mm512_store_ps(out + 16 * k, _mm512_add_ps(o, _mm512_set1_ps(half_to_float(z[g]))));
    }
    return;
  }
  const int64_t row = group_row(f, h, t);
  if (h * (int64_t(1) << 40) + row != a.key) load_affine(f, h, row, 64, a);
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k) {
    const __m512 o = _mm512_mul_ps(codes16<BITS>(c, k), _mm512_load_ps(a.s + 16 * k));
    _mm512_store_ps(out + 16 * k, _mm512_add_ps(o, _mm512_load_ps(a.z + 16 * k)));
  }
}

inline bool dequant_row64(const Format& f, int64_t h, int64_t t, Affine& a, float* __restrict out) {
  if (f.kind == FP8 || (f.kind == TOKEN_GROUPS && f.group < 16)) return false;
  const uint8_t* c = f.codes + h * f.code_h + t * f.code_t;
  switch (f.bits) {
    case 2: dequant64<2>(f, c, h, t, a, out); return true;
    case 4: dequant64<4>(f, c, h, t, a, out); return true;
    default: dequant64<8>(f, c, h, t, a, out); return true;
  }
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// The AVX2 build's dequant_row for D = 64: the AVX-512 one's steps on 8 lanes (token groups of >= 8
// channels); codes8: the 8 codes of channels 8 chunk .. 8 chunk + 7 as floats.
template <int BITS>
inline __m256 codes8(const uint8_t* c, int chunk) {
  constexpr int PER = 8 / BITS, CH = 64 / PER / 8;     // 8-channel chunks per planar pass
  const int p = chunk / CH, i0 = (chunk % CH) * 8;
  const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(c + i0)));
  if (BITS == 8) return _mm256_cvtepi32_ps(x);
  return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(x, p * BITS), _mm256_set1_epi32((1 << BITS) - 1)));
}

template <int BITS>
inline void dequant64(const Format& f, const uint8_t* c, int64_t h, int64_t t, Affine& a, float* __restrict out) {
  if (f.kind == TOKEN_GROUPS) {
    const at::Half* s = f.scale + h * f.sc_h + t * f.sc_t;
    const at::Half* z = f.zero + h * f.sc_h + t * f.sc_t;
    const int shift = __builtin_ctz((unsigned)f.group);
#pragma GCC unroll 8
    for (int k = 0; k < 8; ++k) {
      const int g = (8 * k) >> shift;
      const __m256 o = _mm256_mul_ps(codes8<BITS>(c, k), _mm256_set1_ps(half_to_float(s[g])));
      _mm256_store_ps(out + 8 * k, _mm256_add_ps(o, _mm256_set1_ps(half_to_float(z[g]))));
    }
    return;
  }
  const int64_t row = group_row(f, h, t);
  if (h * (int64_t(1) << 40) + row != a.key) load_affine(f, h, row, 64, a);
#pragma GCC unroll 8
  for (int k = 0; k < 8; ++k) {
    const __m256 o = _mm256_mul_ps(codes8<BITS>(c, k), _mm256_load_ps(a.s + 8 * k));
    _mm256_store_ps(out + 8 * k, _mm256_add_ps(o, _mm256_load_ps(a.z + 8 * k)));
  }
}

inline bool dequant_row64(const Format& f, int64_t h, int64_t t, Affine& a, float* __restrict out) {
  if (f.kind == FP8 || (f.kind == TOKEN_GROUPS && f.group < 8)) return false;
  const uint8_t* c = f.codes + h * f.code_h + t * f.code_t;
  switch (f.bits) {
    case 2: dequant64<2>(f, c, h, t, a, out); return true;
    case 4: dequant64<4>(f, c, h, t, a, out); return true;
    default: dequant64<8>(f, c, h, t, a, out); return true;
  }
}
#endif

inline void dequant_row(const Format& f, const float* fp8_lut, int64_t h, int64_t t, int d, Affine& a,
                        float* __restrict out) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  if (d == 64 && dequant_row64(f, h, t, a, out)) return;
#endif
  const uint8_t* c = f.codes + h * f.code_h + t * f.code_t;
  if (f.kind == FP8) {
    const float s = (float)f.scale[h * f.sc_h + t * f.sc_t];
#if defined(__AVX2__) && defined(__F16C__)
    return fp8_row(c, s, d, out);
#endif
#pragma omp simd
    for (int j = 0; j < d; ++j) out[j] = fp8_lut[c[j]] * s;
    return;
  }
  if (f.bits == 2) unpack<2>(c, out, d);
  else if (f.bits == 4) unpack<4>(c, out, d);
  else {
#pragma omp simd
    for (int j = 0; j < d; ++j) out[j] = (float)c[j];
  }
  if (f.kind == TOKEN_GROUPS) {
    const at::Half* s = f.scale + h * f.sc_h + t * f.sc_t;
    const at::Half* z = f.zero + h * f.sc_h + t * f.sc_t;
    for (int g = 0; g < d / f.group; ++g) {
      const float sg = half_to_float(s[g]), zg = half_to_float(z[g]);
      float* o = out + g * f.group;
#pragma omp simd
      for (int i = 0; i < f.group; ++i) o[i] = o[i] * sg + zg;
    }
    return;
  }
  const int64_t row = group_row(f, h, t);
  if (h * (int64_t(1) << 40) + row != a.key) load_affine(f, h, row, d, a);
#pragma omp simd
  for (int j = 0; j < d; ++j) out[j] = out[j] * a.s[j] + a.z[j];
}

inline void fp8_table(float* lut) {
  for (int i = 0; i < 256; ++i) lut[i] = (float)c10::Float8_e4m3fn((uint8_t)i, c10::Float8_e4m3fn::from_bits());
}

}  // namespace vc_quant
