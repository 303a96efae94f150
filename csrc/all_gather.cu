// detcomm: workspace all-gather (data movement only, no arithmetic, so one byte-level kernel serves every
// dtype). Each rank copies its nbytes into its slot; after the START barrier every rank copies slot s to
// out + s*out_stride bytes; the END barrier keeps slots stable until all ranks have read them.
#include "detcomm_common.cuh"

#if DETCOMM_WANT(DT_U8)
extern "C" __global__ void __launch_bounds__(DETCOMM_BLOCK_THREADS)
    detcomm_all_gather(const u8* x, u8* out, i64 nbytes, i64 out_stride, u32 call, char* const* data,
                       u32* const* sigs, int rank, u64 timeout_ns, u32* ctrl) {
  const Group g{data, sigs, rank, timeout_ns, ctrl, (DETCOMM_KIND_ALL_GATHER << 8) | DT_U8, call, (u64)nbytes};
  constexpr int kPer = Traits<DT_U8>::kPer;
  const i64 tid = thread_id();
  const i64 stride = grid_stride();
  const i64 npacks = (nbytes + kPer - 1) / kPer;
  uint4* own = reinterpret_cast<uint4*>(g.data[g.rank]);

  for (i64 p = tid; p < npacks; p += stride) st_ws(own + p, load_user<DT_U8>(x + p * kPer, nbytes - p * kPer));
  if (!block_barrier(g, BARRIER_START)) return;
#pragma unroll 1
  for (int s = 0; s < DETCOMM_W; ++s) {
    const uint4* src = reinterpret_cast<const uint4*>(g.data[s]);
    for (i64 p = tid; p < npacks; p += stride)
      store_user<DT_U8>(out + (i64)s * out_stride + p * kPer, nbytes - p * kPer, ld_ws(src + p));
  }
  block_barrier(g, BARRIER_END);
}
#endif
