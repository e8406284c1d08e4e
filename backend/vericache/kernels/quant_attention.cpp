// Attention that reads quantized KV as stored: codes and scales are dequantized block by block
// inside the kernel (into a small L1-resident buffer), never into a full-precision copy.
//
// q: [H, R, D] fp32, the R query rows that share KV head h (GQA groups folded into rows).
// Keys and values each come in one of three formats (`kind`):
//   0 TOKEN_GROUPS   codes [H, C, D*bits/8] u8, scale/zero [H, C, D/group] fp16 (per token, channel groups)
//   1 CHANNEL_GROUPS codes [H, C, D*bits/8] u8, scale/zero [H, NG, D] fp16; token t uses the row of
//                    group pos[h, t] / group (KIVI keys: per channel over groups of tokens)
//   2 FP8            codes [H, C, D] u8 holding e4m3 bits, scale [H, C, 1] fp16 (per token)
// bits 2 and 4 are packed planar (see unpack).
// Returns out [H, R, D] fp32 and lse [H, R] fp32 (natural log of the sum of exp of scaled scores),
// so the result merges with other parts of the cache by log-sum-exp.
//
// Work is split over (head, block of BLOCK tokens); each block keeps its own max, sum and
// accumulator, merged at the end (FlashDecoding's split-K): one request at 8K has 3 KV heads but
// ~96 blocks, enough for every core.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <immintrin.h>
#include <cmath>
#include <vector>

namespace {

constexpr int BLOCK = 64;
constexpr int MAX_D = 256;

struct Format {
  int kind, bits, group;
  const uint8_t* codes; int64_t code_h, code_t;          // strides in bytes
  const at::Half* scale; const at::Half* zero; int64_t sc_h, sc_t;  // strides in elements
  const int32_t* pos; int64_t pos_h;                      // kind 1 only (nullptr: pos = t)
};

Format make_format(int64_t kind, int64_t bits, int64_t group, const at::Tensor& codes, const at::Tensor& scale,
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

// The work items lo..hi of the (head, block) grid. DFIX fixes the head dim at compile time (64, the
// common case) so every per-row loop is whole unrolled vectors; DFIX = 0 reads it at run time.
template <int DFIX>
void attend_blocks(int64_t lo, int64_t hi, int64_t n, int64_t nb, int64_t R, int64_t D_, const float* qp,
                   const Format& kf, const Format& vf, const float* fp8_lut, float* bmax, float* bsum, float* bacc) {
  const int64_t D = DFIX ? DFIX : D_;
  const float sm = 1.0f / std::sqrt((float)D);
  alignas(64) float kb[BLOCK][MAX_D];
  alignas(64) float vb[MAX_D];
  Affine ka, va;
  std::vector<float> s(R * BLOCK);
  for (int64_t w = lo; w < hi; ++w) {
    const int64_t h = w / nb, b = w % nb, t0 = b * BLOCK, t1 = std::min(n, t0 + BLOCK), bt = t1 - t0;
    if (bt <= 0) continue;
    for (int64_t t = t0; t < t1; ++t) dequant_row(kf, fp8_lut, h, t, (int)D, ka, kb[t - t0]);
    float* mx = &bmax[w * R];
    float* sum = &bsum[w * R];
    float* acc = &bacc[w * R * D];
    for (int64_t r = 0; r < R; ++r) {               // scores and softmax statistics of row r
      const float* qr = qp + (h * R + r) * D;
      float m = -1e30f;
      for (int64_t t = 0; t < bt; ++t) {
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t j = 0; j < D; ++j) dot += qr[j] * kb[t][j];
        s[r * BLOCK + t] = dot * sm;
        m = std::max(m, dot * sm);
      }
      float l = 0.f;
      float* sr = &s[r * BLOCK];
#pragma omp simd reduction(+ : l)
      for (int64_t t = 0; t < bt; ++t) { sr[t] = std::exp(sr[t] - m); l += sr[t]; }
      mx[r] = m; sum[r] = l;
    }
    for (int64_t t = 0; t < bt; ++t) {               // values: dequantize a row once for every query row
      dequant_row(vf, fp8_lut, h, t0 + t, (int)D, va, vb);
      for (int64_t r = 0; r < R; ++r) {
        const float p = s[r * BLOCK + t];
        float* a = acc + r * D;
#pragma omp simd
        for (int64_t j = 0; j < D; ++j) a[j] += p * vb[j];
      }
    }
  }
}

}  // namespace

std::vector<at::Tensor> attend_quantized(
    const at::Tensor& q, int64_t n,
    int64_t k_kind, int64_t k_bits, int64_t k_group, const at::Tensor& k_codes, const at::Tensor& k_scale,
    const c10::optional<at::Tensor>& k_zero,
    int64_t v_kind, int64_t v_bits, int64_t v_group, const at::Tensor& v_codes, const at::Tensor& v_scale,
    const c10::optional<at::Tensor>& v_zero, const c10::optional<at::Tensor>& pos) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q: contiguous fp32 [H, R, D]");
  const int64_t H = q.size(0), R = q.size(1), D = q.size(2);
  TORCH_CHECK(D <= MAX_D && D % 8 == 0, "head dim must be a multiple of 8 and <= 256, got ", D);
  TORCH_CHECK(k_codes.size(0) == H && v_codes.size(0) == H && k_codes.size(1) >= n && v_codes.size(1) >= n,
              "codes must hold ", n, " tokens for each of the ", H, " heads");
  const Format kf = make_format(k_kind, k_bits, k_group, k_codes, k_scale, k_zero, pos);
  const Format vf = make_format(v_kind, v_bits, v_group, v_codes, v_scale, v_zero, pos);
  float fp8_lut[256];
  for (int i = 0; i < 256; ++i) fp8_lut[i] = (float)c10::Float8_e4m3fn((uint8_t)i, c10::Float8_e4m3fn::from_bits());

  const int64_t nb = std::max<int64_t>(1, (n + BLOCK - 1) / BLOCK);
  // per (head, block): running max [R], sum [R], accumulator [R, D]
  std::vector<float> bmax(H * nb * R, -1e30f), bsum(H * nb * R, 0.f), bacc(H * nb * R * D, 0.f);
  const float* qp = q.data_ptr<float>();

  at::parallel_for(0, H * nb, 1, [&](int64_t lo, int64_t hi) {
    if (D == 64) attend_blocks<64>(lo, hi, n, nb, R, D, qp, kf, vf, fp8_lut, bmax.data(), bsum.data(), bacc.data());
    else attend_blocks<0>(lo, hi, n, nb, R, D, qp, kf, vf, fp8_lut, bmax.data(), bsum.data(), bacc.data());
  });

  at::Tensor out = at::zeros({H, R, D}, q.options());
  at::Tensor lse = at::full({H, R}, -INFINITY, q.options());
  float* op = out.data_ptr<float>();
  float* lp = lse.data_ptr<float>();
  if (n == 0) return {out, lse};
  for (int64_t h = 0; h < H; ++h) {                    // merge the blocks of each row
    for (int64_t r = 0; r < R; ++r) {
      float m = -1e30f;
      for (int64_t b = 0; b < nb; ++b) m = std::max(m, bmax[(h * nb + b) * R + r]);
      float l = 0.f;
      float* o = op + (h * R + r) * D;
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t w = h * nb + b;
        const float c = std::exp(bmax[w * R + r] - m);
        l += bsum[w * R + r] * c;
        const float* a = &bacc[(w * R + r) * D];
        for (int64_t j = 0; j < D; ++j) o[j] += a[j] * c;
      }
      for (int64_t j = 0; j < D; ++j) o[j] /= l;
      lp[h * R + r] = m + std::log(l);
    }
  }
  return {out, lse};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attend_quantized", &attend_quantized, "attention over quantized KV, dequantized block by block");
}
