// The per-key decode step on the CPU: each plane's update decision, its query heads' attention over
// the updated kept set, then the writes, one plane after another within a thread. float64 inputs
// are computed and ranked in float64 (flexdma/perkey/kept.py's order_key), the others in float32
// (float16 / bfloat16 convert exactly, so their order is kept).
#include "decode_step.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "float_convert.h"

namespace flexdma {
namespace cpu {
namespace {

// The selection's order of a score as an integer (kept.py's order_key): -0.0 equal to +0.0, every
// NaN above +inf.
int64_t order_key(double s, bool wide) {
  if (std::isnan(s)) return wide ? std::numeric_limits<int64_t>::max() : std::numeric_limits<int32_t>::max();
  if (s == 0) return 0;
  if (wide) {
    int64_t bits;
    std::memcpy(&bits, &s, 8);
    return bits < 0 ? bits ^ std::numeric_limits<int64_t>::max() : bits;
  }
  const float f = static_cast<float>(s);
  int32_t bits;
  std::memcpy(&bits, &f, 4);
  return bits < 0 ? bits ^ std::numeric_limits<int32_t>::max() : bits;
}

template <class T, class S>
void decode_plane(const DecodeParams& p, int64_t plane) {
  using Acc = typename Elem<T>::acc;
  const bool wide = std::is_same<S, double>::value;
  // Plane a of batch row b: kv head g, query heads from a * G (DecodeParams::planes_per_batch).
  const int64_t A = p.planes_per_batch, b = plane / A, a = plane % A, g = a * p.num_heads_k / A;
  const int64_t W = p.window, D = p.head_dim, G = p.num_heads / A;
  const int64_t pos = p.position_at ? *p.position_at : p.position;
  int64_t* idx = p.kept_idx + b * p.idx_batch_stride + a * p.idx_head_stride;
  uint8_t* valid = p.kept_valid + b * p.valid_batch_stride + a * p.valid_head_stride;
  S* score = static_cast<S*>(p.kept_score) + b * p.score_batch_stride + a * p.score_head_stride;
  // No new key (perkey_last_row): nothing enters, nothing is written.
  const bool has_new = p.s_new != nullptr;
  const S s_new_raw =
      has_new ? static_cast<const S*>(p.s_new)[b * p.s_new_batch_stride + g * p.s_new_head_stride] : S{};
  const double sn = has_new ? static_cast<double>(Elem<S>::load(s_new_raw)) : -std::numeric_limits<double>::infinity();
  const bool eligible = has_new && p.eligible[b * p.eligible_batch_stride + g * p.eligible_head_stride] != 0;

  // decode.append's decision: the first free slot, else the worst kept key's (lowest order key,
  // among equal ones the highest index, then the first such slot).
  int64_t first_free = -1, worst_slot = -1, worst_order = 0, worst_idx = 0;
  for (int64_t j = 0; j < W; ++j) {
    if (!valid[j * p.valid_slot_stride]) {
      if (first_free < 0) first_free = j;
      continue;
    }
    const int64_t o = order_key(static_cast<double>(Elem<S>::load(score[j * p.score_slot_stride])), wide);
    const int64_t ix = idx[j * p.idx_slot_stride];
    if (worst_slot < 0 || o < worst_order || (o == worst_order && ix > worst_idx)) {
      worst_slot = j;
      worst_order = o;
      worst_idx = ix;
    }
  }
  const bool free = first_free >= 0;
  const bool enter =
      eligible && sn != -std::numeric_limits<double>::infinity() && (free || order_key(sn, wide) > worst_order);
  const int64_t slot = free ? first_free : worst_slot;
  const int64_t taken = enter ? slot : -1;

  // The new key's rows: its own (decode_append) or the caches' at the position.
  const T* kc = static_cast<const T*>(p.k) + b * p.k_batch_stride + g * p.k_head_stride;
  const T* vc = static_cast<const T*>(p.v) + b * p.v_batch_stride + g * p.v_head_stride;
  const T* k_new = p.k_new   ? static_cast<const T*>(p.k_new) + b * p.k_new_batch_stride + g * p.k_new_head_stride
                   : has_new ? kc + pos * p.k_row_stride
                             : nullptr;
  const T* v_new = p.v_new   ? static_cast<const T*>(p.v_new) + b * p.v_new_batch_stride + g * p.v_new_head_stride
                   : has_new ? vc + pos * p.v_row_stride
                             : nullptr;

  const Acc scale = static_cast<Acc>(p.softmax_scale), cap = static_cast<Acc>(p.softcap);
  const Acc inf = std::numeric_limits<Acc>::infinity();
  std::vector<Acc> logits(W), acc(D);
  for (int64_t r = 0; r < G; ++r) {
    const int64_t h = a * G + r;
    const T* q = static_cast<const T*>(p.q) + b * p.q_batch_stride + h * p.q_head_stride;
    Acc m = -inf;
    for (int64_t j = 0; j < W; ++j) {
      const bool is_new = j == taken;
      if (!is_new && !valid[j * p.valid_slot_stride]) {
        logits[j] = -inf;
        continue;
      }
      const T* kr = is_new ? k_new : kc + idx[j * p.idx_slot_stride] * p.k_row_stride;
      Acc dot = 0;
      for (int64_t d = 0; d < D; ++d) dot += Elem<T>::load(q[d]) * Elem<T>::load(kr[d]);
      Acc s = cap > 0 ? cap * std::tanh(scale * dot / cap) : scale * dot;
      s += static_cast<Acc>(is_new ? sn : static_cast<double>(Elem<S>::load(score[j * p.score_slot_stride])));
      // A NaN becomes +inf: the max and the sum turn NaN and the row comes out NaN, as in the
      // reference, instead of the max skipping it.
      logits[j] = std::isnan(s) ? inf : s;
      m = std::max(m, logits[j]);
    }
    std::fill(acc.begin(), acc.end(), Acc(0));
    Acc l = 0;
    if (m != -inf) {
      for (int64_t j = 0; j < W; ++j) {
        if (logits[j] == -inf) continue;
        const Acc e = std::exp(logits[j] - m);
        l += e;
        const T* vr = j == taken ? v_new : vc + idx[j * p.idx_slot_stride] * p.v_row_stride;
        for (int64_t d = 0; d < D; ++d) acc[d] += e * Elem<T>::load(vr[d]);
      }
    }
    T* out = static_cast<T*>(p.out) + b * p.o_batch_stride + h * p.o_head_stride;
    for (int64_t d = 0; d < D; ++d) out[d] = Elem<T>::store(l == 0 ? Acc(0) : acc[d] / l);
  }

  // The writes, after every read of the kept set and of the caches.
  if (enter) {
    idx[slot * p.idx_slot_stride] = pos;
    valid[slot * p.valid_slot_stride] = 1;
    score[slot * p.score_slot_stride] = s_new_raw;
  }
  if (p.k_new) {
    T* kd = static_cast<T*>(p.k) + b * p.k_batch_stride + g * p.k_head_stride + pos * p.k_row_stride;
    T* vd = static_cast<T*>(p.v) + b * p.v_batch_stride + g * p.v_head_stride + pos * p.v_row_stride;
    std::copy(k_new, k_new + D, kd);
    std::copy(v_new, v_new + D, vd);
    static_cast<S*>(p.bias_cache)[b * p.bias_batch_stride + g * p.bias_head_stride + pos * p.bias_row_stride] =
        s_new_raw;
    if (g == 0) p.padding_cache[b * p.padding_batch_stride + pos * p.padding_row_stride] = eligible ? 1 : 0;
  }
}

// The kept set of plane `plane` of p.scores: its top-W eligible keys by (score desc, index asc),
// in index order, the free slots after them (decode.last_row's set, in another slot order).
template <class S>
void select_plane(const DecodeParams& p, int64_t plane) {
  const bool wide = std::is_same<S, double>::value;
  const int64_t K = p.seqlen_k, W = p.window;
  const S* sc = static_cast<const S*>(p.scores) + (plane / p.score_planes2) * p.scores_batch_stride +
                (plane % p.score_planes2) * p.scores_head_stride;
  const int64_t never = order_key(-std::numeric_limits<double>::infinity(), wide);
  std::vector<std::pair<int64_t, int64_t>> keys;  // (order key, index)
  for (int64_t j = 0; j < K; ++j) {
    const int64_t o = order_key(static_cast<double>(Elem<S>::load(sc[j])), wide);
    if (o > never) keys.emplace_back(o, j);
  }
  const auto better = [](const std::pair<int64_t, int64_t>& x, const std::pair<int64_t, int64_t>& y) {
    return x.first > y.first || (x.first == y.first && x.second < y.second);
  };
  if (static_cast<int64_t>(keys.size()) > W) {
    std::nth_element(keys.begin(), keys.begin() + W, keys.end(), better);
    keys.resize(W);
  }
  std::sort(keys.begin(), keys.end(), [](const auto& x, const auto& y) { return x.second < y.second; });
  int64_t* idx = p.kept_idx + plane * W;
  uint8_t* valid = p.kept_valid + plane * W;
  S* score = static_cast<S*>(p.kept_score) + plane * W;
  for (int64_t j = 0; j < W; ++j) {
    const bool kept = j < static_cast<int64_t>(keys.size());
    idx[j] = kept ? keys[j].second : 0;
    valid[j] = kept;
    score[j] = kept ? sc[keys[j].second] : S{};
  }
}

template <class T, class S>
void run_typed(const DecodeParams& p, const ParallelFor& parallel_for) {
  parallel_for(p.batch * p.planes_per_batch, [&](int64_t begin, int64_t end) {
    for (int64_t plane = begin; plane < end; ++plane) decode_plane<T, S>(p, plane);
  });
}

template <class S>
void select_typed(const DecodeParams& p, const ParallelFor& parallel_for) {
  parallel_for(p.score_planes1 * p.score_planes2, [&](int64_t begin, int64_t end) {
    for (int64_t plane = begin; plane < end; ++plane) select_plane<S>(p, plane);
  });
}

}  // namespace

void run_last_row(const DecodeParams& p, const ParallelFor& parallel_for) {
  visit_elem(p.score_dtype, [&](auto s) { select_typed<std::remove_pointer_t<decltype(s)>>(p, parallel_for); });
  run_decode(p, parallel_for);
}

void run_decode(const DecodeParams& p, const ParallelFor& parallel_for) {
  if (p.num_heads_k <= 0 || p.planes_per_batch <= 0 || p.num_heads % p.planes_per_batch != 0 ||
      p.planes_per_batch % p.num_heads_k != 0 || p.head_dim <= 0 || p.window <= 0)
    throw std::invalid_argument(
        "flexdma cpu decode: heads must group onto planes and kv heads, head_dim and window positive");
  if (p.batch == 0) return;
  visit_elem(p.dtype, [&](auto t) {
    visit_elem(p.score_dtype, [&](auto s) {
      run_typed<std::remove_pointer_t<decltype(t)>, std::remove_pointer_t<decltype(s)>>(p, parallel_for);
    });
  });
}

}  // namespace cpu
}  // namespace flexdma
