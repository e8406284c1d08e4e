// One forward step in one native call: the CPU's exact path with no Python per layer (a decode step's
// fixed cost was ~30 layers x a dozen small torch calls).
//
// The tokens' embedding rows (dequantized from the stored weight), then per layer, for the step's N
// packed rows: RMSNorm -> fused q/k/v (the linear op) -> RoPE -> each
// sequence's chunk K/V into its cache (and its queries into a compressed cache's observation window)
// -> attention over every sequence's parts (attend_packed) -> o -> residual -> RMSNorm -> gate/up ->
// SiLU x up -> down -> residual; then the final RMSNorm and the LM head over the rows whose logits are
// wanted. These are the PyTorch module's CPU operations in its order: the same
// linear op and row ops (row_ops.h), RoPE as x*cos + rot(x)*sin (three IEEE roundings, no
// contraction), the cache writes as ATen copies. So a row's bits are the module's whichever path a
// step takes (tests/test_native_step.py), and batch-invariant as every op is.
//
// Shapes: N rows, H hidden, F intermediate, Hq / Hkv heads, D head dim, L layers.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <algorithm>
#include <cmath>
#include <vector>

#include "layouts.h"
#include "row_ops.h"
#include "step.h"

using namespace vc_step;

namespace vc_step {

Linear make_linear(const LinearSpec& spec) {
  Linear L;
  const auto& [fmts, data, row_bytes, ns, k, bias, q8, panels] = spec;
  L.q8 = q8;
  TORCH_CHECK(!fmts.empty() && fmts.size() == data.size() && data.size() == row_bytes.size() &&
              data.size() == ns.size() && data.size() == panels.size(),
              "a linear needs one format, tensor, row size, row count and panels (or none) per weight");
  TORCH_CHECK(k % 16 == 0, "the native step needs linear widths divisible by 16, got ", k);
  L.k = k;
  for (size_t i = 0; i < fmts.size(); ++i) {
    TORCH_CHECK(data[i].is_contiguous() && data[i].nbytes() == (size_t)(ns[i] * row_bytes[i]),
                "stored weight ", i, ": ", ns[i], " contiguous rows of ", row_bytes[i], " bytes expected");
    L.fmt.push_back((int)fmts[i]);
    L.data.push_back((const uint8_t*)data[i].data_ptr());
    L.row_bytes.push_back(row_bytes[i]);
    L.n.push_back(ns[i]);
    L.n_total += ns[i];
    L.keep.push_back(data[i]);
    L.panels.push_back(panels[i].has_value() ? (const uint8_t*)panels[i]->data_ptr() : nullptr);
    if (panels[i].has_value()) L.keep.push_back(*panels[i]);   // (their size: checked by LinearOp.pack)
  }
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == L.n_total,
                "bias: fp32 [", L.n_total, "]");
    L.bias = bias->data_ptr<float>();
    L.keep.push_back(*bias);
  }
  return L;
}

}  // namespace vc_step

namespace {

constexpr int64_t GRAIN = 16;   // rows per task of the row ops (fewer: one thread, no fork)
// y rows [0, n_draft) through the q8 op (drafts' free numerics), the rest through the linear's numerics;
// y's rows ldy floats apart (default: the linear's outputs)
void run_linear(const StepWeights& W, const Linear& L, const float* x, int64_t ldx, int64_t M, float* y,
                int64_t n_draft, int threads, int64_t ldy = 0) {
  if (ldy == 0) ldy = L.n_total;
  auto call = [&](bool q8, int64_t r0, int64_t m) {
    int64_t col = 0;
    for (size_t i = 0; i < L.fmt.size(); ++i) {
      const float* b = L.bias ? L.bias + col : nullptr;
      const float* xr = x + r0 * ldx;
      float* yr = y + r0 * ldy + col;
      int rc = q8 ? W.q8(L.fmt[i], L.data[i], L.panels[i], L.row_bytes[i], L.n[i], L.k, xr, ldx, m, b, yr, ldy, threads)
                  : W.fp32(L.fmt[i], L.data[i], L.row_bytes[i], L.n[i], L.k, xr, ldx, m, b, yr, ldy, threads);
      if (rc == -2)   // a float weight has no integer codes: the fp32 op, in either numerics
        rc = W.fp32(L.fmt[i], L.data[i], L.row_bytes[i], L.n[i], L.k, xr, ldx, m, b, yr, ldy, threads);
      TORCH_CHECK(rc == 0, "the linear op refused format ", L.fmt[i], " [", L.n[i], ", ", L.k, "]");
      col += L.n[i];
    }
  };
  if (n_draft > 0) call(true, 0, n_draft);
  if (M > n_draft) call(L.q8, n_draft, M - n_draft);
}

// y[j] = x[j] cos[j] + rot(x)[j] sin[j], rot(x) = (-x[D/2:], x[:D/2]): the module's apply_rope
inline void rope_row(const float* x, const float* c, const float* s, int64_t D, float* y) {
  const int64_t h = D / 2;
  for (int64_t j = 0; j < h; ++j) y[j] = x[j] * c[j] + (-x[j + h]) * s[j];
  for (int64_t j = 0; j < h; ++j) y[h + j] = x[h + j] * c[h + j] + x[j] * s[h + j];
}

// the last W queries of a layer: buf [Hq, W, D], q [Hq, T, D] (CompressedKVCache.observe)
void observe(at::Tensor buf, const at::Tensor& q) {
  const int64_t w = buf.size(1), t = q.size(1);
  if (t >= w) {
    buf.copy_(q.narrow(1, t - w, w));
  } else {
    buf.narrow(1, 0, w - t).copy_(buf.narrow(1, t, w - t).clone());
    buf.narrow(1, w - t, t).copy_(q);
  }
}

struct SeqCache {               // one sequence's cache in the step (tensors with a leading layer dim)
  int64_t slot, n_parts, ints_at, tensors_at;
  at::Tensor k, v;              // where the chunk's K/V go: [L, Hkv, cap, D] at slot
  c10::optional<at::Tensor> queries;   // [L, Hq, W, D]: the observation window, or none
};

}  // namespace

// tokens: [N] int64; cos, sin: [N, D] fp32; rows [0, n_draft) are draft rows, through the q8 linears when
// ``draft_q8``; rows [0, n_vocab) (n_vocab <= n_draft) take their logits from the draft head where the
// weights have one (``set_draft_head``), and with ``extra`` (the head's rows for the tokens ``extra_ids``,
// int64 [E], past the draft head's) those tokens' too; logits_rows: [M] int64 indices into N, ascending;
// per sequence: cache_ints (slot, number of parts, then PART_INTS ints per part as kv.packed.op_args) and
// cache_tensors (k, v, queries, then PART_TENSORS per part, each with a leading layer dim; layouts.h).
// Returns logits [M, V].
at::Tensor forward_step(const StepWeights& W, const at::Tensor& tokens, const at::Tensor& cos, const at::Tensor& sin,
                        const std::vector<int64_t>& seq_lens, int64_t n_draft, bool draft_q8, int64_t n_vocab,
                        const c10::optional<LinearSpec>& extra, const c10::optional<at::Tensor>& extra_ids,
                        const at::Tensor& logits_rows,
                        const std::vector<int64_t>& cache_ints,
                        const std::vector<c10::optional<at::Tensor>>& cache_tensors) {
  const int64_t N = tokens.numel(), H = W.hidden, F = W.inter, D = W.d, Hq = W.hq, Hkv = W.hkv;
  const int64_t S = (int64_t)seq_lens.size(), QD = Hq * D, KD = Hkv * D, L = (int64_t)W.layers.size();
  TORCH_CHECK(!W.head.fmt.empty(), "the step weights have no embedding and head (set_ends)");
  TORCH_CHECK(tokens.dim() == 1 && tokens.scalar_type() == at::kLong && tokens.is_contiguous(), "tokens: int64 [N]");
  TORCH_CHECK(logits_rows.dim() == 1 && logits_rows.scalar_type() == at::kLong && logits_rows.is_contiguous(),
              "logits_rows: int64 [M]");
  const int64_t V = W.embed.n_total, M = logits_rows.numel();
  const int64_t* tok = tokens.data_ptr<int64_t>();
  const int64_t* rows_out = logits_rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < N; ++i) TORCH_CHECK(tok[i] >= 0 && tok[i] < V, "token ", tok[i], " out of [0, ", V, ")");
  for (int64_t i = 0; i < M; ++i)
    TORCH_CHECK(rows_out[i] >= 0 && rows_out[i] < N && (i == 0 || rows_out[i] > rows_out[i - 1]),
                "logits_rows must ascend within [0, ", N, ")");
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->size(0) == N && t->size(1) == D,
                "cos, sin: contiguous fp32 [", N, ", ", D, "]");
  TORCH_CHECK(n_draft >= 0 && n_draft <= N, "n_draft ", n_draft, " out of [0, ", N, "]");
  TORCH_CHECK(n_vocab >= 0 && n_vocab <= n_draft, "n_vocab ", n_vocab, " out of [0, n_draft = ", n_draft, "]");
  TORCH_CHECK(extra.has_value() == extra_ids.has_value(), "extra head rows come with their token ids");
  Linear extra_head;   // the draft-vocabulary rows' extra tokens: the head's rows for them
  const int64_t* extra_at = nullptr;
  if (extra.has_value()) {
    extra_head = make_linear(*extra);
    const at::Tensor& ids = *extra_ids;
    TORCH_CHECK(!W.draft_head.fmt.empty() && extra_head.k == H && ids.dim() == 1 && ids.scalar_type() == at::kLong &&
                ids.is_contiguous() && ids.numel() == extra_head.n_total,
                "extra head rows: a draft head first, then [E, ", H, "] rows with int64 ids [E]");
    extra_at = ids.data_ptr<int64_t>();
    for (int64_t j = 0; j < ids.numel(); ++j)
      TORCH_CHECK(extra_at[j] >= W.draft_head.n_total && extra_at[j] < W.head.n_total, "extra token ", extra_at[j],
                  " out of [", W.draft_head.n_total, ", ", W.head.n_total, ")");
  }
  const int64_t n_q8 = draft_q8 ? n_draft : 0;   // rows through the q8 linears
  std::vector<int64_t> row0(S + 1, 0);
  for (int64_t s = 0; s < S; ++s) row0[s + 1] = row0[s] + seq_lens[s];
  TORCH_CHECK(row0[S] == N, "seq_lens sum to ", row0[S], " but x has ", N, " rows");
  std::vector<SeqCache> caches;
  size_t at = 0, tat = 0;
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(at + 2 <= cache_ints.size() && tat + 3 <= cache_tensors.size(), "cache descriptions end early");
    SeqCache c{cache_ints[at], cache_ints[at + 1], (int64_t)at + 2, (int64_t)tat + 3,
               *cache_tensors[tat], *cache_tensors[tat + 1], cache_tensors[tat + 2]};
    TORCH_CHECK(c.k.dim() == 4 && c.k.size(0) == L && c.k.size(1) == Hkv && c.k.size(3) == D &&
                c.slot + seq_lens[s] <= c.k.size(2) && c.v.sizes() == c.k.sizes(),
                "sequence ", s, ": cache K/V [", L, ", ", Hkv, ", >= ", c.slot + seq_lens[s], ", ", D, "] expected");
    at += 2 + vc_layout::PART_INTS * c.n_parts;
    tat += 3 + vc_layout::PART_TENSORS * c.n_parts;
    caches.push_back(c);
  }
  TORCH_CHECK(at == cache_ints.size() && tat == cache_tensors.size(), "cache descriptions do not match the sequences");

  const auto f32 = cos.options();
  at::Tensor x = at::empty({N, H}, f32);
  TORCH_CHECK(W.dequant(W.embed.fmt[0], W.embed.data[0], W.embed.row_bytes[0], H, tok, N, x.data_ptr<float>()) == 0,
              "cannot read embedding rows of format ", W.embed.fmt[0]);
  at::Tensor h = at::empty({N, H}, f32), qkv = at::empty({N, QD + 2 * KD}, f32), qr = at::empty({N, Hq, D}, f32),
             kr = at::empty({N, Hkv, D}, f32), o = at::empty({N, H}, f32), gu = at::empty({N, 2 * F}, f32),
             act = at::empty({N, F}, f32);
  const at::Tensor q_view = qr.transpose(0, 1), k_view = kr.transpose(0, 1);                 // [Hq|Hkv, N, D]
  const at::Tensor v_view = qkv.narrow(1, QD + KD, KD).view({N, Hkv, D}).transpose(0, 1);    // [Hkv, N, D]
  float *xp = x.data_ptr<float>(), *hp = h.data_ptr<float>(), *qkvp = qkv.data_ptr<float>();
  float *qp = qr.data_ptr<float>(), *kp = kr.data_ptr<float>(), *op = o.data_ptr<float>();
  float *gup = gu.data_ptr<float>(), *actp = act.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  const int threads = at::get_num_threads();
  std::vector<int64_t> ints;
  std::vector<c10::optional<at::Tensor>> tensors;

  for (int64_t l = 0; l < L; ++l) {
    const Layer& y = W.layers[l];
    const float *in_w = y.in_norm.data_ptr<float>(), *post_w = y.post_norm.data_ptr<float>();
    at::parallel_for(0, N, GRAIN, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) vc_rows::rms_norm_row(xp + i * H, in_w, H, W.eps, hp + i * H);
    });
    run_linear(W, y.qkv, hp, H, N, qkvp, n_q8, threads);
    const float* qn_w = y.q_norm.has_value() ? y.q_norm->data_ptr<float>() : nullptr;
    const float* kn_w = y.k_norm.has_value() ? y.k_norm->data_ptr<float>() : nullptr;
    at::parallel_for(0, N, GRAIN, [&](int64_t lo, int64_t hi) {
      std::vector<float> normed(D);   // one head after its RMSNorm (Qwen3), as the module's RMSNorm row op
      auto rope_head = [&](const float* head, const float* norm_w, int64_t i, float* out) {
        if (norm_w != nullptr) {
          vc_rows::rms_norm_row(head, norm_w, D, W.eps, normed.data());
          head = normed.data();
        }
        rope_row(head, cp + i * D, sp + i * D, D, out);
      };
      for (int64_t i = lo; i < hi; ++i) {
        const float* row = qkvp + i * (QD + 2 * KD);
        for (int64_t hd = 0; hd < Hq; ++hd) rope_head(row + hd * D, qn_w, i, qp + (i * Hq + hd) * D);
        for (int64_t hd = 0; hd < Hkv; ++hd) rope_head(row + QD + hd * D, kn_w, i, kp + (i * Hkv + hd) * D);
      }
    });
    ints.clear();
    tensors.clear();
    for (int64_t s = 0; s < S; ++s) {
      const SeqCache& c = caches[s];
      const int64_t r0 = row0[s], t = seq_lens[s];
      c.k.select(0, l).narrow(1, c.slot, t).copy_(k_view.narrow(1, r0, t));
      c.v.select(0, l).narrow(1, c.slot, t).copy_(v_view.narrow(1, r0, t));
      if (c.queries.has_value()) observe(c.queries->select(0, l), q_view.narrow(1, r0, t));
      for (int64_t p = 0; p < c.n_parts; ++p) {
        const size_t i0 = c.ints_at + vc_layout::PART_INTS * p, t0 = c.tensors_at + vc_layout::PART_TENSORS * p;
        const size_t first = ints.size();
        ints.insert(ints.end(), cache_ints.begin() + i0, cache_ints.begin() + i0 + vc_layout::PART_INTS);
        ints[first + vc_layout::SEQ] = s;   // the part's sequence: its index in this call
        for (size_t j = t0; j < t0 + vc_layout::PART_TENSORS; ++j)
          tensors.push_back(cache_tensors[j].has_value() ? c10::optional<at::Tensor>(cache_tensors[j]->select(0, l))
                                                         : c10::nullopt);
      }
    }
    const at::Tensor attn = attend_packed(q_view, Hkv, seq_lens, ints, tensors, W.score_unit,
                                         W.layers[l].key_coding, c10::nullopt, c10::nullopt);   // [N, Hq, D]
    run_linear(W, y.o, attn.data_ptr<float>(), QD, N, op, n_q8, threads);
    at::parallel_for(0, N, GRAIN, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) {
        for (int64_t j = 0; j < H; ++j) xp[i * H + j] = xp[i * H + j] + op[i * H + j];
        vc_rows::rms_norm_row(xp + i * H, post_w, H, W.eps, hp + i * H);
      }
    });
    run_linear(W, y.gate_up, hp, H, N, gup, n_q8, threads);
    at::parallel_for(0, N, GRAIN, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) vc_rows::silu_mul_row(gup + i * 2 * F, F, actp + i * F);
    });
    run_linear(W, y.down, actp, F, N, op, n_q8, threads);
    at::parallel_for(0, N, GRAIN, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i)
        for (int64_t j = 0; j < H; ++j) xp[i * H + j] = xp[i * H + j] + op[i * H + j];
    });
  }
  // the rows whose logits are wanted: final RMSNorm, then the head in the model's numerics (for draft
  // rows too, as the module runs it); draft-vocabulary rows through the draft head where there is one (the
  // first draft_head.n_total tokens: -inf past them, so no draft proposes one)
  const float* norm_w = W.final_norm.data_ptr<float>();
  for (int64_t i = 0; i < M; ++i) vc_rows::rms_norm_row(xp + rows_out[i] * H, norm_w, H, W.eps, hp + i * H);
  const int64_t V_out = W.head.n_total;
  at::Tensor logits = at::empty({M, V_out}, f32);
  float* lp = logits.data_ptr<float>();
  int64_t m_draft = 0;   // logits rows of draft-vocabulary rows: the first ones (both ascend)
  if (!W.draft_head.fmt.empty())
    while (m_draft < M && rows_out[m_draft] < n_vocab) ++m_draft;
  if (m_draft > 0) {
    const int64_t nd = W.draft_head.n_total;
    run_linear(W, W.draft_head, hp, H, m_draft, lp, 0, threads, V_out);
    for (int64_t i = 0; i < m_draft; ++i) std::fill(lp + i * V_out + nd, lp + (i + 1) * V_out, -INFINITY);
    if (extra_at != nullptr) {   // their extra tokens' logits, scattered to the tokens' columns
      const int64_t E = extra_head.n_total;
      std::vector<float> ex(m_draft * E);
      run_linear(W, extra_head, hp, H, m_draft, ex.data(), 0, threads);
      for (int64_t i = 0; i < m_draft; ++i)
        for (int64_t j = 0; j < E; ++j) lp[i * V_out + extra_at[j]] = ex[i * E + j];
    }
  }
  if (M > m_draft) run_linear(W, W.head, hp + m_draft * H, H, M - m_draft, lp + m_draft * V_out, 0, threads);
  return logits;
}

// The row ops for the PyTorch module's CPU path: x [M, K] fp32 -> [M, K]; gu [M, 2F] -> [M, F].
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat &&
              w.numel() == x.size(1), "rms_norm: fp32 x [M, K] and weight [K], got ", x.sizes(), " ", w.sizes());
  const at::Tensor xc = x.contiguous(), wc = w.contiguous();
  at::Tensor y = at::empty_like(xc);
  const int64_t M = xc.size(0), K = xc.size(1);
  const float *xp = xc.data_ptr<float>(), *wp = wc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, M, GRAIN, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) vc_rows::rms_norm_row(xp + i * K, wp, K, (float)eps, yp + i * K);
  });
  return y;
}

at::Tensor silu_mul(const at::Tensor& gu) {
  TORCH_CHECK(gu.dim() == 2 && gu.scalar_type() == at::kFloat && gu.size(1) % 2 == 0,
              "silu_mul: fp32 [M, 2F], got ", gu.sizes());
  const at::Tensor g = gu.contiguous();
  const int64_t M = g.size(0), F = g.size(1) / 2;
  at::Tensor y = at::empty({M, F}, g.options());
  const float* gp = g.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, M, GRAIN, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) vc_rows::silu_mul_row(gp + i * 2 * F, F, yp + i * F);
  });
  return y;
}
