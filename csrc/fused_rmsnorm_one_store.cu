// detcomm: fused all-reduce + residual add + RMSNorm on the one-store exchange (docs/spec.md §9.2; the exchange is
// described in csrc/one_store_common.cuh). No barrier: the latency is one NVLink store plus a local poll, then the
// norm.
//
// The bits are the barrier variants' (csrc/fused_rmsnorm.cu) and the composition's: the same row code
// (csrc/fused_norm_row.cuh: 256 lanes of 8-element chunks, the warp tree, correctly rounded division and square
// root), fed with s-packs folded from this rank's one-store region instead of the workspace slots. Only x travels
// (marked +0.0 -> -0.0, which no fold can see); s, r and y are computed on every rank from the packs it received,
// so no rounded result is ever moved and -0.0 in r or y needs no other marker. Every rank adds its OWN residual,
// exactly as the composition does.
//
// Rows. Row i of the launch belongs to block i mod gridDim.x, as for the barrier variants (fn_block_rows): the
// block pushes its rows' packs (every thread, DETCOMM_UNROLL packs in flight) and then norms them two at a time,
// one per 256-thread half, or one at a time on both halves in the wide kernel (csrc/fused_norm_row.cuh,
// FnPlace). Layout of an area: pack j of row i at pack index i * P + j (P = packs per row, whole
// packs: the last pack of a row is zero-filled past H, and its -0.0-marked padding folds to +0.0, squares to
// nothing). A launch's rows * P * 16 bytes fit one area (the host's fused_norm_one_store_rows). Each pack of row i
// has one reader, the half that holds its chunk, which empties it right after it arrived.
//
// The call descriptor's count is rows << 32 | H (plan.describe_call decodes it), so ranks whose launches differ
// in rows or in H (even with equal rows * H) fail with a mismatch instead of folding misplaced packs.
//
// Launch: grid = the blocks of the launch's tier (plan.one_store_tiers, shared with csrc/one_store.cu: a tier's region
// serves both kernels), block = DETCOMM_BLOCK_THREADS, identical on every rank; every block runs one_store_open and
// one_store_close (its launch counter) even when it has no row.
#include "fused_norm_row.cuh"
#include "one_store_common.cuh"

// Push this block's rows of x (marked) into area [buffer][this rank] of every rank's region.
template <int DT>
__device__ __forceinline__ void fn_one_store_push(const typename Traits<DT>::T* x, i64 rows_b, i64 H, i64 P, const Group& g,
                                            const OneStoreArea& l) {
  constexpr int kPer = Traits<DT>::kPer;
  constexpr int U = DETCOMM_UNROLL;
  const i64 total = rows_b * P, G = gridDim.x;
  for (i64 k0 = threadIdx.x; k0 < total; k0 += U * DETCOMM_BLOCK_THREADS) {
    uint4 v[U];
    i64 at[U];  // the pack's index in an area
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const i64 k = k0 + u * DETCOMM_BLOCK_THREADS;
      if (k < total) {
        const i64 row = (k / P) * G + blockIdx.x, j = k % P;
        v[u] = one_store_mark<DT>(load_user<DT>(x + row * H + j * kPer, H - j * kPer));
        at[u] = row * P + j;
      }
    }
#pragma unroll
    for (int t = 0; t < DETCOMM_W; ++t) {
      uint4* area = one_store_area(l, (g.rank + 1 + t) % DETCOMM_W, g.rank);  // peers first, this rank's own area last
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (k0 + u * DETCOMM_BLOCK_THREADS < total) st_ws(area + at[u], v[u]);
      }
    }
  }
}

// The s-packs of one row from this rank's one-store region (the Src of csrc/fused_norm_row.cuh): every poll of a
// batch issued first, then the batch waited for until every pack is full, then emptied; s is their canonical fold.
//
// One spin site per batch, not one per pack: while some pack is still empty, one_store_wait spins on the first such pack
// (its deadline, abort and host-abort checks), then every pack not yet full is polled again, all at once. The packs
// stay in registers (static indices only), the spin code is not inlined W * kBatch times, and a batch whose first
// polls came too early costs one more round of parallel polls, not one sequential poll per pack (the peers' stores
// were all in flight together, so they land together). The four walks over the batch are written out rather than
// shared through a lambda: with the lambda ptxas spilled 212-464 bytes per thread at W = 2 instead of 124.
template <int DT> struct FnLamSrc {
  static constexpr int NB = FnChunk<DT>::kBatch, NP = FnChunk<DT>::kPacks;
  struct In {
    uint4 v[NB][NP][DETCOMM_W];
  };
  const Group& g;
  const OneStoreArea& l;
  OneStoreWait& w;
  const uint4* const* area;  // the W source areas of this rank's region, this launch's buffer
  i64 first;                 // the row's first pack index in an area: row * P
  i64 H, P;

  // Pack h of chunk c0 + u * 256 exists (beyond P only in fp32's last chunk, all padding: never pushed, read as
  // +0.0); it sits at base[k] + u * 256 * NP + h in source k's area.
  __device__ __forceinline__ bool valid(i64 c0, int u, int h) const {
    const i64 c = c0 + u * NORM_THREADS;
    return c * NORM_CHUNK < H && c * NP + h < P;
  }

  __device__ __forceinline__ void load(i64 c0, In& in) {
    uint4* base[DETCOMM_W];
#pragma unroll
    for (int k = 0; k < DETCOMM_W; ++k) base[k] = const_cast<uint4*>(area[k]) + first + c0 * NP;
#pragma unroll
    for (int u = 0; u < NB; ++u) {
#pragma unroll
      for (int h = 0; h < NP; ++h) {
#pragma unroll
        for (int k = 0; k < DETCOMM_W; ++k)
          in.v[u][h][k] = valid(c0, u, h) ? ld_poll(base[k] + u * NORM_THREADS * NP + h) : make_uint4(0u, 0u, 0u, 0u);
      }
    }
    for (;;) {
      const uint4* empty = nullptr;  // the first pack still empty, and its source
      int peer = 0;
#pragma unroll
      for (int u = 0; u < NB; ++u) {
#pragma unroll
        for (int h = 0; h < NP; ++h) {
#pragma unroll
          for (int k = 0; k < DETCOMM_W; ++k) {
            if (empty == nullptr && valid(c0, u, h) && !one_store_full(in.v[u][h][k])) {
              empty = base[k] + u * NORM_THREADS * NP + h;
              peer = k;
            }
          }
        }
      }
      if (empty == nullptr) break;
      uint4 v = ld_poll(empty);
      if (!one_store_wait(g, l, empty, v, peer, w)) return;  // the workspace failed: leave the region as it is
      // `empty` is full now: poll it again with every other pack still empty, all in flight together (only this
      // thread empties these packs, so a pack once full stays full until then). Each round fills one more pack.
#pragma unroll
      for (int u = 0; u < NB; ++u) {
#pragma unroll
        for (int h = 0; h < NP; ++h) {
#pragma unroll
          for (int k = 0; k < DETCOMM_W; ++k) {
            if (valid(c0, u, h) && !one_store_full(in.v[u][h][k])) in.v[u][h][k] = ld_poll(base[k] + u * NORM_THREADS * NP + h);
          }
        }
      }
    }
#pragma unroll
    for (int u = 0; u < NB; ++u) {
#pragma unroll
      for (int h = 0; h < NP; ++h) {
#pragma unroll
        for (int k = 0; k < DETCOMM_W; ++k) {
          if (valid(c0, u, h)) st_ws(base[k] + u * NORM_THREADS * NP + h, make_uint4(0u, 0u, 0u, 0u));
        }
      }
    }
  }

  __device__ __forceinline__ void s_chunk(const In& in, int u, float (&sv)[NORM_CHUNK]) const {
    uint4 packs[FnChunk<DT>::kPacks];
#pragma unroll
    for (int h = 0; h < FnChunk<DT>::kPacks; ++h) packs[h] = fold_pack<DT>(in.v[u][h], g.rank);
    widen_packs<DT>(packs, sv);
  }
};

// After a failure (a peer's abort, the deadline, a mismatch) the waits stop, the block still meets at one_store_close,
// and y and r hold unspecified values: the call raises WorkspaceFailed (the host reads this rank's record).
// WIDE: the wide kernel (rows of C < H <= 2C elements on a whole block) or the row kernel (csrc/fused_norm_row.cuh).
template <int DT, int WDT, bool WIDE>
__device__ __forceinline__ void fused_rmsnorm_one_store(const typename Traits<DT>::T* __restrict__ x,
                                                      const typename Traits<DT>::T* __restrict__ residual,
                                                      const typename Traits<WDT>::T* __restrict__ weight,
                                                      typename Traits<DT>::T* __restrict__ y,
                                                      typename Traits<DT>::T* r_out, i64 rows, i64 H, float eps,
                                                      i64 off, i64 cap, const Group& g, FnShared& sh) {
  constexpr int kPer = Traits<DT>::kPer;
  const OneStoreArea l = one_store_open(g, off, cap);
  OneStoreWait w{0u, 0ull, 0u};
  const i64 rows_b = fn_block_rows(rows);
  const bool owns = rows_b > 0;  // uniform over the block, and the same on every rank (rows is)
  if (owns) {
    const i64 P = (H + kPer - 1) / kPer;
    const FnPlace pl = fn_place<WIDE>();
    const bool regs = WIDE || fn_rows_in_registers<DT>(H);
    FnPre<DT, WDT> pre;
    // The first row's residual and weight are loaded before the push, so their latency hides behind the peers'.
    if (regs) fn_prefetch<DT, WDT>(pl, (i64)pl.slot * gridDim.x + blockIdx.x, H, residual, weight, pre, pl.slot < rows_b);
    one_store_announce(g, l);
    fn_one_store_push<DT>(x, rows_b, H, P, g, l);
    one_store_claim(g, w);  // after the pushes: its atomic round trip would delay thread 32's stores (as in one_store.cu)
    one_store_check_call(g, l, w);
    const uint4* area[DETCOMM_W];
#pragma unroll
    for (int k = 0; k < DETCOMM_W; ++k) area[k] = one_store_area(l, g.rank, k);
    for (i64 m0 = 0; m0 < rows_b; m0 += pl.step) {  // the same trip count for both halves
      const i64 m = m0 + pl.slot, row = m * gridDim.x + blockIdx.x;
      FnLamSrc<DT> src{g, l, w, area, row * P, H, P};
      if (regs) {
        if (m0 > 0) fn_prefetch<DT, WDT>(pl, row, H, residual, weight, pre, m < rows_b);
        fn_norm_row_regs<DT, WDT, WIDE>(pl, row, H, src, pre, y, r_out, eps, sh, m < rows_b);
      } else {
        fn_norm_row<DT, WDT>(row, H, src, residual, weight, y, r_out, eps, sh, pl, m < rows_b);
      }
    }
  }
  one_store_close(g, l, w, owns);
}

#define DETCOMM_FUSED_NORM_ONE_STORE_KERNEL(NAME, WIDE, DT, WDT)                                                     \
  extern "C" __global__ void __launch_bounds__(DETCOMM_BLOCK_THREADS) NAME(                                         \
      const Traits<DT>::T* x, const Traits<DT>::T* residual, const Traits<WDT>::T* weight, Traits<DT>::T* y,        \
      Traits<DT>::T* r_out, i64 rows, i64 H, float eps, i64 off, i64 cap, u32 call, char* const* data,             \
      u32* const* sigs, int rank, u64 timeout_ns, u32* ctrl) {                                                      \
    __shared__ FnShared sh;                                                                                         \
    const Group g{data, sigs, rank, timeout_ns, ctrl, (DETCOMM_KIND_FUSED_NORM_ONE_STORE << 8) | DT, call,            \
                  ((u64)rows << 32) | (u64)H, true};                                                                \
    fused_rmsnorm_one_store<DT, WDT, WIDE>(x, residual, weight, y, r_out, rows, H, eps, off, cap, g, sh);             \
  }

// The row kernel and the wide kernel (names with "_wide": plan.fused_norm_kernel).
#define DETCOMM_FUSED_NORM_ONE_STORE(SFX, DT, WSFX, WDT)                                                       \
  DETCOMM_FUSED_NORM_ONE_STORE_KERNEL(detcomm_fused_rmsnorm_one_store_##SFX##_w##WSFX, false, DT, WDT)         \
  DETCOMM_FUSED_NORM_ONE_STORE_KERNEL(detcomm_fused_rmsnorm_one_store_wide_##SFX##_w##WSFX, true, DT, WDT)

FN_FUSED_KERNELS(DETCOMM_FUSED_NORM_ONE_STORE)
