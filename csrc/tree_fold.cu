// detcomm: the tree-order virtual-shard all-reduce (docs/spec.md §9.1, shard_fold="tree"). Every rank passes
// S = V/W fp32 slabs of n elements (slab j of rank r is global shard r*S + j; S and W powers of two); every rank
// gets, element by element,
//
//   T(i, 1) = p_i;  T(i, m) = __fadd_rn(T(i, m/2), T(i + m/2, m/2));  out = narrow(__fadd_rn(T(0, V), +0.0f))
//
// Rank r folds its own subtree s_r = T(r*S, S) while it reads its slabs (tree_local: no +0.0 there), so only s_r,
// one fp32 value per element, goes through the workspace: the slot (or the one-store area) holds one fp32 row per
// rank whatever S is. After the exchange the top log2(W) levels are T over s_0..s_{W-1} (tree_top, the same
// pairwise shape), then +0.0 (a sum of zeros is +0.0, docs/spec.md §9.4), then one rounding and the canonical NaN
// (Traits<T>::narrow). Every add is __fadd_rn in a --fmad=false -ftz=false module. The host launches these kernels
// only where W is a power of two dividing V (detcomm/workspace/plan.py tree_refusal); at other W they compile (one
// source for every module) and are never run.
//
// Work unit: one output pack (E elements of T, 16 bytes) = E fp32 values = P = E / 4 fp32 packs of the slot, as in
// csrc/virtual_fold.cu. Thread t handles unit t of a range (t, t + stride, ...), and the slot layouts are that
// file's with one slab: the one-shot slot holds unit t at pack t*P; the two-shot slot holds slice s (L elements,
// Lu = L / E units) at unit s*Lu. The barrier contract is therefore virtual_fold.cu's (its header says why dense
// units keep it). The one-store kernel pushes the P packs of unit t into area [buf][rank] of every rank's region
// at pack t*P (csrc/one_store_common.cuh: +0.0 rewritten as -0.0 before the push). That rewrite cannot change a bit
// here either: two nodes that differ only in a zero's sign give sums that differ only in a zero's sign (x + ±0 = x
// for x != 0, NaN and Inf alike), so the roots differ at most in a zero's sign, which the +0.0 erases.
//
// The call descriptor's count is S * n, and the kinds are the tree's own (DETCOMM_KIND_TREE_*): ranks that
// disagree on the slabs, the rows or the fold order fail the call on every rank.
#include "one_store_common.cuh"
#include "slice_fold.cuh"
#include "tree_common.cuh"

// Packs of a unit whose W loads are in flight together: the whole unit while that is at most 8 loads (the
// workspace's budget, DETCOMM_UNROLL x W), else one pack at a time (16-bit dtypes at W = 8 spilled otherwise).
template <int DT>
struct TreeTop {
  static constexpr int kGroup = DETCOMM_W * TreeUnit<DT>::kPacks <= 8 ? TreeUnit<DT>::kPacks : 1;
};

// This rank's subtree roots of units [0, nu) of `len` elements (slab offset `off0`) into dst (unit t at t*P).
template <int DT>
__device__ __forceinline__ void publish_units(const u32* x, i64 x_stride, int S, i64 off0, i64 len, uint4* dst,
                                              i64 tid, i64 stride) {
  constexpr int E = TreeUnit<DT>::kElems;
  constexpr int P = TreeUnit<DT>::kPacks;
  const i64 nu = (len + E - 1) / E;
  for (i64 t = tid; t < nu; t += stride) {
    uint4 v[P];
#pragma unroll
    for (int p = 0; p < P; ++p) v[p] = tree_local(x, x_stride, S, off0 + t * E + p * 4, len - t * E - p * 4);
#pragma unroll
    for (int p = 0; p < P; ++p) st_ws(dst + t * P + p, v[p]);
  }
}

// The G packs p0 .. p0 + G - 1 of one unit (at pack `at`) of every rank's roots, all in flight together: `ld` is
// how a kernel reads them (the barrier kernels' ld_ws, the one-store kernel's ld_poll).
template <int G, typename Ld>
__device__ __forceinline__ void load_group(uint4 (&in)[G][DETCOMM_W], const uint4* const (&src)[DETCOMM_W], i64 at,
                                           int p0, const Ld& ld) {
#pragma unroll
  for (int q = 0; q < G; ++q) {
#pragma unroll
    for (int k = 0; k < DETCOMM_W; ++k) in[q][k] = ld(src[k] + at + p0 + q);
  }
}

template <int DT>
__device__ __forceinline__ uint4 top_of_unit(const uint4* const (&src)[DETCOMM_W], i64 unit, int rank) {
  constexpr int P = TreeUnit<DT>::kPacks;
  constexpr int G = TreeTop<DT>::kGroup;
  PackU<DT> o;
#pragma unroll
  for (int p0 = 0; p0 < P; p0 += G) {
    uint4 in[G][DETCOMM_W];
    load_group<G>(in, src, unit * P, p0, [](const uint4* a) { return ld_ws(a); });
#pragma unroll
    for (int q = 0; q < G; ++q) tree_top_pack<DT>(in[q], rank, p0 + q, o);
  }
  return o.v;
}

template <int DT>
__device__ __forceinline__ void tree_one_shot(const u32* __restrict__ x, i64 x_stride, int S,
                                              typename Traits<DT>::T* __restrict__ out, i64 n, const Group& g0) {
  unit_one_shot<DT, TreeUnit<DT>::kElems>(
      out, n, g0, [&](uint4* own, i64, i64 tid, i64 stride) { publish_units<DT>(x, x_stride, S, 0, n, own, tid, stride); },
      [&](const uint4* const (&src)[DETCOMM_W], i64 t, i64, int rank) { return top_of_unit<DT>(src, t, rank); });
}

template <int DT>
__device__ __forceinline__ void tree_two_shot(const u32* __restrict__ x, i64 x_stride, int S,
                                              typename Traits<DT>::T* __restrict__ out, i64 n, i64 L,
                                              const Group& g0) {
  constexpr int E = TreeUnit<DT>::kElems;
  constexpr int P = TreeUnit<DT>::kPacks;
  unit_two_shot<DT, E, P>(
      out, n, L, g0,
      [&](uint4* own, i64 Lu, i64 tid, i64 stride) {  // this rank's subtree roots of every slice (slice s at unit s*Lu)
#pragma unroll 1
        for (int s = 0; s < DETCOMM_W; ++s)
          publish_units<DT>(x, x_stride, S, (i64)s * L, slice_len(s, n, L), own + (i64)s * Lu * P, tid, stride);
      },
      [&](const uint4* const (&src)[DETCOMM_W], i64 u, i64, int r) { return top_of_unit<DT>(src, u, r); });
}

// The one-store variant (csrc/one_store_common.cuh): push this rank's subtree roots, marked, into every rank's
// area; poll this rank's own areas until all W roots of a unit are there; the top levels; empty what was read.
template <int DT>
__device__ __forceinline__ void tree_one_store(const u32* __restrict__ x, i64 x_stride, int S,
                                             typename Traits<DT>::T* __restrict__ out, i64 n, i64 off, i64 cap,
                                             const Group& g) {
  constexpr int E = TreeUnit<DT>::kElems;
  constexpr int P = TreeUnit<DT>::kPacks;
  constexpr int G = TreeTop<DT>::kGroup;
  const OneStoreArea l = one_store_open(g, off, cap);
  OneStoreWait w{0u, 0ull, 0u};
  const i64 tid = thread_id();
  const i64 stride = grid_stride();
  const i64 nu = (n + E - 1) / E;
  const bool owns = block_owns_packs(nu);
  if (owns) {
    one_store_announce(g, l);
    for (i64 t = tid; t < nu; t += stride) {
      uint4 v[P];
#pragma unroll
      for (int p = 0; p < P; ++p) v[p] = one_store_mark<DT_F32>(tree_local(x, x_stride, S, t * E + p * 4, n - t * E - p * 4));
#pragma unroll
      for (int k = 0; k < DETCOMM_W; ++k) {
        const int dst = (g.rank + 1 + k) % DETCOMM_W;  // peers first, this rank's own area last
        uint4* area = one_store_area(l, dst, g.rank);
#pragma unroll
        for (int p = 0; p < P; ++p) st_ws(area + t * P + p, v[p]);
      }
    }
    one_store_claim(g, w);
    one_store_check_call(g, l, w);
    const uint4* src[DETCOMM_W];
#pragma unroll
    for (int k = 0; k < DETCOMM_W; ++k) src[k] = one_store_area(l, g.rank, k);
    for (i64 t = tid; t < nu && !w.failed; t += stride) {
      PackU<DT> o;
      bool ok = true;
#pragma unroll
      for (int p0 = 0; p0 < P; p0 += G) {
        uint4 in[G][DETCOMM_W];
        load_group<G>(in, src, t * P, p0, [](const uint4* a) { return ld_poll(a); });
#pragma unroll
        for (int q = 0; q < G; ++q) {
#pragma unroll
          for (int k = 0; k < DETCOMM_W; ++k) ok = one_store_wait(g, l, src[k] + t * P + p0 + q, in[q][k], k, w) && ok;
        }
        if (ok) {
#pragma unroll
          for (int q = 0; q < G; ++q) tree_top_pack<DT>(in[q], g.rank, p0 + q, o);
        }
      }
      if (!ok) break;
      store_user<DT>(out + t * E, n - t * E, o.v);
#pragma unroll
      for (int k = 0; k < DETCOMM_W; ++k) {
#pragma unroll
        for (int p = 0; p < P; ++p) st_ws(const_cast<uint4*>(src[k]) + t * P + p, make_uint4(0u, 0u, 0u, 0u));
      }
    }
  }
  one_store_close(g, l, w, owns);
}

// x: this rank's S fp32 slabs, slab j at x + j*x_stride (elements); out: n elements of T.
#define DETCOMM_TREE_ONE_SHOT(NAME, DT)                                                                            \
  extern "C" __global__ void __launch_bounds__(DETCOMM_BLOCK_THREADS)                                              \
      NAME(const u32* x, i64 x_stride, int S, Traits<DT>::T* out, i64 n, u32 call, char* const* data,              \
           u32* const* sigs, int rank, u64 timeout_ns, u32* ctrl) {                                                \
    const Group g{data, sigs, rank, timeout_ns, ctrl, (DETCOMM_KIND_TREE_1SHOT << 8) | DT, call, (u64)S * (u64)n,  \
                  true};                                                                                           \
    tree_one_shot<DT>(x, x_stride, S, out, n, g);                                                                  \
  }

// L: slice length in elements (a multiple of the output pack), from detcomm/workspace/plan.py.
#define DETCOMM_TREE_TWO_SHOT(NAME, DT)                                                                            \
  extern "C" __global__ void __launch_bounds__(DETCOMM_BLOCK_THREADS)                                              \
      NAME(const u32* x, i64 x_stride, int S, Traits<DT>::T* out, i64 n, i64 L, u32 call, char* const* data,       \
           u32* const* sigs, int rank, u64 timeout_ns, u32* ctrl) {                                                \
    const Group g{data, sigs, rank, timeout_ns, ctrl, (DETCOMM_KIND_TREE_2SHOT << 8) | DT, call, (u64)S * (u64)n,  \
                  true};                                                                                           \
    tree_two_shot<DT>(x, x_stride, S, out, n, L, g);                                                               \
  }

// off, cap: the one-store tier's region offset and area bytes (plan.one_store_tiers); grid = the tier's blocks.
#define DETCOMM_TREE_ONE_STORE(NAME, DT)                                                                             \
  extern "C" __global__ void __launch_bounds__(DETCOMM_BLOCK_THREADS)                                              \
      NAME(const u32* x, i64 x_stride, int S, Traits<DT>::T* out, i64 n, i64 off, i64 cap, u32 call,               \
           char* const* data, u32* const* sigs, int rank, u64 timeout_ns, u32* ctrl) {                             \
    const Group g{data, sigs, rank, timeout_ns, ctrl, (DETCOMM_KIND_TREE_ONE_STORE << 8) | DT, call,                 \
                  (u64)S * (u64)n, true};                                                                          \
    tree_one_store<DT>(x, x_stride, S, out, n, off, cap, g);                                                         \
  }

#if DETCOMM_WANT(DT_F32)
DETCOMM_TREE_ONE_SHOT(detcomm_tree_one_shot_f32, DT_F32)
DETCOMM_TREE_TWO_SHOT(detcomm_tree_two_shot_f32, DT_F32)
DETCOMM_TREE_ONE_STORE(detcomm_tree_one_store_f32, DT_F32)
#endif
#if DETCOMM_WANT(DT_BF16)
DETCOMM_TREE_ONE_SHOT(detcomm_tree_one_shot_bf16, DT_BF16)
DETCOMM_TREE_TWO_SHOT(detcomm_tree_two_shot_bf16, DT_BF16)
DETCOMM_TREE_ONE_STORE(detcomm_tree_one_store_bf16, DT_BF16)
#endif
#if DETCOMM_WANT(DT_F16)
DETCOMM_TREE_ONE_SHOT(detcomm_tree_one_shot_f16, DT_F16)
DETCOMM_TREE_TWO_SHOT(detcomm_tree_two_shot_f16, DT_F16)
DETCOMM_TREE_ONE_STORE(detcomm_tree_one_store_f16, DT_F16)
#endif
