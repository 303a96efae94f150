// detcomm: workspace all-gather (data movement only, no arithmetic, so one byte-level kernel serves every
// dtype). Each rank copies its nbytes into its slot; after the START barrier every rank copies slot s to
// out + s*out_stride bytes. No end barrier: a peer rewrites the slot copy of this use's parity only after this
// rank has read it (detcomm_common.cuh, "Barriers").
#include "detcomm_common.cuh"

#if DETCOMM_WANT(DT_U8)
extern "C" __global__ void __launch_bounds__(DETCOMM_BLOCK_THREADS)
    detcomm_all_gather(const u8* x, u8* out, i64 nbytes, i64 out_stride, u32 call, char* const* data,
                       u32* const* sigs, int rank, u64 timeout_ns, u32* ctrl) {
  const Group g0{data, sigs, rank, timeout_ns, ctrl, (DETCOMM_KIND_ALL_GATHER << 8) | DT_U8, call, (u64)nbytes, true};
  constexpr int kPer = Traits<DT_U8>::kPer;
  constexpr int U = DETCOMM_UNROLL;
  const i64 tid = thread_id();
  const i64 stride = grid_stride();
  const i64 npacks = (nbytes + kPer - 1) / kPer;
  if (!block_owns_packs(npacks)) return skip_use(g0);
  const Group g = open_use(g0);
  uint4* own = slot(g, g.rank);

  copy_in<DT_U8>(x, nbytes, own, tid, stride);
  if (!block_barrier(g, BARRIER_START)) return;
  // Every rank's pack of one sweep in flight at once, then the stores.
  for (i64 p0 = tid; p0 < npacks; p0 += U * stride) {
    uint4 v[U][DETCOMM_W];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const i64 p = p0 + u * stride;
      if (p < npacks) {
#pragma unroll
        for (int s = 0; s < DETCOMM_W; ++s) v[u][s] = ld_ws(slot(g, s) + p);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const i64 p = p0 + u * stride;
      if (p < npacks) {
#pragma unroll
        for (int s = 0; s < DETCOMM_W; ++s) store_user<DT_U8>(out + (i64)s * out_stride + p * kPer, nbytes - p * kPer, v[u][s]);
      }
    }
  }
  close_use(g);
}
#endif
