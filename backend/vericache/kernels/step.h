// The native step's types (step.cpp), shared with the Python binding (bindings.cpp): the linear op's C
// ABI, an ExactLinear's stored weights (Linear), a decoder layer's, and every layer's (StepWeights);
// and the functions the binding exports. Only ATen's core headers: the ISA-specific files compile in
// seconds, and the one file that includes the Python binding headers is bindings.cpp.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>
#include <cstdint>
#include <tuple>
#include <vector>

namespace vc_step {

// linear.cpp's / linear_q8.cpp's C ABI: y[M, N] (row stride ldy) = x[M, K] W^T + bias; 0 on success,
// -2: no integer codes (a float weight: the fp32 op runs it)
using LinearFn = int (*)(int fmt, const uint8_t* w, int64_t row_bytes, int64_t n, int64_t k, const float* x,
                         int64_t ldx, int64_t m, const float* bias, float* y, int64_t ldy, int n_threads);
// linear_q8.cpp's q8 op with W's packed panels (``packed`` null: decoded in the call; the same bits)
using Q8Fn = int (*)(int fmt, const uint8_t* w, const uint8_t* packed, int64_t row_bytes, int64_t n, int64_t k,
                     const float* x, int64_t ldx, int64_t m, const float* bias, float* y, int64_t ldy, int n_threads);
// linear.cpp's out[i, :K] = row rows[i] of W, dequantized (embedding lookups)
using DequantFn = int (*)(int fmt, const uint8_t* w, int64_t row_bytes, int64_t k, const int64_t* rows, int64_t n,
                          float* out);

struct Linear {                 // an ExactLinear: its stored weights' outputs side by side
  bool q8 = false;              // its numerics: the q8 op (else the fp32 op)
  std::vector<int> fmt;
  std::vector<const uint8_t*> data, panels;   // panels: the q8 op's packed panels of each weight, or null
  std::vector<int64_t> row_bytes, n;
  int64_t k = 0, n_total = 0;
  const float* bias = nullptr;
  std::vector<at::Tensor> keep; // the tensors behind the pointers
};

struct Layer {
  at::Tensor in_norm, post_norm;
  Linear qkv, o, gate_up, down;
  c10::optional<at::Tensor> q_norm, k_norm;   // [D] each: Qwen3's per-head RMSNorm before RoPE, or none
  c10::optional<at::Tensor> key_coding;       // [2, Hkv, D]: the q8qk numerics' key coding (int_scores.h), or none
};

// fmts, data tensors, row bytes, output rows, K, bias, q8 numerics, packed panels (or none) of each weight:
// one ``ExactLinear`` (native_step.py)
using LinearSpec = std::tuple<std::vector<int64_t>, std::vector<at::Tensor>, std::vector<int64_t>,
                              std::vector<int64_t>, int64_t, c10::optional<at::Tensor>, bool,
                              std::vector<c10::optional<at::Tensor>>>;

Linear make_linear(const LinearSpec& spec);

// Every layer's weights for the native step, built once per model (``model/native_step.py``).
struct StepWeights {
  Q8Fn q8;                      // the two numerics' ops (a Linear says which it runs; q8 draft rows run q8)
  LinearFn fp32;
  DequantFn dequant;
  float eps;
  int64_t hq, hkv, d, hidden = 0, inter = 0;
  int64_t score_unit;           // the attention's scores: 0 fp32, else integer dots on that unit (int_scores.h)
  std::vector<Layer> layers;
  Linear embed, head;          // the embedding's stored rows (one weight [V, H]) and the LM head
  Linear draft_head;           // draft rows' head: the LM head's first rows (a draft vocabulary), or none
  at::Tensor final_norm;

  StepWeights(int64_t q8_fn, int64_t fp32_fn, int64_t dequant_fn, double eps_, int64_t hq_, int64_t hkv_, int64_t d_,
              int64_t score_unit_)
      : q8((Q8Fn)q8_fn), fp32((LinearFn)fp32_fn), dequant((DequantFn)dequant_fn), eps((float)eps_), hq(hq_),
        hkv(hkv_), d(d_), score_unit(score_unit_) {
    TORCH_CHECK(q8_fn && fp32_fn && dequant_fn && hq > 0 && hkv > 0 && hq % hkv == 0 && d % 2 == 0,
                "bad step weights");
  }

  void set_ends(const LinearSpec& embed_, const at::Tensor& norm, const LinearSpec& head_) {
    embed = make_linear(embed_);
    head = make_linear(head_);
    TORCH_CHECK(embed.fmt.size() == 1 && !embed.bias && embed.k == hidden && head.k == hidden &&
                norm.scalar_type() == at::kFloat && norm.numel() == hidden,
                "the embedding (one stored weight [V, ", hidden, "]), final norm and head do not fit the layers");
    final_norm = norm.contiguous();
  }

  // draft-vocabulary rows' logits over the head's first rows only (``set_ends`` first); none: the whole head
  void set_draft_head(const c10::optional<LinearSpec>& spec) {
    if (!spec.has_value()) {
      draft_head = Linear{};
      return;
    }
    Linear h = make_linear(*spec);
    TORCH_CHECK(!head.fmt.empty() && h.k == hidden && h.n_total > 0 && h.n_total <= head.n_total,
                "the draft head must be the LM head's first rows [<= ", head.n_total, ", ", hidden, "], got [",
                h.n_total, ", ", h.k, "]");
    draft_head = std::move(h);
  }

  void add_layer(const at::Tensor& in_norm, const at::Tensor& post_norm, const std::vector<LinearSpec>& linears,
                 const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm,
                 const c10::optional<at::Tensor>& key_coding) {
    TORCH_CHECK(linears.size() == 4, "a layer has 4 linears (qkv, o, gate_up, down), got ", linears.size());
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "q and k norms come together");
    Layer y{in_norm.contiguous(), post_norm.contiguous(), make_linear(linears[0]), make_linear(linears[1]),
            make_linear(linears[2]), make_linear(linears[3]), c10::nullopt, c10::nullopt, c10::nullopt};
    if (key_coding.has_value()) {
      TORCH_CHECK(key_coding->scalar_type() == at::kFloat && key_coding->numel() == 2 * hkv * d,
                  "key coding: fp32 [2, ", hkv, ", ", d, "]");
      y.key_coding = key_coding->contiguous().view({2, hkv, d});   // a view: set_key_coding writes it in place
    }
    if (q_norm.has_value()) {
      for (const at::Tensor* w : {&*q_norm, &*k_norm})
        TORCH_CHECK(w->scalar_type() == at::kFloat && w->numel() == d, "q/k norm weights: fp32 [", d, "]");
      y.q_norm = q_norm->contiguous();
      y.k_norm = k_norm->contiguous();
    }
    const int64_t H = y.qkv.k, F = y.down.k;
    TORCH_CHECK(y.qkv.n_total == (hq + 2 * hkv) * d && y.o.k == hq * d && y.o.n_total == H && y.gate_up.k == H &&
                y.gate_up.n_total == 2 * F && y.down.n_total == H, "layer ", layers.size(), ": shapes do not chain");
    for (const at::Tensor* w : {&y.in_norm, &y.post_norm})
      TORCH_CHECK(w->scalar_type() == at::kFloat && w->numel() == H, "norm weights: fp32 [", H, "]");
    TORCH_CHECK(layers.empty() || (H == hidden && F == inter), "every layer must have the same widths");
    hidden = H;
    inter = F;
    layers.push_back(std::move(y));
  }
};

}  // namespace vc_step

// packed_attention.cpp
at::Tensor attend_packed(const at::Tensor& q, int64_t hkv, const std::vector<int64_t>& seq_lens,
                         const std::vector<int64_t>& part_ints,
                         const std::vector<c10::optional<at::Tensor>>& part_tensors, int64_t score_unit,
                         const c10::optional<at::Tensor>& key_coding, const c10::optional<at::Tensor>& lse,
                         const c10::optional<at::Tensor>& row_lse);
// guide_select.cpp
at::Tensor guide_select(const at::Tensor& seen, int64_t n, const at::Tensor& pos, const at::Tensor& scores,
                        const at::Tensor& memory, int64_t count, int64_t limit, int64_t swaps, double decay);
at::Tensor guide_trade(const at::Tensor& seen, int64_t n, const at::Tensor& pos, const at::Tensor& scores,
                       const at::Tensor& memory, int64_t count, int64_t limit, int64_t swaps, double decay,
                       const at::Tensor& full_k, const at::Tensor& full_v, const at::Tensor& store_k,
                       const at::Tensor& store_v);
// step.cpp
at::Tensor forward_step(const vc_step::StepWeights& W, const at::Tensor& tokens, const at::Tensor& cos,
                        const at::Tensor& sin, const std::vector<int64_t>& seq_lens, int64_t n_draft,
                        bool draft_q8, int64_t n_vocab, const c10::optional<vc_step::LinearSpec>& extra,
                        const c10::optional<at::Tensor>& extra_ids, const at::Tensor& logits_rows, const std::vector<int64_t>& cache_ints,
                        const std::vector<c10::optional<at::Tensor>>& cache_tensors);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
at::Tensor silu_mul(const at::Tensor& gu);
