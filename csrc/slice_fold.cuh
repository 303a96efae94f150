// detcomm: the slice fold shared by two-shot all-reduce and reduce-scatter.
//
// The message is cut into W slices of L elements (the last ones may be shorter or empty). Slice s of every
// rank lands at pack offset s*Lp of that rank's slot, where Lp is a multiple of the grid stride (see
// detcomm_common.cuh, "Work assignment"). Rank r folds slice r from all W slots (docs/spec.md §1, rank order
// 0..W-1). Two-shot then writes the folded slice back into its own slot and, after a MID barrier, gathers
// the other ranks' folded slices; reduce-scatter stops after the fold.
#pragma once
#include "detcomm_common.cuh"

__device__ __forceinline__ i64 slice_len(int s, i64 n, i64 L) {
  const i64 left = n - (i64)s * L;
  return left <= 0 ? 0 : (left < L ? left : L);
}

template <int DT, bool kGather>
__device__ __forceinline__ void slice_fold(const typename Traits<DT>::T* __restrict__ x, i64 x_stride, i64 n,
                                           i64 L, i64 Lp, typename Traits<DT>::T* __restrict__ out_self,
                                           typename Traits<DT>::T* __restrict__ out, const Group& g) {
  constexpr int kPer = Traits<DT>::kPer;
  const i64 tid = thread_id();
  const i64 stride = grid_stride();
  const int r = g.rank;
  uint4* own = reinterpret_cast<uint4*>(g.data[r]);

  // Phase 0: this rank's W slices into its slot (slice s at s*Lp).
#pragma unroll 1
  for (int s = 0; s < DETCOMM_W; ++s) {
    const i64 len = slice_len(s, n, L);
    const i64 np = (len + kPer - 1) / kPer;
    for (i64 j = tid; j < np; j += stride)
      st_ws(own + (i64)s * Lp + j, load_user<DT>(x + (i64)s * x_stride + j * kPer, len - j * kPer));
  }
  if (!block_barrier(g, BARRIER_START)) return;

  // Phase 1: fold slice r from every rank's slot.
  {
    const i64 len = slice_len(r, n, L);
    const i64 np = (len + kPer - 1) / kPer;
    for (i64 j = tid; j < np; j += stride) {
      uint4 in[DETCOMM_W];
#pragma unroll
      for (int k = 0; k < DETCOMM_W; ++k) in[k] = ld_ws(reinterpret_cast<const uint4*>(g.data[k]) + (i64)r * Lp + j);
      const uint4 v = fold_pack<DT>(in, r);
      store_user<DT>(out_self + j * kPer, len - j * kPer, v);
      // Slice r of this slot is read by no other rank in phase 1, so the result can replace it in place.
      if (kGather) st_ws(own + (i64)r * Lp + j, v);
    }
  }

  if (kGather) {
    if (!block_barrier(g, BARRIER_MID)) return;
    // Phase 2: every other rank's folded slice.
#pragma unroll 1
    for (int s = 0; s < DETCOMM_W; ++s) {
      if (s == r) continue;
      const i64 len = slice_len(s, n, L);
      const i64 np = (len + kPer - 1) / kPer;
      for (i64 j = tid; j < np; j += stride)
        store_user<DT>(out + (i64)s * L + j * kPer, len - j * kPer,
                       ld_ws(reinterpret_cast<const uint4*>(g.data[s]) + (i64)s * Lp + j));
    }
  }
  block_barrier(g, BARRIER_END);
}
