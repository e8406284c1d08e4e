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
// guide_select returns int64 [T, 4]: (layer, head, slot, position) of each trade, heads in order.
// guide_trade makes the same choice and applies it to a plain store (one K and one V row a token, the
// full cache's element type): each slot takes its position's K/V rows from the full cache and the
// larger of its old score and its head's median score (CompressedKVCache.trade, without ~30 small
// torch ops a round: ~1 ms of SmolLM2's 8 x 4K round updates).
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

using Scored = std::pair<float, int64_t>;   // (attention or memory, position or slot)

struct Store {   // the store's bookkeeping as guide_select reads it: [L, Hkv, C] each
  int64_t L, Hkv, C, G, count, limit;
  const int32_t* pos;
  float* scores;
  float* memory;
};

struct Scratch {   // one thread's buffers, reused head after head
  std::vector<float> att;
  std::vector<Scored> cand, victim;
  std::vector<float> kept_scores;
};

void check_store(const at::Tensor& seen, int64_t n, const at::Tensor& pos, const at::Tensor& scores,
                 const at::Tensor& memory, int64_t count, int64_t limit, int64_t swaps) {
  TORCH_CHECK(seen.dim() == 3 && seen.scalar_type() == at::kFloat && seen.stride(2) == 1 && seen.size(2) >= n,
              "seen: fp32 [L, Hq, >= ", n, "] with a contiguous last dim, got ", seen.sizes());
  TORCH_CHECK(pos.dim() == 3 && pos.scalar_type() == at::kInt && pos.is_contiguous() && pos.size(0) == seen.size(0),
              "pos: contiguous int32 [L, Hkv, C], got ", pos.sizes());
  TORCH_CHECK(scores.sizes() == pos.sizes() && scores.scalar_type() == at::kFloat && scores.is_contiguous(),
              "scores: contiguous fp32 like pos, got ", scores.sizes());
  TORCH_CHECK(memory.sizes() == pos.sizes() && memory.scalar_type() == at::kFloat && memory.is_contiguous(),
              "memory: contiguous fp32 like pos, got ", memory.sizes());
  const int64_t C = pos.size(2), Hkv = pos.size(1), Hq = seen.size(1);
  TORCH_CHECK(Hq % Hkv == 0 && 0 <= count && count <= C && 0 <= limit && limit <= n && swaps >= 0,
              "guide_select: count ", count, " of ", C, ", limit ", limit, " of ", n, ", ", Hq, " query heads for ",
              Hkv, " KV heads");
}

// One (layer, head)'s trades (slot, position), most attended candidate first; updates its memory.
void select_head(const at::Tensor& seen, const Store& s, int64_t lh, float thr, float decay, int64_t swaps,
                 Scratch& w, std::vector<std::array<int64_t, 2>>& trades) {
  const int64_t l = lh / s.Hkv, h = lh % s.Hkv, limit = s.limit;
  float* att = w.att.data();
  std::fill(att, att + limit, -INFINITY);
  for (int64_t g = 0; g < s.G; ++g) {
    const float* sg = seen.data_ptr<float>() + l * seen.stride(0) + (h * s.G + g) * seen.stride(1);
#pragma omp simd
    for (int64_t j = 0; j < limit; ++j) att[j] = sg[j] > att[j] ? sg[j] : att[j];
  }
  const int32_t* ph = s.pos + lh * s.C;
  const float* sh = s.scores + lh * s.C;
  float* mh = s.memory + lh * s.C;
  w.victim.clear();
  float least = INFINITY;                     // a candidate must beat the least remembered victim
  for (int64_t i = 0; i < s.count; ++i) {
    TORCH_CHECK(ph[i] >= 0 && ph[i] < limit, "stored position ", ph[i], " outside [0, ", limit, ")");
    mh[i] = std::max(mh[i] - decay, att[ph[i]]);
    if (!std::isinf(sh[i])) {
      w.victim.emplace_back(mh[i], i);                                       // least remembered first
      least = std::min(least, mh[i]);
    }
  }
  const size_t m = std::min<size_t>((size_t)swaps, w.victim.size());
  if (m == 0) return;
  for (int64_t i = 0; i < s.count; ++i) att[ph[i]] = -INFINITY;              // held: never a candidate
  // the m most attended missing positions: every key above the bar (a few percent: a block of 16 keys
  // none of which is above it is skipped by one vector compare), then the top m of those, in order
  const float bar = std::max(thr, least);
  std::vector<Scored>& cand = w.cand;
  cand.clear();
  int64_t j = 0;
  for (; j + 16 <= limit; j += 16) {
    int any = 0;
#pragma omp simd reduction(| : any)
    for (int i = 0; i < 16; ++i) any |= att[j + i] > bar;
    if (any)
      for (int64_t i = j; i < j + 16; ++i)
        if (att[i] > bar) cand.emplace_back(att[i], i);
  }
  for (; j < limit; ++j)
    if (att[j] > bar) cand.emplace_back(att[j], j);
  const auto before = [](const Scored& a, const Scored& b) {   // most attended first, ties: the lower position
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  if (m < cand.size()) {
    std::nth_element(cand.begin(), cand.begin() + m, cand.end(), before);
    cand.resize(m);
  }
  std::sort(cand.begin(), cand.end(), before);
  std::vector<Scored>& victim = w.victim;
  if (m < victim.size()) std::nth_element(victim.begin(), victim.begin() + m, victim.end());
  std::sort(victim.begin(), victim.begin() + std::min(m, victim.size()));
  for (size_t t = 0; t < cand.size() && cand[t].first > victim[t].first; ++t) {
    trades.push_back({victim[t].second, cand[t].second});
    mh[victim[t].second] = cand[t].first;
  }
}

// Every head's trades (heads in parallel; each head writes only its own memory and store rows), then
// ``apply(lh, trades of lh, scratch)`` on each head with trades; the trades as int64 [T, 4].
template <typename Apply>
at::Tensor select_all(const at::Tensor& seen, int64_t n, const Store& s, int64_t swaps, double decay, Apply apply) {
  const float thr = -std::log((float)std::max<int64_t>(n, 1));
  std::vector<std::vector<std::array<int64_t, 2>>> out(s.L * s.Hkv);
  at::parallel_for(0, s.L * s.Hkv, 1, [&](int64_t lo, int64_t hi) {
    Scratch w;
    w.att.resize(s.limit);
    for (int64_t lh = lo; lh < hi; ++lh) {
      select_head(seen, s, lh, thr, (float)decay, swaps, w, out[lh]);
      if (!out[lh].empty()) apply(lh, out[lh], w);
    }
  });
  int64_t total = 0;
  for (const auto& o : out) total += (int64_t)o.size();
  at::Tensor res = at::empty({total, 4}, at::kLong);
  int64_t* rp = res.data_ptr<int64_t>();
  for (int64_t lh = 0; lh < s.L * s.Hkv; ++lh)
    for (const auto& t : out[lh]) {
      const int64_t row[4] = {lh / s.Hkv, lh % s.Hkv, t[0], t[1]};
      rp = std::copy(row, row + 4, rp);
    }
  return res;
}

Store store_of(const at::Tensor& seen, const at::Tensor& pos, const at::Tensor& scores, const at::Tensor& memory,
               int64_t count, int64_t limit) {
  return Store{pos.size(0), pos.size(1), pos.size(2), seen.size(1) / pos.size(1), count, limit,
               pos.data_ptr<int32_t>(), scores.data_ptr<float>(), memory.data_ptr<float>()};
}

}  // namespace

at::Tensor guide_select(const at::Tensor& seen, int64_t n, const at::Tensor& pos, const at::Tensor& scores,
                        const at::Tensor& memory, int64_t count, int64_t limit, int64_t swaps, double decay) {
  check_store(seen, n, pos, scores, memory, count, limit, swaps);
  return select_all(seen, n, store_of(seen, pos, scores, memory, count, limit), swaps, decay,
                    [](int64_t, const std::vector<std::array<int64_t, 2>>&, Scratch&) {});
}

at::Tensor guide_trade(const at::Tensor& seen, int64_t n, const at::Tensor& pos, const at::Tensor& scores,
                       const at::Tensor& memory, int64_t count, int64_t limit, int64_t swaps, double decay,
                       const at::Tensor& full_k, const at::Tensor& full_v, const at::Tensor& store_k,
                       const at::Tensor& store_v) {
  check_store(seen, n, pos, scores, memory, count, limit, swaps);
  const int64_t L = pos.size(0), Hkv = pos.size(1), C = pos.size(2);
  for (const at::Tensor* t : {&full_k, &full_v, &store_k, &store_v})
    TORCH_CHECK(t->dim() == 4 && t->is_contiguous() && t->size(0) == L && t->size(1) == Hkv &&
                    t->size(3) == full_k.size(3) && t->scalar_type() == full_k.scalar_type(),
                "guide_trade: K/V must be contiguous [", L, ", ", Hkv, ", *, D] of one dtype, got ", t->sizes(), " ",
                t->scalar_type());
  TORCH_CHECK(store_k.size(2) == C && store_v.size(2) == C && full_k.size(2) == full_v.size(2) &&
                  full_k.size(2) >= limit,
              "guide_trade: the store holds ", C, " slots, the full cache ", full_k.size(2), " positions (limit ",
              limit, ")");
  const int64_t row = full_k.size(3) * (int64_t)full_k.element_size(), cap = full_k.size(2);
  const char* fk = static_cast<const char*>(full_k.data_ptr());
  const char* fv = static_cast<const char*>(full_v.data_ptr());
  char* sk = static_cast<char*>(store_k.data_ptr());
  char* sv = static_cast<char*>(store_v.data_ptr());
  const Store s = store_of(seen, pos, scores, memory, count, limit);
  int32_t* pp = pos.data_ptr<int32_t>();
  return select_all(seen, n, s, swaps, decay, [&](int64_t lh, const std::vector<std::array<int64_t, 2>>& trades,
                                                  Scratch& w) {
    float* sh = s.scores + lh * C;
    w.kept_scores.assign(sh, sh + count);                      // the head's median score: torch's lower median
    const auto mid = w.kept_scores.begin() + (count - 1) / 2;
    std::nth_element(w.kept_scores.begin(), mid, w.kept_scores.end());
    const float median = *mid;
    for (const auto& t : trades) {
      const int64_t slot = t[0], position = t[1];
      std::memcpy(sk + (lh * C + slot) * row, fk + (lh * cap + position) * row, row);
      std::memcpy(sv + (lh * C + slot) * row, fv + (lh * cap + position) * row, row);
      sh[slot] = std::max(sh[slot], median);
      pp[lh * C + slot] = (int32_t)position;
    }
  });
}
