// detcomm: the canonical fold of W local buffers, with no communication: the CUDA fold leaf of gather_fold and
// a2a_fold (detcomm/numerics/cuda_leaf.py), and the bench's measure of the fold against a device-to-device copy.
// Input k starts at base + k * step elements (one stacked tensor, or W buffers at a common stride): two scalar
// arguments instead of a pointer table, so a launch needs no per-call upload and can be captured in a CUDA
// graph. Any grid size works: there are no barriers.
#include "detcomm_common.cuh"

template <int DT>
__device__ __forceinline__ void fold_local(const typename Traits<DT>::T* base, i64 step,
                                           typename Traits<DT>::T* __restrict__ out, i64 n) {
  constexpr int kPer = Traits<DT>::kPer;
  constexpr int U = DETCOMM_UNROLL;
  const i64 npacks = (n + kPer - 1) / kPer;
  const i64 stride = (i64)gridDim.x * blockDim.x;
  for (i64 p0 = (i64)blockIdx.x * blockDim.x + threadIdx.x; p0 < npacks; p0 += U * stride) {
    uint4 in[U][DETCOMM_W];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const i64 p = p0 + u * stride;
      if (p < npacks) {
#pragma unroll
        for (int k = 0; k < DETCOMM_W; ++k) in[u][k] = load_user<DT>(base + k * step + p * kPer, n - p * kPer);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const i64 p = p0 + u * stride;
      if (p < npacks) store_user<DT>(out + p * kPer, n - p * kPer, fold_pack<DT>(in[u], 0));
    }
  }
}

#define DETCOMM_FOLD_LOCAL(NAME, DT)                                                                \
  extern "C" __global__ void __launch_bounds__(DETCOMM_BLOCK_THREADS)                               \
      NAME(const Traits<DT>::T* base, i64 step, Traits<DT>::T* out, i64 n) {                        \
    fold_local<DT>(base, step, out, n);                                                             \
  }

#if DETCOMM_WANT(DT_F32)
DETCOMM_FOLD_LOCAL(detcomm_fold_local_f32, DT_F32)
#endif
#if DETCOMM_WANT(DT_BF16)
DETCOMM_FOLD_LOCAL(detcomm_fold_local_bf16, DT_BF16)
#endif
#if DETCOMM_WANT(DT_F16)
DETCOMM_FOLD_LOCAL(detcomm_fold_local_f16, DT_F16)
#endif
