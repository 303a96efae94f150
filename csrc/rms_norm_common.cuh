// detcomm: the pieces of docs/spec.md §9.2's canonical RMSNorm shared by csrc/rms_norm.cu (the norm alone) and
// csrc/fused_rmsnorm.cu (fused with the workspace all-reduce): 8-element chunks widened to fp32, the residual
// add, and the lane/warp tree that turns 256 lane partials into inv_rms. One definition, so the two kernels
// cannot drift apart.
#pragma once
#include "detcomm_common.cuh"

// NORM_THREADS (the definition's 256 lanes) and NORM_CHUNK (8 elements per chunk) are device constants
// (detcomm/workspace/plan.py DEVICE_CONSTANTS, given as -D options).
#define NORM_WARPS (NORM_THREADS / 32)

// 8 consecutive elements of a row widened to fp32 (missing ones read as +0.0).
template <int DT>
__device__ __forceinline__ void load_chunk(const typename Traits<DT>::T* p, i64 valid, float (&a)[NORM_CHUNK]) {
  constexpr int kPer = Traits<DT>::kPer;
#pragma unroll
  for (int h = 0; h < NORM_CHUNK / kPer; ++h) {
    PackU<DT> u;
    u.v = load_user<DT>(p + h * kPer, valid - h * kPer);
#pragma unroll
    for (int e = 0; e < kPer; ++e) a[h * kPer + e] = Traits<DT>::widen(u.e[e]);
  }
}

template <int DT>
__device__ __forceinline__ void store_chunk(typename Traits<DT>::T* p, i64 valid, const float (&a)[NORM_CHUNK]) {
  constexpr int kPer = Traits<DT>::kPer;
#pragma unroll
  for (int h = 0; h < NORM_CHUNK / kPer; ++h) {
    PackU<DT> u;
#pragma unroll
    for (int e = 0; e < kPer; ++e) u.e[e] = Traits<DT>::narrow(a[h * kPer + e]);  // the one rounding, NaN canonical
    store_user<DT>(p + h * kPer, valid - h * kPer, u.v);
  }
}

// r = round(fp32(residual) + fp32(s)), returned widened (the value the norm reads is the rounded r).
template <int DT>
__device__ __forceinline__ void residual_add(const float (&res)[NORM_CHUNK], const float (&s)[NORM_CHUNK],
                                             float (&a)[NORM_CHUNK]) {
#pragma unroll
  for (int e = 0; e < NORM_CHUNK; ++e) a[e] = Traits<DT>::widen(Traits<DT>::narrow(__fadd_rn(res[e], s[e])));
}

// Steps 5-6 for one row: `p` is lane t's partial, t = threadIdx.x % NORM_THREADS of a 256-thread group whose
// warps are that group's 8 consecutive warps. Warp tree (h = 16..1), then the tree over the 8 warp results in
// the group's first warp, then inv_rms = 1 / sqrt(S / H + eps), every operation correctly rounded. Returns
// inv_rms to every thread of the group. Contains two __syncthreads(): every thread of the block calls it.
// Reuse of warp_sum / inv_shared for the next row needs no third barrier: a thread reads inv before it can reach
// the next row's first barrier, and warp_sum is read before this call's second one.
__device__ __forceinline__ float norm_inv_rms(float p, float* warp_sum, float* inv_shared, i64 H, float eps) {
  const int t = threadIdx.x % NORM_THREADS;
  const int lane = t & 31, warp = t >> 5;
#pragma unroll
  for (int h = 16; h >= 1; h >>= 1) p = __fadd_rn(p, __shfl_down_sync(0xffffffffu, p, h));
  if (lane == 0) warp_sum[warp] = p;
  __syncthreads();
  if (warp == 0) {
    float u = lane < NORM_WARPS ? warp_sum[lane] : 0.0f;
#pragma unroll
    for (int h = NORM_WARPS / 2; h >= 1; h >>= 1) u = __fadd_rn(u, __shfl_down_sync(0xffffffffu, u, h));
    if (lane == 0) {
      const float mean = __fdiv_rn(u, (float)H);  // H <= 2^24: exact in fp32 (checked by the host)
      *inv_shared = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(mean, eps)));
    }
  }
  __syncthreads();
  return *inv_shared;
}
