// CPU kernel of the flexdma op family: FlashAttention (key tiles, online softmax) in plain C++17.
//
// Forward: one work item per (batch, head, query tile); key tiles whose mask (or top-k rank
// rule) keeps nothing, or that lie fully past the causal diagonal, are skipped before any load.
// Backward: two passes, both without atomics and in a fixed order, so results are bitwise
// reproducible whatever the thread count:
//   delta, dq:       one work item per (batch, head, query tile), looping over key tiles;
//   dk / dv / dbias: one work item per (batch, kv head, key tile), looping over the query heads
//                    of that kv head and every query tile.
// The tile products (Q K^T, dO V^T, P V, dS K, P^T dO, dS^T Q) go through one register-blocked
// GEMM; the other inner loops run with unit stride over head_dim or the keys of a tile. Inputs
// are converted to the accumulation type once per tile; the element type is a template
// parameter, never a branch in a hot loop.
#include "flash_dma_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "float_convert.h"

namespace flexdma {
namespace cpu {
namespace {

constexpr int64_t kBlockM = 64;  // query rows per tile
constexpr int64_t kBlockN = 64;  // keys per tile (also the row stride of score-sized scratch)

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// c[M x N] += a[M x K] * b[K x N], all row-major with the given row strides. A block of 4 rows
// x two 16-byte vectors of c stays in registers (GCC/Clang vector extensions; 16 bytes is native
// on SSE2 and NEON) across the whole k loop; edges fall back to plain loops. Every element of c
// sums its k terms in ascending order, and the path taken depends only on the shapes, so results
// never depend on the thread count.
template <class A>
struct Vec {
  typedef A type __attribute__((vector_size(16)));
  static constexpr int kLanes = static_cast<int>(16 / sizeof(A));
};

template <class A>
void gemm_acc(int64_t M, int64_t N, int64_t K, const A* a, int64_t lda, const A* b, int64_t ldb, A* c,
              int64_t ldc) {
  using V = typename Vec<A>::type;
  constexpr int R = 4;
  constexpr int L = Vec<A>::kLanes;
  constexpr int C = 2 * L;
  int64_t i = 0;
  for (; i + R <= M; i += R) {
    int64_t j = 0;
    for (; j + C <= N; j += C) {
      V x[R][2];
      for (int r = 0; r < R; ++r) {
        std::memcpy(&x[r][0], c + (i + r) * ldc + j, sizeof(V));
        std::memcpy(&x[r][1], c + (i + r) * ldc + j + L, sizeof(V));
      }
      const A* a0 = a + i * lda;
      for (int64_t k = 0; k < K; ++k) {
        V b0, b1;
        std::memcpy(&b0, b + k * ldb + j, sizeof(V));
        std::memcpy(&b1, b + k * ldb + j + L, sizeof(V));
        for (int r = 0; r < R; ++r) {
          const A av = a0[r * lda + k];
          x[r][0] += av * b0;
          x[r][1] += av * b1;
        }
      }
      for (int r = 0; r < R; ++r) {
        std::memcpy(c + (i + r) * ldc + j, &x[r][0], sizeof(V));
        std::memcpy(c + (i + r) * ldc + j + L, &x[r][1], sizeof(V));
      }
    }
    for (; j < N; ++j)
      for (int r = 0; r < R; ++r) {
        A acc = c[(i + r) * ldc + j];
        for (int64_t k = 0; k < K; ++k) acc += a[(i + r) * lda + k] * b[k * ldb + j];
        c[(i + r) * ldc + j] = acc;
      }
  }
  for (; i < M; ++i) {
    A* __restrict crow = c + i * ldc;
    for (int64_t k = 0; k < K; ++k) {
      const A av = a[i * lda + k];
      const A* __restrict brow = b + k * ldb;
      for (int64_t j = 0; j < N; ++j) crow[j] += av * brow[j];
    }
  }
}

// dst[c * ld_dst + r] = src[r * ld_src + c] for r < m, c < n.
template <class A>
void transpose(const A* src, int64_t ld_src, int64_t m, int64_t n, A* dst, int64_t ld_dst) {
  for (int64_t r = 0; r < m; ++r)
    for (int64_t c = 0; c < n; ++c) dst[c * ld_dst + r] = src[r * ld_src + c];
}

// Everything a tile needs besides its buffers, derived once from the params.
template <class T>
struct Ctx {
  using A = typename Elem<T>::acc;
  const FwdParams& p;
  int64_t B, Q, K, H, KVH, D, group, causal_off, n_qt, n_kt;
  A scale, cap, scale_over_cap;
  const uint8_t* mask;
  const T* bias;
  const int32_t* key_rank;  // with row_thr: the top-k rank keep rule (FwdParams::key_rank)
  const int32_t* row_thr;

  explicit Ctx(const FwdParams& prm)
      : p(prm), B(prm.batch), Q(prm.seqlen_q), K(prm.seqlen_k), H(prm.num_heads), KVH(prm.num_heads_k),
        D(prm.head_dim), group(prm.num_heads / prm.num_heads_k), causal_off(prm.seqlen_k - prm.seqlen_q),
        n_qt(ceil_div(prm.seqlen_q, kBlockM)), n_kt(ceil_div(prm.seqlen_k, kBlockN)),
        scale(static_cast<A>(prm.softmax_scale)), cap(static_cast<A>(prm.softcap)),
        scale_over_cap(prm.softcap > 0 ? static_cast<A>(prm.softmax_scale) / static_cast<A>(prm.softcap) : A(0)),
        mask(static_cast<const uint8_t*>(prm.mask.ptr)), bias(static_cast<const T*>(prm.bias.ptr)),
        key_rank(static_cast<const int32_t*>(prm.key_rank.ptr)), row_thr(static_cast<const int32_t*>(prm.row_thr.ptr)) {}

  static int64_t offset(const Broadcast4d& o, int64_t b, int64_t h, int64_t i) {
    return b * o.batch_stride + (h / o.head_ratio) * o.head_stride + i * o.row_stride;
  }

  // Key tiles [0, end) can hold a key visible to some row of [i0, i0 + m) under causality.
  int64_t kt_end(int64_t i0, int64_t m) const {
    if (!p.is_causal) return n_kt;
    const int64_t last_key = i0 + m - 1 + causal_off;
    return last_key < 0 ? 0 : std::min(n_kt, last_key / kBlockN + 1);
  }
  // Query tiles [begin, n_qt) can see some key of [j0, ...) under causality.
  int64_t qt_begin(int64_t j0) const {
    if (!p.is_causal) return 0;
    const int64_t first_row = j0 - causal_off;
    return first_row <= 0 ? 0 : std::min(n_qt, first_row / kBlockM);
  }

  // False when the mask or the rank rule drops every (row, key) of the tile: the tile is skipped.
  bool tile_any(int64_t b, int64_t h, int64_t i0, int64_t m, int64_t j0, int64_t n) const {
    if (key_rank) {
      // Some pair (i, j) keeps iff the tile's smallest key rank is <= its largest row threshold.
      const Broadcast4d& kr = p.key_rank;
      const Broadcast4d& rt = p.row_thr;
      const int32_t* ranks = key_rank + offset(kr, b, h, 0) + j0 * kr.col_stride;
      const int32_t* thrs = row_thr + offset(rt, b, h, i0);
      int32_t min_rank = std::numeric_limits<int32_t>::max();
      for (int64_t c = 0; c < (kr.col_stride == 0 ? 1 : n); ++c)
        min_rank = std::min(min_rank, ranks[c * kr.col_stride]);
      int32_t max_thr = std::numeric_limits<int32_t>::min();
      for (int64_t r = 0; r < (rt.row_stride == 0 ? 1 : m); ++r)
        max_thr = std::max(max_thr, thrs[r * rt.row_stride]);
      if (min_rank > max_thr) return false;
    }
    if (!mask) return true;
    const Broadcast4d& mk = p.mask;
    const int64_t rows = mk.row_stride == 0 ? 1 : m;
    const int64_t cols = mk.col_stride == 0 ? 1 : n;
    const uint8_t* base = mask + offset(mk, b, h, i0) + j0 * mk.col_stride;
    for (int64_t r = 0; r < rows; ++r) {
      const uint8_t* row = base + r * mk.row_stride;
      for (int64_t c = 0; c < cols; ++c)
        if (row[c * mk.col_stride]) return true;
    }
    return false;
  }

  // s[r * kBlockN + c] = final score of row i0 + r, key j0 + c, from q rows qf ([m][D]) and the
  // transposed key tile kt ([D][kBlockN]). With softcap, th (if given) receives the tanh values.
  void scores(int64_t b, int64_t h, int64_t i0, int64_t m, int64_t j0, int64_t n, const A* qf, const A* kt,
              A* s, A* th) const {
    const A neg_inf = -std::numeric_limits<A>::infinity();
    for (int64_t r = 0; r < m; ++r) std::fill(s + r * kBlockN, s + r * kBlockN + n, A(0));
    gemm_acc(m, n, D, qf, D, kt, kBlockN, s, kBlockN);
    for (int64_t r = 0; r < m; ++r) {
      A* __restrict srow = s + r * kBlockN;
      if (cap > 0) {
        A* trow = th ? th + r * kBlockN : nullptr;
        for (int64_t c = 0; c < n; ++c) {
          const A t = std::tanh(srow[c] * scale_over_cap);
          if (trow) trow[c] = t;
          srow[c] = cap * t;
        }
      } else {
        for (int64_t c = 0; c < n; ++c) srow[c] *= scale;
      }
      const int64_t i = i0 + r;
      if (bias) {
        const int64_t cs = p.bias.col_stride;
        const T* brow = bias + offset(p.bias, b, h, i) + j0 * cs;
        for (int64_t c = 0; c < n; ++c) srow[c] += Elem<T>::load(brow[c * cs]);
      }
      if (mask) {
        const int64_t cs = p.mask.col_stride;
        const uint8_t* mrow = mask + offset(p.mask, b, h, i) + j0 * cs;
        for (int64_t c = 0; c < n; ++c)
          if (!mrow[c * cs]) srow[c] = neg_inf;
      }
      if (key_rank) {
        const int32_t thr = row_thr[offset(p.row_thr, b, h, i)];
        const int64_t cs = p.key_rank.col_stride;
        const int32_t* rrow = key_rank + offset(p.key_rank, b, h, 0) + j0 * cs;
        for (int64_t c = 0; c < n; ++c)
          if (rrow[c * cs] > thr) srow[c] = neg_inf;
      }
      if (p.is_causal) {
        // Keys j > i + (K - Q) are dropped (bottom-right alignment).
        const int64_t first_hidden = std::max<int64_t>(0, i + causal_off + 1 - j0);
        for (int64_t c = first_hidden; c < n; ++c) srow[c] = neg_inf;
      }
    }
  }
};

// Rows [r0, r0 + m) of a (row, head, D) tensor into a dense [m][D] accumulation-type buffer.
template <class T, class A>
void load_rows(const T* base, int64_t row_stride, int64_t m, int64_t D, A* dst) {
  for (int64_t r = 0; r < m; ++r) {
    const T* src = base + r * row_stride;
    A* out = dst + r * D;
    for (int64_t d = 0; d < D; ++d) out[d] = Elem<T>::load(src[d]);
  }
}

// Same, transposed into [D][kBlockN] (keys contiguous), the layout of the score loops.
template <class T, class A>
void load_rows_t(const T* base, int64_t row_stride, int64_t n, int64_t D, A* dst) {
  for (int64_t c = 0; c < n; ++c) {
    const T* src = base + c * row_stride;
    for (int64_t d = 0; d < D; ++d) dst[d * kBlockN + c] = Elem<T>::load(src[d]);
  }
}

template <class T, class A>
void store_rows(const A* src, int64_t m, int64_t D, T* base, int64_t row_stride) {
  for (int64_t r = 0; r < m; ++r) {
    T* out = base + r * row_stride;
    const A* in = src + r * D;
    for (int64_t d = 0; d < D; ++d) out[d] = Elem<T>::store(in[d]);
  }
}

// ------------------------------------------------------------------------------------ forward
template <class T>
void fwd_typed(const FwdParams& p, const ParallelFor& parallel_for) {
  using A = typename Elem<T>::acc;
  const Ctx<T> cx(p);
  const int64_t D = cx.D;
  const T* q = static_cast<const T*>(p.q);
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);
  T* out = static_cast<T*>(p.out);
  A* lse = static_cast<A*>(p.lse);

  parallel_for(cx.B * cx.H * cx.n_qt, [&](int64_t begin, int64_t end) {
    std::vector<A> qf(kBlockM * D), kt(D * kBlockN), vf(kBlockN * D), s(kBlockM * kBlockN), o(kBlockM * D);
    std::vector<A> row_max(kBlockM), row_sum(kBlockM);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t qt = item % cx.n_qt, h = (item / cx.n_qt) % cx.H, b = item / (cx.n_qt * cx.H);
      const int64_t kvh = h / cx.group;
      const int64_t i0 = qt * kBlockM, m = std::min(kBlockM, cx.Q - i0);
      load_rows(q + b * p.q_batch_stride + h * p.q_head_stride + i0 * p.q_row_stride, p.q_row_stride, m, D,
                qf.data());
      std::fill(o.begin(), o.begin() + m * D, A(0));
      std::fill(row_max.begin(), row_max.end(), -std::numeric_limits<A>::infinity());
      std::fill(row_sum.begin(), row_sum.end(), A(0));

      const int64_t kt_end = cx.kt_end(i0, m);
      for (int64_t ktile = 0; ktile < kt_end; ++ktile) {
        const int64_t j0 = ktile * kBlockN, n = std::min(kBlockN, cx.K - j0);
        if (!cx.tile_any(b, h, i0, m, j0, n)) continue;
        load_rows_t(k + b * p.k_batch_stride + kvh * p.k_head_stride + j0 * p.k_row_stride, p.k_row_stride, n, D,
                    kt.data());
        load_rows(v + b * p.v_batch_stride + kvh * p.v_head_stride + j0 * p.v_row_stride, p.v_row_stride, n, D,
                  vf.data());
        cx.scores(b, h, i0, m, j0, n, qf.data(), kt.data(), s.data(), nullptr);
        for (int64_t r = 0; r < m; ++r) {
          A* srow = s.data() + r * kBlockN;
          A mx = -std::numeric_limits<A>::infinity();
          for (int64_t c = 0; c < n; ++c) mx = std::max(mx, srow[c]);
          if (mx == -std::numeric_limits<A>::infinity()) {  // nothing visible here: adds nothing to P V
            std::fill(srow, srow + n, A(0));
            continue;
          }
          const A m_new = std::max(row_max[r], mx);
          const A alpha = std::exp(row_max[r] - m_new);  // 0 on the row's first visible tile
          A sum = 0;
          for (int64_t c = 0; c < n; ++c) {
            srow[c] = std::exp(srow[c] - m_new);
            sum += srow[c];
          }
          row_sum[r] = row_sum[r] * alpha + sum;
          row_max[r] = m_new;
          A* __restrict orow = o.data() + r * D;
          if (alpha != A(1))
            for (int64_t d = 0; d < D; ++d) orow[d] *= alpha;
        }
        gemm_acc(m, D, n, s.data(), kBlockN, vf.data(), D, o.data(), D);
      }
      A* lse_row = lse + (b * cx.H + h) * cx.Q + i0;
      for (int64_t r = 0; r < m; ++r) {
        A* orow = o.data() + r * D;
        if (row_sum[r] == A(0)) {  // no visible key: out 0, lse -inf
          std::fill(orow, orow + D, A(0));
          lse_row[r] = -std::numeric_limits<A>::infinity();
        } else {
          const A inv = A(1) / row_sum[r];
          for (int64_t d = 0; d < D; ++d) orow[d] *= inv;
          lse_row[r] = row_max[r] + std::log(row_sum[r]);
        }
      }
      store_rows(o.data(), m, D, out + b * p.o_batch_stride + h * p.o_head_stride + i0 * p.o_row_stride,
                 p.o_row_stride);
    }
  });
}

// ----------------------------------------------------------------------------------- backward
// Shared by both backward passes: from scores s (in place -> dS_raw) and dO V^T (dp), compute
// P (into pbuf), dS = P * (dP - delta) (into ds, the gradient w.r.t. the score after the bias)
// and dS_raw = dS * d(score)/d(q.k) (in place in s).
template <class T>
void softmax_grad_tile(const Ctx<T>& cx, int64_t m, int64_t n, const typename Elem<T>::acc* lse_row,
                       const typename Elem<T>::acc* delta_row, typename Elem<T>::acc* s,
                       const typename Elem<T>::acc* th, const typename Elem<T>::acc* dp,
                       typename Elem<T>::acc* pbuf, typename Elem<T>::acc* ds) {
  using A = typename Elem<T>::acc;
  for (int64_t r = 0; r < m; ++r) {
    A* __restrict srow = s + r * kBlockN;
    A* __restrict prow = pbuf + r * kBlockN;
    A* __restrict dsrow = ds + r * kBlockN;
    const A* dprow = dp + r * kBlockN;
    const A l = lse_row[r];
    if (l == -std::numeric_limits<A>::infinity()) {  // empty row: no gradient flows from it
      std::fill(prow, prow + n, A(0));
      std::fill(dsrow, dsrow + n, A(0));
      std::fill(srow, srow + n, A(0));
      continue;
    }
    const A dl = delta_row[r];
    for (int64_t c = 0; c < n; ++c) {
      const A pc = std::exp(srow[c] - l);
      prow[c] = pc;
      dsrow[c] = pc * (dprow[c] - dl);
    }
    if (cx.cap > 0) {
      const A* trow = th + r * kBlockN;
      for (int64_t c = 0; c < n; ++c) srow[c] = dsrow[c] * cx.scale * (A(1) - trow[c] * trow[c]);
    } else {
      for (int64_t c = 0; c < n; ++c) srow[c] = dsrow[c] * cx.scale;
    }
  }
}

// dp[r * kBlockN + c] = dO_r . V_c, with V transposed ([D][kBlockN]).
template <class A>
void dot_tile(const A* rows, const A* cols_t, int64_t m, int64_t n, int64_t D, A* dst) {
  for (int64_t r = 0; r < m; ++r) std::fill(dst + r * kBlockN, dst + r * kBlockN + n, A(0));
  gemm_acc(m, n, D, rows, D, cols_t, kBlockN, dst, kBlockN);
}

template <class T>
void bwd_typed(const BwdParams& p, const ParallelFor& parallel_for) {
  using A = typename Elem<T>::acc;
  const Ctx<T> cx(p);
  const int64_t D = cx.D, H = cx.H, Q = cx.Q;
  const T* q = static_cast<const T*>(p.q);
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);
  const T* dout = static_cast<const T*>(p.dout);
  const A* lse = static_cast<const A*>(p.lse);
  // delta_i = sum_j P_ij dP_ij, computed by pass 1 in the accumulation type from the P and dP it
  // forms anyway, into softmax_d (caller-owned scratch). rowsum(dO * O) from an output rounded
  // to bf16 (~4e-3 relative) would show in dq and, summed over rows and heads, in a broadcast dbias.
  A* delta = static_cast<A*>(p.softmax_d);
  T* dq = static_cast<T*>(p.dq);
  T* dk = static_cast<T*>(p.dk);
  T* dv = static_cast<T*>(p.dv);

  // dbias. Work items (b, kv head, key tile) must never share an accumulator element; the
  // caller guarantees that across (b, kv head).
  // Broadcast4d holds a const pointer (it also describes the read-only mask / bias); the
  // accumulator it points to here is a writable buffer owned by the caller.
  A* dbias = static_cast<A*>(const_cast<void*>(p.dbias_accum.ptr));
  const Broadcast4d& db = p.dbias_accum;
  // A bias broadcast over keys (col stride 0) is a per-row shift, which softmax cancels: its
  // gradient is sum_j dS_ij = delta_i * (1 - sum_j P_ij), 0 up to rounding. Pass 1 sees whole
  // rows, so it writes that per (b, h, row) into row_dbias, reduced in a fixed order afterwards;
  // key tiles (separate work items of pass 2) never share an accumulator element.
  const bool dbias_by_row = dbias && db.col_stride == 0;
  std::vector<A> row_dbias;
  if (dbias) {
    if ((db.batch_stride == 0 && cx.B > 1) || (db.head_stride == 0 && cx.KVH > 1) ||
        (db.head_stride != 0 && cx.group % db.head_ratio != 0 && db.head_ratio % cx.group != 0))
      throw std::invalid_argument("flexdma cpu: dbias accumulator shared across (batch, kv head) work items");
    if (dbias_by_row) row_dbias.assign(static_cast<size_t>(cx.B * H * Q), A(0));
  }

  // Pass 1: delta, then dq; one work item per (batch, head, query tile).
  parallel_for(cx.B * H * cx.n_qt, [&](int64_t begin, int64_t end) {
    std::vector<A> kt(D * kBlockN), vt(D * kBlockN), kf(kBlockN * D), qf(kBlockM * D), dof(kBlockM * D);
    std::vector<A> s(kBlockM * kBlockN), th(kBlockM * kBlockN), dp(kBlockM * kBlockN), pb(kBlockM * kBlockN),
        ds(kBlockM * kBlockN), dq_acc(kBlockM * D), pdp_sum(kBlockM), p_sum(kBlockM);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t qt = item % cx.n_qt, h = (item / cx.n_qt) % H, b = item / (cx.n_qt * H);
      const int64_t kvh = h / cx.group;
      const int64_t i0 = qt * kBlockM, m = std::min(kBlockM, Q - i0);
      const int64_t lrow = (b * H + h) * Q + i0;
      std::fill(dq_acc.begin(), dq_acc.begin() + m * D, A(0));
      std::fill(pdp_sum.begin(), pdp_sum.end(), A(0));
      std::fill(p_sum.begin(), p_sum.end(), A(0));
      load_rows(q + b * p.q_batch_stride + h * p.q_head_stride + i0 * p.q_row_stride, p.q_row_stride, m, D,
                qf.data());
      load_rows(dout + b * p.do_batch_stride + h * p.do_head_stride + i0 * p.do_row_stride, p.do_row_stride, m, D,
                dof.data());
      const int64_t kt_end = cx.kt_end(i0, m);
      const T* kbatch = k + b * p.k_batch_stride + kvh * p.k_head_stride;
      const T* vbatch = v + b * p.v_batch_stride + kvh * p.v_head_stride;
      // Sweep 1: delta_i = sum_j P_ij dP_ij and sum_j P_ij. Sweep 2: dS and dq. With one key
      // tile the second sweep reuses the first's tiles.
      for (int sweep = 0; sweep < 2; ++sweep) {
        for (int64_t ktile = 0; ktile < kt_end; ++ktile) {
          const int64_t j0 = ktile * kBlockN, n = std::min(kBlockN, cx.K - j0);
          if (!cx.tile_any(b, h, i0, m, j0, n)) continue;
          const bool reuse = sweep == 1 && kt_end == 1;
          if (!reuse) {
            load_rows_t(kbatch + j0 * p.k_row_stride, p.k_row_stride, n, D, kt.data());
            load_rows_t(vbatch + j0 * p.v_row_stride, p.v_row_stride, n, D, vt.data());
            cx.scores(b, h, i0, m, j0, n, qf.data(), kt.data(), s.data(), th.data());
            dot_tile(dof.data(), vt.data(), m, n, D, dp.data());
          }
          if (sweep == 0) {
            for (int64_t r = 0; r < m; ++r) {
              const A l = lse[lrow + r];
              if (l == -std::numeric_limits<A>::infinity()) continue;
              const A* srow = s.data() + r * kBlockN;
              const A* dprow = dp.data() + r * kBlockN;
              A a = 0, z = 0;
              for (int64_t c = 0; c < n; ++c) {
                const A pc = std::exp(srow[c] - l);
                a += pc * dprow[c];
                z += pc;
              }
              pdp_sum[r] += a;
              p_sum[r] += z;
            }
            continue;
          }
          load_rows(kbatch + j0 * p.k_row_stride, p.k_row_stride, n, D, kf.data());
          softmax_grad_tile(cx, m, n, lse + lrow, delta + lrow, s.data(), th.data(), dp.data(), pb.data(),
                            ds.data());
          gemm_acc(m, D, n, s.data(), kBlockN, kf.data(), D, dq_acc.data(), D);
        }
        if (sweep == 0) {
          for (int64_t r = 0; r < m; ++r) {
            delta[lrow + r] = pdp_sum[r];
            if (dbias_by_row) row_dbias[lrow + r] = pdp_sum[r] * (A(1) - p_sum[r]);
          }
        }
      }
      store_rows(dq_acc.data(), m, D, dq + b * p.dq_batch_stride + h * p.dq_head_stride + i0 * p.dq_row_stride,
                 p.dq_row_stride);
    }
  });

  // Pass 2: dk, dv, dbias; one work item per (batch, kv head, key tile).
  parallel_for(cx.B * cx.KVH * cx.n_kt, [&](int64_t begin, int64_t end) {
    std::vector<A> kt(D * kBlockN), vt(D * kBlockN), qf(kBlockM * D), dof(kBlockM * D);
    std::vector<A> s(kBlockM * kBlockN), th(kBlockM * kBlockN), dp(kBlockM * kBlockN), pb(kBlockM * kBlockN),
        ds(kBlockM * kBlockN), tt(kBlockN * kBlockM), dk_acc(kBlockN * D), dv_acc(kBlockN * D);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t ktile = item % cx.n_kt, kvh = (item / cx.n_kt) % cx.KVH, b = item / (cx.n_kt * cx.KVH);
      const int64_t j0 = ktile * kBlockN, n = std::min(kBlockN, cx.K - j0);
      std::fill(dk_acc.begin(), dk_acc.begin() + n * D, A(0));
      std::fill(dv_acc.begin(), dv_acc.begin() + n * D, A(0));
      bool loaded = false;
      for (int64_t hh = 0; hh < cx.group; ++hh) {
        const int64_t h = kvh * cx.group + hh;
        for (int64_t qt = cx.qt_begin(j0); qt < cx.n_qt; ++qt) {
          const int64_t i0 = qt * kBlockM, m = std::min(kBlockM, Q - i0);
          if (!cx.tile_any(b, h, i0, m, j0, n)) continue;
          if (!loaded) {
            load_rows_t(k + b * p.k_batch_stride + kvh * p.k_head_stride + j0 * p.k_row_stride, p.k_row_stride, n,
                        D, kt.data());
            load_rows_t(v + b * p.v_batch_stride + kvh * p.v_head_stride + j0 * p.v_row_stride, p.v_row_stride, n,
                        D, vt.data());
            loaded = true;
          }
          load_rows(q + b * p.q_batch_stride + h * p.q_head_stride + i0 * p.q_row_stride, p.q_row_stride, m, D,
                    qf.data());
          load_rows(dout + b * p.do_batch_stride + h * p.do_head_stride + i0 * p.do_row_stride, p.do_row_stride, m,
                    D, dof.data());
          cx.scores(b, h, i0, m, j0, n, qf.data(), kt.data(), s.data(), th.data());
          dot_tile(dof.data(), vt.data(), m, n, D, dp.data());
          const int64_t lrow = (b * H + h) * Q + i0;
          softmax_grad_tile(cx, m, n, lse + lrow, delta + lrow, s.data(), th.data(), dp.data(), pb.data(),
                            ds.data());
          // dV += P^T dO, dK += dS_raw^T Q (transposed tiles in tt, [kBlockN][kBlockM]).
          transpose(pb.data(), kBlockN, m, n, tt.data(), kBlockM);
          gemm_acc(n, D, m, tt.data(), kBlockM, dof.data(), D, dv_acc.data(), D);
          transpose(s.data(), kBlockN, m, n, tt.data(), kBlockM);
          gemm_acc(n, D, m, tt.data(), kBlockM, qf.data(), D, dk_acc.data(), D);
          if (dbias && !dbias_by_row) {
            for (int64_t r = 0; r < m; ++r) {
              A* __restrict dst = dbias + Ctx<T>::offset(db, b, h, i0 + r) + j0 * db.col_stride;
              const A* dsrow = ds.data() + r * kBlockN;
              for (int64_t c = 0; c < n; ++c) dst[c * db.col_stride] += dsrow[c];
            }
          }
        }
      }
      store_rows(dk_acc.data(), n, D, dk + b * p.dk_batch_stride + kvh * p.dk_head_stride + j0 * p.dk_row_stride,
                 p.dk_row_stride);
      store_rows(dv_acc.data(), n, D, dv + b * p.dv_batch_stride + kvh * p.dv_head_stride + j0 * p.dv_row_stride,
                 p.dv_row_stride);
    }
  });

  if (dbias_by_row) {
    // Per (batch, kv head): its query heads and rows in ascending order, a fixed order.
    parallel_for(cx.B * cx.KVH, [&](int64_t begin, int64_t end) {
      for (int64_t item = begin; item < end; ++item) {
        const int64_t kvh = item % cx.KVH, b = item / cx.KVH;
        for (int64_t h = kvh * cx.group; h < (kvh + 1) * cx.group; ++h)
          for (int64_t i = 0; i < Q; ++i) dbias[Ctx<T>::offset(db, b, h, i)] += row_dbias[(b * H + h) * Q + i];
      }
    });
  }
}

void check(const FwdParams& p) {
  if (p.num_heads_k <= 0 || p.num_heads % p.num_heads_k != 0)
    throw std::invalid_argument("flexdma cpu: num_heads must be a positive multiple of num_heads_k");
  if (p.head_dim <= 0) throw std::invalid_argument("flexdma cpu: head_dim must be positive");
  for (const Broadcast4d* o : {&p.mask, &p.bias, &p.key_rank, &p.row_thr})
    if (o->ptr && o->head_ratio <= 0)
      throw std::invalid_argument("flexdma cpu: mask/bias/key_rank/row_thr head_ratio must be >= 1");
  if ((p.key_rank.ptr == nullptr) != (p.row_thr.ptr == nullptr))
    throw std::invalid_argument("flexdma cpu: key_rank and row_thr come together");
}

}  // namespace

void run_fwd(const FwdParams& p, const ParallelFor& parallel_for) {
  check(p);
  if (p.batch == 0 || p.seqlen_q == 0 || p.num_heads == 0) return;
  switch (p.dtype) {
    case DType::kFloat32: return fwd_typed<float>(p, parallel_for);
    case DType::kFloat64: return fwd_typed<double>(p, parallel_for);
    case DType::kBFloat16: return fwd_typed<bf16_t>(p, parallel_for);
    case DType::kFloat16: return fwd_typed<fp16_t>(p, parallel_for);
  }
  throw std::invalid_argument("flexdma cpu: unknown dtype " + std::to_string(static_cast<int>(p.dtype)));
}

void run_bwd(const BwdParams& p, const ParallelFor& parallel_for) {
  check(p);
  if (p.batch == 0 || p.num_heads == 0) return;
  switch (p.dtype) {
    case DType::kFloat32: return bwd_typed<float>(p, parallel_for);
    case DType::kFloat64: return bwd_typed<double>(p, parallel_for);
    case DType::kBFloat16: return bwd_typed<bf16_t>(p, parallel_for);
    case DType::kFloat16: return bwd_typed<fp16_t>(p, parallel_for);
  }
  throw std::invalid_argument("flexdma cpu: unknown dtype " + std::to_string(static_cast<int>(p.dtype)));
}

}  // namespace cpu
}  // namespace flexdma
