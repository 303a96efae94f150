// detcomm: the phases every barrier kernel over slots shares: the slice fold of two-shot all-reduce and
// reduce-scatter (slice_fold, below), and the one-shot / two-shot phases of the virtual-shard layouts
// (unit_one_shot / unit_two_shot: each layout gives only its publish and its combine).
//
// The message is cut into W slices of L elements (the last ones may be shorter or empty). Slice s of every
// rank lands at pack offset s*Lp of that rank's slot, where Lp is a multiple of the grid stride (see
// detcomm_common.cuh, "Work assignment"). Rank r folds slice r from all W slots (docs/spec.md §1, rank order
// 0..W-1). Two-shot then writes the folded slice back into its own slot and, after a MID barrier, gathers
// the other ranks' folded slices (all peers' packs of one sweep loaded before any is stored); reduce-scatter
// stops after the fold. Slots are addressed in copy g.par (detcomm_common.cuh, "Barriers"); no end barrier. At W = 1
// the one slice is the whole message: folded straight from x into out_self (fold_direct).
#pragma once
#include "detcomm_common.cuh"

__device__ __forceinline__ i64 slice_len(int s, i64 n, i64 L) {
  const i64 left = n - (i64)s * L;
  return left <= 0 ? 0 : (left < L ? left : L);
}

// Every rank's slot of this use (copy g.par): what the phases that read the peers load from.
__device__ __forceinline__ void peer_slots(const Group& g, const uint4* (&src)[DETCOMM_W]) {
#pragma unroll
  for (int k = 0; k < DETCOMM_W; ++k) src[k] = slot(g, k);
}

// The one-shot and two-shot kernels over units of E elements, P fp32 packs of the slot each: every layout's
// (csrc/virtual_fold.cu: the shard order, csrc/tree_fold.cu: the tree) is these phases with the layout's two parts,
//   publish(own, units, tid, stride)   phase 0: this rank's units into its slot `own` (units: nu, or Lu per slice)
//   top(src, u, units, rank)           the layout's combine: the rounded output pack of slot unit u over every
//                                      rank's slot src[k] (read after the START barrier)
// One-shot: every rank combines every unit. Two-shot: slice s (L elements, Lu = L / E units) at unit s*Lu; rank r
// combines slice r to the output and over the unit's first pack of its own slot (no other rank reads slice r in
// phase 1), then, after the MID barrier, copies every other rank's rounded packs verbatim (a rounded -0.0 is a
// value, docs/spec.md §9.4). Slots in copy g.par, no end barrier, as every barrier kernel.
template <int DT, int E, typename Publish, typename Top>
__device__ __forceinline__ void unit_one_shot(typename Traits<DT>::T* __restrict__ out, i64 n, const Group& g0,
                                              const Publish& publish, const Top& top) {
  const i64 tid = thread_id();
  const i64 stride = grid_stride();
  const i64 nu = (n + E - 1) / E;
  if (!block_owns_packs(nu)) return skip_use(g0);
  const Group g = open_use(g0);
  const uint4* src[DETCOMM_W];
  peer_slots(g, src);
  publish(slot(g, g.rank), nu, tid, stride);
  if (!block_barrier(g, BARRIER_START)) return;
  for (i64 t = tid; t < nu; t += stride) store_user<DT>(out + t * E, n - t * E, top(src, t, nu, g.rank));
  close_use(g);
}

template <int DT, int E, int P, typename Publish, typename Top>
__device__ __forceinline__ void unit_two_shot(typename Traits<DT>::T* __restrict__ out, i64 n, i64 L,
                                              const Group& g0, const Publish& publish, const Top& top) {
  const i64 tid = thread_id();
  const i64 stride = grid_stride();
  const i64 Lu = L / E;
  if (!block_owns_packs(Lu)) return skip_use(g0);  // slice 0 is the longest: Lu units
  const Group g = open_use(g0);
  const int r = g.rank;
  uint4* own = slot(g, r);
  const uint4* src[DETCOMM_W];
  peer_slots(g, src);
  publish(own, Lu, tid, stride);  // phase 0
  if (!block_barrier(g, BARRIER_START)) return;

  // Phase 1: slice r combined; the rounded pack to the output and over the unit's first pack of this slot.
  {
    const i64 len = slice_len(r, n, L);
    const i64 nu = (len + E - 1) / E;
    for (i64 t = tid; t < nu; t += stride) {
      const uint4 v = top(src, (i64)r * Lu + t, Lu, r);
      store_user<DT>(out + (i64)r * L + t * E, len - t * E, v);
      st_ws(own + ((i64)r * Lu + t) * P, v);
    }
  }
  if (!block_barrier(g, BARRIER_MID)) return;

  // Phase 2: every other rank's rounded packs, copied verbatim.
  for (i64 t = tid; t < Lu; t += stride) {
    uint4 v[DETCOMM_W];
#pragma unroll
    for (int s = 0; s < DETCOMM_W; ++s) {
      if (s != r && t * E < slice_len(s, n, L)) v[s] = ld_ws(src[s] + ((i64)s * Lu + t) * P);
    }
#pragma unroll
    for (int s = 0; s < DETCOMM_W; ++s) {
      const i64 len = slice_len(s, n, L);
      if (s != r && t * E < len) store_user<DT>(out + (i64)s * L + t * E, len - t * E, v[s]);
    }
  }
  close_use(g);
}

template <int DT, bool kGather>
__device__ __forceinline__ void slice_fold(const typename Traits<DT>::T* __restrict__ x, i64 x_stride, i64 n,
                                           i64 L, i64 Lp, typename Traits<DT>::T* __restrict__ out_self,
                                           typename Traits<DT>::T* __restrict__ out, const Group& g0) {
#if DETCOMM_W == 1
  (void)x_stride, (void)Lp, (void)out, (void)g0;
  fold_direct<DT>(x, out_self, slice_len(0, n, L));
#else
  constexpr int kPer = Traits<DT>::kPer;
  constexpr int U = DETCOMM_UNROLL;
  const i64 tid = thread_id();
  const i64 stride = grid_stride();
  if (!block_owns_packs((L + kPer - 1) / kPer)) return skip_use(g0);  // slice 0 is the longest: L elements
  const Group g = open_use(g0);
  const int r = g.rank;
  uint4* own = slot(g, r);
  const uint4* src[DETCOMM_W];
  peer_slots(g, src);

  // Phase 0: this rank's W slices into its slot (slice s at s*Lp).
#pragma unroll 1
  for (int s = 0; s < DETCOMM_W; ++s)
    copy_in<DT>(x + (i64)s * x_stride, slice_len(s, n, L), own + (i64)s * Lp, tid, stride);
  if (!block_barrier(g, BARRIER_START)) return;

  // Phase 1: fold slice r from every rank's slot.
  {
    const i64 len = slice_len(r, n, L);
    const i64 np = (len + kPer - 1) / kPer;
    for (i64 j0 = tid; j0 < np; j0 += U * stride) {
      uint4 in[U][DETCOMM_W];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const i64 j = j0 + u * stride;
        if (j < np) {
#pragma unroll
          for (int k = 0; k < DETCOMM_W; ++k) in[u][k] = ld_ws(src[k] + (i64)r * Lp + j);
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const i64 j = j0 + u * stride;
        if (j < np) {
          const uint4 v = fold_pack<DT>(in[u], r);
          store_user<DT>(out_self + j * kPer, len - j * kPer, v);
          // Slice r of this slot is read by no other rank in phase 1, so the result can replace it in place.
          if (kGather) st_ws(own + (i64)r * Lp + j, v);
        }
      }
    }
  }

  if (kGather) {
    if (!block_barrier(g, BARRIER_MID)) return;
    // Phase 2: every other rank's folded slice, all peers of one sweep in flight at once.
    const i64 np_max = (L + kPer - 1) / kPer;
    for (i64 j0 = tid; j0 < np_max; j0 += U * stride) {
      uint4 v[U][DETCOMM_W];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const i64 j = j0 + u * stride;
#pragma unroll
        for (int s = 0; s < DETCOMM_W; ++s) {
          if (s != r && j * kPer < slice_len(s, n, L)) v[u][s] = ld_ws(src[s] + (i64)s * Lp + j);
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const i64 j = j0 + u * stride;
#pragma unroll
        for (int s = 0; s < DETCOMM_W; ++s) {
          const i64 len = slice_len(s, n, L);
          if (s != r && j * kPer < len) store_user<DT>(out + (i64)s * L + j * kPer, len - j * kPer, v[u][s]);
        }
      }
    }
  }
  close_use(g);
#endif
}
