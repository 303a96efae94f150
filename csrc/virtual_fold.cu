// detcomm: the virtual-shard all-reduce (docs/spec.md §9.1): every rank passes S = V/W fp32 slabs of n elements
// (slab j of rank r is global shard r*S + j); every rank gets the fold over shards 0..V-1, rounded once to T.
//
//   acc = +0.0f; for k in 0..W-1: for j in 0..S-1: acc = __fadd_rn(acc, slab_j of rank k); out = narrow(acc)
//
// The partials are fp32 already (no widening); the adds are __fadd_rn in a --fmad=false -ftz=false module, the one
// rounding and the canonical NaN are Traits<T>::narrow, exactly as fold_pack of the one-input kernels.
//
// Work unit: one output pack (kPer elements of T, 16 bytes) = kPer fp32 inputs = 1 (fp32) or 2 (bf16/fp16)
// fp32 packs of the slot. Thread t handles unit t of a range (t, t + stride, ...).
//
// Slot layout (dense, no per-slab padding): slab j of this rank at unit j * slab_units.
//   one-shot: slab_units = ceil(n / kPer); unit t of every slab is copied in by thread t and read (on every rank)
//             by thread t.
//   two-shot: each slab is cut into W slices of L elements (L a multiple of kPer, Lu = L / kPer units); slab j's
//             slice s sits at unit j*W*Lu + s*Lu, so slab_units = W*Lu. Unit t of a slice is copied in by thread t
//             and read by thread t: rank q folds slice q of all V slabs, writes the rounded T pack to the output and
//             over the first fp32 pack of its own slab 0 slice q unit t (read by no other thread or rank: the other
//             ranks fold other slices), and after the MID barrier every rank copies the other ranks' rounded packs
//             verbatim (bits moved, nothing compared: a rounded -0.0 is a value, docs/spec.md §9.4).
// The barrier contract (detcomm_common.cuh "Work assignment" and "Barriers"): inside a launch every slot unit is
// written and read by the same (block, thread) index on every rank, so the per-block START / MID barriers order
// each write before each read; across launches every access goes to the slot copy of the launch's parity, which no
// peer rewrites before this rank's launch completed. Units of two packs and back-to-back slabs give a position to
// another block than the one-input kernels do: harmless, since the parity is the launch's, the same in every block
// (blocks that own no unit skip the launch on every rank alike, same n and L, and count it: skip_use).
//
// The descriptor's count is the fp32 input element count S * n: ranks that disagree on the slabs or the rows
// fail at the START barrier like any mismatched call.
#include "slice_fold.cuh"

template <int DT>
struct VUnit {
  static constexpr int kElems = Traits<DT>::kPer;  // elements of T in one 16-byte output pack
  static constexpr int kPacks = kElems / 4;         // fp32 slot packs per unit
};

// Copy `len` fp32 elements of a caller's slab into units dst[0..) (unit t at dst + t*kPacks), unit t by thread t.
template <int DT>
__device__ __forceinline__ void copy_units(const u32* x, i64 len, uint4* dst, i64 tid, i64 stride) {
  constexpr int E = VUnit<DT>::kElems;
  constexpr int P = VUnit<DT>::kPacks;
  const i64 nu = (len + E - 1) / E;
  for (i64 t = tid; t < nu; t += stride) {
    uint4 v[P];
#pragma unroll
    for (int p = 0; p < P; ++p) v[p] = load_user<DT_F32>(x + t * E + p * 4, len - t * E - p * 4);
#pragma unroll
    for (int p = 0; p < P; ++p) st_ws(dst + t * P + p, v[p]);
  }
}

// The canonical fold of unit `unit` of every slab of every rank (slab j at unit j * slab_units of each slot), in
// global shard order: rank order outside (fold_source: the tests' rotated build permutes it), slab order inside.
template <int DT>
__device__ __forceinline__ uint4 fold_unit(const uint4* const (&src)[DETCOMM_W], i64 unit, i64 slab_units, int S,
                                           int rank) {
  constexpr int E = VUnit<DT>::kElems;
  constexpr int P = VUnit<DT>::kPacks;
  float acc[E];
#pragma unroll
  for (int i = 0; i < E; ++i) acc[i] = 0.0f;  // +0.0 start (docs/spec.md §1)
#pragma unroll
  for (int k = 0; k < DETCOMM_W; ++k) {
    const uint4* base = src[fold_source(k, rank)] + unit * P;
#pragma unroll 1
    for (int j = 0; j < S; ++j) {
      uint4 v[P];
#pragma unroll
      for (int p = 0; p < P; ++p) v[p] = ld_ws(base + (i64)j * slab_units * P + p);
#pragma unroll
      for (int p = 0; p < P; ++p) {
        PackU<DT_F32> u;
        u.v = v[p];
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[p * 4 + i] = __fadd_rn(acc[p * 4 + i], __uint_as_float(u.e[i]));
      }
    }
  }
  PackU<DT> o;
#pragma unroll
  for (int i = 0; i < E; ++i) o.e[i] = Traits<DT>::narrow(acc[i]);  // the one rounding, canonical NaN
  return o.v;
}

template <int DT>
__device__ __forceinline__ void virtual_one_shot(const u32* __restrict__ x, i64 x_stride, int S,
                                                 typename Traits<DT>::T* __restrict__ out, i64 n, const Group& g0) {
  constexpr int P = VUnit<DT>::kPacks;
  unit_one_shot<DT, VUnit<DT>::kElems>(
      out, n, g0,
      [&](uint4* own, i64 nu, i64 tid, i64 stride) {  // slab j at unit j*nu
#pragma unroll 1
        for (int j = 0; j < S; ++j) copy_units<DT>(x + (i64)j * x_stride, n, own + (i64)j * nu * P, tid, stride);
      },
      [&](const uint4* const (&src)[DETCOMM_W], i64 t, i64 nu, int rank) { return fold_unit<DT>(src, t, nu, S, rank); });
}

template <int DT>
__device__ __forceinline__ void virtual_two_shot(const u32* __restrict__ x, i64 x_stride, int S,
                                                 typename Traits<DT>::T* __restrict__ out, i64 n, i64 L,
                                                 const Group& g0) {
  constexpr int E = VUnit<DT>::kElems;
  constexpr int P = VUnit<DT>::kPacks;
  unit_two_shot<DT, E, P>(
      out, n, L, g0,
      [&](uint4* own, i64 Lu, i64 tid, i64 stride) {  // slab j slice s at unit j*W*Lu + s*Lu
        const i64 slab_units = (i64)DETCOMM_W * Lu;
#pragma unroll 1
        for (int j = 0; j < S; ++j) {
#pragma unroll 1
          for (int s = 0; s < DETCOMM_W; ++s)
            copy_units<DT>(x + (i64)j * x_stride + (i64)s * L, slice_len(s, n, L),
                           own + ((i64)j * slab_units + s * Lu) * P, tid, stride);
        }
      },
      [&](const uint4* const (&src)[DETCOMM_W], i64 u, i64 Lu, int r) {
        return fold_unit<DT>(src, u, (i64)DETCOMM_W * Lu, S, r);
      });
}

// x: this rank's S fp32 slabs, slab j at x + j*x_stride (elements); out: n elements of T.
#define DETCOMM_VIRTUAL_ONE_SHOT(NAME, DT)                                                                   \
  extern "C" __global__ void __launch_bounds__(DETCOMM_BLOCK_THREADS)                                        \
      NAME(const u32* x, i64 x_stride, int S, Traits<DT>::T* out, i64 n, u32 call, char* const* data,        \
           u32* const* sigs, int rank, u64 timeout_ns, u32* ctrl) {                                          \
    const Group g{data, sigs, rank, timeout_ns, ctrl, (DETCOMM_KIND_VIRTUAL_1SHOT << 8) | DT, call,          \
                  (u64)S * (u64)n, true};                                                                    \
    virtual_one_shot<DT>(x, x_stride, S, out, n, g);                                                         \
  }

// L: slice length in elements (a multiple of the output pack), from detcomm/workspace/plan.py.
#define DETCOMM_VIRTUAL_TWO_SHOT(NAME, DT)                                                                   \
  extern "C" __global__ void __launch_bounds__(DETCOMM_BLOCK_THREADS)                                        \
      NAME(const u32* x, i64 x_stride, int S, Traits<DT>::T* out, i64 n, i64 L, u32 call, char* const* data, \
           u32* const* sigs, int rank, u64 timeout_ns, u32* ctrl) {                                          \
    const Group g{data, sigs, rank, timeout_ns, ctrl, (DETCOMM_KIND_VIRTUAL_2SHOT << 8) | DT, call,          \
                  (u64)S * (u64)n, true};                                                                    \
    virtual_two_shot<DT>(x, x_stride, S, out, n, L, g);                                                      \
  }

#if DETCOMM_WANT(DT_F32)
DETCOMM_VIRTUAL_ONE_SHOT(detcomm_virtual_one_shot_f32, DT_F32)
DETCOMM_VIRTUAL_TWO_SHOT(detcomm_virtual_two_shot_f32, DT_F32)
#endif
#if DETCOMM_WANT(DT_BF16)
DETCOMM_VIRTUAL_ONE_SHOT(detcomm_virtual_one_shot_bf16, DT_BF16)
DETCOMM_VIRTUAL_TWO_SHOT(detcomm_virtual_two_shot_bf16, DT_BF16)
#endif
#if DETCOMM_WANT(DT_F16)
DETCOMM_VIRTUAL_ONE_SHOT(detcomm_virtual_one_shot_f16, DT_F16)
DETCOMM_VIRTUAL_TWO_SHOT(detcomm_virtual_two_shot_f16, DT_F16)
#endif
