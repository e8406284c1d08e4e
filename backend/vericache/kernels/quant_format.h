// Quantized K/V as stored (kv/quantized.py's layouts): the formats and a row dequantizer, shared by
// quant_attention.cpp and packed_attention.cpp.
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

namespace vc_quant {

constexpr int MAX_D = 256;

struct Format {
  int kind, bits, group;
  const uint8_t* codes; int64_t code_h, code_t;          // strides in bytes
  const at::Half* scale; const at::Half* zero; int64_t sc_h, sc_t;  // strides in elements
  const int32_t* pos; int64_t pos_h;                      // kind 1 only (nullptr: pos = t)
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
  if (kind != 2) {
    TORCH_CHECK(zero.has_value() && zero->scalar_type() == at::kHalf && zero->strides() == scale.strides(),
                "zero: fp16 laid out like scale");
    f.zero = zero->data_ptr<at::Half>();
  }
  f.pos = nullptr; f.pos_h = 0;
  if (kind == 1 && pos.has_value()) {
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

inline void dequant_row(const Format& f, const float* fp8_lut, int64_t h, int64_t t, int d, Affine& a,
                        float* __restrict out) {
  const uint8_t* c = f.codes + h * f.code_h + t * f.code_t;
  if (f.kind == 2) {
    const float s = (float)f.scale[h * f.sc_h + t * f.sc_t];
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
  if (f.kind == 0) {
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
  const int64_t row = (f.pos ? f.pos[h * f.pos_h + t] : t) / f.group;
  if (h * (int64_t(1) << 40) + row != a.key) {
    const at::Half* s = f.scale + h * f.sc_h + row * f.sc_t;
    const at::Half* z = f.zero + h * f.sc_h + row * f.sc_t;
    for (int j = 0; j < d; ++j) {
      a.s[j] = half_to_float(s[j]);
      a.z[j] = half_to_float(z[j]);
    }
    a.key = h * (int64_t(1) << 40) + row;
  }
#pragma omp simd
  for (int j = 0; j < d; ++j) out[j] = out[j] * a.s[j] + a.z[j];
}

inline void fp8_table(float* lut) {
  for (int i = 0; i < 256; ++i) lut[i] = (float)c10::Float8_e4m3fn((uint8_t)i, c10::Float8_e4m3fn::from_bits());
}

}  // namespace vc_quant
