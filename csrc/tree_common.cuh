// detcomm: the tree order's arithmetic (docs/spec.md §9.1, shard_fold="tree"), shared by the tree all-reduce
// (csrc/tree_fold.cu) and the fused all-reduce + RMSNorm's tree variants (csrc/fused_rmsnorm.cu): a rank's local
// subtree over its S fp32 slabs (tree_local) and the top levels over the W subtree roots with the root's +0.0 and the
// one rounding (tree_top_pack). Both work on one fp32 pack (4 elements) at a time: the tree is element-wise.
#pragma once
#include "detcomm_common.cuh"

// The local subtree, one fp32 pack at a time: up to 8 leaves as one register tree (TREE_LEAF_LOG), above that a
// binary counter over 8-leaf blocks with one pending subtree per level (TREE_STACK levels, so S <=
// 2^DETCOMM_TREE_MAX_LOG).
#define TREE_LEAF_LOG 3
#define TREE_STACK (DETCOMM_TREE_MAX_LOG - TREE_LEAF_LOG)
static_assert(TREE_STACK >= 1, "DETCOMM_TREE_MAX_LOG must exceed the register tree's levels");

template <int DT>
struct TreeUnit {
  static constexpr int kElems = Traits<DT>::kPer;  // elements of T in one 16-byte output pack
  static constexpr int kPacks = kElems / 4;         // fp32 slot packs per unit
};

// The pairwise levels over N fp32 packs in place, the tree's one shape for its leaves and its top: level by level,
// after step h, v[k] (k a multiple of 2h) holds T(k, 2h) of the N (the left operand always the earlier subtree).
template <int N>
__device__ __forceinline__ void tree_levels(float (&v)[N][4]) {
#pragma unroll
  for (int h = 1; h < N; h *= 2) {
#pragma unroll
    for (int k = 0; k + h < N; k += 2 * h) {
#pragma unroll
      for (int i = 0; i < 4; ++i) v[k][i] = __fadd_rn(v[k][i], v[k + h][i]);
    }
  }
}

// T over the 2^LOG slabs j0 .. j0 + 2^LOG - 1 of one fp32 pack (elements off .. off + 3 of every slab, `valid` of
// them present; missing ones read as +0.0 and are never stored). Every load is issued before the first add. The
// tree is element-wise, so a unit's P packs are folded one after the other (4 live values per leaf, not E: fewer
// registers, and the compiler still overlaps the packs' loads where registers allow).
template <int LOG>
__device__ __forceinline__ void tree_leaves(const u32* x, i64 x_stride, int j0, i64 off, i64 valid, float (&out)[4]) {
  constexpr int N = 1 << LOG;
  uint4 raw[N];
#pragma unroll
  for (int k = 0; k < N; ++k) raw[k] = load_user<DT_F32>(x + (i64)(j0 + k) * x_stride + off, valid);
  float v[N][4];
#pragma unroll
  for (int k = 0; k < N; ++k) {
    PackU<DT_F32> u;
    u.v = raw[k];
#pragma unroll
    for (int i = 0; i < 4; ++i) v[k][i] = __uint_as_float(u.e[i]);
  }
  tree_levels(v);  // v[0] = T(j0, N)
#pragma unroll
  for (int i = 0; i < 4; ++i) out[i] = v[0][i];
}

// T(0, S) for S = 2^TREE_LEAF_LOG * 2^m (S > 2^TREE_LEAF_LOG): blocks b = 0 .. 2^m - 1 of 2^TREE_LEAF_LOG leaves.
// pend[l] holds the pending T over 2^l blocks; block b merges with pend[l] for every trailing one bit l of b (the
// left operand is always the earlier subtree), so after the last block (b = 2^m - 1, m one bits) the running value
// is T(0, S). Out of line: inlined, the one-store kernel of 16-bit dtypes at W = 8 spilled 32 bytes per thread
// instead of 16 (ptxas -v; every other tree kernel at W = 2, 4, 8 spills nothing either way).
__device__ __noinline__ void tree_local_blocks(const u32* x, i64 x_stride, int S, i64 off, i64 valid, float (&s)[4]) {
  float pend[TREE_STACK][4];
  const int blocks = S >> TREE_LEAF_LOG;
#pragma unroll 1
  for (int b = 0; b < blocks; ++b) {
    float t[4];
    tree_leaves<TREE_LEAF_LOG>(x, x_stride, b << TREE_LEAF_LOG, off, valid, t);
    bool placed = false;
#pragma unroll
    for (int l = 0; l < TREE_STACK; ++l) {
      if (!placed) {
        if ((b >> l) & 1) {
#pragma unroll
          for (int i = 0; i < 4; ++i) t[i] = __fadd_rn(pend[l][i], t[i]);
        } else {
#pragma unroll
          for (int i = 0; i < 4; ++i) pend[l][i] = t[i];
          placed = true;
        }
      }
    }
    if (b == blocks - 1) {
#pragma unroll
      for (int i = 0; i < 4; ++i) s[i] = t[i];
    }
  }
}

// s = T(0, S) over this rank's S slabs of one fp32 pack, S a power of two up to 2^DETCOMM_TREE_MAX_LOG.
__device__ __forceinline__ uint4 tree_local(const u32* x, i64 x_stride, int S, i64 off, i64 valid) {
  float s[4];
  switch (S) {
    case 1: tree_leaves<0>(x, x_stride, 0, off, valid, s); break;
    case 2: tree_leaves<1>(x, x_stride, 0, off, valid, s); break;
    case 4: tree_leaves<2>(x, x_stride, 0, off, valid, s); break;
    case 8: tree_leaves<3>(x, x_stride, 0, off, valid, s); break;
    default: tree_local_blocks(x, x_stride, S, off, valid, s);
  }
  PackU<DT_F32> u;
#pragma unroll
  for (int i = 0; i < 4; ++i) u.e[i] = __float_as_uint(s[i]);
  return u.v;
}

// The top levels for one fp32 pack: T over the W subtree roots (col[k] = rank k's pack; the rotated negative-control
// build permutes the leaves, fold_source), then the root's +0.0: the fp32 value before the one rounding.
__device__ __forceinline__ void tree_top_root(const uint4 (&col)[DETCOMM_W], int rank, float (&v0)[4]) {
  float v[DETCOMM_W][4];
#pragma unroll
  for (int k = 0; k < DETCOMM_W; ++k) {
    PackU<DT_F32> u;
    u.v = col[fold_source(k, rank)];
#pragma unroll
    for (int i = 0; i < 4; ++i) v[k][i] = __uint_as_float(u.e[i]);
  }
  tree_levels(v);
#pragma unroll
  for (int i = 0; i < 4; ++i) v0[i] = __fadd_rn(v[0][i], 0.0f);  // the root's +0.0
}

// tree_top_root rounded once to T (canonical NaN) into elements 4p .. 4p + 3 of the output pack o.
template <int DT>
__device__ __forceinline__ void tree_top_pack(const uint4 (&col)[DETCOMM_W], int rank, int p, PackU<DT>& o) {
  float v[4];
  tree_top_root(col, rank, v);
#pragma unroll
  for (int i = 0; i < 4; ++i) o.e[p * 4 + i] = Traits<DT>::narrow(v[i]);  // the one rounding
}

// tree_top_root rounded once to T and widened back (exact): the s a fused kernel adds to the residual (step 1).
template <int DT>
__device__ __forceinline__ void tree_top_values(const uint4 (&col)[DETCOMM_W], int rank, float (&s)[4]) {
  float v[4];
  tree_top_root(col, rank, v);
#pragma unroll
  for (int i = 0; i < 4; ++i) s[i] = Traits<DT>::widen(Traits<DT>::narrow(v[i]));
}
