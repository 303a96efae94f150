// detcomm: the one-store exchange of the small-message workspace kernels (csrc/one_store.cu, and the fused
// all-reduce + RMSNorm's one-store variant). Data and arrival travel in the same store: no barrier, no flag.
//
// How it works. Every rank owns a one-store region after its data slots: per-block launch counters, two buffers
// of call descriptors and two data buffers, each holding one area per source rank. In launch e every rank
// stores its input (whole 16-byte packs) into area [e & 1][its rank] of EVERY rank's region (its own included),
// then spins on its OWN region until the packs it needs from all W sources are no longer empty, folds them, and
// empties what it read. All reads are local; the only remote traffic is the pushed stores.
//
// "Empty" is the all-zero 32-bit word, which a pushed pack never contains: before the store, every +0.0 element
// is rewritten as -0.0 (fp32 0x80000000, bf16/fp16 0x8000), so a pushed 32-bit word is never 0 whatever the
// dtype (a 16-bit pair is 0 only when both halves are +0.0). The rewrite cannot change a result bit: the
// canonical fold starts from +0.0, and under round-to-nearest-even an fp32 sum is -0.0 only when both addends
// are -0.0, so the accumulator is never -0.0 and acc + (-0.0) == acc + (+0.0) == acc for every acc (for
// acc = +0.0 both give +0.0). Only inputs are rewritten; results are never moved through the region (a rounded
// result can be -0.0 and would need another marker). NaN and Inf inputs keep their bits. Zeroed memory is empty,
// so a new workspace needs no initialisation pass (symm_mem zeroes every buffer before the peer-access proof).
//
// Why two buffers suffice, and every block must count every launch. Rank p reads area [e & 1][*] of its region
// in launch e and empties it before its kernel ends. A peer q stores into p's buffer e & 1 again in launch e+2,
// which q starts only after its launch e+1 ended, and that needed p's launch-(e+1) stores, which p issues only in
// kernel e+1, i.e. after kernel e (with every emptying store) completed on p's stream. So a push never lands in a
// buffer before the owner emptied it, and never in the buffer the owner is reading. This needs every block of
// a launch to agree on e: each block keeps its own counter (no cross-block synchronisation) and EVERY block of
// EVERY one-store launch advances it, also blocks that own no pack of the launch, so all counters stay equal.
// One-store kernels share the region whatever their pack ownership (the whole buffer belongs to one launch).
//
// Tiers. The region above is one tier; a workspace has up to three, one after the other (plan.one_store_tiers), and a
// launch takes the first whose areas hold it, on that tier's blocks: small launches on few blocks (the blocks that
// own no pack still cost a launch time), large ones on the grid. Each tier has its own counters, descriptors and
// areas, and its launches are the same sequence on every rank, so the argument above holds per tier, whatever the
// other tiers ran in between.
//
// Ranks must agree on the call: each block of each rank also stores its call descriptor (what, call number,
// count; see one_store_descriptor) into desc[e & 1][block][its rank] of every peer, next to its data; threads 0..W-1 of the block wait
// for the descriptors, compare them with their own and empty them. A mismatch fails the workspace on every
// rank (record DETCOMM_ERR_MISMATCH). A rank that runs a barrier kernel while its peers run a one-store kernel
// (counts that pick different kernels) is caught by the deadline instead: neither side ever sees the other.
//
// Failure: every spin polls this rank's abort word (every 16th poll) and gives up after the deadline, through
// fail_workspace like the barriers (record "one-store wait" instead of a barrier kind). Only thread 0 of a block
// polls the host's abort word (every 256th poll): unlike a barrier, where W threads per block spin, every thread
// of a one-store launch may spin, and one read of mapped host memory over PCIe per 256 polls from each of ~67K
// threads saturated the bus (a 1 MiB launch took 0.8 ms on 2x H200). The host's abort() also stores this rank's
// header abort word, which every spinning thread sees; the host word is the fallback when that copy cannot run. A block never returns early
// on failure: it stops waiting and meets its other threads at the end, so no __syncthreads is skipped.
#pragma once
#include "detcomm_common.cuh"

// Device constants (detcomm/workspace/plan.py DEVICE_CONSTANTS, given as -D options): DETCOMM_KIND_ONE_STORE and
// DETCOMM_KIND_FUSED_NORM_ONE_STORE, what a one-store call descriptor names (kernel kind << 8 | dtype code);
// DETCOMM_WAIT_ONE_STORE, the record kind of a one-store wait (decode_record in plan.py names it);
// DETCOMM_ONE_STORE_COUNTER_BYTES, the counters' bytes of the region.
// Region layout, in bytes from the region's start (plan.py computes the same offsets):
//   [0, ONE_STORE_COUNTER_BYTES)                      counters[block]: launches this block has run (owner only)
//   [ONE_STORE_DESC_OFF, + ONE_STORE_DESC_BYTES)            desc[buffer][block][source][4 u32]
//   [ONE_STORE_DATA_OFF, + 2 * W * cap)               data[buffer][source]: cap bytes each (whole packs)
#define DETCOMM_ONE_STORE_DESC_OFF DETCOMM_ONE_STORE_COUNTER_BYTES
#define DETCOMM_ONE_STORE_DESC_BYTES (2 * DETCOMM_MAX_BLOCKS * DETCOMM_MAX_W * DETCOMM_PACK_BYTES)
#define DETCOMM_ONE_STORE_DATA_OFF (DETCOMM_ONE_STORE_DESC_OFF + DETCOMM_ONE_STORE_DESC_BYTES)
static_assert(DETCOMM_MAX_BLOCKS * 4 <= DETCOMM_ONE_STORE_COUNTER_BYTES, "one counter per block");

// A volatile 16-byte load: re-read from memory on every poll (never from L1, which peers' stores bypass).
__device__ __forceinline__ uint4 ld_poll(const uint4* p) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}

__device__ __forceinline__ bool one_store_full(const uint4& v) { return v.x != 0u && v.y != 0u && v.z != 0u && v.w != 0u; }

// A pushed descriptor: (what, call, count lo, count hi | DESC_MARK). Empty is all-zero; a pushed one has a nonzero
// word in each 8-byte half (what is never 0: kind << 8; the mark is bit 31 of the high count word, free because a
// count is far below 2^63), so a reader that sees both halves nonzero sees the whole store even if the 16-byte
// store became visible in two 8-byte halves. The call number and the low count word may be 0 and are not tested.
#define DETCOMM_ONE_STORE_DESC_MARK 0x80000000u
__device__ __forceinline__ uint4 one_store_descriptor(const Group& g) {
  return make_uint4(g.what, g.call, (u32)g.count, (u32)(g.count >> 32) | DETCOMM_ONE_STORE_DESC_MARK);
}
__device__ __forceinline__ bool one_store_desc_full(const uint4& v) { return v.x != 0u && v.w != 0u; }


// +0.0 -> -0.0 in every element of a pack (see the header comment): no pushed word is ever the empty word.
template <int DT>
__device__ __forceinline__ uint4 one_store_mark(uint4 v) {
#ifdef DETCOMM_TEST_UNMARKED
  return v;  // negative control (tests only): a pack of +0.0 looks empty forever
#endif
  if (DT == DT_F32) {
    v.x = v.x ? v.x : 0x80000000u;
    v.y = v.y ? v.y : 0x80000000u;
    v.z = v.z ? v.z : 0x80000000u;
    v.w = v.w ? v.w : 0x80000000u;
  } else {
    u32* w = reinterpret_cast<u32*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const u32 lo = (w[i] & 0xFFFFu) ? 0u : 0x8000u;
      const u32 hi = (w[i] & 0xFFFF0000u) ? 0u : 0x80000000u;
      w[i] |= lo | hi;
    }
  }
  return v;
}

// One launch's view of the one-store regions of every rank.
struct OneStoreArea {
  char* region[DETCOMM_W];  // every rank's region, as mapped in this process
  i64 cap;                  // bytes of one data area
  u32 buf;                  // this launch's buffer: the block's counter & 1
  u32* counter;             // this block's counter in this rank's region
  u32 launch;               // the counter's value in this launch
};

__device__ __forceinline__ OneStoreArea one_store_open(const Group& g, i64 off, i64 cap) {
  OneStoreArea l;
#pragma unroll
  for (int k = 0; k < DETCOMM_W; ++k) l.region[k] = g.data[k] + off;
  l.cap = cap;
  l.counter = reinterpret_cast<u32*>(l.region[g.rank]) + blockIdx.x;
  // Written only by this block of this rank, at the end of the previous launch (a kernel boundary ago).
  l.launch = *l.counter;
  l.buf = l.launch & 1u;
#ifdef DETCOMM_TEST_ONE_BUFFER
  l.buf = 0u;  // negative control (tests only): a fast peer's next launch lands in the buffer this rank still reads
#endif
  return l;
}

// Area of `src` in `owner`'s region for this launch's buffer.
__device__ __forceinline__ uint4* one_store_area(const OneStoreArea& l, int owner, int src) {
  return reinterpret_cast<uint4*>(l.region[owner] + DETCOMM_ONE_STORE_DATA_OFF + ((i64)l.buf * DETCOMM_W + src) * l.cap);
}
__device__ __forceinline__ uint4* one_store_desc(const OneStoreArea& l, int owner, int src) {
  return reinterpret_cast<uint4*>(l.region[owner] + DETCOMM_ONE_STORE_DESC_OFF) +
         ((i64)l.buf * DETCOMM_MAX_BLOCKS + blockIdx.x) * DETCOMM_MAX_W + src;
}

// The state of one thread's waits: the first failure it saw (0 = none) and when it started waiting.
struct OneStoreWait {
  u32 failed;
  u64 start;
  u32 polls;
};

// Poll a pack until it is full (a data pack: every word nonzero; a descriptor: one_store_desc_full); false when the
// workspace failed (recorded through fail_workspace).
template <bool kDesc = false>
__device__ __forceinline__ bool one_store_ready(const uint4& v) {
  return kDesc ? one_store_desc_full(v) : one_store_full(v);
}
template <bool kDesc = false>
__device__ __forceinline__ bool one_store_wait(const Group& g, const OneStoreArea& l, const uint4* p, uint4& v, int peer, OneStoreWait& w) {
  if (one_store_ready<kDesc>(v)) return true;
  if (w.failed) return false;
  if (w.start == 0) w.start = global_timer_ns();
  for (;;) {
    v = ld_poll(p);
    if (one_store_ready<kDesc>(v)) return true;
    ++w.polls;
    if ((w.polls & 15u) != 0u) continue;
    // Every thread may spin here (see the header comment): only thread 0 reads the host's word, every 256th poll.
    w.failed = spin_failure(g, DETCOMM_WAIT_ONE_STORE, peer, l.launch, 0u, w.start,
                            threadIdx.x == 0 && (w.polls & 255u) == 0u);
    if (w.failed != 0u) return false;
  }
}

// Threads 0..W-1: store this block's call descriptor into every rank's region (thread t -> rank t).
__device__ __forceinline__ void one_store_announce(const Group& g, const OneStoreArea& l) {
  const int t = threadIdx.x;
  if (t < DETCOMM_W) st_ws(one_store_desc(l, t, g.rank), one_store_descriptor(g));
}

// Threads 0..W-1: refuse to go on in a workspace that already failed (a peer's kernel or host raised this rank's
// abort word while this rank was between kernels: its pushes may well all be here, but the workspace is dead);
// then wait for source t's descriptor, compare, empty it. Returns false on failure. Runs after the pushes, so
// neither load sits between the caller's input and the peers.
__device__ __forceinline__ bool one_store_check_call(const Group& g, const OneStoreArea& l, OneStoreWait& w) {
  const int t = threadIdx.x;
  if (t >= DETCOMM_W) return true;
  if (failed_before(g, DETCOMM_WAIT_ONE_STORE, l.launch)) {
    w.failed = DETCOMM_ERR_PEER_FAILED;
    return false;
  }
  uint4* d = one_store_desc(l, g.rank, t);
  uint4 v = ld_poll(d);
  if (!one_store_wait<true>(g, l, d, v, t, w)) return false;
  st_ws(d, make_uint4(0u, 0u, 0u, 0u));
  const uint4 mine = one_store_descriptor(g);
  if (v.x != mine.x || v.y != mine.y || v.z != mine.z || v.w != mine.w) {
    const u32 pd[DETCOMM_DESC_WORDS] = {v.x, v.y, v.z, v.w & ~DETCOMM_ONE_STORE_DESC_MARK};
    fail_workspace(g, DETCOMM_ERR_MISMATCH, DETCOMM_WAIT_ONE_STORE, t, l.launch, 0u, 0, pd);
    w.failed = DETCOMM_ERR_MISMATCH;
    return false;
  }
  return true;
}

// One kernel per rank at a time, also for one-store launches: claim this block's busy word (thread 32).
__device__ __forceinline__ bool one_store_claim(const Group& g, OneStoreWait& w) {
  if (threadIdx.x != 32 || claim_busy(g, DETCOMM_WAIT_ONE_STORE)) return true;
  w.failed = DETCOMM_ERR_OVERLAP;
  return false;
}

// End of a block's launch: every thread meets here (none returned early). Unless the workspace failed, advance
// the block's counter (the next launch uses the other buffer) and release the busy word. `claimed`: the block
// took the busy word (blocks that own no pack do not).
__device__ __forceinline__ void one_store_close(const Group& g, const OneStoreArea& l, const OneStoreWait& w, bool claimed) {
  if (__syncthreads_or(w.failed != 0u)) return;
  if (threadIdx.x == 0) *l.counter = l.launch + 1u;
  if (claimed && threadIdx.x == 32) release_busy(g);
}
