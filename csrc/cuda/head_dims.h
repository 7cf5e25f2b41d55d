// The head dims the CUDA kernels implement: the one table that instantiations/generate.py writes
// the launchers' instantiation files from, the dispatcher accepts, and setup.py reads
// (FLEXDMA_ALL_HEAD_DIMS). A build compiles the instantiation files of the dims it names and
// defines -DFLEXDMA_HEAD_DIM_<d> for each (setup.py's FLEXDMA_HEAD_DIMS); the wgmma-only ones
// (above 128: Q / dO / K / V read from swizzled smem) also need the sm_90a build (FLEXDMA_SM90A).
//   FLEXDMA_FOR_EACH_HEAD_DIM(X)   X(d) for every dim of this build
//   FLEXDMA_ALL_HEAD_DIMS(X)       X(d) for every dim the kernels implement
#pragma once

#define FLEXDMA_ALL_HEAD_DIMS(X) X(32) X(64) X(96) X(128) X(192) X(256)

#ifdef FLEXDMA_HEAD_DIM_32
#define FLEXDMA_HD_32(X) X(32)
#else
#define FLEXDMA_HD_32(X)
#endif
#ifdef FLEXDMA_HEAD_DIM_64
#define FLEXDMA_HD_64(X) X(64)
#else
#define FLEXDMA_HD_64(X)
#endif
#ifdef FLEXDMA_HEAD_DIM_96
#define FLEXDMA_HD_96(X) X(96)
#else
#define FLEXDMA_HD_96(X)
#endif
#ifdef FLEXDMA_HEAD_DIM_128
#define FLEXDMA_HD_128(X) X(128)
#else
#define FLEXDMA_HD_128(X)
#endif
#if defined(FLEXDMA_HEAD_DIM_192) && defined(FLEXDMA_SM90A)
#define FLEXDMA_HD_192(X) X(192)
#else
#define FLEXDMA_HD_192(X)
#endif
#if defined(FLEXDMA_HEAD_DIM_256) && defined(FLEXDMA_SM90A)
#define FLEXDMA_HD_256(X) X(256)
#else
#define FLEXDMA_HD_256(X)
#endif

#define FLEXDMA_FOR_EACH_HEAD_DIM(X) \
  FLEXDMA_HD_32(X) FLEXDMA_HD_64(X) FLEXDMA_HD_96(X) FLEXDMA_HD_128(X) FLEXDMA_HD_192(X) FLEXDMA_HD_256(X)
