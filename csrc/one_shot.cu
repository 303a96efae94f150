// detcomm: one-shot all-reduce. Every rank copies its rows into its own workspace slot, then reads all W
// peers' slots and folds them (docs/spec.md §1) into its output. Latency-optimal for small messages: one barrier
// round before the fold, and every rank computes the whole result itself (W x read traffic per rank).
//
// Launch: grid = the workspace's static block count, block = DETCOMM_BLOCK_THREADS, identical on every rank.
#include "detcomm_common.cuh"

template <int DT>
__device__ __forceinline__ void one_shot(const typename Traits<DT>::T* __restrict__ x,
                                         typename Traits<DT>::T* __restrict__ out, i64 n, const Group& g) {
  constexpr int kPer = Traits<DT>::kPer;
  constexpr int U = DETCOMM_UNROLL;
  const i64 tid = thread_id();
  const i64 stride = grid_stride();
  const i64 npacks = (n + kPer - 1) / kPer;
  if (!block_owns_packs(npacks)) return;
  announce_call(g);
  uint4* own = reinterpret_cast<uint4*>(g.data[g.rank]);
  const uint4* src[DETCOMM_W];
#pragma unroll
  for (int k = 0; k < DETCOMM_W; ++k) src[k] = reinterpret_cast<const uint4*>(g.data[k]);

  copy_in<DT>(x, n, own, tid, stride);
  if (!block_barrier(g, BARRIER_START)) return;

  for (i64 p0 = tid; p0 < npacks; p0 += U * stride) {
    uint4 in[U][DETCOMM_W];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const i64 p = p0 + u * stride;
      if (p < npacks) {
#pragma unroll
        for (int k = 0; k < DETCOMM_W; ++k) in[u][k] = ld_ws(src[k] + p);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const i64 p = p0 + u * stride;
      if (p < npacks) store_user<DT>(out + p * kPer, n - p * kPer, fold_pack<DT>(in[u], g.rank));
    }
  }
  // END keeps peers from overwriting their slots (next collective) while this rank still reads them.
  block_barrier(g, BARRIER_END);
}

#define DETCOMM_ONE_SHOT(NAME, DT)                                                                        \
  extern "C" __global__ void __launch_bounds__(DETCOMM_BLOCK_THREADS)                                     \
      NAME(const Traits<DT>::T* x, Traits<DT>::T* out, i64 n, u32 call, char* const* data, u32* const* sigs, \
           int rank, u64 timeout_ns, u32* ctrl) {                                                          \
    const Group g{data, sigs, rank, timeout_ns, ctrl, (DETCOMM_KIND_ONE_SHOT << 8) | DT, call, (u64)n, true};    \
    one_shot<DT>(x, out, n, g);                                                                           \
  }

#if DETCOMM_WANT(DT_F32)
DETCOMM_ONE_SHOT(detcomm_one_shot_f32, DT_F32)
#endif
#if DETCOMM_WANT(DT_BF16)
DETCOMM_ONE_SHOT(detcomm_one_shot_bf16, DT_BF16)
#endif
#if DETCOMM_WANT(DT_F16)
DETCOMM_ONE_SHOT(detcomm_one_shot_f16, DT_F16)
#endif
