// detcomm: two-shot all-reduce (reduce-scatter of slices, then all-gather of the folded slices).
// Bandwidth-optimal for large messages: each rank reads W slices of n/W elements and 1 - 1/W of the result.
// Same bits as one-shot: each element is folded once, by the canonical fold, whichever rank does it.
//
// Arguments: x and out hold n elements; L = slice length in elements (a multiple of the pack), Lp = slice
// stride in the slot in packs (a multiple of the grid stride). Computed by detcomm/workspace/plan.py.
#include "slice_fold.cuh"

#define DETCOMM_TWO_SHOT(NAME, DT)                                                                          \
  extern "C" __global__ void __launch_bounds__(DETCOMM_BLOCK_THREADS)                                       \
      NAME(const Traits<DT>::T* x, Traits<DT>::T* out, i64 n, i64 L, i64 Lp, u32 call, char* const* data,   \
           u32* const* sigs, int rank, u64 timeout_ns, u32* ctrl) {                                         \
    const Group g{data, sigs, rank, timeout_ns, ctrl, (DETCOMM_KIND_TWO_SHOT << 8) | DT, call, (u64)n, true};     \
    slice_fold<DT, true>(x, L, n, L, Lp, out + (i64)rank * L, out, g);                                      \
  }

#if DETCOMM_WANT(DT_F32)
DETCOMM_TWO_SHOT(detcomm_two_shot_f32, DT_F32)
#endif
#if DETCOMM_WANT(DT_BF16)
DETCOMM_TWO_SHOT(detcomm_two_shot_bf16, DT_BF16)
#endif
#if DETCOMM_WANT(DT_F16)
DETCOMM_TWO_SHOT(detcomm_two_shot_f16, DT_F16)
#endif
