// Attention that reads quantized KV as stored: codes and scales are dequantized block by block
// inside the kernel (into a small L1-resident buffer), never into a full-precision copy.
//
// q: [H, R, D] fp32, the R query rows that share KV head h (GQA groups folded into rows).
// Keys and values each come in one of the three formats of quant_format.h (`kind`).
// Returns out [H, R, D] fp32 and lse [H, R] fp32 (natural log of the sum of exp of scaled scores),
// so the result merges with other parts of the cache by log-sum-exp.
//
// Work is split over (head, block of BLOCK tokens); each block keeps its own max, sum and
// accumulator, merged at the end (FlashDecoding's split-K): one request at 8K has 3 KV heads but
// ~96 blocks, enough for every core.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>

#include "quant_format.h"

namespace {

using namespace vc_quant;
constexpr int BLOCK = 64;

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
  fp8_table(fp8_lut);

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
