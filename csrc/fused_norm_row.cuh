// detcomm: one row of the fused all-reduce + residual add + RMSNorm (docs/spec.md §9.2 steps 1-7) on a 256-thread
// half-block, shared by the barrier kernels (csrc/fused_rmsnorm.cu: s from the workspace slots) and the one-store
// kernel (csrc/fused_rmsnorm_lamport.cu: s from this rank's one-store region). One definition of the arithmetic, so
// the variants cannot drift apart: they differ only in where a row's s-packs come from.
//
// Where s comes from is the `Src` parameter of fn_norm_row / fn_norm_row_regs, an object with
//   typename Src::In                               the packs of one batch (kBatch chunks of one lane)
//   void load(i64 c0, typename Src::In& in)        every load of chunks c0, c0 + 256, ... (kBatch of them, those
//                                                  with c * 8 < H) in flight before any is used; chunks and packs
//                                                  past the row read as +0.0
//   void s_chunk(const In& in, int u, float (&)[8]) chunk u's s widened to fp32 (step 1: the canonical fold of the
//                                                  W sources rounded to the dtype, or an already folded s)
// Rows, halves: a 512-thread block norms two rows at a time, one per half (256 threads = the definition's 256
// lanes); both halves run the same number of iterations so the block-wide __syncthreads of the tree stay uniform.
#pragma once
#include "rms_norm_common.cuh"

#define FN_HALVES (DETCOMM_BLOCK_THREADS / NORM_THREADS)

// Rows of this launch handled by this block: row i belongs to block i mod gridDim.x, as its local row i / grid.
__device__ __forceinline__ i64 fn_block_rows(i64 rows) {
  const i64 b = blockIdx.x, G = gridDim.x;
  return rows > b ? (rows - b + G - 1) / G : 0;
}

// The fused kernels' load batch cap (chunks per lane per batch); the bench-only build "fused_batch4"
// (detcomm/workspace/kernels.py) sets 4, the batch these kernels had before round 7, to time the two against each other.
#ifndef DETCOMM_FUSED_BATCH
#define DETCOMM_FUSED_BATCH 2
#endif

// Packs per 8-element chunk: 1 for 16-bit dtypes, 2 for fp32.
template <int DT> struct FnChunk {
  static constexpr int kPacks = NORM_CHUNK / Traits<DT>::kPer;
  static constexpr int kBudget = DETCOMM_UNROLL / kPacks > 0 ? DETCOMM_UNROLL / kPacks : 1;
  // Chunks whose loads one lane issues before folding any (all W peers each): the workspace's unroll budget, at
  // most DETCOMM_FUSED_BATCH. A 512-thread block has 128 registers per thread; a batch of 4 (W = 2, 16-bit dtypes)
  // held 4 * W source packs plus 8 prefetched residual and weight packs and 4 packs of r, and the one-store variant
  // spilled 380 bytes per thread: capping the batch at 2 removed the spills and took 2.1 us off its graph time at 1
  // row of 4096 bf16 (W = 2 streams of one H200: 10.34 -> 8.26 us; docs/performance.md, round 7). Rows wider than
  // 2 * 256 chunks take the streaming path (fn_norm_row). The batch only groups loads: the summation order is the
  // lane's chunk order whatever it is.
  static constexpr int kBatch = kBudget < DETCOMM_FUSED_BATCH ? kBudget : DETCOMM_FUSED_BATCH;
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

// Steps 1-7 for row `row` on one half-block, any H: r is stored, then read back for step 7.
// Inactive halves (no row left) only take part in the block barriers of the tree.
template <int DT, int WDT, class Src>
__device__ __forceinline__ void fn_norm_row(i64 row, i64 H, Src& src, const typename Traits<DT>::T* __restrict__ residual,
                                            const typename Traits<WDT>::T* __restrict__ weight,
                                            typename Traits<DT>::T* __restrict__ y, typename Traits<DT>::T* r_out,
                                            float eps, float* warp_sum, float* inv_shared, bool active) {
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
  const float inv = norm_inv_rms(p, warp_sum, inv_shared, H, eps);  // steps 5-6
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

// The latency path, for rows a lane covers in one batch (H <= NB * 256 * 8: the decode shapes): the lane's
// residual and weight chunks are loaded before s (for a block's first row, before the wait for the peers, so their
// latency hides behind the peers' arrival), and r stays in registers for step 7 (packed: 4 registers per 16 bytes).
template <int DT, int WDT> struct FnPre {
  uint4 res[FnChunk<DT>::kBatch][FnChunk<DT>::kPacks];
  uint4 w[FnChunk<DT>::kBatch][FnChunk<WDT>::kPacks];
};

// Whether rows of H elements take the latency path (uniform over the block: H is the same for every thread).
template <int DT>
__device__ __forceinline__ bool fn_rows_in_registers(i64 H) {
  return H <= (i64)FnChunk<DT>::kBatch * NORM_THREADS * NORM_CHUNK;
}

template <int DT, int WDT>
__device__ __forceinline__ void fn_prefetch(i64 row, i64 H, const typename Traits<DT>::T* __restrict__ residual,
                                            const typename Traits<WDT>::T* __restrict__ weight, FnPre<DT, WDT>& pre,
                                            bool active) {
  const int t = threadIdx.x % NORM_THREADS;
  if (!active) return;
#pragma unroll
  for (int u = 0; u < FnChunk<DT>::kBatch; ++u) {
    const i64 off = (t + (i64)u * NORM_THREADS) * NORM_CHUNK;
    if (off < H) {
      load_packs<DT>(residual + row * H + off, H - off, pre.res[u]);
      load_packs<WDT>(weight + off, H - off, pre.w[u]);
    }
  }
}

template <int DT, int WDT, class Src>
__device__ __forceinline__ void fn_norm_row_regs(i64 row, i64 H, Src& src, const FnPre<DT, WDT>& pre,
                                                 typename Traits<DT>::T* __restrict__ y,
                                                 typename Traits<DT>::T* __restrict__ r_out, float eps,
                                                 float* warp_sum, float* inv_shared, bool active) {
  constexpr int NB = FnChunk<DT>::kBatch;
  constexpr int NP = FnChunk<DT>::kPacks;
  constexpr int kPer = Traits<DT>::kPer;
  const int t = threadIdx.x % NORM_THREADS;
  const i64 base = row * H;
  float p = 0.0f;
  uint4 rp[NB][NP];
  if (active) {
    typename Src::In in;
    src.load(t, in);
#pragma unroll
    for (int u = 0; u < NB; ++u) {  // chunk after chunk: the lane's summation order
      const i64 off = (t + (i64)u * NORM_THREADS) * NORM_CHUNK;
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
#pragma unroll
        for (int e = 0; e < NORM_CHUNK; ++e) p = __fadd_rn(p, __fmul_rn(a[e], a[e]));  // steps 3-4
      }
    }
  }
  const float inv = norm_inv_rms(p, warp_sum, inv_shared, H, eps);  // steps 5-6
  if (active) {
#pragma unroll
    for (int u = 0; u < NB; ++u) {  // step 7
      const i64 off = (t + (i64)u * NORM_THREADS) * NORM_CHUNK;
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
