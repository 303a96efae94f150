// detcomm: one row of the fused all-reduce + residual add + RMSNorm (docs/spec.md §9.2 steps 1-7), shared by the
// barrier kernels (csrc/fused_rmsnorm.cu: s from the workspace slots) and the one-store kernel
// (csrc/fused_rmsnorm_one_store.cu: s from this rank's one-store region). One definition of the arithmetic, so the
// variants cannot drift apart: they differ only in where a row's s-packs come from.
//
// Where s comes from is the `Src` parameter of fn_norm_row / fn_norm_row_regs, an object with
//   typename Src::In                               the packs of one batch (kBatch chunks of one lane)
//   void load(i64 c0, typename Src::In& in)        every load of chunks c0, c0 + 256, ... (kBatch of them, those
//                                                  with c * 8 < H) in flight before any is used; chunks and packs
//                                                  past the row read as +0.0
//   void s_chunk(const In& in, int u, float (&)[8]) chunk u's s widened to fp32 (step 1: the canonical fold of the
//                                                  W sources rounded to the dtype, or an already folded s)
// Rows and halves: a 512-thread block has two 256-thread halves (256 threads = the definition's 256 lanes). How a
// block covers its rows depends on H alone (FnPlace, below), so it is uniform over the block and the same for every
// row of a site; every half runs the same number of iterations so the block-wide __syncthreads stay uniform.
#pragma once
#include "rms_norm_common.cuh"

#define FN_HALVES (DETCOMM_BLOCK_THREADS / NORM_THREADS)

// Rows of this launch handled by this block: row i belongs to block i mod gridDim.x, as its local row i / grid.
__device__ __forceinline__ i64 fn_block_rows(i64 rows) {
  const i64 b = blockIdx.x, G = gridDim.x;
  return rows > b ? (rows - b + G - 1) / G : 0;
}

// DETCOMM_FUSED_BATCH, the fused kernels' load batch cap (chunks per lane per batch), is a device constant
// (detcomm/workspace/plan.py FUSED_NORM_BATCH); the bench-only build "fused_batch4" (detcomm/workspace/kernels.py)
// gives 4 instead, to time the spilling larger batch against this one.

// Packs per 8-element chunk: 1 for 16-bit dtypes, 2 for fp32.
template <int DT> struct FnChunk {
  static constexpr int kPacks = NORM_CHUNK / Traits<DT>::kPer;
  static constexpr int kBudget = DETCOMM_UNROLL / kPacks > 0 ? DETCOMM_UNROLL / kPacks : 1;
  // Chunks whose loads one lane issues before folding any (all W peers each): the workspace's unroll budget, at
  // most DETCOMM_FUSED_BATCH. A 512-thread block has 128 registers per thread; a batch of 4 (W = 2, 16-bit dtypes)
  // held 4 * W source packs plus 8 prefetched residual and weight packs and 4 packs of r, and the one-store variant
  // spilled 380 bytes per thread: capping the batch at 2 removed the spills and took 2.1 us off its graph time at 1
  // row of 4096 bf16 (W = 2 streams of one H200: 10.34 -> 8.26 us; docs/performance.md). Rows up to twice
  // one half's batch keep registers by spreading over both halves (the wide layout, below), wider ones stream. The
  // batch only groups loads: the summation order is the lane's chunk order whatever it is.
  static constexpr int kBatch = kBudget < DETCOMM_FUSED_BATCH ? kBudget : DETCOMM_FUSED_BATCH;
};

// How a block covers its rows (NB = FnChunk<DT>::kBatch chunks per lane per batch, C = NB * 256 * 8 elements: what
// one half holds in registers). Each fused kernel exists twice: the row kernel (WIDE = false) takes the first
// two layouts by H at run time, as it always did; the wide kernel (WIDE = true, names with "_wide") takes the
// third alone. The host launches the wide kernel exactly for C < H <= 2C (plan.fused_norm_layout mirrors C; a CPU
// test holds the mirror to this header). Two kernels, not one run-time branch over three layouts: with all three
// in one kernel ptxas spilled the one-store kernel at W = 2 (8-672 bytes per thread, by arrangement), with two
// layouts per kernel it spills none.
//   registers  H <= C: one row per half, two rows per block at a time. A lane's chunks are one batch: its residual
//              and weight are loaded before s (fn_prefetch) and r stays in registers for step 7.
//   wide       C < H <= 2C: one row per block. Half `part` holds batch `part` of every lane (lane t's chunks
//              t + (part * NB + u) * 256, u < NB), in registers as above, so a row twice as wide keeps the
//              latency path without a bigger batch (a batch of 4 spilled: FnChunk). Lane t's partial is still one
//              sequential sum in the definition's order: half 0 sums its chunks from +0.0 and hands the partial
//              over in shared memory (FnShared::carry); half 1 continues it with its own chunks, then runs the
//              tree. The hand-over costs one block barrier and NB * 8 dependent adds.
//   streaming  H > C in the row kernel: one row per half; each batch is folded, r stored, squares summed, then the
//              next batch; step 7 reads r back and loads the weight (fn_norm_row). It measured slower than the
//              composition at decode sizes, so a site whose rows would stream (H > 2C) is served by the
//              composition (detcomm/backends/ipc_fold.py); the workspace call itself still takes this path.
// Hidden 8192 in bf16 at W <= 4 is wide (NB = 2): streamed at W = 2 it cost 5.3 us after its all-reduce against
// 1.8 us for a row of 4096 in registers (2x H200, docs/performance.md), which is why the wide layout exists.

// Whether rows of H elements fit one half's registers (uniform over the block: H is the same for every thread).
template <int DT>
__device__ __forceinline__ bool fn_rows_in_registers(i64 H) {
  return H <= (i64)FnChunk<DT>::kBatch * NORM_THREADS * NORM_CHUNK;
}

// Where this thread works in a block iteration.
struct FnPlace {
  int half;  // threadIdx.x / 256: this thread's half (its tree's shared memory)
  int part;  // wide: the batch of every lane this half holds (0 or 1); else 0
  int slot;  // the local row of a block iteration this half works on: local rows m0 + slot
  int step;  // local rows a block covers per iteration
};

template <bool WIDE>
__device__ __forceinline__ FnPlace fn_place() {
  static_assert(FN_HALVES == 2, "the wide layout splits a row over exactly two halves");
  const int half = threadIdx.x / NORM_THREADS;
  return FnPlace{half, WIDE ? half : 0, WIDE ? 0 : half, WIDE ? 1 : FN_HALVES};
}

// The row code's shared memory (one per block).
struct FnShared {
  float warp_sum[FN_HALVES][NORM_WARPS];
  float inv[FN_HALVES];
  float carry[NORM_THREADS];  // wide: lane t's partial over half 0's chunks
};

// One 8-element chunk of a caller's tensor as packs (missing elements read as +0.0), and back to fp32.
template <int DT>
__device__ __forceinline__ void load_packs(const typename Traits<DT>::T* p, i64 valid,
                                           uint4 (&v)[FnChunk<DT>::kPacks]) {
#pragma unroll
  for (int h = 0; h < FnChunk<DT>::kPacks; ++h) v[h] = load_user<DT>(p + h * Traits<DT>::kPer, valid - h * Traits<DT>::kPer);
}
template <int DT>
__device__ __forceinline__ void widen_packs(const uint4 (&v)[FnChunk<DT>::kPacks], float (&a)[NORM_CHUNK]) {
  constexpr int kPer = Traits<DT>::kPer;
#pragma unroll
  for (int h = 0; h < FnChunk<DT>::kPacks; ++h) {
    PackU<DT> u;
    u.v = v[h];
#pragma unroll
    for (int e = 0; e < kPer; ++e) a[h * kPer + e] = Traits<DT>::widen(u.e[e]);
  }
}

// Streaming: steps 1-7 for row `row` on one half-block, any H: r is stored, then read back for step 7.
// Inactive halves (no row left) only take part in the block barriers of the tree.
template <int DT, int WDT, class Src>
__device__ __forceinline__ void fn_norm_row(i64 row, i64 H, Src& src, const typename Traits<DT>::T* __restrict__ residual,
                                            const typename Traits<WDT>::T* __restrict__ weight,
                                            typename Traits<DT>::T* __restrict__ y, typename Traits<DT>::T* r_out,
                                            float eps, FnShared& sh, const FnPlace& pl, bool active) {
  constexpr int NB = FnChunk<DT>::kBatch;
  const int t = threadIdx.x % NORM_THREADS;  // lane t of the definition
  const i64 base = row * H;
  float p = 0.0f;  // +0.0 start of this lane's partial
  if (active) {
    for (i64 c0 = t; c0 * NORM_CHUNK < H; c0 += NB * NORM_THREADS) {
      typename Src::In in;
      src.load(c0, in);
#pragma unroll
      for (int u = 0; u < NB; ++u) {  // chunk after chunk: the lane's summation order
        const i64 c = c0 + u * NORM_THREADS;
        if (c * NORM_CHUNK < H) {
          const i64 off = c * NORM_CHUNK, valid = H - off;
          float sv[NORM_CHUNK], res[NORM_CHUNK], a[NORM_CHUNK];
          src.s_chunk(in, u, sv);
          load_chunk<DT>(residual + base + off, valid, res);
          residual_add<DT>(res, sv, a);                   // step 2
          store_chunk<DT>(r_out + base + off, valid, a);  // a holds rounded values: narrow() is exact here
#pragma unroll
          for (int e = 0; e < NORM_CHUNK; ++e) p = __fadd_rn(p, __fmul_rn(a[e], a[e]));  // steps 3-4
        }
      }
    }
  }
  const float inv = norm_inv_rms(p, sh.warp_sum[pl.half], &sh.inv[pl.half], H, eps);  // steps 5-6
  if (active) {
    for (i64 c = t; c * NORM_CHUNK < H; c += NORM_THREADS) {  // step 7
      const i64 off = c * NORM_CHUNK, valid = H - off;
      float a[NORM_CHUNK], w[NORM_CHUNK];
      load_chunk<DT>(r_out + base + off, valid, a);  // this thread stored these r elements above: ordered
      load_chunk<WDT>(weight + off, valid, w);
#pragma unroll
      for (int e = 0; e < NORM_CHUNK; ++e) a[e] = __fmul_rn(__fmul_rn(a[e], inv), w[e]);
      store_chunk<DT>(y + base + off, valid, a);
    }
  }
}

// The register and wide layouts, the latency path: the lane's residual and weight chunks of this half's batch are loaded
// before s (for a block's first row, before the wait for the peers, so their latency hides behind the peers'
// arrival), and r stays in registers for step 7 (packed: 4 registers per 16 bytes).
template <int DT, int WDT> struct FnPre {
  uint4 res[FnChunk<DT>::kBatch][FnChunk<DT>::kPacks];
  uint4 w[FnChunk<DT>::kBatch][FnChunk<WDT>::kPacks];
};

// The first chunk this thread's half holds of a row: lane t's chunk t + part * NB * 256 (its batch `part`).
template <int DT>
__device__ __forceinline__ i64 fn_first_chunk(const FnPlace& pl) {
  return (i64)(threadIdx.x % NORM_THREADS) + (i64)pl.part * FnChunk<DT>::kBatch * NORM_THREADS;
}

template <int DT, int WDT>
__device__ __forceinline__ void fn_prefetch(const FnPlace& pl, i64 row, i64 H,
                                            const typename Traits<DT>::T* __restrict__ residual,
                                            const typename Traits<WDT>::T* __restrict__ weight, FnPre<DT, WDT>& pre,
                                            bool active) {
  if (!active) return;
  const i64 c0 = fn_first_chunk<DT>(pl);
#pragma unroll
  for (int u = 0; u < FnChunk<DT>::kBatch; ++u) {
    const i64 off = (c0 + (i64)u * NORM_THREADS) * NORM_CHUNK;
    if (off < H) {
      load_packs<DT>(residual + row * H + off, H - off, pre.res[u]);
      load_packs<WDT>(weight + off, H - off, pre.w[u]);
    }
  }
}

template <int DT, int WDT, bool WIDE, class Src>
__device__ __forceinline__ void fn_norm_row_regs(const FnPlace& pl, i64 row, i64 H, Src& src, const FnPre<DT, WDT>& pre,
                                                 typename Traits<DT>::T* __restrict__ y,
                                                 typename Traits<DT>::T* __restrict__ r_out, float eps, FnShared& sh,
                                                 bool active) {
  constexpr int NB = FnChunk<DT>::kBatch;
  constexpr int NP = FnChunk<DT>::kPacks;
  constexpr int kPer = Traits<DT>::kPer;
  const int t = threadIdx.x % NORM_THREADS;
  const i64 c0 = fn_first_chunk<DT>(pl);
  const i64 base = row * H;
  constexpr bool wide = WIDE;
  float p = 0.0f;  // +0.0 start of lane t's partial
  uint4 rp[NB][NP];
  if (active) {
    typename Src::In in;
    src.load(c0, in);
#pragma unroll
    for (int u = 0; u < NB; ++u) {  // chunk after chunk: the lane's summation order
      const i64 off = (c0 + (i64)u * NORM_THREADS) * NORM_CHUNK;
      if (off < H) {
        float sv[NORM_CHUNK], res[NORM_CHUNK], a[NORM_CHUNK];
        src.s_chunk(in, u, sv);
        widen_packs<DT>(pre.res[u], res);
        residual_add<DT>(res, sv, a);  // step 2
#pragma unroll
        for (int h = 0; h < NP; ++h) {
          PackU<DT> r;
#pragma unroll
          for (int e = 0; e < kPer; ++e) r.e[e] = Traits<DT>::narrow(a[h * kPer + e]);  // exact: a is rounded
          rp[u][h] = r.v;
          store_user<DT>(r_out + base + off + h * kPer, H - off - h * kPer, r.v);
        }
        if (!wide || pl.part == 0) {
#pragma unroll
          for (int e = 0; e < NORM_CHUNK; ++e) p = __fadd_rn(p, __fmul_rn(a[e], a[e]));  // steps 3-4
        }
      }
    }
  }
  if constexpr (wide) {
    // Half 1's chunks come after half 0's in every lane's order: continue lane t's partial from half 0's.
    if (pl.part == 0) sh.carry[t] = p;
    __syncthreads();
    if (pl.part == 1) {
      // Half 0 writes carry again only after both tree barriers of norm_inv_rms below, so this read is this row's.
      p = sh.carry[t];
      if (active) {
#pragma unroll
        for (int u = 0; u < NB; ++u) {
          const i64 off = (c0 + (i64)u * NORM_THREADS) * NORM_CHUNK;
          if (off < H) {
            float a[NORM_CHUNK];
            widen_packs<DT>(rp[u], a);  // exact: the rounded r the composition squares
#pragma unroll
            for (int e = 0; e < NORM_CHUNK; ++e) p = __fadd_rn(p, __fmul_rn(a[e], a[e]));  // steps 3-4
          }
        }
      }
    }
  }
  // Steps 5-6. Wide: both halves run the tree (its barriers are block-wide), half 1's is the row's; half 0's
  // result is discarded. sh.inv[1] is read after the tree's second barrier and rewritten only after the next
  // row's hand-over barrier, which every thread reaches after this read.
  float inv = norm_inv_rms(p, sh.warp_sum[pl.half], &sh.inv[pl.half], H, eps);
  if constexpr (wide) inv = sh.inv[FN_HALVES - 1];
  if (active) {
#pragma unroll
    for (int u = 0; u < NB; ++u) {  // step 7
      const i64 off = (c0 + (i64)u * NORM_THREADS) * NORM_CHUNK;
      if (off < H) {
        float a[NORM_CHUNK], w[NORM_CHUNK];
        widen_packs<DT>(rp[u], a);
        widen_packs<WDT>(pre.w[u], w);
#pragma unroll
        for (int e = 0; e < NORM_CHUNK; ++e) a[e] = __fmul_rn(__fmul_rn(a[e], inv), w[e]);
        store_chunk<DT>(y + base + off, H - off, a);
      }
    }
  }
}

// The fused families' kernels of this module: KERNELS(SFX, DT, WSFX, WDT) for the module's dtype DT (its name
// SFX) and each weight dtype WDT (WSFX), in one order for every family (csrc/fused_rmsnorm.cu,
// csrc/fused_rmsnorm_one_store.cu); a dtype the module does not hold (DETCOMM_WANT) expands to nothing.
#if DETCOMM_WANT(DT_F32)
#define FN_IF_F32(...) __VA_ARGS__
#else
#define FN_IF_F32(...)
#endif
#if DETCOMM_WANT(DT_BF16)
#define FN_IF_BF16(...) __VA_ARGS__
#else
#define FN_IF_BF16(...)
#endif
#if DETCOMM_WANT(DT_F16)
#define FN_IF_F16(...) __VA_ARGS__
#else
#define FN_IF_F16(...)
#endif
#define FN_EVERY_WEIGHT(KERNELS, SFX, DT) \
  KERNELS(SFX, DT, f32, DT_F32)           \
  KERNELS(SFX, DT, bf16, DT_BF16)         \
  KERNELS(SFX, DT, f16, DT_F16)
#define FN_FUSED_KERNELS(KERNELS)                       \
  FN_IF_F32(FN_EVERY_WEIGHT(KERNELS, f32, DT_F32))      \
  FN_IF_BF16(FN_EVERY_WEIGHT(KERNELS, bf16, DT_BF16))   \
  FN_IF_F16(FN_EVERY_WEIGHT(KERNELS, f16, DT_F16))
