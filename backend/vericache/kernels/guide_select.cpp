// Verification-guided selection's choice (drafting/guide.py): which kept tokens of an evicting store
// to trade for which missing ones, per layer and KV head, from a verification's log-attention
// estimates (packed_attention.cpp's ``seen``). O(keys) a head, where torch's topk over every key
// of every head cost more than the verification it follows.
//
// seen: [L, Hq, >= n] fp32, log-attention estimates of keys 0..n-1; pos: [L, Hkv, C] int32 the store's
// positions (slots 0..count-1 in use, each < limit); scores: [L, Hkv, C] fp32 (inf: never traded);
// memory: [L, Hkv, C] fp32, in and out, each kept token's attention memory (log).
// Per (layer, head): att[j] = max over the group's query heads of seen[j], for positions j < limit;
// each kept token's memory becomes max(memory - decay, att) (attended in a recent round still counts);
// candidates: positions the head lacks with att > -log(n) (above a uniform share), most attended
// first; victims: kept slots, least remembered first; the t-th candidate replaces the t-th victim
// while its attention beats the victim's memory (and takes it as its memory), at most ``swaps`` a
// head. Ties go to the lower position / slot.
// Returns int64 [T, 4]: (layer, head, slot, position) of each trade, heads in order.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <algorithm>
#include <array>
#include <cmath>
#include <vector>

at::Tensor guide_select(const at::Tensor& seen, int64_t n, const at::Tensor& pos, const at::Tensor& scores,
                        const at::Tensor& memory, int64_t count, int64_t limit, int64_t swaps, double decay) {
  TORCH_CHECK(seen.dim() == 3 && seen.scalar_type() == at::kFloat && seen.stride(2) == 1 && seen.size(2) >= n,
              "seen: fp32 [L, Hq, >= ", n, "] with a contiguous last dim, got ", seen.sizes());
  TORCH_CHECK(pos.dim() == 3 && pos.scalar_type() == at::kInt && pos.is_contiguous() && pos.size(0) == seen.size(0),
              "pos: contiguous int32 [L, Hkv, C], got ", pos.sizes());
  TORCH_CHECK(scores.sizes() == pos.sizes() && scores.scalar_type() == at::kFloat && scores.is_contiguous(),
              "scores: contiguous fp32 like pos, got ", scores.sizes());
  TORCH_CHECK(memory.sizes() == pos.sizes() && memory.scalar_type() == at::kFloat && memory.is_contiguous(),
              "memory: contiguous fp32 like pos, got ", memory.sizes());
  const int64_t L = pos.size(0), Hkv = pos.size(1), C = pos.size(2), Hq = seen.size(1);
  TORCH_CHECK(Hq % Hkv == 0 && 0 <= count && count <= C && 0 <= limit && limit <= n && swaps >= 0,
              "guide_select: count ", count, " of ", C, ", limit ", limit, " of ", n, ", ", Hq, " query heads for ",
              Hkv, " KV heads");
  const int64_t G = Hq / Hkv;
  const float thr = -std::log((float)std::max<int64_t>(n, 1));
  const int32_t* pp = pos.data_ptr<int32_t>();
  const float* sp = scores.data_ptr<float>();
  float* mp = memory.data_ptr<float>();
  std::vector<std::vector<std::array<int64_t, 4>>> out(L * Hkv);
  at::parallel_for(0, L * Hkv, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> att(limit);
    std::vector<char> held(limit);
    std::vector<std::pair<float, int64_t>> cand, victim;
    for (int64_t lh = lo; lh < hi; ++lh) {
      const int64_t l = lh / Hkv, h = lh % Hkv;
      std::fill(att.begin(), att.end(), -INFINITY);
      for (int64_t g = 0; g < G; ++g) {
        const float* sg = seen.data_ptr<float>() + l * seen.stride(0) + (h * G + g) * seen.stride(1);
#pragma omp simd
        for (int64_t j = 0; j < limit; ++j) att[j] = sg[j] > att[j] ? sg[j] : att[j];
      }
      std::fill(held.begin(), held.end(), 0);
      const int32_t* ph = pp + lh * C;
      const float* sh = sp + lh * C;
      for (int64_t i = 0; i < count; ++i) {
        TORCH_CHECK(ph[i] >= 0 && ph[i] < limit, "stored position ", ph[i], " outside [0, ", limit, ")");
        held[ph[i]] = 1;
      }
      float* mh = mp + lh * C;
      victim.clear();
      float least = INFINITY;                     // a candidate must beat the least remembered victim
      for (int64_t i = 0; i < count; ++i) {
        mh[i] = std::max(mh[i] - (float)decay, att[ph[i]]);
        if (!std::isinf(sh[i])) {
          victim.emplace_back(mh[i], i);                                       // least remembered first
          least = std::min(least, mh[i]);
        }
      }
      const size_t m = std::min<size_t>((size_t)swaps, victim.size());
      if (m == 0) continue;
      // the m most attended missing positions: a min-heap of m (most keys fail its top at once)
      const float bar = std::max(thr, least);
      cand.clear();
      const auto later = [](const std::pair<float, int64_t>& a, const std::pair<float, int64_t>& b) {
        return a.first > b.first || (a.first == b.first && a.second < b.second);   // heap top: the weakest
      };
      for (int64_t j = 0; j < limit; ++j) {
        if (!(att[j] > bar) || held[j]) continue;
        if (cand.size() < m) {
          cand.emplace_back(att[j], j);
          std::push_heap(cand.begin(), cand.end(), later);
        } else if (att[j] > cand.front().first) {
          std::pop_heap(cand.begin(), cand.end(), later);
          cand.back() = {att[j], j};
          std::push_heap(cand.begin(), cand.end(), later);
        }
      }
      std::sort_heap(cand.begin(), cand.end(), later);                        // most attended first
      if (m < victim.size()) std::nth_element(victim.begin(), victim.begin() + m, victim.end());
      std::sort(victim.begin(), victim.begin() + std::min(m, victim.size()));
      for (size_t t = 0; t < cand.size() && cand[t].first > victim[t].first; ++t) {
        out[lh].push_back({l, h, victim[t].second, cand[t].second});
        mh[victim[t].second] = cand[t].first;
      }
    }
  });
  int64_t total = 0;
  for (const auto& o : out) total += (int64_t)o.size();
  at::Tensor res = at::empty({total, 4}, at::kLong);
  int64_t* rp = res.data_ptr<int64_t>();
  for (const auto& o : out)
    for (const auto& t : o) rp = std::copy(t.begin(), t.end(), rp);
  return res;
}
