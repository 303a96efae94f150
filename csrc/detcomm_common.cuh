// detcomm: shared device code for the workspace kernels (docs/spec.md section 1, the canonical fold).
//
// Compiled two ways, with the same source: at run time by NVRTC (detcomm/workspace/kernels.py inlines
// this header into each .cu before compiling, so the on-disk cache key covers it) and by `nvcc -c` in the
// CPU compile check. No CUDA headers are included (only <cstdio> under nvcc): NVRTC needs no include path, and
// every conversion is spelled as one PTX instruction whose rounding is named (cvt.rn), so nothing depends
// on a header's choice of intrinsic.
//
// Numerics (docs/spec.md §1):
//   acc = +0.0f; for k in 0..W-1: acc = __fadd_rn(acc, widen(x_k)); out = round_rn(acc)
//   - __fadd_rn is never contracted into an FMA (and the module is built with --fmad=false anyway);
//   - no flush-to-zero: add.rn.f32 without .ftz, and the module is built with -ftz=false;
//   - the +0.0 start turns a sum of -0.0s into +0.0 (IEEE: +0 + -0 = +0 under round-to-nearest);
//   - NaN policy (project-wide): any NaN result is written as the canonical positive quiet NaN with an
//     empty payload (fp32 0x7FC00000, bf16 0x7FC0, fp16 0x7E00); Inf stays Inf.
//
// Memory layout of one rank's symmetric buffer (detcomm/workspace/plan.py computes the same offsets; a CPU test
// evaluates this header's index formulas against plan's):
//   [0, DETCOMM_BUFFER_HEADER_BYTES) barrier flags and start-barrier call descriptors (two copies each, see
//                                    "Barriers"), epoch counters, the abort word, the record claim and the
//                                    per-block busy words (u32 words)
//   [.., + DETCOMM_PROBE_BYTES)      scratch the startup peer-access proof writes through IPC handles
//   [.., + 2 x slot bytes)           the data slot, twice (copy 0, copy 1): this rank's rows (and the two-shot
//                                    partial results); a block's use of parity p touches copy p only
// Every rank writes only its own data slot; peers only read it. The only remote writes are barrier flags, the
// call descriptors that travel with the start barrier, and the abort word.
// The host's pointer table: data[p * W + k] = copy p of rank k's slot (Group::data), then sigs[k] = rank k's header.
#pragma once

#if !defined(__CUDACC_RTC__)
#include <cstdio>  // printf under nvcc; NVRTC declares it as a builtin
#endif

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef unsigned long long u64;
typedef long long i64;

#ifndef DETCOMM_W
#error "DETCOMM_W (the group's world size, 1..8) must be given as -DDETCOMM_W=<n>"
#endif
// The constants this code shares with the host are defined once, in detcomm/workspace/plan.py (DEVICE_CONSTANTS),
// and given to every build as -D options (detcomm/workspace/kernels.py nvrtc_options; the nvcc checks pass the same
// options): none is defined here, so the host and the kernels cannot disagree. What they are:
//   DETCOMM_MAX_W, DETCOMM_MAX_BLOCKS, DETCOMM_BLOCK_THREADS, DETCOMM_PACK_BYTES: group, grid and pack limits;
//   DETCOMM_BARRIER_KINDS, DETCOMM_PARITIES, DETCOMM_BUFFER_HEADER_BYTES, DETCOMM_PROBE_BYTES, DETCOMM_DESC_WORDS:
//     the header layout below;
//   DETCOMM_ERR_WORDS, DETCOMM_CTRL_WORDS, DETCOMM_HOST_ABORT_WORD: the host-mapped control block of one rank (one
//     failure record, then the host's abort word);
//   DETCOMM_ERR_*: record tags (word 0 of the record; written last, so a tagged record is complete);
//   DETCOMM_ABORT_BY_KERNEL, DETCOMM_ABORT_BY_HOST: values of the abort word in a header (who raised it and how);
//   DETCOMM_KIND_*: what a call descriptor names (kernel kind << 8 | dtype code);
//   BARRIER_START, BARRIER_MID: barrier kinds (the `kind` of a failure record; there is no end barrier: see
//     "Barriers"); DETCOMM_WAIT_ONE_STORE, DETCOMM_ONE_STORE_COUNTER_BYTES: csrc/one_store_common.cuh;
//   DT_F32, DT_BF16, DT_F16, DT_U8: dtype codes; NORM_THREADS, NORM_CHUNK: csrc/rms_norm_common.cuh;
//   DETCOMM_FUSED_BATCH: csrc/fused_norm_row.cuh; DETCOMM_TREE_MAX_LOG: csrc/tree_fold.cu.
#if !defined(DETCOMM_MAX_W) || !defined(DETCOMM_MAX_BLOCKS) || !defined(DETCOMM_BLOCK_THREADS) ||              \
    !defined(DETCOMM_PACK_BYTES) || !defined(DETCOMM_BARRIER_KINDS) || !defined(DETCOMM_PARITIES) ||            \
    !defined(DETCOMM_BUFFER_HEADER_BYTES) || !defined(DETCOMM_PROBE_BYTES) || !defined(DETCOMM_DESC_WORDS) ||    \
    !defined(DETCOMM_ERR_WORDS) || !defined(DETCOMM_CTRL_WORDS) || !defined(DETCOMM_HOST_ABORT_WORD) ||          \
    !defined(DETCOMM_ERR_TIMEOUT) || !defined(DETCOMM_ERR_ABORTED) || !defined(DETCOMM_ERR_PEER_FAILED) ||       \
    !defined(DETCOMM_ERR_MISMATCH) || !defined(DETCOMM_ERR_OVERLAP) || !defined(DETCOMM_ABORT_BY_KERNEL) ||      \
    !defined(DETCOMM_ABORT_BY_HOST) || !defined(DETCOMM_KIND_ONE_SHOT) || !defined(DETCOMM_KIND_TWO_SHOT) ||     \
    !defined(DETCOMM_KIND_REDUCE_SCATTER) || !defined(DETCOMM_KIND_ALL_GATHER) ||                                \
    !defined(DETCOMM_KIND_FUSED_NORM_1SHOT) || !defined(DETCOMM_KIND_FUSED_NORM_2SHOT) ||                        \
    !defined(DETCOMM_KIND_VIRTUAL_1SHOT) || !defined(DETCOMM_KIND_VIRTUAL_2SHOT) ||                              \
    !defined(DETCOMM_KIND_ONE_STORE) || !defined(DETCOMM_KIND_FUSED_NORM_ONE_STORE) || !defined(BARRIER_START) ||    \
    !defined(BARRIER_MID) || !defined(DETCOMM_WAIT_ONE_STORE) || !defined(DETCOMM_ONE_STORE_COUNTER_BYTES) ||            \
    !defined(DT_F32) || !defined(DT_BF16) || !defined(DT_F16) || !defined(DT_U8) || !defined(NORM_THREADS) ||    \
    !defined(NORM_CHUNK) || !defined(DETCOMM_FUSED_BATCH) || !defined(DETCOMM_KIND_TREE_ONE_STORE) ||              \
    !defined(DETCOMM_KIND_TREE_1SHOT) || !defined(DETCOMM_KIND_TREE_2SHOT) || !defined(DETCOMM_TREE_MAX_LOG) ||     \
    !defined(DETCOMM_KIND_FUSED_NORM_TREE_1SHOT) || !defined(DETCOMM_KIND_FUSED_NORM_TREE_2SHOT)
#error "csrc/ needs the device constants as -D options: build with detcomm.workspace.kernels.nvrtc_options (nvcc: pass kernels.constant_options())"
#endif
#if DETCOMM_W < 1 || DETCOMM_W > DETCOMM_MAX_W
#error "DETCOMM_W must be in 1..DETCOMM_MAX_W"
#endif

// flags[kind][parity][block][source rank]: written by the source rank (remote store), read by the owner.
__device__ __forceinline__ u32 flag_index(int kind, u32 par, int block, int src) {
  return (u32)(((kind * DETCOMM_PARITIES + (int)par) * DETCOMM_MAX_BLOCKS + block) * DETCOMM_MAX_W + src);
}
#define DETCOMM_EPOCH_BASE (DETCOMM_BARRIER_KINDS * DETCOMM_PARITIES * DETCOMM_MAX_BLOCKS * DETCOMM_MAX_W)
// epochs[kind][block]: the owner's own count of completed barriers of that kind for that block.
__device__ __forceinline__ u32 epoch_index(int kind, int block) {
  return (u32)(DETCOMM_EPOCH_BASE + kind * DETCOMM_MAX_BLOCKS + block);
}
#define DETCOMM_DESC_BASE (DETCOMM_EPOCH_BASE + DETCOMM_BARRIER_KINDS * DETCOMM_MAX_BLOCKS)
// desc[parity][block][source rank][4]: the call the source rank's block is making (what, call, count lo, count
// hi), stored by the source before its start-barrier flag (at kernel entry: open_use), read by the owner after it.
__device__ __forceinline__ u32 desc_index(u32 par, int block, int src) {
  return (u32)(DETCOMM_DESC_BASE + (((int)par * DETCOMM_MAX_BLOCKS + block) * DETCOMM_MAX_W + src) * DETCOMM_DESC_WORDS);
}
#define DETCOMM_CTRL_BASE (DETCOMM_DESC_BASE + DETCOMM_PARITIES * DETCOMM_MAX_BLOCKS * DETCOMM_MAX_W * DETCOMM_DESC_WORDS)
#define DETCOMM_ABORT_INDEX DETCOMM_CTRL_BASE        // nonzero: the workspace failed (sticky until re-created)
#define DETCOMM_CLAIM_INDEX (DETCOMM_CTRL_BASE + 1)  // the first failing thread of this rank claims the record
// busy[block]: set while a kernel of this rank runs that block (two kernels at once on one rank are an error).
__device__ __forceinline__ u32 busy_index(int block) { return (u32)(DETCOMM_CTRL_BASE + 2 + block); }
#define DETCOMM_HEADER_WORDS_USED (DETCOMM_CTRL_BASE + 2 + DETCOMM_MAX_BLOCKS)
static_assert(DETCOMM_HEADER_WORDS_USED * 4 <= DETCOMM_BUFFER_HEADER_BYTES,
              "header layout overflows DETCOMM_BUFFER_HEADER_BYTES");

// One module per dtype at run time (-DDETCOMM_DTYPE=<code>, see detcomm/workspace/kernels.py), so a dtype whose
// conversions an architecture lacks is refused alone; without it (the CPU compile check) every dtype is built.
#ifdef DETCOMM_DTYPE
#define DETCOMM_WANT(DT) (DETCOMM_DTYPE == (DT))
#else
#define DETCOMM_WANT(DT) 1
#endif

// ----------------------------------------------------------------------------------------------------
// dtypes: DT_F32 = fp32, DT_BF16 = bf16, DT_F16 = fp16, DT_U8 = raw bytes (data movement only)
// ----------------------------------------------------------------------------------------------------

template <int DT> struct Traits;

template <> struct Traits<DT_F32> {
  typedef u32 T;
  static constexpr int kPer = 4;
  __device__ static __forceinline__ float widen(u32 b) { return __uint_as_float(b); }
  __device__ static __forceinline__ u32 narrow(float a) {
    u32 b = __float_as_uint(a);
    return ((b & 0x7FFFFFFFu) > 0x7F800000u) ? 0x7FC00000u : b;
  }
};

template <> struct Traits<DT_BF16> {
  typedef u16 T;
  static constexpr int kPer = 8;
  // bf16 is the top half of an fp32: widening is exact by construction.
  __device__ static __forceinline__ float widen(u16 b) { return __uint_as_float(((u32)b) << 16); }
  __device__ static __forceinline__ u16 narrow(float a) {
    u16 r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(a));
    return ((__float_as_uint(a) & 0x7FFFFFFFu) > 0x7F800000u) ? (u16)0x7FC0u : r;
  }
};

template <> struct Traits<DT_F16> {
  typedef u16 T;
  static constexpr int kPer = 8;
  // Every fp16 value (subnormals included) is exactly representable in fp32.
  __device__ static __forceinline__ float widen(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
  }
  __device__ static __forceinline__ u16 narrow(float a) {
    u16 r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(a));
    return ((__float_as_uint(a) & 0x7FFFFFFFu) > 0x7F800000u) ? (u16)0x7E00u : r;
  }
};

template <> struct Traits<DT_U8> {
  typedef u8 T;
  static constexpr int kPer = 16;
};

template <int DT> union PackU {
  uint4 v;
  typename Traits<DT>::T e[Traits<DT>::kPer];
};

// ----------------------------------------------------------------------------------------------------
// Memory access
// ----------------------------------------------------------------------------------------------------
// Workspace slots are 16-byte aligned and padded, so a whole pack is always readable there. `.cg` keeps
// peer data out of L1, which is not coherent with other GPUs' (or other processes') writes. `asm volatile`
// keeps these in program order with the barriers (whose asm and bar.sync are volatile too), and no "memory"
// clobber: the compiler may keep pointers and values in registers across them, so the independent loads of
// one sweep (see DETCOMM_UNROLL) go out back to back instead of one round trip each.
__device__ __forceinline__ uint4 ld_ws(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ void st_ws(uint4* p, const uint4& v) {
  asm volatile("st.global.cg.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w));
}

// Packs in flight per thread: each thread handles DETCOMM_UNROLL packs of one grid sweep before storing any, so
// a thread has up to DETCOMM_UNROLL * W independent 16-byte loads outstanding (at most 8 per peer set, which keeps
// the registers of a 512-thread block under its 128-per-thread bound). Pack q is still handled by thread
// q mod stride, so within a launch each pack keeps one block ("Work assignment").
#define DETCOMM_UNROLL ((8 / DETCOMM_W) > 0 ? (8 / DETCOMM_W) : 1)

// A caller's tensor may start at any element offset and end mid-pack: one 16-byte access where the pack is
// aligned and whole, element by element otherwise (the scalar tail). Which path runs never changes which
// thread handles which pack, so the per-block barrier contract holds whatever the pointers' alignment.
template <int DT>
__device__ __forceinline__ uint4 load_user(const typename Traits<DT>::T* p, i64 valid) {
  typedef typename Traits<DT>::T T;
  constexpr int kPer = Traits<DT>::kPer;
  PackU<DT> u;
  if (valid >= kPer && ((unsigned long long)p & 15ull) == 0) {
    u.v = *reinterpret_cast<const uint4*>(p);
  } else {
    u.v = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      if (i < valid) u.e[i] = p[i];
    }
  }
  return u.v;
}

template <int DT>
__device__ __forceinline__ void store_user(typename Traits<DT>::T* p, i64 valid, const uint4& v) {
  typedef typename Traits<DT>::T T;
  constexpr int kPer = Traits<DT>::kPer;
  if (valid >= kPer && ((unsigned long long)p & 15ull) == 0) {
    *reinterpret_cast<uint4*>(p) = v;
  } else {
    PackU<DT> u;
    u.v = v;
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      if (i < valid) p[i] = u.e[i];
    }
  }
}

// Copy n elements of a caller's tensor into workspace packs dst[0..): DETCOMM_UNROLL packs of one sweep loaded
// before any is stored. Pack j is handled by thread j mod stride: the block that copies it in is the block that
// reads it after START ("Work assignment").
template <int DT>
__device__ __forceinline__ void copy_in(const typename Traits<DT>::T* x, i64 n, uint4* dst, i64 tid, i64 stride) {
  constexpr int kPer = Traits<DT>::kPer;
  constexpr int U = DETCOMM_UNROLL;
  const i64 np = (n + kPer - 1) / kPer;
  for (i64 j0 = tid; j0 < np; j0 += U * stride) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const i64 j = j0 + u * stride;
      if (j < np) v[u] = load_user<DT>(x + j * kPer, n - j * kPer);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const i64 j = j0 + u * stride;
      if (j < np) st_ws(dst + j, v[u]);
    }
  }
}

// ----------------------------------------------------------------------------------------------------
// The canonical fold of one pack from W ranks
// ----------------------------------------------------------------------------------------------------
// The negative control (tests only) folds in the rotated order 1, 2, ..., W-1, 0 on every rank: the same
// additions in another order, which must be caught differing from the oracle on an ill-conditioned payload at
// W >= 3. At W = 2 both orders agree (+0 + a + b == +0 + b + a), which is why the control needs W >= 3.
__device__ __forceinline__ int fold_source(int k, int rank) {
  (void)rank;
#ifdef DETCOMM_ROTATE_RANK_ORDER
  return (k + 1) % DETCOMM_W;
#else
  return k;
#endif
}

template <int DT>
__device__ __forceinline__ uint4 fold_pack(const uint4 (&in)[DETCOMM_W], int rank) {
  constexpr int kPer = Traits<DT>::kPer;
  float acc[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) acc[i] = 0.0f;  // +0.0 start (docs/spec.md §1)
#pragma unroll
  for (int k = 0; k < DETCOMM_W; ++k) {  // group-rank order 0..W-1, never rotated or regrouped
    PackU<DT> u;
    u.v = in[fold_source(k, rank)];
#pragma unroll
    for (int i = 0; i < kPer; ++i) acc[i] = __fadd_rn(acc[i], Traits<DT>::widen(u.e[i]));
  }
  PackU<DT> o;
#pragma unroll
  for (int i = 0; i < kPer; ++i) o.e[i] = Traits<DT>::narrow(acc[i]);  // the one rounding
  return o.v;
}

#if DETCOMM_W == 1
// W = 1: the canonical fold of one rank is round(+0.0 + widen(x)) with the canonical NaN (fold_pack), and it is
// computed straight from x into out: no slot, no barrier, no descriptor (the same bits as through the slot; one
// read and one write of each element, as a copy). No busy word either: it guards the barriers and the slot
// against a second kernel of the same rank, and this path touches neither; two of them at once are as
// independent as two copy kernels. Pack p is loaded and stored by the same thread, so out == x is safe.
template <int DT>
__device__ __forceinline__ void fold_direct(const typename Traits<DT>::T* x, typename Traits<DT>::T* out, i64 n) {
  constexpr int kPer = Traits<DT>::kPer;
  constexpr int U = DETCOMM_UNROLL;
  const i64 stride = (i64)gridDim.x * blockDim.x;
  const i64 np = (n + kPer - 1) / kPer;
  for (i64 p0 = (i64)blockIdx.x * blockDim.x + threadIdx.x; p0 < np; p0 += U * stride) {
    uint4 in[U][1];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const i64 p = p0 + u * stride;
      if (p < np) in[u][0] = load_user<DT>(x + p * kPer, n - p * kPer);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const i64 p = p0 + u * stride;
      if (p < np) store_user<DT>(out + p * kPer, n - p * kPer, fold_pack<DT>(in[u], 0));
    }
  }
}
#endif

// ----------------------------------------------------------------------------------------------------
// Barriers
// ----------------------------------------------------------------------------------------------------
// One barrier is a W-way rendezvous of block b on every rank. Rank r arrives by a system-scope release
// store of the barrier's epoch into flags[kind][parity][b][r] of every peer, and waits until every peer p has
// stored the same epoch into its own flags[kind][parity][b][p].
//
// Uses and parities. Each (kind, block) has its own uint32 epoch counter in the owner's header, wrapping modulo
// 2^32. The START counter of EVERY block advances once per barrier launch, also in a block that owns no pack of
// it (skip_use, "Work assignment"), so it counts this rank's barrier launches and a launch's parity p = e & 1 is
// the same in all its blocks (open_use reads it at kernel entry: e = counter + 1). The parity selects one of two
// copies of everything a launch shares: the data slot (copy p of every rank's slot), the call descriptors and the
// START flags. MID flags take the parity of their own (MID) epoch, counted by the blocks that pass MID. There is no
// end barrier: a block leaves the kernel as soon as its own last access is done, and the next launch overlaps the
// peers' tail.
//
// Why two copies suffice. Claim: while this rank runs barrier launch e, no peer runs barrier launch e+2 or later.
// Peer t starts launch e+2 only after its launch e+1 completed (stream order), which needs t's block 0 (block 0
// owns a pack of every launch) past START e+1, i.e. this rank's block 0 arrived at START e+1, which it does only in
// its next launch, after its launch e completed, every block's last read included. So while this rank works in
// launch e, any peer is in launch e or e+1, and one launch ahead it writes only copy 1-p: its slot copy, its
// descriptors and its START flags in this rank's header. The same holds for this rank's own slot. Nothing in the
// claim depends on which block a launch gives a slot position to. (One-store launches in between take no part:
// they use their own region, csrc/one_store_common.cuh, and a peer completing one needs this rank's stores in it.)
// MID (two-shot, fused two-shot): a block has at most one MID per launch, so MID use m lies in launch e and MID
// use m+2 (the next write of MID copy m & 1) in a launch >= e+2: the same claim. MID keeps its own counter and parity
// (not START's) so that its flags stay exact: with START's parity, kernels without MID interleaved with two-shot
// ones could leave one MID copy unwritten for 2^32 MID uses, after which its stale epoch would alias the awaited one.
//
// Epoch test. When this rank waits for use e on copy p, a peer's flag holds e (arrived) or the epoch of the
// previous launch of copy p, e-2 (stored at that launch's START or by its skip_use; 0, the initial value, before
// the first): never a later use (the claim). So an equality test is exact forever, across the wrap, and needs no
// ordering comparison (plan.py mirrors this; CPU tests drive the mirror with a peer one use ahead, show one copy
// would be overtaken, cross 2^32, and run blocks that skip launches under layouts that differ between launches:
// tests/barrier_sim.py).
//
// Ordering: __syncthreads() makes every thread's prior data stores precede the release (release is
// cumulative over what bar.sync ordered before it); the acquire load plus __syncthreads_or() makes the
// peers' data visible to all threads of the block before they read it.
//
// The call descriptor (docs/spec.md §9, failure semantics): before its START flag every rank also stores its
// (kernel kind | dtype, call number, element count) into desc[p][b][r] of every peer (at kernel entry, see
// open_use, or inside START for a kernel that does not announce); after the acquire each rank compares every
// peer's descriptor with its own. A mismatch (one rank in another call, another dtype or count) fails the
// workspace on every rank, whatever the host-side checking says. desc[p][b][t] is rewritten only in t's use e+2
// (the claim), after this rank's comparison of use e: the comparison never reads a later call's descriptor.
//
// The busy word (one kernel per rank at a time): claimed at START by each block that passes it, released by that
// block at kernel exit (close_use) after its last access. A block that fails returns without releasing it: the
// workspace has failed and refuses every later call anyway.
//
// Failure instead of a hang: every spin polls the abort word in its own header (peers and the host store
// there) and, every 256 iterations, the host's abort word in mapped pinned memory, and gives up after
// timeout_ns (read from %globaltimer). A failing thread raises the abort word in every rank's header (so its
// peers stop too), claims this rank's single record (atomicCAS on the header's claim word: the first failing
// thread of the rank wins), writes it into host-mapped memory, and returns false; the kernel then returns
// without touching the data. The CUDA context survives; the host raises WorkspaceFailed at its next call
// or synchronisation. Only the debug build (DETCOMM_WORKSPACE_TRAP=1 -> DETCOMM_TRAP_ON_FAILURE) traps.
__device__ __forceinline__ void st_release_sys(u32* p, u32 v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ u32 ld_acquire_sys(const u32* p) {
  u32 v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ u32 ld_relaxed_sys(const u32* p) {
  u32 v;
  asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_relaxed_sys(u32* p, u32 v) {
  asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ u64 global_timer_ns() {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

struct Group {
  char* const* data;  // [2 * W] data[p * W + k]: copy p of rank k's data slot, as mapped in this process
  u32* const* sigs;   // [W] header base of every rank, as mapped in this process
  int rank;
  u64 timeout_ns;
  u32* ctrl;  // host-mapped: [DETCOMM_CTRL_WORDS] = this rank's record, then the host's abort word
  u32 what;   // this call's descriptor: kernel kind << 8 | dtype code
  u32 call;   //   the host's launch number
  u64 count;  //   the element (or byte) count every rank must agree on
  // true: the kernel stored its call descriptor at entry (announce_call), so the START barrier does not store it
  // again. A kernel that leaves it out (aggregate initialization: false) gets the descriptor stored by START.
  bool announced;
  u32 par;  // this block's use parity (set by open_use; left out of the kernels' aggregate initialization)
};

// The failure path, out of line so the spin loop stays small. `peer_desc` is the peer's descriptor on a mismatch.
__device__ __noinline__ void fail_workspace(const Group& g, u32 tag, int kind, int peer, u32 epoch, u32 seen,
                                            u64 waited_ns, const u32* peer_desc) {
  u32* own = g.sigs[g.rank];
  // Claim first: the thread that detects the failure owns the record, not a thread stopped by its abort word.
  const bool reporter = atomicCAS(own + DETCOMM_CLAIM_INDEX, 0u, 1u) == 0u;
  // Own header first (this rank's other blocks stop at once), then every peer's, unless a peer's abort is what
  // stopped us (that peer already told everyone). atomicCAS keeps the first abort's identity in our header.
  atomicCAS(own + DETCOMM_ABORT_INDEX, 0u, DETCOMM_ABORT_BY_KERNEL | (u32)g.rank);
  if (tag != DETCOMM_ERR_PEER_FAILED) {
    for (int p = 0; p < DETCOMM_W; ++p)
      if (p != g.rank) st_relaxed_sys(g.sigs[p] + DETCOMM_ABORT_INDEX, DETCOMM_ABORT_BY_KERNEL | (u32)g.rank);
  }
  __threadfence_system();
  if (!reporter) return;  // another thread of this rank reports
  volatile u32* rec = g.ctrl;
  rec[1] = (u32)g.rank;
  rec[2] = (u32)peer;
  rec[3] = (u32)kind;
  rec[4] = epoch;
  rec[5] = seen;
  rec[6] = (u32)(waited_ns / 1000000ull);
  rec[7] = blockIdx.x;
  rec[8] = g.what;
  rec[9] = g.call;
  rec[10] = (u32)g.count;
  rec[11] = (u32)(g.count >> 32);
  for (int i = 0; i < DETCOMM_DESC_WORDS; ++i) rec[12 + i] = peer_desc ? peer_desc[i] : 0u;
  __threadfence_system();
  rec[0] = tag;  // last: a tagged record is complete
  __threadfence_system();
  printf("detcomm: rank %d: workspace failed (record %#x) at barrier %d, call %u, peer %d (epoch %u, seen %#x, %llu ms)\n",
         g.rank, tag, kind, g.call, peer, epoch, seen, waited_ns / 1000000ull);
#ifdef DETCOMM_TRAP_ON_FAILURE
  __trap();  // debug only: keeps the failing kernel on the stack for a debugger, at the price of the context
#endif
}

// The call descriptor of this rank's block into peer t's header: strong (relaxed, system-scope) stores, ordered
// before the peer reads them by the START flag's release/acquire, never a data race.
__device__ __forceinline__ void store_call_descriptor(const Group& g, int t) {
  u32* d = g.sigs[t] + desc_index(g.par, blockIdx.x, g.rank);
  st_relaxed_sys(d + 0, g.what);
  st_relaxed_sys(d + 1, g.call);
  st_relaxed_sys(d + 2, (u32)g.count);
  st_relaxed_sys(d + 3, (u32)(g.count >> 32));
}

// The copy a use of parity p works in. The negative control (tests only, DETCOMM_TEST_SINGLE_COPY) keeps one copy
// of everything, as a scheme without the end barrier and without parity would: a peer one use ahead then
// overwrites what this rank still reads, which the fast-rank test must catch.
__device__ __forceinline__ u32 parity_of(u32 epoch) {
#ifdef DETCOMM_TEST_SINGLE_COPY
  return 0u;
#else
  return epoch & 1u;
#endif
}

// The call descriptor into every peer's header (threads 0..W-1): at kernel entry, so the remote stores are
// acknowledged while the block copies its input in, and the START flag's release (which must wait for every prior
// store of the thread) does not pay an NVLink round trip for them. Kernels that call this build their Group with
// announced = true.
//
// Why storing this early is safe: peer p reads desc[par][b][r] during its launch e, right after its acquire of r's
// START flag for block b. This rank stores copy par again only in launch e+2, which it starts after its launch e+1
// completed, which needed peer p's block 0 at START e+1, i.e. peer p's launch e completed ("Barriers", the claim).
// So the store never overtakes a read of the previous use of that copy. If the workspace already failed, the
// stores land in headers nobody trusts any more (every call is refused until re-created).
__device__ __forceinline__ void announce_call(const Group& g) {
  if (threadIdx.x < DETCOMM_W) store_call_descriptor(g, threadIdx.x);
}

// At kernel entry, after the block's ownership test and before its copy-in: this use's parity from the block's own
// START counter (only this block of this rank writes it, at its START barriers, and the previous kernel of the
// rank has finished: a plain read is race-free), then the descriptor (announced kernels). Returns the Group the
// rest of the kernel uses; every slot address goes through slot() with it.
__device__ __forceinline__ Group open_use(Group g) {
  g.par = parity_of(g.sigs[g.rank][epoch_index(BARRIER_START, blockIdx.x)] + 1u);
  if (g.announced) announce_call(g);
  return g;
}

// Copy g.par of rank k's data slot. Both table entries are loaded and one is selected, so the loads need not wait
// for the parity (itself a load of the epoch word) and the kernel's start pays one dependent load, not two.
__device__ __forceinline__ uint4* slot(const Group& g, int k) {
  char* const c0 = g.data[k];
  char* const c1 = g.data[DETCOMM_W + k];
  return reinterpret_cast<uint4*>(g.par ? c1 : c0);
}

// The guards every workspace kernel shares (barrier kernels here, the one-store kernels in one_store_common.cuh).
// One kernel per rank at a time (a graph replay and an eager call on two streams would interleave their
// accesses): claim this block's busy word; false (and the workspace failed) when another kernel holds it.
__device__ __forceinline__ bool claim_busy(const Group& g, int kind) {
  u32* own = g.sigs[g.rank];
  if (atomicCAS(own + busy_index(blockIdx.x), 0u, g.call | 0x80000000u) != 0u) {
    fail_workspace(g, DETCOMM_ERR_OVERLAP, kind, g.rank, 0, own[busy_index(blockIdx.x)], 0, nullptr);
    return false;
  }
  return true;
}
__device__ __forceinline__ void release_busy(const Group& g) {
  atomicExch(g.sigs[g.rank] + busy_index(blockIdx.x), 0u);
}

// Before a kernel starts waiting on its peers: true (and this thread's failure recorded) when the workspace already
// failed, i.e. a peer's kernel or host raised this rank's abort word while this rank was between kernels.
__device__ __forceinline__ bool failed_before(const Group& g, int kind, u32 epoch) {
  const u32 ab = ld_relaxed_sys(g.sigs[g.rank] + DETCOMM_ABORT_INDEX);
  if (ab == 0u) return false;
  fail_workspace(g, DETCOMM_ERR_PEER_FAILED, kind, (int)(ab & 0xFFu), epoch, ab, 0, nullptr);
  return true;
}

// One check of a spin that has waited since `start` for `peer`: this rank's abort word (peers and the host store
// there), the host's abort word in mapped memory when `poll_host` (over PCIe: callers ask rarely), then the
// deadline. Returns 0, or the record tag of the failure it reported.
__device__ __forceinline__ u32 spin_failure(const Group& g, int kind, int peer, u32 epoch, u32 seen, u64 start,
                                            bool poll_host) {
  const u32 ab = ld_relaxed_sys(g.sigs[g.rank] + DETCOMM_ABORT_INDEX);
  if (ab != 0u) {
    fail_workspace(g, DETCOMM_ERR_PEER_FAILED, kind, (int)(ab & 0xFFu), epoch, ab, global_timer_ns() - start, nullptr);
    return DETCOMM_ERR_PEER_FAILED;
  }
  if (poll_host && *(const volatile u32*)(g.ctrl + DETCOMM_HOST_ABORT_WORD) != 0u) {
    fail_workspace(g, DETCOMM_ERR_ABORTED, kind, peer, epoch, seen, global_timer_ns() - start, nullptr);
    return DETCOMM_ERR_ABORTED;
  }
  const u64 waited = global_timer_ns() - start;
  if (waited > g.timeout_ns) {
    fail_workspace(g, DETCOMM_ERR_TIMEOUT, kind, peer, epoch, seen, waited, nullptr);
    return DETCOMM_ERR_TIMEOUT;
  }
  return 0u;
}

// At kernel exit, on the success path only: release this block's busy word after every thread's last access.
__device__ __forceinline__ void close_use(const Group& g) {
  __syncthreads();
  if (threadIdx.x == 32) release_busy(g);
}

// The arrival test. The negative control (tests only, DETCOMM_TEST_STALE_FLAGS) accepts any earlier use's flag,
// so once both copies of a flag were written (from the third use on) a barrier passes on the previous use of its
// copy before the peer arrives: the slow-rank test must catch it.
__device__ __forceinline__ bool has_arrived(u32 seen, u32 epoch) {
#ifdef DETCOMM_TEST_STALE_FLAGS
  return seen != 0u;
#else
  return seen == epoch;
#endif
}

// Spin until the peer's flag shows this use. Returns 0, or the record tag of the failure it reported.
__device__ __forceinline__ u32 wait_flag(const Group& g, const u32* flag, u32 epoch, int kind, int peer) {
  u32 seen = ld_acquire_sys(flag);
  if (has_arrived(seen, epoch)) return 0;
  const u64 start = global_timer_ns();
  for (u32 it = 1;; ++it) {
    seen = ld_acquire_sys(flag);
    if (has_arrived(seen, epoch)) return 0;
    // W threads per block spin here: each checks its abort word every poll and the host's every 256th.
    const u32 tag = spin_failure(g, kind, peer, epoch, seen, start, (it & 255u) == 0u);
    if (tag != 0u) return tag;
  }
}

// Returns true when every rank's block arrived; false when the workspace failed (the caller returns at once,
// uniformly for the whole block).
__device__ __forceinline__ bool block_barrier(const Group& g, int kind) {
  __syncthreads();
  const int t = threadIdx.x;
  u32* own = g.sigs[g.rank];
  int failed = 0;
  if (t < DETCOMM_W) {
    // Only this block of this rank ever touches its epoch word (written below, after this read): a plain read
    // is race-free. START's parity is g.par by construction (open_use read the same counter).
    const u32 epoch = own[epoch_index(kind, blockIdx.x)] + 1u;
    const u32 par = parity_of(epoch);
    if (failed_before(g, kind, epoch)) {
      failed = 1;  // the workspace already failed: arrive nowhere, touch nothing
    } else {
      if (kind == BARRIER_START && !g.announced) store_call_descriptor(g, t);
      st_release_sys(g.sigs[t] + flag_index(kind, par, blockIdx.x, g.rank), epoch);
      failed = wait_flag(g, own + flag_index(kind, par, blockIdx.x, t), epoch, kind, t) != 0u;
      if (!failed && kind == BARRIER_START) {
        const u32* d = own + desc_index(g.par, blockIdx.x, t);
        u32 pd[DETCOMM_DESC_WORDS] = {ld_relaxed_sys(d + 0), ld_relaxed_sys(d + 1), ld_relaxed_sys(d + 2),
                                      ld_relaxed_sys(d + 3)};
        if (pd[0] != g.what || pd[1] != g.call || pd[2] != (u32)g.count || pd[3] != (u32)(g.count >> 32)) {
          failed = 1;
          const u32 seen = ld_relaxed_sys(own + flag_index(kind, par, blockIdx.x, t));
          fail_workspace(g, DETCOMM_ERR_MISMATCH, kind, t, epoch, seen, 0, pd);
        }
      }
    }
  } else if (t == 32 && kind == BARRIER_START) {
    // One kernel per rank at a time: claim this block's busy word; close_use releases it at kernel exit.
    failed = !claim_busy(g, kind);
  }
  if (__syncthreads_or(failed)) return false;
  if (t == 0) own[epoch_index(kind, blockIdx.x)] += 1u;
  return true;
}

// ----------------------------------------------------------------------------------------------------
// Work assignment
// ----------------------------------------------------------------------------------------------------
// Inside a launch, a slot pack is written and read by one block index on every rank: the per-block START and MID
// barriers order those accesses. The kernels of csrc/ place packs in different ways (one-shot and all-gather walk
// q = thread id + k*stride; two-shot and reduce-scatter place slice s at s*Lp, Lp a multiple of stride; the virtual
// and tree kernels place units of two fp32 packs and slabs or slices back to back; the fused kernels a row's regions),
// so ACROSS launches one position may belong to different blocks. That is safe because a launch's parity is the same
// in every block ("Barriers": every block counts every barrier launch, skip_use below), not because of a common
// pack-to-block rule: an earlier version relied on such a rule, which the unit layouts broke, and a block that had
// skipped launches worked in the copy a peer's other block was still reading (seen on one H200, ranks as processes
// sharing it: the fused tree norm's self-check read other calls' values).
//
// A block that owns no pack of a launch skips it: it touches no slot and waits for nobody, every rank's block b
// makes the same decision (the count is the same on every rank, and block 0, which always owns a pack, compares the
// counts at its start barrier). Small messages then pay barriers only in the few blocks that carry data, instead of
// in every block of the grid; the skipping block only counts the launch (skip_use).
__device__ __forceinline__ bool block_owns_packs(i64 packs) { return (i64)blockIdx.x * DETCOMM_BLOCK_THREADS < packs; }
__device__ __forceinline__ i64 thread_id() { return (i64)blockIdx.x * DETCOMM_BLOCK_THREADS + threadIdx.x; }
__device__ __forceinline__ i64 grid_stride() { return (i64)gridDim.x * DETCOMM_BLOCK_THREADS; }

// What a block that owns no pack of a barrier launch does instead of its uses (call it and return, before open_use):
// advance its START counter, so that every block's counter is the number of barrier launches this rank ran and a
// launch's parity is the same in all of them, and store that epoch into its START flag (of that parity) in every
// rank's header, without waiting: no rank waits on it (every rank's block b skips this launch), and it keeps every
// flag one use of its copy old at most, so the equality test stays exact across the wrap whatever a block skipped.
// Relaxed stores: they publish no data. Thread 0 alone (at most DETCOMM_MAX_W stores). In a workspace that has failed
// (its abort word raised) it neither counts nor stores: a kernel that finds the workspace failed arrives nowhere
// (docs/spec.md §9.3), and every later call is refused, so no parity is needed again. The negative control (tests
// only, DETCOMM_TEST_UNCOUNTED_SKIP) skips without counting, as the earlier scheme did: a block's parity then
// follows its own uses, and the mixed-layout test must catch a peer's block overwriting a copy still being read.
__device__ __forceinline__ void skip_use(const Group& g) {
#ifndef DETCOMM_TEST_UNCOUNTED_SKIP
  if (threadIdx.x == 0) {
    u32* own = g.sigs[g.rank];
    if (ld_relaxed_sys(own + DETCOMM_ABORT_INDEX) != 0u) return;
    const u32 epoch = own[epoch_index(BARRIER_START, blockIdx.x)] + 1u;
    const u32 par = parity_of(epoch);
#pragma unroll
    for (int t = 0; t < DETCOMM_W; ++t) st_relaxed_sys(g.sigs[t] + flag_index(BARRIER_START, par, blockIdx.x, g.rank), epoch);
    own[epoch_index(BARRIER_START, blockIdx.x)] = epoch;
  }
#else
  (void)g;
#endif
}
