// CPU kernel of the flexdma op family: FlashAttention (key tiles, online softmax) in plain C++17.
// The kernel itself is flash_dma_cpu_impl.h. It is compiled twice: for the baseline target of
// the build and, on x86-64 with GCC, for AVX2 + FMA (8-wide float vectors, fused
// multiply-adds), picked at run time by what the CPU supports. The library is built without
// -march flags, so the baseline copy alone would leave most of the vector units idle.
#include "flash_dma_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "float_convert.h"

#define FLEXDMA_CPU_ISA base
#define FLEXDMA_CPU_VEC_BYTES 16
#include "flash_dma_cpu_impl.h"
#undef FLEXDMA_CPU_ISA
#undef FLEXDMA_CPU_VEC_BYTES

// GCC only: Clang has no `#pragma GCC target` and its `#pragma clang attribute` equivalent is
// untested here; other compilers get the baseline copy alone.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FLEXDMA_CPU_HAVE_AVX2 1
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#define FLEXDMA_CPU_ISA avx2
#define FLEXDMA_CPU_VEC_BYTES 32
#include "flash_dma_cpu_impl.h"
#undef FLEXDMA_CPU_ISA
#undef FLEXDMA_CPU_VEC_BYTES
#pragma GCC pop_options
#endif

namespace flexdma {
namespace cpu {
namespace {

// FLEXDMA_CPU_NO_AVX2=1 forces the baseline copy (what CPUs without AVX2 run), for its tests.
bool use_avx2() {
#ifdef FLEXDMA_CPU_HAVE_AVX2
  static const bool yes = [] {
    const char* off = std::getenv("FLEXDMA_CPU_NO_AVX2");
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && !(off && std::string(off) == "1");
  }();
  return yes;
#else
  return false;
#endif
}

// a is b, NaN included.
bool same(float a, float b) { return a == b || (std::isnan(a) && std::isnan(b)); }

void check(const FwdParams& p, const ScoreConsts& c) {
  if (!same(static_cast<float>(c.softmax_scale), p.softmax_scale) || !same(static_cast<float>(c.softcap), p.softcap))
    throw std::invalid_argument("flexdma cpu: softmax_scale / softcap differ between the params and ScoreConsts");
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

void run_fwd(const FwdParams& p, const ScoreConsts& c, const ParallelFor& parallel_for) {
  check(p, c);
  if (p.batch == 0 || p.seqlen_q == 0 || p.num_heads == 0) return;
#ifdef FLEXDMA_CPU_HAVE_AVX2
  if (use_avx2()) return avx2::run_fwd_isa(p, c, parallel_for);
#endif
  base::run_fwd_isa(p, c, parallel_for);
}

void run_bwd(const BwdParams& p, const ScoreConsts& c, const ParallelFor& parallel_for, int64_t num_threads) {
  check(p, c);
  if (p.batch == 0 || p.num_heads == 0) return;
#ifdef FLEXDMA_CPU_HAVE_AVX2
  if (use_avx2()) return avx2::run_bwd_isa(p, c, parallel_for, num_threads);
#endif
  base::run_bwd_isa(p, c, parallel_for, num_threads);
}

}  // namespace cpu
}  // namespace flexdma
