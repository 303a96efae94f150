// detcomm: the canonical residual add + RMSNorm of docs/spec.md §9, one 256-thread block per row.
//
// Compiled at run time by NVRTC (detcomm/numerics/norm_cuda.py, through detcomm.workspace.kernels' flatten/compile/cache
// helpers and the same options: --fmad=false -ftz=false -prec-div=true -prec-sqrt=true, never fast math). It needs
// only the dtype traits of detcomm_common.cuh (widen/narrow with the canonical NaN); DETCOMM_W is irrelevant here.
//
// The arithmetic, exactly (docs/spec.md §9; detcomm/numerics/norm.py computes the same with torch ops):
//   a_i = fp32(r_i); q_i = a_i * a_i (fp32, rounded)
//   lane t (0..255) owns the 8-element chunks c = t, t+256, t+512, ... of the row; its partial p_t starts at
//     +0.0 and adds q_i for i = 8c .. 8c+7 (i < H), chunk after chunk, element after element;
//   S = halving tree over the 32 lanes of each warp (h = 16, 8, 4, 2, 1: v_l += v_{l+h}), then halving tree over
//     the 8 warp results (h = 4, 2, 1);
//   inv_rms = 1 / sqrt(S / H + eps), each operation correctly rounded;
//   y_i = round_dtype((a_i * inv_rms) * fp32(w_i)), every product rounded to fp32 on its own.
// Thread t of the block IS lane t and warp w holds lanes 32w..32w+31, so the definition's tree is the natural
// shuffle tree. Every add and multiply is an explicit _rn intrinsic, so no FMA contraction can happen even
// without --fmad=false. A missing element (past H) is loaded as +0.0: q = +0.0 and p + (+0.0) == p for every
// p >= +0.0 or NaN, which are the only values a sum of squares takes, so the tail needs no branch.
#include "rms_norm_common.cuh"

// ADD: r = round(residual + s) is written to r_out and normalized; otherwise r is read from `r` (s, residual unused).
template <int DT, int WDT, bool ADD>
__device__ __forceinline__ void add_rms_norm(const typename Traits<DT>::T* __restrict__ s,
                                             const typename Traits<DT>::T* __restrict__ residual,
                                             const typename Traits<DT>::T* r,
                                             const typename Traits<WDT>::T* __restrict__ weight,
                                             typename Traits<DT>::T* __restrict__ y, typename Traits<DT>::T* r_out,
                                             i64 rows, i64 H, float eps) {
  __shared__ float warp_sum[NORM_WARPS];
  __shared__ float inv_shared;
  const int t = threadIdx.x;
  for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
    const i64 base = row * H;
    float p = 0.0f;  // +0.0 start
    for (i64 c = t; c * NORM_CHUNK < H; c += NORM_THREADS) {
      const i64 off = c * NORM_CHUNK, valid = H - off;
      float a[NORM_CHUNK];
      if constexpr (ADD) {
        float res[NORM_CHUNK], sv[NORM_CHUNK];
        load_chunk<DT>(residual + base + off, valid, res);
        load_chunk<DT>(s + base + off, valid, sv);
        residual_add<DT>(res, sv, a);
        store_chunk<DT>(r_out + base + off, valid, a);  // a holds rounded values: narrow() is exact here
      } else {
        load_chunk<DT>(r + base + off, valid, a);
      }
#pragma unroll
      for (int e = 0; e < NORM_CHUNK; ++e) p = __fadd_rn(p, __fmul_rn(a[e], a[e]));
    }
    const float inv = norm_inv_rms(p, warp_sum, &inv_shared, H, eps);  // steps 5-6
    for (i64 c = t; c * NORM_CHUNK < H; c += NORM_THREADS) {
      const i64 off = c * NORM_CHUNK, valid = H - off;
      float a[NORM_CHUNK], w[NORM_CHUNK];
      // ADD: this thread wrote these r elements itself above, so reading them back is ordered.
      load_chunk<DT>((ADD ? r_out : r) + base + off, valid, a);
      load_chunk<WDT>(weight + off, valid, w);
#pragma unroll
      for (int e = 0; e < NORM_CHUNK; ++e) a[e] = __fmul_rn(__fmul_rn(a[e], inv), w[e]);
      store_chunk<DT>(y + base + off, valid, a);
    }
  }
}

#define DETCOMM_RMS_NORM(SFX, DT, WSFX, WDT)                                                                   \
  extern "C" __global__ void __launch_bounds__(NORM_THREADS) detcomm_rms_norm_##SFX##_w##WSFX(                 \
      const Traits<DT>::T* r, const Traits<WDT>::T* weight, Traits<DT>::T* y, i64 rows, i64 H, float eps) {    \
    add_rms_norm<DT, WDT, false>(nullptr, nullptr, r, weight, y, nullptr, rows, H, eps);                       \
  }                                                                                                            \
  extern "C" __global__ void __launch_bounds__(NORM_THREADS) detcomm_add_rms_norm_##SFX##_w##WSFX(             \
      const Traits<DT>::T* s, const Traits<DT>::T* residual, const Traits<WDT>::T* weight, Traits<DT>::T* y,   \
      Traits<DT>::T* r_out, i64 rows, i64 H, float eps) {                                                      \
    add_rms_norm<DT, WDT, true>(s, residual, nullptr, weight, y, r_out, rows, H, eps);                         \
  }

#define DETCOMM_RMS_NORM_ALL_W(SFX, DT)         \
  DETCOMM_RMS_NORM(SFX, DT, f32, DT_F32)        \
  DETCOMM_RMS_NORM(SFX, DT, bf16, DT_BF16)      \
  DETCOMM_RMS_NORM(SFX, DT, f16, DT_F16)

DETCOMM_RMS_NORM_ALL_W(f32, DT_F32)
DETCOMM_RMS_NORM_ALL_W(bf16, DT_BF16)
DETCOMM_RMS_NORM_ALL_W(f16, DT_F16)
