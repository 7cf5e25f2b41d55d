// The body of the CPU kernel (see flash_dma_cpu.cpp), included once per instruction set: the
// includer defines FLEXDMA_CPU_ISA (the namespace of this copy) and FLEXDMA_CPU_VEC_BYTES (the
// width of the vectors of its GEMM and softmax loops), and sets the compiler's target options.
// No include guard on purpose.
//
// FlashAttention (key tiles, online softmax) in plain C++17.
// Forward: one work item per (batch, head, query tile); key tiles whose mask (or top-k rank
// rule) keeps nothing, or that lie fully past the causal diagonal, are skipped before any load.
// Backward: two passes, both without atomics and in a fixed order, so results are bitwise
// reproducible whatever the thread count:
//   delta, dq:       one work item per (batch, head, query tile), looping over key tiles;
//   dk / dv / dbias: one work item per (batch, kv head, key tile), looping over the query heads
//                    of that kv head and every query tile.
// The tile products (Q K^T, dO V^T, P V, dS K, P^T dO, dS^T Q) go through one register-blocked
// GEMM; the other inner loops run with unit stride over head_dim or the keys of a tile. Keys and
// values are converted to the accumulation type and laid out (rows and, transposed, tiles) once
// per call (KeySide), query-side rows once per work item. The element type is a template
// parameter, never a branch in a hot loop.

namespace flexdma {
namespace cpu {
namespace FLEXDMA_CPU_ISA {
namespace {

constexpr int64_t kBlockM = 64;  // query rows per tile
constexpr int64_t kBlockN = 64;  // keys per tile (also the row stride of score-sized scratch)

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// c[M x N] += a[M x K] * b[K x N], all row-major with the given row strides. A block of 6 rows
// x two vectors of c (FLEXDMA_CPU_VEC_BYTES wide, GCC/Clang vector extensions) stays in
// registers across the whole k loop: 12 accumulators + 2 rows of b + 1 broadcast fill the 16
// vector registers of SSE2 / AVX2. Leftover rows take 4-, 2- and 1-row blocks, leftover columns
// one vector, then plain loops. Every element of c sums its k terms in ascending order, and the
// path taken depends only on the shapes, so results never depend on the thread count.
template <class A>
struct Vec {
  typedef A type __attribute__((vector_size(FLEXDMA_CPU_VEC_BYTES)));
  static constexpr int kLanes = static_cast<int>(FLEXDMA_CPU_VEC_BYTES / sizeof(A));
};

template <class A, int R, int NV, bool kAcc>
inline __attribute__((always_inline)) void gemm_block(int64_t K, const A* a, int64_t lda, const A* b, int64_t ldb, A* c,
                                                      int64_t ldc) {
  using V = typename Vec<A>::type;
  constexpr int L = Vec<A>::kLanes;
  V x[R][NV];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) {
      if (kAcc)
        std::memcpy(&x[r][v], c + r * ldc + v * L, sizeof(V));
      else
        x[r][v] = V{};
    }
  for (int64_t k = 0; k < K; ++k) {
    V bv[NV];
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) std::memcpy(&bv[v], b + k * ldb + v * L, sizeof(V));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const A av = a[r * lda + k];
#pragma GCC unroll 2
      for (int v = 0; v < NV; ++v) x[r][v] += av * bv[v];
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) std::memcpy(c + r * ldc + v * L, &x[r][v], sizeof(V));
}

template <class A, int R, bool kAcc>
void gemm_rows(int64_t N, int64_t K, const A* a, int64_t lda, const A* b, int64_t ldb, A* c, int64_t ldc) {
  constexpr int L = Vec<A>::kLanes;
  int64_t j = 0;
  for (; j + 2 * L <= N; j += 2 * L) gemm_block<A, R, 2, kAcc>(K, a, lda, b + j, ldb, c + j, ldc);
  for (; j + L <= N; j += L) gemm_block<A, R, 1, kAcc>(K, a, lda, b + j, ldb, c + j, ldc);
  for (; j < N; ++j)
    for (int r = 0; r < R; ++r) {
      A acc = kAcc ? c[r * ldc + j] : A(0);
      for (int64_t k = 0; k < K; ++k) acc += a[r * lda + k] * b[k * ldb + j];
      c[r * ldc + j] = acc;
    }
}

// kAcc: c += a b; else c = a b (c is not read).
template <class A, bool kAcc>
void gemm(int64_t M, int64_t N, int64_t K, const A* a, int64_t lda, const A* b, int64_t ldb, A* c, int64_t ldc) {
  int64_t i = 0;
  for (; i + 6 <= M; i += 6) gemm_rows<A, 6, kAcc>(N, K, a + i * lda, lda, b, ldb, c + i * ldc, ldc);
  if (M - i >= 4) {
    gemm_rows<A, 4, kAcc>(N, K, a + i * lda, lda, b, ldb, c + i * ldc, ldc);
    i += 4;
  }
  if (M - i >= 2) {
    gemm_rows<A, 2, kAcc>(N, K, a + i * lda, lda, b, ldb, c + i * ldc, ldc);
    i += 2;
  }
  if (M - i >= 1) gemm_rows<A, 1, kAcc>(N, K, a + i * lda, lda, b, ldb, c + i * ldc, ldc);
}

template <class A>
void gemm_acc(int64_t M, int64_t N, int64_t K, const A* a, int64_t lda, const A* b, int64_t ldb, A* c, int64_t ldc) {
  gemm<A, true>(M, N, K, a, lda, b, ldb, c, ldc);
}

// c = a b over the columns [0, N) of a tile whose b has zero columns up to round_up(N, 2 vectors)
// (<= kBlockN): the GEMM then runs only full vector blocks.
template <class A>
void gemm_set_padded(int64_t M, int64_t N, int64_t K, const A* a, int64_t lda, const A* b, int64_t ldb, A* c,
                     int64_t ldc) {
  constexpr int64_t C = 2 * Vec<A>::kLanes;
  gemm<A, false>(M, std::min<int64_t>(kBlockN, ceil_div(N, C) * C), K, a, lda, b, ldb, c, ldc);
}

// Softmax helpers over one row of a tile. float runs FLEXDMA_CPU_VEC_BYTES-wide vectors with
// Cephes' expf polynomial (~1 ulp; std::exp, one scalar call per element, cost as much as the
// GEMMs); double keeps std::exp. Like the GEMM, the order of every sum depends only on n.
using VecF = Vec<float>::type;
typedef int32_t VecI __attribute__((vector_size(FLEXDMA_CPU_VEC_BYTES)));
constexpr int kLanesF = Vec<float>::kLanes;

inline VecF bits_select(VecI mask, VecF yes, VecF no) {
  VecI y, n;
  std::memcpy(&y, &yes, sizeof(y));
  std::memcpy(&n, &no, sizeof(n));
  const VecI r = (y & mask) | (n & ~mask);
  VecF out;
  std::memcpy(&out, &r, sizeof(out));
  return out;
}

// exp(x) lane-wise for x <= ~0 (scores minus a row maximum or an lse); exactly 0 below
// ln(FLT_MIN) ~ -87.3, which covers the -inf of dropped keys (their lanes compute garbage that
// the last select drops).
inline VecF exp_nonpos(VecF x) {
  const VecF zero = VecF{};
  const VecI under = x < -87.33654475f;
  // t = round(x / ln 2), by adding and removing 1.5 * 2^23 (the sum's low mantissa bits hold t).
  const VecF magic = VecF{} + 12582912.0f;
  const VecF tm = x * 1.44269504088896341f + magic;
  const VecF t = tm - magic;
  x = x - t * 0.693359375f - t * -2.12194440e-4f;
  const VecF z = x * x;
  VecF y = VecF{} + 1.9875691500e-4f;
  y = y * x + 1.3981999507e-3f;
  y = y * x + 8.3334519073e-3f;
  y = y * x + 4.1665795894e-2f;
  y = y * x + 1.6666665459e-1f;
  y = y * x + 5.0000001201e-1f;
  y = y * z + x + 1.0f;
  VecI ti, mi;
  std::memcpy(&ti, &tm, sizeof(ti));
  std::memcpy(&mi, &magic, sizeof(mi));
  const VecI e = (ti - mi + 127) << 23;
  VecF scale;
  std::memcpy(&scale, &e, sizeof(scale));
  return bits_select(under, zero, y * scale);
}

inline float hsum(VecF v) {
  float s = 0;
  for (int l = 0; l < kLanesF; ++l) s += v[l];
  return s;
}

// max over row[0, n).
inline double max_of(const double* row, int64_t n) {
  double m = -std::numeric_limits<double>::infinity();
  for (int64_t c = 0; c < n; ++c) m = std::max(m, row[c]);
  return m;
}
inline float max_of(const float* row, int64_t n) {
  int64_t c = 0;
  float m = -std::numeric_limits<float>::infinity();
  if (n >= kLanesF) {
    VecF mv;
    std::memcpy(&mv, row, sizeof(mv));
    for (c = kLanesF; c + kLanesF <= n; c += kLanesF) {
      VecF x;
      std::memcpy(&x, row + c, sizeof(x));
      mv = bits_select(x > mv, x, mv);
    }
    for (int l = 0; l < kLanesF; ++l) m = std::max(m, mv[l]);
  }
  for (; c < n; ++c) m = std::max(m, row[c]);
  return m;
}

// dst[c] = exp(src[c] - sub) for c < n (src == dst allowed); returns the sum of dst. sub is
// finite and >= every src[c].
inline double exp_sub_sum(const double* src, double sub, double* dst, int64_t n) {
  double sum = 0;
  for (int64_t c = 0; c < n; ++c) {
    dst[c] = std::exp(src[c] - sub);
    sum += dst[c];
  }
  return sum;
}
inline float exp_sub_sum(const float* src, float sub, float* dst, int64_t n) {
  VecF acc = VecF{};
  int64_t c = 0;
  for (; c + kLanesF <= n; c += kLanesF) {
    VecF x;
    std::memcpy(&x, src + c, sizeof(x));
    x = exp_nonpos(x - sub);
    std::memcpy(dst + c, &x, sizeof(x));
    acc += x;
  }
  float sum = hsum(acc);
  if (c < n) {  // the tail through one padded vector, so that it rounds like the rest
    VecF x = VecF{} - std::numeric_limits<float>::infinity();
    std::memcpy(&x, src + c, sizeof(float) * (n - c));
    x = exp_nonpos(x - sub);
    std::memcpy(dst + c, &x, sizeof(float) * (n - c));
    sum += hsum(x);
  }
  return sum;
}

// sum of a[c] * b[c] for c < n.
inline double dot(const double* a, const double* b, int64_t n) {
  double s = 0;
  for (int64_t c = 0; c < n; ++c) s += a[c] * b[c];
  return s;
}
inline float dot(const float* a, const float* b, int64_t n) {
  VecF acc = VecF{};
  int64_t c = 0;
  for (; c + kLanesF <= n; c += kLanesF) {
    VecF x, y;
    std::memcpy(&x, a + c, sizeof(x));
    std::memcpy(&y, b + c, sizeof(y));
    acc += x * y;
  }
  float sum = hsum(acc);
  for (; c < n; ++c) sum += a[c] * b[c];
  return sum;
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

  Ctx(const FwdParams& prm, const ScoreConsts& c)
      : p(prm),
        B(prm.batch),
        Q(prm.seqlen_q),
        K(prm.seqlen_k),
        H(prm.num_heads),
        KVH(prm.num_heads_k),
        D(prm.head_dim),
        group(prm.num_heads / prm.num_heads_k),
        causal_off(prm.seqlen_k - prm.seqlen_q),
        n_qt(ceil_div(prm.seqlen_q, kBlockM)),
        n_kt(ceil_div(prm.seqlen_k, kBlockN)),
        // From the double values: for float64 inputs in double, for the others rounded to
        // float (the params' values).
        scale(static_cast<A>(c.softmax_scale)),
        cap(static_cast<A>(c.softcap)),
        scale_over_cap(c.softcap > 0 ? static_cast<A>(c.softmax_scale) / static_cast<A>(c.softcap) : A(0)),
        mask(static_cast<const uint8_t*>(prm.mask.ptr)),
        bias(static_cast<const T*>(prm.bias.ptr)),
        key_rank(static_cast<const int32_t*>(prm.key_rank.ptr)),
        row_thr(static_cast<const int32_t*>(prm.row_thr.ptr)) {}

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
      for (int64_t r = 0; r < (rt.row_stride == 0 ? 1 : m); ++r) max_thr = std::max(max_thr, thrs[r * rt.row_stride]);
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

  // s[r * kBlockN + c] = final score of row i0 + r, key j0 + c, from q rows qf ([m][D], row
  // stride ldq) and the transposed keys kt ([D][.], row stride ldk, zero-padded past the last
  // key: KeySide). With softcap, th (if given) receives the tanh values.
  void scores(int64_t b, int64_t h, int64_t i0, int64_t m, int64_t j0, int64_t n, const A* qf, int64_t ldq, const A* kt,
              int64_t ldk, A* s, A* th) const {
    const A neg_inf = -std::numeric_limits<A>::infinity();
    gemm_set_padded(m, n, D, qf, ldq, kt, ldk, s, kBlockN);
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
      // A NaN score becomes +inf, before the masks write -inf: the row max and sum then turn NaN
      // and so does the row (as in the reference), where a max that skips NaN would read the row
      // as empty and output 0.
      for (int64_t c = 0; c < n; ++c)
        if (std::isnan(srow[c])) srow[c] = std::numeric_limits<A>::infinity();
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

template <class T, class A>
void store_rows(const A* src, int64_t m, int64_t D, T* base, int64_t row_stride) {
  for (int64_t r = 0; r < m; ++r) {
    T* out = base + r * row_stride;
    const A* in = src + r * D;
    for (int64_t d = 0; d < D; ++d) out[d] = Elem<T>::store(in[d]);
  }
}

// The key-side operands in the layouts the tile GEMMs read, built once per call instead of once
// per (query tile, key tile): K^T (and V^T for the backward) tile by tile, each key tile a dense
// [D][kBlockN] block, zero in the padding keys; K / V rows as dense [K][D] planes in the
// accumulation type. Dense copies, not the inputs in place: rows of a (B, K, KVH, D) input are
// KVH * D apart, and a power-of-two stride puts a tile's rows in a few L1 sets, where they evict
// each other in the GEMM's inner loop.
template <class T>
struct KeySide {
  using A = typename Elem<T>::acc;
  static constexpr int64_t ld_t = kBlockN;  // row stride of a K^T / V^T tile
  int64_t D, KVH, K, n_kt;
  std::vector<A> kt, vt, kf, vf;

  KeySide(const Ctx<T>& cx, bool with_vt, const ParallelFor& parallel_for)
      : D(cx.D), KVH(cx.KVH), K(cx.K), n_kt(cx.n_kt) {
    const FwdParams& p = cx.p;
    const int64_t planes = cx.B * cx.KVH;
    kt.assign(static_cast<size_t>(planes * n_kt * D * kBlockN), A(0));
    if (with_vt) vt.assign(static_cast<size_t>(planes * n_kt * D * kBlockN), A(0));
    kf.resize(static_cast<size_t>(planes * K * D));
    vf.resize(static_cast<size_t>(planes * K * D));
    const T* k = static_cast<const T*>(p.k);
    const T* v = static_cast<const T*>(p.v);
    parallel_for(planes * n_kt, [&](int64_t begin, int64_t end) {
      for (int64_t item = begin; item < end; ++item) {
        const int64_t ktile = item % n_kt, plane = item / n_kt;
        const int64_t b = plane / KVH, kvh = plane % KVH;
        const int64_t j0 = ktile * kBlockN, n = std::min(kBlockN, K - j0);
        A* krows = kf.data() + (plane * K + j0) * D;
        A* vrows = vf.data() + (plane * K + j0) * D;
        load_rows(k + b * p.k_batch_stride + kvh * p.k_head_stride + j0 * p.k_row_stride, p.k_row_stride, n, D, krows);
        load_rows(v + b * p.v_batch_stride + kvh * p.v_head_stride + j0 * p.v_row_stride, p.v_row_stride, n, D, vrows);
        transpose(krows, D, n, D, kt.data() + (plane * n_kt + ktile) * D * kBlockN, kBlockN);
        if (with_vt) transpose(vrows, D, n, D, vt.data() + (plane * n_kt + ktile) * D * kBlockN, kBlockN);
      }
    });
  }

  // The K^T / V^T tile of keys [j0, j0 + kBlockN), row stride ld_t.
  const A* k_t(int64_t b, int64_t kvh, int64_t j0) const { return tile(kt, b, kvh, j0); }
  const A* v_t(int64_t b, int64_t kvh, int64_t j0) const { return tile(vt, b, kvh, j0); }
  // Rows of K / V from key j0 on, row stride D.
  const A* k_rows(int64_t b, int64_t kvh, int64_t j0) const { return kf.data() + ((b * KVH + kvh) * K + j0) * D; }
  const A* v_rows(int64_t b, int64_t kvh, int64_t j0) const { return vf.data() + ((b * KVH + kvh) * K + j0) * D; }

 private:
  const A* tile(const std::vector<A>& t, int64_t b, int64_t kvh, int64_t j0) const {
    return t.data() + ((b * KVH + kvh) * n_kt + j0 / kBlockN) * D * kBlockN;
  }
};

// ------------------------------------------------------------------------------------ forward
template <class T>
void fwd_typed(const FwdParams& p, const ScoreConsts& consts, const ParallelFor& parallel_for) {
  using A = typename Elem<T>::acc;
  const Ctx<T> cx(p, consts);
  const int64_t D = cx.D;
  const T* q = static_cast<const T*>(p.q);
  T* out = static_cast<T*>(p.out);
  A* lse = static_cast<A*>(p.lse);

  const KeySide<T> keys(cx, /*with_vt=*/false, parallel_for);
  parallel_for(cx.B * cx.H * cx.n_qt, [&](int64_t begin, int64_t end) {
    std::vector<A> qf(kBlockM * D), s(kBlockM * kBlockN), o(kBlockM * D);
    std::vector<A> row_max(kBlockM), row_sum(kBlockM);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t qt = item % cx.n_qt, h = (item / cx.n_qt) % cx.H, b = item / (cx.n_qt * cx.H);
      const int64_t kvh = h / cx.group;
      const int64_t i0 = qt * kBlockM, m = std::min(kBlockM, cx.Q - i0);
      load_rows(q + b * p.q_batch_stride + h * p.q_head_stride + i0 * p.q_row_stride, p.q_row_stride, m, D, qf.data());
      std::fill(o.begin(), o.begin() + m * D, A(0));
      std::fill(row_max.begin(), row_max.end(), -std::numeric_limits<A>::infinity());
      std::fill(row_sum.begin(), row_sum.end(), A(0));

      const int64_t kt_end = cx.kt_end(i0, m);
      for (int64_t ktile = 0; ktile < kt_end; ++ktile) {
        const int64_t j0 = ktile * kBlockN, n = std::min(kBlockN, cx.K - j0);
        if (!cx.tile_any(b, h, i0, m, j0, n)) continue;
        cx.scores(b, h, i0, m, j0, n, qf.data(), D, keys.k_t(b, kvh, j0), keys.ld_t, s.data(), nullptr);
        for (int64_t r = 0; r < m; ++r) {
          A* srow = s.data() + r * kBlockN;
          const A mx = max_of(srow, n);
          if (mx == -std::numeric_limits<A>::infinity()) {  // nothing visible here: adds nothing to P V
            std::fill(srow, srow + n, A(0));
            continue;
          }
          const A m_new = std::max(row_max[r], mx);
          const A alpha = std::exp(row_max[r] - m_new);  // 0 on the row's first visible tile
          const A sum = exp_sub_sum(srow, m_new, srow, n);
          row_sum[r] = row_sum[r] * alpha + sum;
          row_max[r] = m_new;
          A* __restrict orow = o.data() + r * D;
          if (alpha != A(1))
            for (int64_t d = 0; d < D; ++d) orow[d] *= alpha;
        }
        gemm_acc(m, D, n, s.data(), kBlockN, keys.v_rows(b, kvh, j0), D, o.data(), D);
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
// P = exp(S - lse) of a tile's rows, from scores s into pbuf; 0 on empty rows (lse = -inf).
template <class A>
void probs_tile(int64_t m, int64_t n, const A* lse_row, const A* s, A* pbuf) {
  for (int64_t r = 0; r < m; ++r) {
    A* prow = pbuf + r * kBlockN;
    if (lse_row[r] == -std::numeric_limits<A>::infinity())
      std::fill(prow, prow + n, A(0));
    else
      exp_sub_sum(s + r * kBlockN, lse_row[r], prow, n);
  }
}

// From a tile's P (pbuf), dO V^T (dp) and, with softcap, its tanh values (th): dS = P * (dP -
// delta) into ds (the gradient w.r.t. the score after the bias) and dS_raw = dS * d(score)/d(q.k)
// into s.
template <class T>
void dscores_tile(const Ctx<T>& cx, int64_t m, int64_t n, const typename Elem<T>::acc* lse_row,
                  const typename Elem<T>::acc* delta_row, const typename Elem<T>::acc* pbuf,
                  const typename Elem<T>::acc* th, const typename Elem<T>::acc* dp, typename Elem<T>::acc* ds,
                  typename Elem<T>::acc* s) {
  using A = typename Elem<T>::acc;
  for (int64_t r = 0; r < m; ++r) {
    A* __restrict srow = s + r * kBlockN;
    A* __restrict dsrow = ds + r * kBlockN;
    const A* prow = pbuf + r * kBlockN;
    const A* dprow = dp + r * kBlockN;
    if (lse_row[r] == -std::numeric_limits<A>::infinity()) {  // empty row: no gradient flows from it
      std::fill(dsrow, dsrow + n, A(0));
      std::fill(srow, srow + n, A(0));
      continue;
    }
    const A dl = delta_row[r];
    for (int64_t c = 0; c < n; ++c) dsrow[c] = prow[c] * (dprow[c] - dl);
    if (cx.cap > 0) {
      const A* trow = th + r * kBlockN;
      for (int64_t c = 0; c < n; ++c) srow[c] = dsrow[c] * cx.scale * (A(1) - trow[c] * trow[c]);
    } else {
      for (int64_t c = 0; c < n; ++c) srow[c] = dsrow[c] * cx.scale;
    }
  }
}

// dbias's accumulator: work items (b, kv head, key tile) must never share an element; the caller
// guarantees that across (b, kv head). A bias broadcast over keys gets no accumulator (its gradient
// is zero, BwdParams): key tiles would share its elements.
template <class T>
void check_dbias_accum(const Ctx<T>& cx, const Broadcast4d& db) {
  if ((db.batch_stride == 0 && cx.B > 1) || (db.head_stride == 0 && cx.KVH > 1) ||
      (db.head_stride != 0 && cx.group % db.head_ratio != 0 && db.head_ratio % cx.group != 0))
    throw std::invalid_argument("flexdma cpu: dbias accumulator shared across (batch, kv head) work items");
  if (db.col_stride == 0 && cx.K > 1)
    throw std::invalid_argument("flexdma cpu: dbias accumulator broadcast over keys (its gradient is zero)");
}

constexpr int64_t kBwdTile = kBlockM * kBlockN;

// A thread's scratch for the backward's query tiles (bwd_typed's row_tile): the tile's Q and dO
// rows, the working score tiles, the rows' sums of P * dP, and the P / dP / tanh tiles of the
// first `kept` key tiles, kept from the delta sweep for the dq sweep.
template <class A>
struct BwdRowScratch {
  std::vector<A> qf, dof, s, th, dp, pb, ds, tt, pdp_sum, kept_p, kept_dp, kept_th;
  int64_t kept_tiles;
  BwdRowScratch(int64_t D, int64_t kept, bool softcap)
      : qf(kBlockM * D),
        dof(kBlockM * D),
        s(kBwdTile),
        th(softcap ? kBwdTile : 0),
        dp(kBwdTile),
        pb(kBwdTile),
        ds(kBwdTile),
        tt(kBwdTile),
        pdp_sum(kBlockM),
        kept_p(kept * kBwdTile),
        kept_dp(kept * kBwdTile),
        kept_th(softcap ? kept * kBwdTile : 0),
        kept_tiles(kept) {}
};

// A thread's scratch for the split schedule's key tiles (bwd_typed's pass 2): the query tile's Q
// and dO rows, its score tiles, and the key tile's dk / dv sums.
template <class A>
struct BwdKeyScratch {
  std::vector<A> qf, dof, s, th, dp, pb, ds, tt, dk_acc, dv_acc;
  explicit BwdKeyScratch(int64_t D)
      : qf(kBlockM * D),
        dof(kBlockM * D),
        s(kBwdTile),
        th(kBwdTile),
        dp(kBwdTile),
        pb(kBwdTile),
        ds(kBwdTile),
        tt(kBwdTile),
        dk_acc(kBlockN * D),
        dv_acc(kBlockN * D) {}
};

template <class T>
void bwd_typed(const BwdParams& p, const ScoreConsts& consts, const ParallelFor& parallel_for, int64_t num_threads) {
  using A = typename Elem<T>::acc;
  const Ctx<T> cx(p, consts);
  const int64_t D = cx.D, H = cx.H, Q = cx.Q;
  const T* q = static_cast<const T*>(p.q);
  const T* dout = static_cast<const T*>(p.dout);
  const A* lse = static_cast<const A*>(p.lse);
  // delta_i = sum_j P_ij dP_ij, into softmax_d (caller-owned scratch), in the accumulation type,
  // summed from the P and dP tiles that dS = P * (dP - delta) is then formed from; not
  // FlashAttention's dO_i . O_i, equal in exact arithmetic and cheaper by a sweep over the keys:
  // - where a row's P is one-hot (a saturated softmax; its true dS is 0), delta is then its kept
  //   key's dP bit for bit, and dS exactly 0. dO . O, summed in another order, differs from that
  //   dP in the last bits, and dbias carries the difference to whatever a huge bias multiplies it
  //   by: Doge's bias exp(A * softplus(...)) reaches 1e7 and more, which puts errors of 1e3 into
  //   its dA and dt_proj, whose values are near 1;
  // - for bf16 / fp16, dO . O from an output rounded to 16 bits (~4e-3 relative) would show in dq
  //   and, summed over rows and heads, in a broadcast dbias.
  A* delta = static_cast<A*>(p.softmax_d);
  T* dq = static_cast<T*>(p.dq);
  T* dk = static_cast<T*>(p.dk);
  T* dv = static_cast<T*>(p.dv);

  // dbias. Broadcast4d holds a const pointer (it also describes the read-only mask / bias); the
  // accumulator it points to here is a writable buffer owned by the caller.
  A* dbias = static_cast<A*>(const_cast<void*>(p.dbias_accum.ptr));
  const Broadcast4d& db = p.dbias_accum;
  if (dbias) check_dbias_accum(cx, db);

  const KeySide<T> keys(cx, /*with_vt=*/true, parallel_for);

  // Two schedules, same results. Split: pass 1 (delta, dq) over (batch, head, query tile), then
  // pass 2 (dk, dv, dbias) over (batch, kv head, key tile); each forms S and dP itself. Fused: one
  // item per (batch, kv head) runs pass 1 over its query heads and tiles and adds the key side's
  // gradients too, with S and dP formed once a tile pair where pass 1 keeps its tiles (5 tile
  // GEMMs instead of 7), but offers only B * KVH items and holds a float dk and dv of all keys per
  // thread: taken when that keeps every thread busy and they fit. Every sum adds its terms in the
  // order of the split schedule (dk, dv and dbias over query heads, then query tiles), so both
  // give the same bits.
  const bool fused =
      cx.B * cx.KVH >= 2 * num_threads && 2 * cx.K * D <= (int64_t(1) << 24);  // dk + dv <= 64 MiB (float)

  // One tile pair's share of the key side: dV += P^T dO, dK += dS_raw^T Q into the rows of keys
  // j0 .. j0 + n (dk_rows / dv_rows, row stride D), and dS into dbias. tt: [kBlockN][kBlockM]
  // scratch for the transposed tiles.
  const auto add_key_grads = [&](int64_t b, int64_t h, int64_t i0, int64_t m, int64_t j0, int64_t n, const A* pt,
                                 const A* ds_raw, const A* ds, const A* qf, const A* dof, A* tt, A* dk_rows,
                                 A* dv_rows) {
    transpose(pt, kBlockN, m, n, tt, kBlockM);
    gemm_acc(n, D, m, tt, kBlockM, dof, D, dv_rows, D);
    transpose(ds_raw, kBlockN, m, n, tt, kBlockM);
    gemm_acc(n, D, m, tt, kBlockM, qf, D, dk_rows, D);
    if (dbias) {
      for (int64_t r = 0; r < m; ++r) {
        A* __restrict dst = dbias + Ctx<T>::offset(db, b, h, i0 + r) + j0 * db.col_stride;
        const A* dsrow = ds + r * kBlockN;
        for (int64_t c = 0; c < n; ++c) dst[c * db.col_stride] += dsrow[c];
      }
    }
  };

  // Query tile qt of (b, h): delta of its rows (sweep 0 over the key tiles: P, dP and the row
  // sums of P * dP), then their dq into dq_acc (sweep 1: dS, then dS K) and, in the fused
  // schedule, the key side's gradients into dk_rows / dv_rows (all keys of (b, kv head)) and
  // dbias. With dq_acc null, delta only. Sweep 0's tiles of the first `kept_tiles` key tiles are
  // kept for sweep 1 (P, dP and the tanh values); later ones are formed again by the same calls,
  // so kept or not the bits are the same.
  using RowScratch = BwdRowScratch<A>;
  const auto row_tile = [&](RowScratch& w, int64_t b, int64_t h, int64_t qt, A* dq_acc, A* dk_rows, A* dv_rows) {
    const int64_t kvh = h / cx.group;
    const int64_t i0 = qt * kBlockM, m = std::min(kBlockM, Q - i0);
    const int64_t lrow = (b * H + h) * Q + i0;
    const int64_t kt_end = cx.kt_end(i0, m);
    load_rows(q + b * p.q_batch_stride + h * p.q_head_stride + i0 * p.q_row_stride, p.q_row_stride, m, D, w.qf.data());
    load_rows(dout + b * p.do_batch_stride + h * p.do_head_stride + i0 * p.do_row_stride, p.do_row_stride, m, D,
              w.dof.data());
    // P, dP and the tanh values of key tile `ktile`: its kept slot, or the working tiles.
    struct Tiles {
      A *p, *dp, *th;
    };
    const auto tiles = [&](int64_t ktile) {
      const bool kept = dq_acc && ktile < w.kept_tiles;
      const bool cap = cx.cap > 0;
      return kept ? Tiles{w.kept_p.data() + ktile * kBwdTile, w.kept_dp.data() + ktile * kBwdTile,
                          cap ? w.kept_th.data() + ktile * kBwdTile : nullptr}
                  : Tiles{w.pb.data(), w.dp.data(), cap ? w.th.data() : nullptr};
    };
    const auto form = [&](const Tiles& t, int64_t j0, int64_t n) {
      cx.scores(b, h, i0, m, j0, n, w.qf.data(), D, keys.k_t(b, kvh, j0), keys.ld_t, w.s.data(), t.th);
      gemm_set_padded(m, n, D, w.dof.data(), D, keys.v_t(b, kvh, j0), keys.ld_t, t.dp, kBlockN);
      probs_tile(m, n, lse + lrow, w.s.data(), t.p);
    };
    std::fill(w.pdp_sum.begin(), w.pdp_sum.end(), A(0));
    for (int64_t ktile = 0; ktile < kt_end; ++ktile) {
      const int64_t j0 = ktile * kBlockN, n = std::min(kBlockN, cx.K - j0);
      if (!cx.tile_any(b, h, i0, m, j0, n)) continue;
      const Tiles t = tiles(ktile);
      form(t, j0, n);
      for (int64_t r = 0; r < m; ++r)
        if (lse[lrow + r] != -std::numeric_limits<A>::infinity())
          w.pdp_sum[r] += dot(t.p + r * kBlockN, t.dp + r * kBlockN, n);
    }
    for (int64_t r = 0; r < m; ++r) delta[lrow + r] = w.pdp_sum[r];
    if (!dq_acc) return;
    std::fill(dq_acc, dq_acc + m * D, A(0));
    for (int64_t ktile = 0; ktile < kt_end; ++ktile) {
      const int64_t j0 = ktile * kBlockN, n = std::min(kBlockN, cx.K - j0);
      if (!cx.tile_any(b, h, i0, m, j0, n)) continue;
      const Tiles t = tiles(ktile);
      if (ktile >= w.kept_tiles) form(t, j0, n);
      dscores_tile(cx, m, n, lse + lrow, delta + lrow, t.p, t.th, t.dp, w.ds.data(), w.s.data());
      gemm_acc(m, D, n, w.s.data(), kBlockN, keys.k_rows(b, kvh, j0), D, dq_acc, D);
      if (dk_rows)
        add_key_grads(b, h, i0, m, j0, n, t.p, w.s.data(), w.ds.data(), w.qf.data(), w.dof.data(), w.tt.data(),
                      dk_rows + j0 * D, dv_rows + j0 * D);
    }
  };
  const auto store_dq = [&](const A* dq_acc, int64_t b, int64_t h, int64_t qt) {
    const int64_t i0 = qt * kBlockM, m = std::min(kBlockM, Q - i0);
    store_rows(dq_acc, m, D, dq + b * p.dq_batch_stride + h * p.dq_head_stride + i0 * p.dq_row_stride, p.dq_row_stride);
  };
  // Up to 16 key tiles (1024 keys, 0.5 to 1.5 MiB a thread) are kept from sweep 0 to sweep 1.
  const int64_t kept_tiles = std::min<int64_t>(16, cx.n_kt);

  if (fused) {
    // One work item per (batch, kv head): pass 1 over its query heads and query tiles, in order.
    parallel_for(cx.B * cx.KVH, [&](int64_t begin, int64_t end) {
      RowScratch w(D, kept_tiles, cx.cap > 0);
      std::vector<A> dq_acc(kBlockM * D), dk_rows(static_cast<size_t>(cx.K * D)), dv_rows(dk_rows.size());
      for (int64_t item = begin; item < end; ++item) {
        const int64_t kvh = item % cx.KVH, b = item / cx.KVH;
        std::fill(dk_rows.begin(), dk_rows.end(), A(0));
        std::fill(dv_rows.begin(), dv_rows.end(), A(0));
        for (int64_t hh = 0; hh < cx.group; ++hh) {
          const int64_t h = kvh * cx.group + hh;
          for (int64_t qt = 0; qt < cx.n_qt; ++qt) {
            row_tile(w, b, h, qt, dq_acc.data(), dk_rows.data(), dv_rows.data());
            store_dq(dq_acc.data(), b, h, qt);
          }
        }
        store_rows(dk_rows.data(), cx.K, D, dk + b * p.dk_batch_stride + kvh * p.dk_head_stride, p.dk_row_stride);
        store_rows(dv_rows.data(), cx.K, D, dv + b * p.dv_batch_stride + kvh * p.dv_head_stride, p.dv_row_stride);
      }
    });
    return;
  }

  // Pass 1: delta and dq, one work item per (batch, head, query tile).
  parallel_for(cx.B * H * cx.n_qt, [&](int64_t begin, int64_t end) {
    RowScratch w(D, kept_tiles, cx.cap > 0);
    std::vector<A> dq_acc(kBlockM * D);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t qt = item % cx.n_qt, h = (item / cx.n_qt) % H, b = item / (cx.n_qt * H);
      row_tile(w, b, h, qt, dq_acc.data(), nullptr, nullptr);
      store_dq(dq_acc.data(), b, h, qt);
    }
  });

  // Pass 2: dk, dv and dbias, one work item per (batch, kv head, key tile), over the query heads
  // of the kv head and every query tile, S and dP formed again.
  parallel_for(cx.B * cx.KVH * cx.n_kt, [&](int64_t begin, int64_t end) {
    BwdKeyScratch<A> w(D);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t ktile = item % cx.n_kt, kvh = (item / cx.n_kt) % cx.KVH, b = item / (cx.n_kt * cx.KVH);
      const int64_t j0 = ktile * kBlockN, n = std::min(kBlockN, cx.K - j0);
      std::fill(w.dk_acc.begin(), w.dk_acc.begin() + n * D, A(0));
      std::fill(w.dv_acc.begin(), w.dv_acc.begin() + n * D, A(0));
      for (int64_t hh = 0; hh < cx.group; ++hh) {
        const int64_t h = kvh * cx.group + hh;
        for (int64_t qt = cx.qt_begin(j0); qt < cx.n_qt; ++qt) {
          const int64_t i0 = qt * kBlockM, m = std::min(kBlockM, Q - i0);
          if (!cx.tile_any(b, h, i0, m, j0, n)) continue;
          load_rows(q + b * p.q_batch_stride + h * p.q_head_stride + i0 * p.q_row_stride, p.q_row_stride, m, D,
                    w.qf.data());
          load_rows(dout + b * p.do_batch_stride + h * p.do_head_stride + i0 * p.do_row_stride, p.do_row_stride, m, D,
                    w.dof.data());
          cx.scores(b, h, i0, m, j0, n, w.qf.data(), D, keys.k_t(b, kvh, j0), keys.ld_t, w.s.data(), w.th.data());
          gemm_set_padded(m, n, D, w.dof.data(), D, keys.v_t(b, kvh, j0), keys.ld_t, w.dp.data(), kBlockN);
          const int64_t lrow = (b * H + h) * Q + i0;
          probs_tile(m, n, lse + lrow, w.s.data(), w.pb.data());
          dscores_tile(cx, m, n, lse + lrow, delta + lrow, w.pb.data(), w.th.data(), w.dp.data(), w.ds.data(),
                       w.s.data());
          add_key_grads(b, h, i0, m, j0, n, w.pb.data(), w.s.data(), w.ds.data(), w.qf.data(), w.dof.data(),
                        w.tt.data(), w.dk_acc.data(), w.dv_acc.data());
        }
      }
      store_rows(w.dk_acc.data(), n, D, dk + b * p.dk_batch_stride + kvh * p.dk_head_stride + j0 * p.dk_row_stride,
                 p.dk_row_stride);
      store_rows(w.dv_acc.data(), n, D, dv + b * p.dv_batch_stride + kvh * p.dv_head_stride + j0 * p.dv_row_stride,
                 p.dv_row_stride);
    }
  });
}

}  // namespace

// Entry points of this copy; the params are checked by the caller.
inline void run_fwd_isa(const FwdParams& p, const ScoreConsts& c, const ParallelFor& parallel_for) {
  visit_elem(p.dtype, [&](auto t) { fwd_typed<std::remove_pointer_t<decltype(t)>>(p, c, parallel_for); });
}

inline void run_bwd_isa(const BwdParams& p, const ScoreConsts& c, const ParallelFor& parallel_for,
                        int64_t num_threads) {
  visit_elem(p.dtype, [&](auto t) { bwd_typed<std::remove_pointer_t<decltype(t)>>(p, c, parallel_for, num_threads); });
}

}  // namespace FLEXDMA_CPU_ISA
}  // namespace cpu
}  // namespace flexdma
