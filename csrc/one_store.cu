// detcomm: one-store all-reduce for small messages (the exchange is described in one_store_common.cuh).
//
// Each thread owns packs j = thread id + k * grid stride of the message. For each it loads the caller's pack,
// marks it (+0.0 -> -0.0) and stores it into area [buffer][rank] of every rank's region; then, for the same
// packs, it polls the W areas of its own region until every source's pack is full, folds them in rank order
// (docs/spec.md §1, fold_pack), writes out and empties the W packs. No barrier: the latency is one NVLink store
// plus a local poll. In place (out == x) is exact: the thread that writes out[j] is the one that read x[j], and it
// read it before it stored any result.
//
// Launch: grid = the blocks of the launch's tier (plan.one_store_tiers; `off` and `cap` name the tier's region): the
// same in every launch of that tier, plain or fused, and on every rank; block = DETCOMM_BLOCK_THREADS; every block
// runs the launch counter even when it owns no pack (one_store_common.cuh says why).
#include "one_store_common.cuh"

template <int DT>
__device__ __forceinline__ void one_store_all_reduce(const typename Traits<DT>::T* x, typename Traits<DT>::T* out,
                                                   i64 n, i64 off, i64 cap, const Group& g) {
  constexpr int kPer = Traits<DT>::kPer;
  constexpr int U = DETCOMM_UNROLL;
  const OneStoreArea l = one_store_open(g, off, cap);
  OneStoreWait w{0u, 0ull, 0u};
  const i64 tid = thread_id();
  const i64 stride = grid_stride();
  const i64 npacks = (n + kPer - 1) / kPer;
  const bool owns = block_owns_packs(npacks);
  if (owns) {
    one_store_announce(g, l);
    // Push: U packs of one sweep loaded before any is stored, then each stored to all W regions.
    for (i64 j0 = tid; j0 < npacks; j0 += U * stride) {
      uint4 v[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const i64 j = j0 + u * stride;
        if (j < npacks) v[u] = one_store_mark<DT>(load_user<DT>(x + j * kPer, n - j * kPer));
      }
#pragma unroll
      for (int k = 0; k < DETCOMM_W; ++k) {
        const int t = (g.rank + 1 + k) % DETCOMM_W;  // peers first, this rank's own area last
        uint4* area = one_store_area(l, t, g.rank);
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const i64 j = j0 + u * stride;
          if (j < npacks) st_ws(area + j, v[u]);
        }
      }
    }
    // The busy word after the pushes, so its atomic round trip does not delay thread 32's stores; a second kernel
    // of this rank on these areas is caught all the same (the workspace fails before anyone trusts its results).
    one_store_claim(g, w);
    one_store_check_call(g, l, w);
    // Poll, fold, write, empty.
    const uint4* src[DETCOMM_W];
#pragma unroll
    for (int k = 0; k < DETCOMM_W; ++k) src[k] = one_store_area(l, g.rank, k);
    for (i64 j0 = tid; j0 < npacks && !w.failed; j0 += U * stride) {
      uint4 in[U][DETCOMM_W];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const i64 j = j0 + u * stride;
        if (j < npacks) {
#pragma unroll
          for (int k = 0; k < DETCOMM_W; ++k) in[u][k] = ld_poll(src[k] + j);
        }
      }
      bool ok = true;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const i64 j = j0 + u * stride;
        if (j < npacks) {
#pragma unroll
          for (int k = 0; k < DETCOMM_W; ++k) ok = one_store_wait(g, l, src[k] + j, in[u][k], k, w) && ok;
        }
      }
      if (!ok) break;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const i64 j = j0 + u * stride;
        if (j < npacks) {
          store_user<DT>(out + j * kPer, n - j * kPer, fold_pack<DT>(in[u], g.rank));
#pragma unroll
          for (int k = 0; k < DETCOMM_W; ++k) st_ws(const_cast<uint4*>(src[k]) + j, make_uint4(0u, 0u, 0u, 0u));
        }
      }
    }
  }
  one_store_close(g, l, w, owns);
}

#define DETCOMM_ONE_STORE(NAME, DT)                                                                             \
  extern "C" __global__ void __launch_bounds__(DETCOMM_BLOCK_THREADS)                                         \
      NAME(const Traits<DT>::T* x, Traits<DT>::T* out, i64 n, i64 off, i64 cap, u32 call, char* const* data,  \
           u32* const* sigs, int rank, u64 timeout_ns, u32* ctrl) {                                           \
    const Group g{data, sigs, rank, timeout_ns, ctrl, (DETCOMM_KIND_ONE_STORE << 8) | DT, call, (u64)n, true};  \
    one_store_all_reduce<DT>(x, out, n, off, cap, g);                                                           \
  }

#if DETCOMM_WANT(DT_F32)
DETCOMM_ONE_STORE(detcomm_one_store_f32, DT_F32)
#endif
#if DETCOMM_WANT(DT_BF16)
DETCOMM_ONE_STORE(detcomm_one_store_bf16, DT_BF16)
#endif
#if DETCOMM_WANT(DT_F16)
DETCOMM_ONE_STORE(detcomm_one_store_f16, DT_F16)
#endif
