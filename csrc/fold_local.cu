// detcomm: the canonical fold of W local buffers, with no communication. The bench measures it against a
// device-to-device copy (bytes moved: W inputs read + one output written); tests compare it with the oracle
// like every other kernel. Any grid size works: there are no barriers.
#include "detcomm_common.cuh"

template <int DT>
__device__ __forceinline__ void fold_local(const typename Traits<DT>::T* const* ins,
                                           typename Traits<DT>::T* __restrict__ out, i64 n) {
  constexpr int kPer = Traits<DT>::kPer;
  const i64 npacks = (n + kPer - 1) / kPer;
  const i64 stride = (i64)gridDim.x * blockDim.x;
  const typename Traits<DT>::T* src[DETCOMM_W];
#pragma unroll
  for (int k = 0; k < DETCOMM_W; ++k) src[k] = ins[k];
  for (i64 p = (i64)blockIdx.x * blockDim.x + threadIdx.x; p < npacks; p += stride) {
    uint4 in[DETCOMM_W];
#pragma unroll
    for (int k = 0; k < DETCOMM_W; ++k) in[k] = load_user<DT>(src[k] + p * kPer, n - p * kPer);
    store_user<DT>(out + p * kPer, n - p * kPer, fold_pack<DT>(in, 0));
  }
}

#define DETCOMM_FOLD_LOCAL(NAME, DT)                                                                \
  extern "C" __global__ void __launch_bounds__(DETCOMM_BLOCK_THREADS)                               \
      NAME(const Traits<DT>::T* const* ins, Traits<DT>::T* out, i64 n) {                            \
    fold_local<DT>(ins, out, n);                                                                    \
  }

DETCOMM_FOLD_LOCAL(detcomm_fold_local_f32, DT_F32)
DETCOMM_FOLD_LOCAL(detcomm_fold_local_bf16, DT_BF16)
DETCOMM_FOLD_LOCAL(detcomm_fold_local_f16, DT_F16)
