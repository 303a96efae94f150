// detcomm: workspace reduce-scatter fold. Input slice s (L elements starting at x + s*x_stride) is destined
// for rank s; rank r folds slice r from all W ranks (docs/spec.md §1) into out_self. The host chunks the shard rows,
// so x_stride (the shard length) can exceed L (the chunk length).
#include "slice_fold.cuh"

#define DETCOMM_REDUCE_SCATTER(NAME, DT)                                                                    \
  extern "C" __global__ void __launch_bounds__(DETCOMM_BLOCK_THREADS)                                       \
      NAME(const Traits<DT>::T* x, i64 x_stride, Traits<DT>::T* out_self, i64 L, i64 Lp, u32 call,           \
           char* const* data, u32* const* sigs, int rank, u64 timeout_ns, u32* ctrl) {                      \
    const Group g{data, sigs, rank, timeout_ns, ctrl, (DETCOMM_KIND_REDUCE_SCATTER << 8) | DT, call, (u64)L, true}; \
    slice_fold<DT, false>(x, x_stride, (i64)DETCOMM_W * L, L, Lp, out_self, out_self, g);                   \
  }

#if DETCOMM_WANT(DT_F32)
DETCOMM_REDUCE_SCATTER(detcomm_reduce_scatter_f32, DT_F32)
#endif
#if DETCOMM_WANT(DT_BF16)
DETCOMM_REDUCE_SCATTER(detcomm_reduce_scatter_bf16, DT_BF16)
#endif
#if DETCOMM_WANT(DT_F16)
DETCOMM_REDUCE_SCATTER(detcomm_reduce_scatter_f16, DT_F16)
#endif
