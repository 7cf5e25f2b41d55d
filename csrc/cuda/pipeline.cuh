// The producer / consumer pipeline of the warp-specialized kernels (sm_90): shared-memory
// mbarriers that hand a stage of tiles from the loading warpgroup to the computing ones and back,
// named barriers for a subset of the CTA, and the register hand-over between warpgroups.
#pragma once
#include <cstdint>

#include "mma_sm80.cuh"

namespace flexdma {
namespace cuda {

// An mbarrier completes a phase when `count` arrivals have come; waiters name the phase by its
// parity (phase k of stage use k: parity k & 1).
__device__ inline void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
// Makes the initialised barriers visible to the other threads (before the barrier that follows).
__device__ inline void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
// Release semantics: this thread's earlier shared-memory writes are seen by a thread whose wait
// returns for the phase this arrival completes.
__device__ inline void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
// Arrives when every cp.async this thread has issued so far has landed, without waiting for them
// (counts as one of the phase's arrivals).
__device__ inline void mbar_arrive_copies(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
// Blocks until the phase of the given parity has completed (acquire).
__device__ inline void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}

// Position in a ring of S stages: the stage and the parity of its current use (use i: stage i % S,
// parity (i / S) & 1), advanced one use at a time instead of divided out of i.
template <int S>
struct RingPos {
  int stage = 0;
  uint32_t phase = 0;
  __device__ inline void advance() {
    if (++stage == S) {
      stage = 0;
      phase ^= 1u;
    }
  }
  __device__ inline RingPos next() const {
    RingPos r = *this;
    r.advance();
    return r;
  }
};

// The barriers of a warp-specialized kernel's K / V rings of S stages, at `bars`: full_k (two
// arrivals of every loading thread: its copies landed, its plain stores done), empty_k, full_v (its
// copies landed), empty_v (every thread of the two computing warpgroups). Run by one thread,
// before the mbar_init_fence.
template <int S>
__device__ inline void mbar_init_kv_ring(uint64_t* bars, int loaders, int computers) {
#pragma unroll
  for (int st = 0; st < S; ++st) {
    mbar_init(&bars[st], 2 * loaders);
    mbar_init(&bars[S + st], computers);
    mbar_init(&bars[2 * S + st], loaders);
    mbar_init(&bars[3 * S + st], computers);
  }
}

// The CTA's named barriers (bar.sync ids), one list so that no two roles take one id. 16 exist.
enum class NamedBarrier : int {
  kSyncThreads = 0,  // __syncthreads'
  kLoad = 1,         // the loading warpgroup (warp-specialized forward): its key indices in every loader's view
  kTurn0 = 2,        // computing warpgroup 0's turn to issue its products (paired warp-specialized forward)
  kTurn1 = 3,        // computing warpgroup 1's
  kBwdPiece = 4,     // per-key backward: both computing warpgroups' P / dS of a list piece staged
};
// Computing warpgroup wg's turn barrier.
__device__ inline NamedBarrier turn_barrier(int wg) {
  return static_cast<NamedBarrier>(static_cast<int>(NamedBarrier::kTurn0) + wg);
}

// A barrier among `threads` threads (whole warps) of the CTA.
__device__ inline void named_barrier(NamedBarrier id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(static_cast<int>(id)), "r"(threads) : "memory");
}
// The same, taken or arrived at only where `on` holds: predicated, not branched around, so that
// wgmmas in flight across it are not serialised by ptxas (a branch between a wgmma and its wait
// is). An arrival does not wait; `threads` counts the syncing and the arriving threads together.
__device__ inline void named_barrier_if(bool on, NamedBarrier id, int threads) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %2, 0;\n@p bar.sync %0, %1;\n}\n" ::"r"(static_cast<int>(id)),
               "r"(threads), "r"((int)on)
               : "memory");
}
__device__ inline void named_barrier_arrive_if(bool on, NamedBarrier id, int threads) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %2, 0;\n@p bar.arrive %0, %1;\n}\n" ::"r"(static_cast<int>(id)),
               "r"(threads), "r"((int)on)
               : "memory");
}

// The calling thread's warpgroup, as a value the compiler knows is the same across the warp (a
// shuffle from lane 0; the warp must be converged): what is derived from it (a warpgroup's rows,
// its trip counts, the ring positions and wgmma descriptors of its loop) can live in uniform
// registers, instead of vector registers moved to uniform ones before every wgmma.
__device__ inline int warpgroup_uniform() { return __shfl_sync(0xffffffffu, (int)(threadIdx.x / 128), 0); }

// Hands registers between warpgroups: the loading warpgroup needs few, the computing ones hold
// the O accumulator and the scores. Every warp of the warpgroup executes it.
template <int N>
__device__ inline void regs_release() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ inline void regs_claim() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}

}  // namespace cuda
}  // namespace flexdma
