// detcomm: one-shot all-reduce. Every rank copies its rows into its own workspace slot, then reads all W
// peers' slots and folds them (docs/spec.md §1) into its output. Latency-optimal for small messages: one barrier
// round before the fold, and every rank computes the whole result itself (W x read traffic per rank). No end
// barrier: the slot copy of this use's parity stays untouched until every rank is done with it (detcomm_common.cuh,
// "Barriers"). At W = 1 the fold goes straight from x to out (fold_direct).
//
// Launch: grid = the workspace's static block count, block = DETCOMM_BLOCK_THREADS, identical on every rank.
#include "detcomm_common.cuh"

template <int DT>
__device__ __forceinline__ void one_shot(const typename Traits<DT>::T* __restrict__ x,
                                         typename Traits<DT>::T* __restrict__ out, i64 n, const Group& g0) {
#if DETCOMM_W == 1
  (void)g0;
  fold_direct<DT>(x, out, n);
#else
  constexpr int kPer = Traits<DT>::kPer;
  constexpr int U = DETCOMM_UNROLL;
  const i64 tid = thread_id();
  const i64 stride = grid_stride();
  const i64 npacks = (n + kPer - 1) / kPer;
  if (!block_owns_packs(npacks)) return skip_use(g0);
  const Group g = open_use(g0);
  uint4* own = slot(g, g.rank);
  const uint4* src[DETCOMM_W];
#pragma unroll
  for (int k = 0; k < DETCOMM_W; ++k) src[k] = slot(g, k);

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
  close_use(g);
#endif
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
