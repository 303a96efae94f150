// detcomm: fused all-reduce + residual add + RMSNorm in the CUDA-IPC workspace (docs/spec.md §9.2).
//
// The bits are the composition's: s = canonical fold of x over the ranks (§1, fold_pack), rounded to the dtype;
// r = round(fp32(residual) + fp32(s)); y = the canonical RMSNorm of r (§9.2 steps 3-7, exactly the arithmetic of
// csrc/rms_norm.cu: 256 lanes of 8-element chunks, the warp shuffle tree, then the tree over the 8 warp results,
// correctly rounded division and square root; the row code is csrc/fused_norm_row.cuh, shared with the one-store
// variant csrc/fused_rmsnorm_one_store.cu). The self-checks prove every variant against the composition before a
// site uses it.
//
// Rows, blocks and slots. Row i is handled by block b = i mod gridDim.x as that block's local row m = i / grid.
// Its P packs live in the slot in R = ceil(P / BLOCK_THREADS) regions of BLOCK_THREADS packs, region k of the
// row at slot pack (m*R + k) * stride + b * BLOCK_THREADS: within a launch, every slot pack is written and read by
// one block index on every rank, so the per-block barriers order the launch (detcomm_common.cuh, "Work
// assignment"); the launch's parity, the same in every block, keeps it apart from the launches around it. A 512-thread block norms
// two rows at a time, one per half (256 threads = the definition's 256 lanes), or, in the wide kernels,
// one row on both halves (csrc/fused_norm_row.cuh, FnPlace); both halves run the same number of iterations so the
// block-wide __syncthreads of the tree stay uniform.
//
// One-shot (latency): copy my rows into my slot; START; each half folds whole rows from the W slots into
// registers, adds the residual, writes r and sums the squares; tree; writes y. No end barrier: every slot access
// goes to the copy of this use's parity (detcomm_common.cuh, "Barriers"), which no peer rewrites before this rank
// has arrived at its next START.
// Two-shot (bandwidth): the norm needs the whole row's sum of squares, so the reduce-scatter cuts every row
// into W pack ranges instead of cutting the message: rank q folds range q of each of its blocks' rows and writes
// the rounded s in place into its own slot (that range of that slot is read by no other rank in this phase);
// MID; then every rank reads each row's s from the rank that folded each range (the gather phase moves s, as
// much as a plain two-shot all-reduce moves) and runs steps 2-7 itself on all rows. Every rank therefore adds
// its OWN residual, exactly as the composition does, whatever the residuals hold.
// The zero tail: copy-in zero-fills the last pack of a row (load_user), so the fold gives +0.0 there, r = +0.0
// (the residual's tail is loaded as +0.0 too) and its square adds nothing: no tail branch (docs/spec.md §9.2).
//
// Launch: grid = the workspace's block count, block = DETCOMM_BLOCK_THREADS, identical on every rank.
#include "fused_norm_row.cuh"
#include "tree_common.cuh"

// Where pack j of local row m of this block lives in a slot (in packs).
__device__ __forceinline__ i64 fn_pos(i64 m, i64 j, i64 R, i64 stride) {
  return (m * R + j / DETCOMM_BLOCK_THREADS) * stride + (i64)blockIdx.x * DETCOMM_BLOCK_THREADS +
         j % DETCOMM_BLOCK_THREADS;
}

// Phase 0: this block's rows of x into this rank's slot (DETCOMM_UNROLL packs in flight per thread).
template <int DT>
__device__ __forceinline__ void fn_copy_in(const typename Traits<DT>::T* x, i64 rows_b, i64 H, i64 P, i64 R,
                                           i64 stride, uint4* own) {
  constexpr int kPer = Traits<DT>::kPer;
  constexpr int U = DETCOMM_UNROLL;
  const i64 total = rows_b * P, G = gridDim.x;
  for (i64 k0 = threadIdx.x; k0 < total; k0 += U * DETCOMM_BLOCK_THREADS) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const i64 k = k0 + u * DETCOMM_BLOCK_THREADS;
      if (k < total) {
        const i64 m = k / P, j = k % P, row = m * G + blockIdx.x;
        v[u] = load_user<DT>(x + row * H + j * kPer, H - j * kPer);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const i64 k = k0 + u * DETCOMM_BLOCK_THREADS;
      if (k < total) st_ws(own + fn_pos(k / P, k % P, R, stride), v[u]);
    }
  }
}

// Two-shot phase 1: fold range q (packs [q*Lq, (q+1)*Lq) of each row) from every slot, in place into my slot.
template <int DT>
__device__ __forceinline__ void fn_fold_range(i64 rows_b, i64 P, i64 R, i64 stride, i64 Lq, const uint4* const* src,
                                              uint4* own, int q) {
  constexpr int U = DETCOMM_UNROLL;
  const i64 lo = (i64)q * Lq;
  const i64 hi = lo + Lq < P ? lo + Lq : P;
  const i64 len = hi > lo ? hi - lo : 0;
  const i64 total = rows_b * len;
  for (i64 k0 = threadIdx.x; k0 < total; k0 += U * DETCOMM_BLOCK_THREADS) {
    uint4 in[U][DETCOMM_W];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const i64 k = k0 + u * DETCOMM_BLOCK_THREADS;
      if (k < total) {
        const i64 pos = fn_pos(k / len, lo + k % len, R, stride);
#pragma unroll
        for (int p = 0; p < DETCOMM_W; ++p) in[u][p] = ld_ws(src[p] + pos);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const i64 k = k0 + u * DETCOMM_BLOCK_THREADS;
      if (k < total) st_ws(own + fn_pos(k / len, lo + k % len, R, stride), fold_pack<DT>(in[u], q));
    }
  }
}

// The tree variants (shard_fold="tree", docs/spec.md §9.1 and §9.2): the call passes this rank's S fp32 slabs of
// the rows (slab j at x + j * x_stride elements) and the slot holds each row as an fp32 row (P = ceil(H / 4) fp32
// packs, the fp32 layout of fn_pos): this rank's subtree roots, folded here while they are copied in.
struct FnTreeIn {
  const u32* x;
  i64 x_stride;
  int S;
};

// Phase 0 of the tree variants: the subtree roots of this block's rows into this rank's slot.
__device__ __forceinline__ void fn_tree_copy_in(const FnTreeIn& tin, i64 rows_b, i64 H, i64 P, i64 R, i64 stride,
                                                uint4* own) {
  const i64 total = rows_b * P, G = gridDim.x;
  for (i64 k = threadIdx.x; k < total; k += DETCOMM_BLOCK_THREADS) {
    const i64 m = k / P, j = k % P, row = m * G + blockIdx.x;
    st_ws(own + fn_pos(m, j, R, stride), tree_local(tin.x, tin.x_stride, tin.S, row * H + j * 4, H - j * 4));
  }
}

// Two-shot phase 1 of the tree variants: the top levels of range q (fp32 packs [q*Lq, (q+1)*Lq) of each row), rounded
// to DT and widened back (exact), in place into my slot.
template <int DT>
__device__ __forceinline__ void fn_tree_fold_range(i64 rows_b, i64 P, i64 R, i64 stride, i64 Lq,
                                                   const uint4* const* src, uint4* own, int q) {
  const i64 lo = (i64)q * Lq;
  const i64 hi = lo + Lq < P ? lo + Lq : P;
  const i64 len = hi > lo ? hi - lo : 0;
  const i64 total = rows_b * len;
  for (i64 k = threadIdx.x; k < total; k += DETCOMM_BLOCK_THREADS) {
    const i64 pos = fn_pos(k / len, lo + k % len, R, stride);
    uint4 col[DETCOMM_W];
#pragma unroll
    for (int p = 0; p < DETCOMM_W; ++p) col[p] = ld_ws(src[p] + pos);
    float sv[4];
    tree_top_values<DT>(col, q, sv);
    PackU<DT_F32> u;
#pragma unroll
    for (int i = 0; i < 4; ++i) u.e[i] = __float_as_uint(sv[i]);
    st_ws(own + pos, u.v);
  }
}

// The slot loads of one batch: NB chunks c0, c0+256, ... of local row m, every load in flight before any fold.
// One-shot: the pack from every rank's slot; two-shot: the folded pack from the rank that folded its range.
// Slot packs per chunk: the dtype's (1 for 16-bit dtypes, 2 for fp32), or 2 fp32 packs in the tree variants.
template <int DT, bool TREE> struct FnSlotChunk {
  static constexpr int kPacks = TREE ? NORM_CHUNK / 4 : FnChunk<DT>::kPacks;
};
template <int DT, bool TWO, bool TREE = false> struct FnIn {
  uint4 v[FnChunk<DT>::kBatch][FnSlotChunk<DT, TREE>::kPacks][TWO ? 1 : DETCOMM_W];
};

template <int DT, bool TWO, bool TREE>
__device__ __forceinline__ void fn_load_batch(i64 c0, i64 m, i64 H, i64 P, i64 R, i64 stride, i64 Lq,
                                              const uint4* const* src, FnIn<DT, TWO, TREE>& in) {
  constexpr int NP = FnSlotChunk<DT, TREE>::kPacks;
#pragma unroll
  for (int u = 0; u < FnChunk<DT>::kBatch; ++u) {
    const i64 c = c0 + u * NORM_THREADS;
#pragma unroll
    for (int h = 0; h < NP; ++h) {
      const i64 j = c * NP + h;  // the chunk's h-th pack; j >= P only in fp32's last chunk (all padding)
      if (c * NORM_CHUNK < H && j < P) {
        const i64 pos = fn_pos(m, j, R, stride);
        if constexpr (TWO) {
          in.v[u][h][0] = ld_ws(src[j / Lq] + pos);
        } else {
#pragma unroll
          for (int k = 0; k < DETCOMM_W; ++k) in.v[u][h][k] = ld_ws(src[k] + pos);
        }
      } else {
#pragma unroll
        for (int k = 0; k < (TWO ? 1 : DETCOMM_W); ++k) in.v[u][h][k] = make_uint4(0u, 0u, 0u, 0u);
      }
    }
  }
}

// s of chunk u of a batch, widened (step 1: the canonical fold rounded to the dtype, or the folding rank's s).
template <int DT, bool TWO, bool TREE>
__device__ __forceinline__ void fn_s_chunk(const FnIn<DT, TWO, TREE>& in, int u, int rank, float (&sv)[NORM_CHUNK]) {
  if constexpr (TREE) {
    // The chunk's 2 fp32 packs: the top levels over the W subtree roots, rounded to DT and widened (one-shot), or
    // the folding rank's already rounded and widened values (two-shot).
#pragma unroll
    for (int h = 0; h < NORM_CHUNK / 4; ++h) {
      float v[4];
      if constexpr (TWO) {
        PackU<DT_F32> p;
        p.v = in.v[u][h][0];
#pragma unroll
        for (int i = 0; i < 4; ++i) v[i] = __uint_as_float(p.e[i]);
      } else {
        tree_top_values<DT>(in.v[u][h], rank, v);
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) sv[h * 4 + i] = v[i];
    }
  } else {
    uint4 packs[FnChunk<DT>::kPacks];
#pragma unroll
    for (int h = 0; h < FnChunk<DT>::kPacks; ++h) {
      if constexpr (TWO) {
        packs[h] = in.v[u][h][0];
      } else {
        packs[h] = fold_pack<DT>(in.v[u][h], rank);
      }
    }
    widen_packs<DT>(packs, sv);
  }
}

// The s-packs of local row m of this block from the workspace slots (the Src of csrc/fused_norm_row.cuh).
template <int DT, bool TWO, bool TREE = false> struct FnSlotSrc {
  typedef FnIn<DT, TWO, TREE> In;
  i64 m, H, P, R, stride, Lq;
  const uint4* const* src;
  int rank;
  __device__ __forceinline__ void load(i64 c0, In& in) const {
    fn_load_batch<DT, TWO, TREE>(c0, m, H, P, R, stride, Lq, src, in);
  }
  __device__ __forceinline__ void s_chunk(const In& in, int u, float (&sv)[NORM_CHUNK]) const {
    fn_s_chunk<DT, TWO, TREE>(in, u, rank, sv);
  }
};

// WIDE: the wide kernel (rows of C < H <= 2C elements on a whole block) or the row kernel (csrc/fused_norm_row.cuh).
template <int DT, int WDT, bool TWO, bool WIDE, bool TREE = false>
__device__ __forceinline__ void fused_rmsnorm(const typename Traits<DT>::T* __restrict__ x,
                                              const typename Traits<DT>::T* __restrict__ residual,
                                              const typename Traits<WDT>::T* __restrict__ weight,
                                              typename Traits<DT>::T* __restrict__ y, typename Traits<DT>::T* r_out,
                                              i64 rows, i64 H, float eps, const Group& g0, FnShared& sh,
                                              const FnTreeIn& tin = FnTreeIn{nullptr, 0, 0}) {
  constexpr int kPer = TREE ? 4 : Traits<DT>::kPer;  // elements per slot pack: the tree's slot rows are fp32
  const i64 rows_b = fn_block_rows(rows);
  // Returns before any barrier when this block has no row: every rank's block b decides the same (rows is
  // compared at block 0's start barrier, and block 0 always has a row), see "Work assignment".
  if (rows_b == 0) return skip_use(g0);
  const Group g = open_use(g0);
  const i64 P = (H + kPer - 1) / kPer;
  const i64 R = (P + DETCOMM_BLOCK_THREADS - 1) / DETCOMM_BLOCK_THREADS;
  const i64 stride = grid_stride();
  const i64 Lq = (P + DETCOMM_W - 1) / DETCOMM_W;  // two-shot: packs of each row folded by one rank
  uint4* own = slot(g, g.rank);
  const uint4* src[DETCOMM_W];
#pragma unroll
  for (int k = 0; k < DETCOMM_W; ++k) src[k] = slot(g, k);

  // From H alone: uniform over the block, so every layout keeps the barriers uniform.
  const FnPlace pl = fn_place<WIDE>();
  const bool regs = WIDE || fn_rows_in_registers<DT>(H);
  FnPre<DT, WDT> pre;
  if (regs) fn_prefetch<DT, WDT>(pl, (i64)pl.slot * gridDim.x + blockIdx.x, H, residual, weight, pre, pl.slot < rows_b);
  if constexpr (TREE) {
    fn_tree_copy_in(tin, rows_b, H, P, R, stride, own);
  } else {
    fn_copy_in<DT>(x, rows_b, H, P, R, stride, own);
  }
  if (!block_barrier(g, BARRIER_START)) return;
  if constexpr (TWO) {
    if constexpr (TREE) {
      fn_tree_fold_range<DT>(rows_b, P, R, stride, Lq, src, own, g.rank);
    } else {
      fn_fold_range<DT>(rows_b, P, R, stride, Lq, src, own, g.rank);
    }
    if (!block_barrier(g, BARRIER_MID)) return;
  }
  for (i64 m0 = 0; m0 < rows_b; m0 += pl.step) {  // the same trip count for both halves
    const i64 m = m0 + pl.slot, row = m * gridDim.x + blockIdx.x;
    FnSlotSrc<DT, TWO, TREE> slots{m, H, P, R, stride, Lq, src, g.rank};
    if (regs) {
      if (m0 > 0) fn_prefetch<DT, WDT>(pl, row, H, residual, weight, pre, m < rows_b);
      fn_norm_row_regs<DT, WDT, WIDE>(pl, row, H, slots, pre, y, r_out, eps, sh, m < rows_b);
    } else {
      fn_norm_row<DT, WDT>(row, H, slots, residual, weight, y, r_out, eps, sh, pl, m < rows_b);
    }
  }
  close_use(g);
}

#define DETCOMM_FUSED_NORM_KERNEL(NAME, KIND, TWO, WIDE, DT, WDT)                                                 \
  extern "C" __global__ void __launch_bounds__(DETCOMM_BLOCK_THREADS) NAME(                                         \
      const Traits<DT>::T* x, const Traits<DT>::T* residual, const Traits<WDT>::T* weight, Traits<DT>::T* y,          \
      Traits<DT>::T* r_out, i64 rows, i64 H, float eps, u32 call, char* const* data, u32* const* sigs, int rank,      \
      u64 timeout_ns, u32* ctrl) {                                                                                    \
    __shared__ FnShared sh;                                                                                         \
    const Group g{data, sigs, rank, timeout_ns, ctrl, (KIND << 8) | DT, call, (u64)(rows * H), false};                \
    fused_rmsnorm<DT, WDT, TWO, WIDE>(x, residual, weight, y, r_out, rows, H, eps, g, sh);                            \
  }

// The tree variants: x is this rank's S fp32 slabs of the rows (slab j at x + j * x_stride elements); the
// descriptor counts the fp32 input elements S * rows * H and names the tree kinds.
#define DETCOMM_FUSED_NORM_TREE_KERNEL(NAME, KIND, TWO, WIDE, DT, WDT)                                            \
  extern "C" __global__ void __launch_bounds__(DETCOMM_BLOCK_THREADS) NAME(                                        \
      const u32* x, i64 x_stride, int S, const Traits<DT>::T* residual, const Traits<WDT>::T* weight,              \
      Traits<DT>::T* y, Traits<DT>::T* r_out, i64 rows, i64 H, float eps, u32 call, char* const* data,             \
      u32* const* sigs, int rank, u64 timeout_ns, u32* ctrl) {                                                     \
    __shared__ FnShared sh;                                                                                        \
    const Group g{data, sigs, rank, timeout_ns, ctrl, (KIND << 8) | DT, call, (u64)S * (u64)(rows * H), false};    \
    fused_rmsnorm<DT, WDT, TWO, WIDE, true>(nullptr, residual, weight, y, r_out, rows, H, eps, g, sh,              \
                                            FnTreeIn{x, x_stride, S});                                             \
  }

// Per algorithm: the row kernel and the wide kernel (names with "_wide": plan.fused_norm_kernel).
#define DETCOMM_FUSED_NORM(SFX, DT, WSFX, WDT)                                                                         \
  DETCOMM_FUSED_NORM_KERNEL(detcomm_fused_rmsnorm_1shot_##SFX##_w##WSFX, DETCOMM_KIND_FUSED_NORM_1SHOT, false, false, \
                            DT, WDT)                                                                                \
  DETCOMM_FUSED_NORM_KERNEL(detcomm_fused_rmsnorm_2shot_##SFX##_w##WSFX, DETCOMM_KIND_FUSED_NORM_2SHOT, true, false,  \
                            DT, WDT)                                                                                \
  DETCOMM_FUSED_NORM_KERNEL(detcomm_fused_rmsnorm_1shot_wide_##SFX##_w##WSFX, DETCOMM_KIND_FUSED_NORM_1SHOT, false,   \
                            true, DT, WDT)                                                                          \
  DETCOMM_FUSED_NORM_KERNEL(detcomm_fused_rmsnorm_2shot_wide_##SFX##_w##WSFX, DETCOMM_KIND_FUSED_NORM_2SHOT, true,    \
                            true, DT, WDT)                                                                          \
  DETCOMM_FUSED_NORM_TREE_KERNEL(detcomm_fused_rmsnorm_tree_1shot_##SFX##_w##WSFX,                                  \
                                 DETCOMM_KIND_FUSED_NORM_TREE_1SHOT, false, false, DT, WDT)                         \
  DETCOMM_FUSED_NORM_TREE_KERNEL(detcomm_fused_rmsnorm_tree_2shot_##SFX##_w##WSFX,                                  \
                                 DETCOMM_KIND_FUSED_NORM_TREE_2SHOT, true, false, DT, WDT)                          \
  DETCOMM_FUSED_NORM_TREE_KERNEL(detcomm_fused_rmsnorm_tree_1shot_wide_##SFX##_w##WSFX,                             \
                                 DETCOMM_KIND_FUSED_NORM_TREE_1SHOT, false, true, DT, WDT)                          \
  DETCOMM_FUSED_NORM_TREE_KERNEL(detcomm_fused_rmsnorm_tree_2shot_wide_##SFX##_w##WSFX,                             \
                                 DETCOMM_KIND_FUSED_NORM_TREE_2SHOT, true, true, DT, WDT)

FN_FUSED_KERNELS(DETCOMM_FUSED_NORM)
