// detcomm: workspace all-gather (data movement only, no arithmetic, so one byte-level kernel serves every
// dtype). Each rank copies its nbytes into its slot; after the START barrier every rank copies slot s to
// out + s*out_stride bytes; the END barrier keeps slots stable until all ranks have read them.
#include "detcomm_common.cuh"

#if DETCOMM_WANT(DT_U8)
extern "C" __global__ void __launch_bounds__(DETCOMM_BLOCK_THREADS)
    detcomm_all_gather(const u8* x, u8* out, i64 nbytes, i64 out_stride, u32 call, char* const* data,
                       u32* const* sigs, int rank, u64 timeout_ns, u32* ctrl) {
  const Group g{data, sigs, rank, timeout_ns, ctrl, (DETCOMM_KIND_ALL_GATHER << 8) | DT_U8, call, (u64)nbytes, true};
  constexpr int kPer = Traits<DT_U8>::kPer;
  constexpr int U = DETCOMM_UNROLL;
  const i64 tid = thread_id();
  const i64 stride = grid_stride();
  const i64 npacks = (nbytes + kPer - 1) / kPer;
  if (!block_owns_packs(npacks)) return;
  announce_call(g);
  uint4* own = reinterpret_cast<uint4*>(g.data[g.rank]);

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
        for (int s = 0; s < DETCOMM_W; ++s) v[u][s] = ld_ws(reinterpret_cast<const uint4*>(g.data[s]) + p);
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
  block_barrier(g, BARRIER_END);
}
#endif
