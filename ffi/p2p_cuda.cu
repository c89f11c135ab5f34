// The Echo all-reduce as a CUDA XLA FFI custom call (the Echo paper Sec. 4, 5.3 and App. C).
//
// One fused kernel per rank and call runs the four stages of the protocol over tiles of the
// segments, so the quantization of one tile overlaps the NVLink writes of others:
//   push    quantize tile t of segment j (j != me) and write codes + fp16 parameters straight into
//           owner j's receive slot for this rank, then raise j's push flag (me, t) to `base`;
//   reduce  wait until every peer's push flag (r, t) reached `base`, add the P-1 dequantized copies
//           and the own full-precision tile in fp32 in rank order 0..P-1, quantize the sum once;
//   gather  write that code into every rank's gather slot for this owner, raise each peer's gather
//           flag (me, t) to `base + 2`, dequantize it for the own output;
//   tail    wait for gather flag (j, t) >= base + 2 and dequantize owner j's code.
// The compensator (Algorithm 1) is fused: the entry loads apply x' = x + c in registers (x' never
// goes to memory) and the update of m1/m2 runs where y is produced (reduce for the own segment,
// tail for the others), overlapped with the transfers of the other tiles, in place. The state
// is fp32 or bf16 (EchoConfig.state_dtype; KernelArgs::state_bf16): a bf16 m1, m2 is widened on
// load and the fp32 update rounded to nearest even on store, the bits of echo_jax.compensator.
// The rescaling's factor (Sec. 5.4; an f32[1] operand, 1 when not rescaled) multiplies x' in the
// entry loads and divides y before its store and the state update (exact powers of two).
// The Hadamard rotation (attribute rotate = 1; EchoConfig.rotation = "hadamard") rotates every
// group after the entry loads and the factor (the own contribution in the reduce stage too) and
// rotates the decoded sum back before the factor is divided out, the output and the update:
// push, reduce and gather run in the rotated basis, the state stays in the original one. The
// reference is echo_jax.transports.xla.rotated_allreduce, bit for bit.
//
// Readiness crosses GPUs through flags in the receiver's memory: monotonic 64-bit words raised to
// a per-call base that the host increases by 3 per call (push = base, gather = base + 2; the
// reduce stage, base + 1 in the paper's four-stream schedule, runs in the same block as gather
// here and needs no flag). A flag left from an earlier call is below every value the current call
// polls for, so nothing is ever cleared and the host never waits on the readiness path.
//
// Slot reuse needs no extra flag either: a rank starts call c+1 only after its kernel of call c
// ended, which required every owner's gather of call c, which in turn required that owner to have
// consumed all push slots of call c; and an owner writes a peer's gather slot of call c+1 only
// after that peer pushed for call c+1, i.e. after the peer finished reading its slots of call c.
//
// Kernel blocks are persistent (grid no larger than what is resident), because a block that polls
// must never wait for a block of the same grid that has not been scheduled yet.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "echo_common.h"
#include "echo_cuda.cuh"
#include "fast_io.cuh"
#include "quant_fast.cuh"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace echo {
namespace cuda {
namespace {

constexpr int kMaxCudaRanks = 8;     // ranks of one group on one host (NVLink domain)
constexpr int kThreads = 256;        // 8 warps per block: one group per warp at a time
// Values per tile at most (8 KiB of 4-bit codes); the environment's ECHO_JAX_P2P_TILE_VALUES
// overrides it. Each tile costs a block barrier and a flag round trip; measured on one H200
// (4 virtual ranks, 256 MB a rank, p2p4 fp32): 4096 1.172, 8192 0.952-1.027, 16384 0.904,
// 32768 0.918, 65536 0.928 ms (at 64 MB 65536 was 25 % slower: too few tiles to spread).
constexpr int kTileValues = 16384;
constexpr int kMinTilesPerSegment = 64;
constexpr int kMaxTiles = 16384;     // flag words per (peer, stage) in a workspace
constexpr int kCacheChunks = 4;      // per-lane register cache of the reduce stage
// Blocks of kThreads an SM that ptxas must fit in the uncompensated unrotated fast instances
// (FastStages::kMinBlocks; a build may override them): 6 (40 registers) for fp32, 5 (48) for
// 16-bit x, against 5 (48) and 4 (64) that ptxas picks by itself. Measured on one H200, 4 virtual
// ranks, 256 MB a rank: p2p4 1.027 -> 0.961 ms (fp32), 1.533 -> 1.421 ms (bf16). Both spill a
// little (ptxas: fp32 12-16 bytes a thread, 16-bit 28-52; the fp32 build measured had none).
// The pipeline waits on memory with few bytes in flight a warp, so more resident warps pay.
#ifndef ECHO_P2P_MIN_BLOCKS_32
#define ECHO_P2P_MIN_BLOCKS_32 6
#endif
#ifndef ECHO_P2P_MIN_BLOCKS_16
#define ECHO_P2P_MIN_BLOCKS_16 5
#endif
// The same for the uncompensated rotated instances: 16-bit x 4 blocks (64 registers) against
// the 3 of ptxas' own 80, p2p4-rot bf16 0.530 -> 0.474 ms (64 MB), 1.921 -> 1.756 ms (256 MB)
// with the fma butterflies (0.584 -> 0.532 and 2.130 -> 1.986 without); fp32 stays unbounded
// (5 blocks, 48 registers, measured without the fma butterflies: 0.392 -> 0.400 ms at 64 MB,
// 1.433 -> 1.359 at 256 MB, not clearly better).
#ifndef ECHO_P2P_MIN_BLOCKS_ROT_32
#define ECHO_P2P_MIN_BLOCKS_ROT_32 1
#endif
#ifndef ECHO_P2P_MIN_BLOCKS_ROT_16
#define ECHO_P2P_MIN_BLOCKS_ROT_16 4
#endif
// The applied call's unrotated 16-bit instances (EchoConfig.state_update = "separate"): ptxas
// gives them 70-73 registers (3 blocks an SM) against the 64 of the compensated ones that also
// update; not measured yet, so no bound (1). A build may try 4 (64 registers).
#ifndef ECHO_P2P_MIN_BLOCKS_APPLIED_16
#define ECHO_P2P_MIN_BLOCKS_APPLIED_16 1
#endif
// 1: the 16-bit uncompensated unrotated push takes its group range before scaling, over the
// unpacked fp32 values, as the fp32 one (push_plain; not yet measured on a GPU: ptxas 48
// registers under the bound, 48-64 bytes of spills against 28-52). 0: as measured.
#ifndef ECHO_P2P_PLAIN_PUSH_16
#define ECHO_P2P_PLAIN_PUSH_16 0
#endif
// 1: the uncompensated rotated instances rotate with half exchanges (FastStages::kExchange,
// quant_fast.cuh; checked on the host, not yet measured on a GPU). 0: as measured.
#ifndef ECHO_P2P_ROT_EXCHANGE
#define ECHO_P2P_ROT_EXCHANGE 0
#endif
// Bit 0: the uncompensated push stages the next group set's x in shared memory, bit 1: the
// reduce its own x (FastStages::kPrefetchPush / kPrefetchReduce; not yet measured on a GPU).
// 0: as measured.
#ifndef ECHO_P2P_PREFETCH
#define ECHO_P2P_PREFETCH 0
#endif

// Error codes written to the host-mapped error word (1 + stage * 256 + peer).
enum Stage : int { kStagePush = 0, kStageGather = 1 };

struct KernelArgs {
  const void* x;      // this rank's contribution [n] (T)
  void* y;            // this rank's output [n] (T)
  void* m1;           // compensator state [n] (fp32, or bf16 when state_bf16) or nullptr
  void* m2;
  const float* factor;  // device f32[1]: the rescaling's power of two (1: not rescaled)
  int64_t n;
  int64_t seg_groups;  // Gs: groups per segment
  int me, P, g, bits, policy;
  int tile_groups;     // groups per tile
  int64_t tile0;       // first segment tile of this chunk
  int chunk_tiles;     // tiles of each segment in this chunk
  int64_t slot_bytes;  // bytes of one receive slot
  int64_t params_offset;  // offset of the fp16 parameters inside a slot
  uint64_t base;       // flag base of this call (raised by 3 per call)
  uint64_t timeout_ns;
  int* error;          // host-mapped error word of this rank
  bool aligned;        // x, y, m1, m2 all aligned to 16 bytes: 128-bit accesses allowed
  bool state_bf16;     // m1, m2 are bf16 (EchoConfig.state_dtype): widened on load, rounded
                       // to nearest even on store; a uniform branch in the generic stages, a
                       // template parameter of the fast ones (FastStages' S)
  float rot_scale;     // fp32(1 / sqrt(g)) of the Hadamard rotation (rotated kernels only)
  int twice;           // a diagnostic (repeat_stage_from_env): 1, 2, 3 run push, reduce + gather
                       // or tail twice (uncompensated calls only), 0 none
  CompCoeffs k;
  uint8_t* ws[kMaxCudaRanks];  // workspace base of every rank (peer pointers)
};

// Workspace layout (per rank): P push slots, P gather slots, then the flags and the abort word.
__host__ __device__ inline int64_t push_slot(int src, int64_t slot_bytes) { return src * slot_bytes; }
__host__ __device__ inline int64_t gather_slot(int owner, int P, int64_t slot_bytes) {
  return (P + owner) * slot_bytes;
}
__host__ __device__ inline int64_t flags_offset(int P, int64_t slot_bytes) { return 2 * P * slot_bytes; }
__host__ __device__ inline int64_t flag_index(int stage, int peer, int tile) {
  return (static_cast<int64_t>(stage) * kMaxCudaRanks + peer) * kMaxTiles + tile;
}
__host__ __device__ inline int64_t abort_offset(int P, int64_t slot_bytes) {
  return flags_offset(P, slot_bytes) + 2 * kMaxCudaRanks * kMaxTiles * sizeof(uint64_t);
}
inline int64_t workspace_bytes(int P, int64_t slot_bytes) { return abort_offset(P, slot_bytes) + 256; }

__device__ __forceinline__ uint64_t* flag_ptr(const KernelArgs& a, int rank, int stage, int peer,
                                              int tile) {
  return reinterpret_cast<uint64_t*>(a.ws[rank] + flags_offset(a.P, a.slot_bytes)) +
         flag_index(stage, peer, tile);
}
__device__ __forceinline__ volatile unsigned* abort_ptr(const KernelArgs& a, int rank) {
  return reinterpret_cast<volatile unsigned*>(a.ws[rank] + abort_offset(a.P, a.slot_bytes));
}

// Polls a flag until it reaches `want`; false on timeout or when another block gave up. On a
// timeout it records which stage waited for which peer and tells every rank to stop.
__device__ bool wait_flag(const KernelArgs& a, const uint64_t* f, uint64_t want, int stage,
                          int peer) {
  const uint64_t start = global_timer_ns();
  while (ld_acquire_sys(f) < want) {
    if (*abort_ptr(a, a.me) == a.base) return false;
    if (global_timer_ns() - start > a.timeout_ns) {
      atomicCAS(a.error, 0, 1 + stage * 256 + peer);
      for (int r = 0; r < a.P; ++r) *abort_ptr(a, r) = static_cast<unsigned>(a.base);
      __threadfence_system();
      return false;
    }
    __nanosleep(64);
  }
  return true;
}

// The rescaling's factor (the Echo paper Sec. 5.4) and its inverse; both powers of two, so the
// products with them are exact (x * 1 = x: an unscaled call keeps its bits). Thread 0 of each
// block reads the operand and takes the reciprocal once (set_scaling); the stages read these two
// shared words. Measured on the H200: reading the operand and taking a correctly rounded
// reciprocal per 16-byte piece made p2p4 at 256 MB about 9 % slower (the kernel is
// instruction-bound).
__shared__ float scaling_shared[2];

__device__ __forceinline__ void set_scaling(const KernelArgs& a) {
  if (threadIdx.x == 0) {
    const float f = __ldg(a.factor);
    scaling_shared[0] = f;
    scaling_shared[1] = __frcp_rn(f);
  }
}
__device__ __forceinline__ float scale_of(const KernelArgs&) { return scaling_shared[0]; }
__device__ __forceinline__ float unscale_of(const KernelArgs&) { return scaling_shared[1]; }

// VEC values of a state array (m1 or m2) at element i as fp32: a bf16 state is widened exactly.
template <int VEC>
__device__ __forceinline__ void load_state_vec(const KernelArgs& a, const void* m, int64_t i,
                                               float* v) {
  if (a.state_bf16)
    load_vec<__nv_bfloat16, VEC>(static_cast<const __nv_bfloat16*>(m), i, a.n, v, a.aligned);
  else
    load_vec<float, VEC>(static_cast<const float*>(m), i, a.n, v, a.aligned);
}

// Stores VEC fp32 state values at element i; a bf16 state rounds to nearest even (cvt.rn, the
// reference's reduce_precision + convert).
template <int VEC>
__device__ __forceinline__ void store_state_vec(const KernelArgs& a, void* m, int64_t i,
                                                const float* v) {
  if (a.state_bf16)
    store_vec<__nv_bfloat16, VEC>(static_cast<__nv_bfloat16*>(m), i, a.n, v, a.aligned);
  else
    store_vec<float, VEC>(static_cast<float*>(m), i, a.n, v, a.aligned);
}

// Loads VEC contribution values at element i, with the compensator's apply step (Eq. 10) in
// registers when COMP; the padding beyond n is 0 (not compensated, as in the reference).

template <typename T, int VEC, bool COMP>
__device__ __forceinline__ void load_contrib(const KernelArgs& a, int64_t i, float* v) {
  load_vec<T, VEC>(static_cast<const T*>(a.x), i, a.n, v, a.aligned);
  if constexpr (COMP) {
    float m1[VEC], m2[VEC];
    load_state_vec<VEC>(a, a.m1, i, m1);
    load_state_vec<VEC>(a, a.m2, i, m2);
#pragma unroll
    for (int k = 0; k < VEC; ++k)
      if (i + k < a.n) v[k] = comp_apply(v[k], m1[k], m2[k], a.k);
  }
  const float f = scale_of(a);  // after the apply step: the compensator runs outside the scaling
#pragma unroll
  for (int k = 0; k < VEC; ++k) v[k] = mul_rn(v[k], f);
}

// Stores the output and, when COMP and UPDATE, updates m1/m2 in place (Eq. 4 and 11) from y in
// fp32 (UPDATE false: the applied call, EchoConfig.state_update = "separate", as FastStages').
template <typename T, int VEC, bool COMP, bool UPDATE = COMP>
__device__ __forceinline__ void store_output(const KernelArgs& a, int64_t i,
                                             const float* y_scaled) {
  float y[VEC];  // back in x's units before the output and the update
  const float inv = unscale_of(a);
#pragma unroll
  for (int k = 0; k < VEC; ++k) y[k] = mul_rn(y_scaled[k], inv);
  store_vec<T, VEC>(static_cast<T*>(a.y), i, a.n, y, a.aligned);
  if constexpr (COMP && UPDATE) {
    // x' is recomputed from x, m1, m2 (each read once here) rather than kept from the push
    // stage: the tail runs long after the push of the same values.
    float xp[VEC], m1[VEC], m2[VEC], n1[VEC], n2[VEC];
    load_vec<T, VEC>(static_cast<const T*>(a.x), i, a.n, xp, a.aligned);
    load_state_vec<VEC>(a, a.m1, i, m1);
    load_state_vec<VEC>(a, a.m2, i, m2);
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      if (i + k < a.n) xp[k] = comp_apply(xp[k], m1[k], m2[k], a.k);  // as load_contrib
      comp_update(xp[k], y[k], m1[k], m2[k], a.k, &n1[k], &n2[k]);
    }
    store_state_vec<VEC>(a, a.m1, i, n1);
    store_state_vec<VEC>(a, a.m2, i, n2);
  }
}

__device__ __forceinline__ void stats_add_vec(GroupStats& st, const float* v, int cnt) {
  for (int k = 0; k < cnt; ++k) {
    if (!is_finite(v[k])) st.finite = false;
    st.lo = min_f(st.lo, v[k]);
    st.hi = max_f(st.hi, v[k]);
  }
}

__device__ __forceinline__ GroupStats empty_stats() {
  // Identities of min/max, so lanes without values do not change the warp's statistics.
  return GroupStats{__int_as_float(0x7f800000), __int_as_float(0xff800000), true};
}

template <int VEC>
__device__ __forceinline__ void encode_chunk(const float* v, const QuantParams& p, int bits,
                                             int policy, uint8_t* dst) {
  uint8_t codes[VEC];
#pragma unroll
  for (int k = 0; k < VEC; ++k) codes[k] = encode_value(v[k], p, bits, policy);
  store_codes<VEC>(dst, bits, codes);
}

template <int VEC>
__device__ __forceinline__ void decode_chunk(const uint8_t* src, const DequantParams& d, int bits,
                                             float* v) {
  uint8_t codes[VEC];
  load_codes<VEC>(src, bits, codes);
#pragma unroll
  for (int k = 0; k < VEC; ++k) v[k] = decode_value(codes[k], d);
}

// push: quantize group `grp` of segment `seg` into owner seg's push slot for this rank.
template <typename T, int VEC, bool COMP>
__device__ void push_group(const KernelArgs& a, int seg, int64_t grp, int64_t local, int lane) {
  const int cb = a.g * a.bits / 8;
  const int chunks = a.g / VEC;
  const int64_t e0 = seg * a.seg_groups * a.g + grp * a.g;
  GroupStats st = empty_stats();
  float cache[kCacheChunks][VEC];  // one pass over x (and m1, m2) when the group fits
  for (int c = lane, i = 0; c < chunks; c += kWarp, ++i) {
    float v[VEC];
    load_contrib<T, VEC, COMP>(a, e0 + c * VEC, v);
    stats_add_vec(st, v, VEC);
    if (i < kCacheChunks) {
#pragma unroll
      for (int k = 0; k < VEC; ++k) cache[i][k] = v[k];
    }
  }
  warp_stats(st);
  const QuantParams p = make_params(st, a.bits, a.policy);
  uint8_t* slot = a.ws[seg] + push_slot(a.me, a.slot_bytes);
  uint8_t* codes = slot + local * cb;
  if (lane == 0) {
    uint16_t* prm = reinterpret_cast<uint16_t*>(slot + a.params_offset) + local * num_params(a.policy);
    prm[0] = p.s16;
    if (a.policy != kPolicySym) prm[1] = p.z16;
  }
  for (int c = lane, i = 0; c < chunks; c += kWarp, ++i) {
    float v[VEC];
    if (i < kCacheChunks) {
#pragma unroll
      for (int k = 0; k < VEC; ++k) v[k] = cache[i][k];
    } else {
      load_contrib<T, VEC, COMP>(a, e0 + c * VEC, v);  // large groups: a second (cached) read
    }
    encode_chunk<VEC>(v, p, a.bits, a.policy, codes + c * VEC * a.bits / 8);
  }
}

// One value chunk of the owner's fp32 sum, in rank order with its own contribution in place.
template <typename T, int VEC, bool COMP>
__device__ __forceinline__ void sum_chunk(const KernelArgs& a, int64_t e, int64_t local, int c,
                                          float* acc) {
  const int cb = a.g * a.bits / 8;
  const int np = num_params(a.policy);
  for (int r = 0; r < a.P; ++r) {
    float v[VEC];
    if (r == a.me) {
      load_contrib<T, VEC, COMP>(a, e, v);
    } else {
      const uint8_t* slot = a.ws[a.me] + push_slot(r, a.slot_bytes);
      const DequantParams d = load_dequant_params(
          reinterpret_cast<const uint16_t*>(slot + a.params_offset) + local * np, a.bits, a.policy);
      decode_chunk<VEC>(slot + local * cb + c * VEC * a.bits / 8, d, a.bits, v);
    }
#pragma unroll
    for (int k = 0; k < VEC; ++k) acc[k] = r == 0 ? v[k] : add_rn(acc[k], v[k]);
  }
}

// reduce + gather of one group of the own segment.
template <typename T, int VEC, bool COMP, bool UPDATE = COMP>
__device__ void reduce_group(const KernelArgs& a, int64_t grp, int64_t local, int lane) {
  const int cb = a.g * a.bits / 8;
  const int np = num_params(a.policy);
  const int chunks = a.g / VEC;
  const int64_t e0 = a.me * a.seg_groups * a.g + grp * a.g;
  float cache[kCacheChunks][VEC];
  GroupStats st = empty_stats();
  for (int c = lane, i = 0; c < chunks; c += kWarp, ++i) {
    float acc[VEC];
    sum_chunk<T, VEC, COMP>(a, e0 + c * VEC, local, c, acc);
    stats_add_vec(st, acc, VEC);
    if (i < kCacheChunks) {
#pragma unroll
      for (int k = 0; k < VEC; ++k) cache[i][k] = acc[k];
    }
  }
  warp_stats(st);
  const QuantParams p = make_params(st, a.bits, a.policy);
  if (lane < a.P) {  // the parameters go to every rank's gather slot for this owner
    uint16_t* prm = reinterpret_cast<uint16_t*>(a.ws[lane] + gather_slot(a.me, a.P, a.slot_bytes) +
                                                a.params_offset) + local * np;
    prm[0] = p.s16;
    if (a.policy != kPolicySym) prm[1] = p.z16;
  }
  uint16_t prm_local[2] = {p.s16, p.z16};
  const DequantParams d = dequant_params(prm_local, a.bits, a.policy);
  for (int c = lane, i = 0; c < chunks; c += kWarp, ++i) {
    float acc[VEC];
    if (i < kCacheChunks) {
#pragma unroll
      for (int k = 0; k < VEC; ++k) acc[k] = cache[i][k];
    } else {
      sum_chunk<T, VEC, COMP>(a, e0 + c * VEC, local, c, acc);
    }
    uint8_t codes[VEC];
    float y[VEC];
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      codes[k] = encode_value(acc[k], p, a.bits, a.policy);
      y[k] = decode_value(codes[k], d);  // the owner decodes the same code its peers receive
    }
    const int64_t byte = local * cb + c * VEC * a.bits / 8;
    for (int r = 0; r < a.P; ++r)
      store_codes<VEC>(a.ws[r] + gather_slot(a.me, a.P, a.slot_bytes) + byte, a.bits, codes);
    store_output<T, VEC, COMP, UPDATE>(a, e0 + c * VEC, y);
  }
}

// tail: dequantize one group of owner seg's reduced code.
template <typename T, int VEC, bool COMP, bool UPDATE = COMP>
__device__ void tail_group(const KernelArgs& a, int seg, int64_t grp, int64_t local, int lane) {
  const int cb = a.g * a.bits / 8;
  const int np = num_params(a.policy);
  const int chunks = a.g / VEC;
  const int64_t e0 = seg * a.seg_groups * a.g + grp * a.g;
  const uint8_t* slot = a.ws[a.me] + gather_slot(seg, a.P, a.slot_bytes);
  const DequantParams d = load_dequant_params(
      reinterpret_cast<const uint16_t*>(slot + a.params_offset) + local * np, a.bits, a.policy);
  for (int c = lane; c < chunks; c += kWarp) {
    float y[VEC];
    decode_chunk<VEC>(slot + local * cb + c * VEC * a.bits / 8, d, a.bits, y);
    store_output<T, VEC, COMP, UPDATE>(a, e0 + c * VEC, y);
  }
}

// The generic stages over a tile: one warp per group, g / bits / policy at run time (any g).
// UPDATE as in FastStages (false: the applied call).
template <typename T, int VEC, bool COMP, bool UPDATE = COMP>
struct GenericStages {
  static constexpr int kMinBlocks = 1;  // __launch_bounds__' second argument
  __device__ static void setup() {}
  __device__ static void push(const KernelArgs& a, int seg, int64_t first, int count,
                              int64_t local0, int warp, int warps, int lane) {
    for (int q = warp; q < count; q += warps) push_group<T, VEC, COMP>(a, seg, first + q, local0 + q, lane);
  }
  __device__ static void reduce(const KernelArgs& a, int64_t first, int count, int64_t local0,
                                int warp, int warps, int lane) {
    for (int q = warp; q < count; q += warps) reduce_group<T, VEC, COMP, UPDATE>(a, first + q, local0 + q, lane);
  }
  __device__ static void tail(const KernelArgs& a, int seg, int64_t first, int count,
                              int64_t local0, int warp, int warps, int lane) {
    for (int q = warp; q < count; q += warps) tail_group<T, VEC, COMP, UPDATE>(a, seg, first + q, local0 + q, lane);
  }
};

// The generic stages with the Hadamard rotation (any power-of-two g <= kMaxRotatedGroup): a warp
// stages its group in shared memory, rotates it there (echo_common.h's stages, lane-strided
// pairs, __syncwarp between stages) and quantizes from there; sums and outputs likewise. The
// fallback of the fast stages (g outside their instances, rows not 16-byte aligned), so plain.
constexpr int kMaxRotatedGroup = 1024;

template <typename T, bool COMP, bool UPDATE = COMP>
struct RotatedGenericStages {
  static constexpr int VEC = 2;  // g >= 2 and even: two values a chunk (one byte of 4-bit codes)
  static constexpr int kMinBlocks = 1;

  __device__ static void setup() {}

  __device__ static float* group_buffer(int warp) {
    __shared__ float buf[kThreads / kWarp][kMaxRotatedGroup];  // 32 KiB a block
    return buf[warp];
  }

  // In place on the warp's buffer b[0, g): forward (v * s, stages, * f) or inverse (stages,
  // * s f). Reads and writes of a stage by other lanes are ordered by __syncwarp.
  __device__ static void rotate(float* b, int g, int lane, float f, bool inverse) {
    __syncwarp();  // b was written by the lanes of other chunks
    if (!inverse) {
      for (int i = lane; i < g; i += kWarp)
        b[i] = mul_rn(b[i], hadamard_sign_negative(i) ? -1.0f : 1.0f);
    }
    __syncwarp();
    for (int h = 1; h < g; h *= 2) {
      for (int p = lane; p < g / 2; p += kWarp) {
        const int i = (p / h) * 2 * h + p % h;
        const float x0 = b[i], x1 = b[i + h];
        b[i] = add_rn(x0, x1);
        b[i + h] = sub_rn(x0, x1);
      }
      __syncwarp();
    }
    for (int i = lane; i < g; i += kWarp)
      b[i] = mul_rn(b[i], inverse && hadamard_sign_negative(i) ? -f : f);
    __syncwarp();
  }

  // The quantization parameters of the (rotated) group in b.
  __device__ static QuantParams quantize_buffer(const KernelArgs& a, const float* b, int lane) {
    GroupStats st = empty_stats();
    for (int c = lane; c < a.g / VEC; c += kWarp) stats_add_vec(st, b + c * VEC, VEC);
    warp_stats(st);
    return make_params(st, a.bits, a.policy);
  }

  __device__ static void push(const KernelArgs& a, int seg, int64_t first, int count,
                              int64_t local0, int warp, int warps, int lane) {
    const int cb = a.g * a.bits / 8;
    float* b = group_buffer(warp);
    uint8_t* slot = a.ws[seg] + push_slot(a.me, a.slot_bytes);
    for (int q = warp; q < count; q += warps) {
      const int64_t local = local0 + q;
      const int64_t e0 = (seg * a.seg_groups + first + q) * a.g;
      for (int c = lane; c < a.g / VEC; c += kWarp)
        load_contrib<T, VEC, COMP>(a, e0 + c * VEC, b + c * VEC);
      rotate(b, a.g, lane, a.rot_scale, false);
      const QuantParams p = quantize_buffer(a, b, lane);
      if (lane == 0) {
        uint16_t* prm =
            reinterpret_cast<uint16_t*>(slot + a.params_offset) + local * num_params(a.policy);
        prm[0] = p.s16;
        if (a.policy != kPolicySym) prm[1] = p.z16;
      }
      for (int c = lane; c < a.g / VEC; c += kWarp)
        encode_chunk<VEC>(b + c * VEC, p, a.bits, a.policy,
                          slot + local * cb + c * VEC * a.bits / 8);
      __syncwarp();  // b is reused by the next group
    }
  }

  __device__ static void reduce(const KernelArgs& a, int64_t first, int count, int64_t local0,
                                int warp, int warps, int lane) {
    const int cb = a.g * a.bits / 8;
    const int np = num_params(a.policy);
    float* b = group_buffer(warp);
    for (int q = warp; q < count; q += warps) {
      const int64_t local = local0 + q;
      const int64_t e0 = (a.me * a.seg_groups + first + q) * a.g;
      for (int c = lane; c < a.g / VEC; c += kWarp)
        load_contrib<T, VEC, COMP>(a, e0 + c * VEC, b + c * VEC);
      rotate(b, a.g, lane, a.rot_scale, false);  // the own contribution, rotated like the peers'
      for (int c = lane; c < a.g / VEC; c += kWarp) {  // sum in rank order, own value in place
        float acc[VEC];
        for (int r = 0; r < a.P; ++r) {
          float v[VEC];
          if (r == a.me) {
            v[0] = b[c * VEC];
            v[1] = b[c * VEC + 1];
          } else {
            const uint8_t* slot = a.ws[a.me] + push_slot(r, a.slot_bytes);
            const DequantParams d = load_dequant_params(
                reinterpret_cast<const uint16_t*>(slot + a.params_offset) + local * np, a.bits,
                a.policy);
            decode_chunk<VEC>(slot + local * cb + c * VEC * a.bits / 8, d, a.bits, v);
          }
#pragma unroll
          for (int k = 0; k < VEC; ++k) acc[k] = r == 0 ? v[k] : add_rn(acc[k], v[k]);
        }
        b[c * VEC] = acc[0];
        b[c * VEC + 1] = acc[1];
      }
      __syncwarp();
      const QuantParams p = quantize_buffer(a, b, lane);
      if (lane < a.P) {  // the parameters go to every rank's gather slot for this owner
        uint8_t* gather = a.ws[lane] + gather_slot(a.me, a.P, a.slot_bytes);
        uint16_t* prm = reinterpret_cast<uint16_t*>(gather + a.params_offset) + local * np;
        prm[0] = p.s16;
        if (a.policy != kPolicySym) prm[1] = p.z16;
      }
      uint16_t prm_local[2] = {p.s16, p.z16};
      const DequantParams d = dequant_params(prm_local, a.bits, a.policy);
      for (int c = lane; c < a.g / VEC; c += kWarp) {
        uint8_t codes[VEC];
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          codes[k] = encode_value(b[c * VEC + k], p, a.bits, a.policy);
          b[c * VEC + k] = decode_value(codes[k], d);  // the code every rank decodes
        }
        for (int r = 0; r < a.P; ++r)
          store_codes<VEC>(a.ws[r] + gather_slot(a.me, a.P, a.slot_bytes) + local * cb +
                               c * VEC * a.bits / 8, a.bits, codes);
      }
      rotate(b, a.g, lane, a.rot_scale, true);
      for (int c = lane; c < a.g / VEC; c += kWarp)
        store_output<T, VEC, COMP, UPDATE>(a, e0 + c * VEC, b + c * VEC);
      __syncwarp();
    }
  }

  __device__ static void tail(const KernelArgs& a, int seg, int64_t first, int count,
                              int64_t local0, int warp, int warps, int lane) {
    const int cb = a.g * a.bits / 8;
    const int np = num_params(a.policy);
    float* b = group_buffer(warp);
    const uint8_t* slot = a.ws[a.me] + gather_slot(seg, a.P, a.slot_bytes);
    for (int q = warp; q < count; q += warps) {
      const int64_t local = local0 + q;
      const int64_t e0 = (seg * a.seg_groups + first + q) * a.g;
      const DequantParams d = load_dequant_params(
          reinterpret_cast<const uint16_t*>(slot + a.params_offset) + local * np, a.bits,
          a.policy);
      for (int c = lane; c < a.g / VEC; c += kWarp)
        decode_chunk<VEC>(slot + local * cb + c * VEC * a.bits / 8, d, a.bits, b + c * VEC);
      rotate(b, a.g, lane, a.rot_scale, true);
      for (int c = lane; c < a.g / VEC; c += kWarp)
        store_output<T, VEC, COMP, UPDATE>(a, e0 + c * VEC, b + c * VEC);
      __syncwarp();
    }
  }
};

// ---- the fast stages: G and BITS compile-time, the quantizer of ffi/quant_fast.cuh ------------
// The same arithmetic, in the same order of rounded operations, as the generic stages and
// echo_common.h (quant_fast.cuh argues each hardware shortcut), organised like the fast
// quantize kernel of ffi/quant_cuda.cu: a group is kLanes lanes of one warp, each lane kLoads
// pieces of kVec = 16 / sizeof(T) values (one 16-byte load of x, one 2/4/8-byte word of codes),
// so a warp holds kGroupsPerWarp groups at once and every value stays in registers from the
// load to the encoding. Group statistics are integer min / max of order keys (a group is finite
// iff its extreme keys are). Why: the generic stages run one warp per group with branchy float
// min / max and run-time formats, and were instruction-bound (the quantizer's cost times the
// groups each rank quantizes); here the per-value work is a few integer and fp32 instructions.
// Needs x, y, m1, m2 16-byte aligned (XLA's buffers are; rows of a virtual-rank array may not
// be) and G in {32, 64, 128, 256} (instances for larger groups cost build time and registers,
// 118-191 a thread, for group sizes few use); every other call runs the generic stages.
// ROT: the Hadamard rotation of every group after the entry loads and before the output stores,
// in registers and shuffles (quant_fast.cuh), the sign masks of the lanes in shared memory.
// S: the compensator state's element type (float or __nv_bfloat16; float when !COMP), a template
// parameter rather than KernelArgs::state_bf16: the run-time branch kept both paths' live ranges
// (the rotated fp32 compensated instance 64 -> 80 registers, g = 128, sm_90a), and with it the
// bf16 state was not faster than the fp32 one (one H200: 2.750 against 2.665 ms, fp32 x, 4
// virtual ranks, 256 MB a rank; as a template parameter 2.390 against 2.615).
// UPDATE (COMP only): the update step where y is produced; false: the applied call's instances
// (EchoConfig.state_update = "separate": the apply step alone, m1 and m2 only read). A template
// parameter: as a run-time flag (a uniform branch) it raised the compensated instances'
// registers (64 -> 79-90, 80 -> 89-95, ptxas sm_90a); the generic stages take it likewise.
template <typename T, int G, int BITS, bool COMP, bool ROT, typename S = float, bool UPDATE = COMP>
struct FastStages {
  // Two loads a lane: the stages hold a piece's values, state and output at once (registers).
  // One in the compensated 16-bit instances: with two, the unrotated ones' update's prefetched
  // x, m1, m2 (3 x 16 values a lane) took 123-126 registers (2 blocks an SM), with one 64;
  // measured (one H200, 4 virtual ranks, bf16 x, 256 MB a rank): fused compensator 5.180 ->
  // 4.428 ms, with a bf16 state 4.529 -> 3.425 ms. The same in the rotated compensated 16-bit
  // instances (121-127 -> 80 registers, 2 -> 3 blocks an SM): comp-fused-rot 5.535 -> 4.958 ms
  // (bf16 x, 256 MB; 1.434 -> 1.305 at 64 MB). The uncompensated 16-bit instances keep two
  // (one load: p2p4 1.533 -> 1.620 ms; rotated, 80 -> 48 registers but p2p4-rot 2.168 -> 2.578).
  // Four in the uncompensated rotated instances would take one shuffle stage a rotation away
  // (8 lanes a 128-group in fp32), but ptxas gave fp32 104-110 registers (64 with two) and the
  // 16-bit ones 650-750 bytes of spills under their 4-blocks bound (sm_90a; not timed).
  static constexpr int kLoadsPerLane = sizeof(T) == 2 && COMP ? 1 : 2;
  using L = fast::QuantLayout<T, G, fast::lanes_for_loads<T, G, kLoadsPerLane>()>;
  static constexpr int kVec = L::kVec, kLanes = L::kLanes, kLoads = L::kLoads;
  static constexpr int kGpw = L::kGroupsPerWarp;
  static constexpr int kPieceBytes = kVec * BITS / 8;
  static constexpr int kCodeBytes = G * BITS / 8;
  // Blocks of kThreads an SM that ptxas must fit (__launch_bounds__; kernel_of), uncompensated
  // instances (ECHO_P2P_MIN_BLOCKS_32 / _16, rotated: _ROT_32 / _ROT_16) and the applied call's
  // unrotated 16-bit ones (_APPLIED_16); 1: no bound.
  static constexpr int kMinBlocks =
      COMP ? (!UPDATE && !ROT && sizeof(T) == 2 ? ECHO_P2P_MIN_BLOCKS_APPLIED_16 : 1)
      : ROT ? (sizeof(T) == 4 ? ECHO_P2P_MIN_BLOCKS_ROT_32 : ECHO_P2P_MIN_BLOCKS_ROT_16)
            : (sizeof(T) == 4 ? ECHO_P2P_MIN_BLOCKS_32 : ECHO_P2P_MIN_BLOCKS_16);

  // ECHO_P2P_ROT_EXCHANGE (the uncompensated rotated instances; not yet measured on a GPU):
  // the rotation with half exchanges (quant_fast.cuh: one shuffle for two values a cross-lane
  // stage instead of one a value; the same bits, checked on the host by
  // ffi/tools/hadamard_exchange_check.cc). Its groups are loaded, stored as codes and stored as
  // outputs at permuted lanes and pieces: in_piece, code_lane / code_piece, out_lane (the
  // identity without it).
  static constexpr bool kExchange = ROT && !COMP && ECHO_P2P_ROT_EXCHANGE;
  using XP = fast::ExchangePlans<L>;  // instantiated only where kExchange
  __device__ __forceinline__ static int in_piece(int j, int k) {
    if constexpr (kExchange) return XP::input_piece(j, k);
    return k;
  }
  __device__ __forceinline__ static int code_lane(int j) {
    if constexpr (kExchange) return XP::rotated_lane(j);
    return j;
  }
  __device__ __forceinline__ static int code_piece(int j, int k) {
    if constexpr (kExchange) return XP::rotated_piece(j, k);
    return k;
  }
  __device__ __forceinline__ static int out_lane(int j) {
    if constexpr (kExchange) return XP::output_lane(j);
    return j;
  }
  __device__ __forceinline__ static void rotate_group(float (&v)[kLoads][kVec], int j,
                                                     uint32_t sm, float f) {
    if constexpr (kExchange) fast::hadamard_exchange_rotate<L>(v, j, sm, f);
    else fast::hadamard_rotate<L, !COMP>(v, j, sm, f);
  }
  __device__ __forceinline__ static void unrotate_group(float (&v)[kLoads][kVec], int j,
                                                       uint32_t sm_out, float f) {
    if constexpr (kExchange) fast::hadamard_exchange_unrotate<L>(v, j, sm_out, f);
    else fast::hadamard_unrotate<L, !COMP>(v, j, sm_out, f);
  }

  // Lane j's sign mask (fast::hadamard_sign_mask), computed once a block: the hash costs
  // ~25 instructions a value, too much to repeat for every tile. With kExchange, two: the
  // forward rotation's input layout and the inverse's output layout differ.
  __device__ static uint32_t* sign_masks() {
    __shared__ uint32_t masks[kExchange ? 2 * kLanes : kLanes];
    return masks;
  }
  __device__ static void setup() {
    if constexpr (kExchange) {
      if (threadIdx.x < kLanes) {
        sign_masks()[threadIdx.x] = fast::exchange_sign_mask<L>(threadIdx.x, true);
        sign_masks()[kLanes + threadIdx.x] = fast::exchange_sign_mask<L>(threadIdx.x, false);
      }
    } else if constexpr (ROT) {
      if (threadIdx.x < kLanes)
        sign_masks()[threadIdx.x] = fast::hadamard_sign_mask<L>(threadIdx.x);
    }
  }
  __device__ static uint32_t sign_mask(int j) {
    if constexpr (ROT) return sign_masks()[j];
    return 0;
  }
  __device__ __forceinline__ static uint32_t sign_mask_out(int j) {  // the inverse rotation's
    if constexpr (kExchange) return sign_masks()[kLanes + j];
    return sign_mask(j);
  }

  static constexpr bool kStateBf16 = std::is_same_v<S, __nv_bfloat16>;
  static_assert(kStateBf16 || std::is_same_v<S, float>, "the state is float or bfloat16");

  // kVec values of m (m1 or m2) at element e as fp32; 0 past n. A bf16 state (kVec * 2 bytes:
  // one 8- or 16-byte access) is widened exactly.
  __device__ static void load_state(const KernelArgs& a, const void* m, int64_t e, float* v) {
    if constexpr (kStateBf16)
      load_vec<__nv_bfloat16, kVec>(static_cast<const __nv_bfloat16*>(m), e, a.n, v);
    else
      load_state_f32(static_cast<const float*>(m), e, a.n, v);
  }
  // kVec fp32 values stored at element e (a bf16 state rounded to nearest even); none past n.
  __device__ static void store_state(const KernelArgs& a, void* m, int64_t e, const float* v) {
    if constexpr (kStateBf16)
      store_vec<__nv_bfloat16, kVec>(static_cast<__nv_bfloat16*>(m), e, a.n, v);
    else
      store_state_f32(static_cast<float*>(m), e, a.n, v);
  }
  __device__ static void load_state_f32(const float* m, int64_t e, int64_t n, float* v) {
    if (e + kVec <= n) {
#pragma unroll
      for (int c = 0; c < kVec / 4; ++c) {
        const float4 w = *reinterpret_cast<const float4*>(m + e + 4 * c);
        v[4 * c] = w.x; v[4 * c + 1] = w.y; v[4 * c + 2] = w.z; v[4 * c + 3] = w.w;
      }
    } else {
#pragma unroll
      for (int t = 0; t < kVec; ++t) v[t] = e + t < n ? m[e + t] : 0.0f;
    }
  }
  __device__ static void store_state_f32(float* m, int64_t e, int64_t n, const float* v) {
    if (e + kVec <= n) {
#pragma unroll
      for (int c = 0; c < kVec / 4; ++c)
        *reinterpret_cast<float4*>(m + e + 4 * c) =
            make_float4(v[4 * c], v[4 * c + 1], v[4 * c + 2], v[4 * c + 3]);
    } else {
#pragma unroll
      for (int t = 0; t < kVec; ++t)
        if (e + t < n) m[e + t] = v[t];
    }
  }

  // The raw contribution (x as fp32) of the piece at element e; 0 past n (the padding).
  // kStaged: a whole piece is read from `staged` (shared memory, copied there by prefetch_x)
  // instead of x; a partial one from x, as prefetch_x leaves it out.
  template <bool kStaged = false>
  __device__ static void load_raw(const KernelArgs& a, int64_t e, float* v,
                                  const uint4* staged = nullptr) {
    const T* x = static_cast<const T*>(a.x);
    if (e + kVec <= a.n) {
      fast::unpack_values<T, kVec>(kStaged ? *staged : *reinterpret_cast<const uint4*>(x + e), v);
    } else {
#pragma unroll
      for (int t = 0; t < kVec; ++t) v[t] = e + t < a.n ? to_f32<T>(x[e + t]) : 0.0f;
    }
  }

  // The contribution, after the compensator's apply step (Eq. 10) when COMP; the padding beyond
  // n stays 0 (not compensated, as in the reference).
  template <bool kStaged = false>
  __device__ static void load_contrib(const KernelArgs& a, int64_t e, float* v,
                                      const uint4* staged = nullptr) {
    load_raw<kStaged>(a, e, v, staged);
    if constexpr (COMP) {
      float m1[kVec], m2[kVec];
      load_state(a, a.m1, e, m1);
      load_state(a, a.m2, e, m2);
#pragma unroll
      for (int t = 0; t < kVec; ++t)
        if (e + t < a.n) v[t] = comp_apply(v[t], m1[t], m2[t], a.k);
    }
    const float f = scale_of(a);  // the rescaling, after the apply step (Sec. 5.4)
#pragma unroll
    for (int t = 0; t < kVec; ++t) v[t] = mul_rn(v[t], f);
  }

  // What the state update of a piece reads (COMP): x as fp32 and m1, m2. The unrotated stages
  // load it for all kLoads pieces of a group before the first store (prefetch_update), so that
  // every load of the update is in flight at once (a load after a store of y or m1 / m2 could
  // alias it and waits for it). Measured on one H200 (4 virtual ranks, 256 MB a rank): the
  // fused compensator 2.710 -> 2.679 ms (fp32), 5.673 -> 5.393 ms (bf16). The rotated stages
  // load it piece by piece (load_update): prefetched, their registers went up and the rotated
  // fused compensator from 2.905 to 3.376 ms (fp32), 6.077 to 8.863 ms (bf16).
  struct UpdateIn {
    float x[kVec], m1[kVec], m2[kVec];
  };
  __device__ static void load_update(const KernelArgs& a, int64_t e, UpdateIn& in) {
    if constexpr (COMP && UPDATE) {
      load_raw(a, e, in.x);
      load_state(a, a.m1, e, in.m1);
      load_state(a, a.m2, e, in.m2);
    }
  }
  __device__ static void prefetch_update(const KernelArgs& a, int64_t e0, int j,
                                         UpdateIn (&in)[kLoads]) {
#pragma unroll
    for (int k = 0; k < kLoads; ++k) load_update(a, e0 + L::index(j, k, 0), in[k]);
  }

  // Stores y (rounded to T) and, when COMP, updates m1 / m2 in place (Eq. 4 and 11) from the
  // fp32 y, with x' recomputed from x, m1, m2 (prefetched into `in`) as in load_contrib.
  __device__ static void store_output(const KernelArgs& a, int64_t e, const float* y_scaled,
                                      const UpdateIn& in) {
    float y[kVec];  // back in x's units before the output and the update
    const float inv = unscale_of(a);
#pragma unroll
    for (int t = 0; t < kVec; ++t) y[t] = mul_rn(y_scaled[t], inv);
    T* out = static_cast<T*>(a.y);
    if (e + kVec <= a.n) {
      *reinterpret_cast<uint4*>(out + e) = fast::pack_values<T>(y);
    } else {
#pragma unroll
      for (int t = 0; t < kVec; ++t)
        if (e + t < a.n) out[e + t] = from_f32<T>(y[t]);
    }
    if constexpr (COMP && UPDATE) {  // the applied call leaves the update to its own op
      float n1[kVec], n2[kVec];
#pragma unroll
      for (int t = 0; t < kVec; ++t) {
        const float xp = comp_apply(in.x[t], in.m1[t], in.m2[t], a.k);
        comp_update(xp, y[t], in.m1[t], in.m2[t], a.k, &n1[t], &n2[t]);
      }
      store_state(a, a.m1, e, n1);
      store_state(a, a.m2, e, n2);
    }
  }

  // The encoder of the group whose lanes hold v (order-key min / max over the group's lanes).
  // min.NaN / max.NaN (the standalone quantizer's range) took 4-6 more registers here, and the
  // virtual-rank benchmark showed no gain with it; only the plain fp32 push (push_plain), which
  // takes the range before scaling, measured faster with it.
  __device__ static fast::Encoder group_encoder(const KernelArgs& a, const float (&v)[kLoads][kVec],
                                                uint32_t* wire) {
    int32_t kmin = fast::kKeyMax, kmax = fast::kKeyMin;
#pragma unroll
    for (int k = 0; k < kLoads; ++k) {
#pragma unroll
      for (int t = 0; t < kVec; ++t) {
        const int32_t key = fast::order_key(__float_as_uint(v[k][t]));
        kmin = fast::imin(kmin, key);
        kmax = fast::imax(kmax, key);
      }
    }
#pragma unroll
    for (int off = kLanes / 2; off > 0; off >>= 1) {  // within the group's aligned lanes
      kmin = fast::imin(kmin, __shfl_xor_sync(0xffffffffu, kmin, off));
      kmax = fast::imax(kmax, __shfl_xor_sync(0xffffffffu, kmax, off));
    }
    return fast::make_encoder<BITS>(a.policy, __uint_as_float(fast::from_order_key(kmin)),
                                    __uint_as_float(fast::from_order_key(kmax)),
                                    fast::keys_finite(kmin, kmax), wire);
  }

  __device__ static int64_t piece_byte(int64_t local, int j, int k) {
    return local * kCodeBytes + static_cast<int64_t>(k * kLanes + j) * kPieceBytes;
  }

  // ECHO_P2P_PREFETCH (a build switch, 0 by default; not yet measured on a GPU): bit 0, the
  // uncompensated push copies the next group set's x into shared memory (cp.async, two buffers
  // a warp, 16 KiB a block) while it quantizes the current one; bit 1, the reduce its own x
  // likewise. Why: the stages wait on memory with one group set a warp in flight (one H200, 4
  // virtual ranks, 256 MB a rank, before the launch bounds: push 0.38 ms fp32 / 0.66 ms bf16,
  // against 0.19 / 0.28 ms to issue its instructions, counted in the SASS, and 0.22 / 0.25 ms
  // to move its bytes at the copy's rate; docs/gpu.md), and issuing the next set's loads into
  // registers raised them and was slower (below); copies into shared memory keep loads in
  // flight without registers. Each lane reads back only the words it copied, so its own
  // cp.async.wait_group orders them (no barrier).
  static constexpr bool kPrefetchPush = (ECHO_P2P_PREFETCH & 1) && !COMP;
  static constexpr bool kPrefetchReduce = (ECHO_P2P_PREFETCH & 2) && !COMP;
  static constexpr bool kPrefetch = kPrefetchPush || kPrefetchReduce;  // the buffers exist
  __device__ static uint4* prefetch_buffer(int warp, int stage) {
    __shared__ uint4 staged[kPrefetch ? kThreads / kWarp : 1][2][kLoads * kWarp];
    return staged[kPrefetch ? warp : 0][stage];
  }
  // Lane's word of piece k in buffer `stage` (nullptr without kPrefetch: no shared array then).
  __device__ static const uint4* staged_piece(int warp, int stage, int k, int lane) {
    if constexpr (kPrefetch) return prefetch_buffer(warp, stage) + k * kWarp + lane;
    return nullptr;
  }
  // Starts the copies of the lane's whole pieces of group set q0 of segment seg's tile into buf
  // (word k * kWarp + lane: consecutive lanes, consecutive 16-byte words) and closes the group;
  // partial pieces (past n) are left to load_raw.
  __device__ static void prefetch_x(const KernelArgs& a, int seg, int64_t first, int count,
                                    int q0, int lane, uint4* buf) {
    const int q = q0 + lane / kLanes;
    if (q < count) {
      const T* x = static_cast<const T*>(a.x);
      const int64_t e0 = (seg * a.seg_groups + first + q) * G;
#pragma unroll
      for (int k = 0; k < kLoads; ++k) {
        const int64_t e = e0 + L::index(lane % kLanes, k, 0);
        if (e + kVec <= a.n) cp_async_16(&buf[k * kWarp + lane], x + e);
      }
    }
    cp_async_commit();
  }
  // A stage loop over the group sets q0 = warp * kGpw, + warps * kGpw, ... stages x when kOn:
  // the first set before the loop (prefetch_start), then at the top of each iteration (buffer s)
  // the next set's copies into the other buffer and the wait for this set's (prefetch_next).
  template <bool kOn>
  __device__ __forceinline__ static void prefetch_start(const KernelArgs& a, int seg,
                                                        int64_t first, int count, int warp,
                                                        int lane) {
    if constexpr (kOn)
      prefetch_x(a, seg, first, count, warp * kGpw, lane, prefetch_buffer(warp, 0));
  }
  template <bool kOn>
  __device__ __forceinline__ static void prefetch_next(const KernelArgs& a, int seg,
                                                       int64_t first, int count, int q0,
                                                       int warps, int warp, int lane, int s) {
    if constexpr (kOn) {
      prefetch_x(a, seg, first, count, q0 + warps * kGpw, lane, prefetch_buffer(warp, s ^ 1));
      cp_async_wait<1>();  // this set's copies (the group before the newest) have landed
    }
  }

  // Measured on one H200 (4 virtual ranks, 256 MB per rank): issuing the loads of two group
  // sets per warp before using either, and the P - 1 peers' code words of a group before the
  // sum, raised the registers (fp32 48 -> 73, bf16 64 -> 90 a thread), so fewer blocks fit an SM,
  // and made the call slower (p2p4 fp32 1.00 -> 1.10 ms, bf16 1.54 -> 2.23 ms): one group set a
  // warp at a time, loads issued per stage as below.

  // push of the uncompensated unrotated fp32 call: the group's range from x as loaded, with
  // min.NaN / max.NaN (two instructions a value; order keys take five), then scaled. Scaling by
  // the power-of-two factor f is monotone and keeps signs, so the min / max of the scaled values
  // are the scaled lo / hi bit for bit (-0 < +0 included). Measured on one H200 (4 virtual
  // ranks, p2p4 fp32): 0.264 -> 0.252 ms at 64 MB, 0.910 -> 0.890 ms at 256 MB. The 16-bit
  // instances keep the keys: the same change with their min.NaN.bf16x2 words spilled 300-350
  // bytes a thread under their 5-blocks bound and made bf16 p2p4 slower (1.289 -> 1.441 ms);
  // ECHO_P2P_PLAIN_PUSH_16 gives them this push over the unpacked fp32 values (not measured).
  __device__ static void push_plain(const KernelArgs& a, int seg, int64_t first, int count,
                                    int64_t local0, int warp, int warps, int lane) {
    const int j = lane % kLanes;
    uint8_t* slot = a.ws[seg] + push_slot(a.me, a.slot_bytes);
    uint16_t* prm = reinterpret_cast<uint16_t*>(slot + a.params_offset);
    const float f = scale_of(a);
    prefetch_start<kPrefetchPush>(a, seg, first, count, warp, lane);
    // s: the buffer of this group set (prefetch), toggled by every iteration, `continue` too.
    for (int q0 = warp * kGpw, s = 0; q0 < count; q0 += warps * kGpw, s ^= 1) {
      prefetch_next<kPrefetchPush>(a, seg, first, count, q0, warps, warp, lane, s);
      const int q = q0 + lane / kLanes;
      const bool valid = q < count;
      const int64_t e0 = (seg * a.seg_groups + first + q) * G;
      float v[kLoads][kVec];
      fast::Range r = fast::range_empty();
#pragma unroll
      for (int k = 0; k < kLoads; ++k) {
        if (valid) {
          load_raw<kPrefetchPush>(a, e0 + L::index(j, k, 0), v[k], staged_piece(warp, s, k, lane));
        } else {
#pragma unroll
          for (int t = 0; t < kVec; ++t) v[k][t] = 0.0f;
        }
#pragma unroll
        for (int t = 0; t < kVec; ++t) fast::range_add(r, v[k][t]);
      }
      fast::range_reduce<kLanes>(r);
      r.lo = mul_rn(r.lo, f);
      r.hi = mul_rn(r.hi, f);
      uint32_t wire;
      const fast::Encoder enc =
          fast::make_encoder<BITS>(a.policy, r.lo, r.hi, fast::range_finite(r), &wire);
      if (!valid) continue;
      if (j == 0) fast::store_wire(prm, local0 + q, a.policy, wire);
#pragma unroll
      for (int k = 0; k < kLoads; ++k) {
        uint32_t codes[kVec];
#pragma unroll
        for (int t = 0; t < kVec; ++t) codes[t] = fast::encode<BITS>(mul_rn(v[k][t], f), enc);
        fast::store_piece<kVec, BITS>(slot + piece_byte(local0 + q, j, k), codes, enc.mask);
      }
    }
  }

  // push: quantize the tile's groups of segment seg into owner seg's push slot for this rank.
  __device__ static void push(const KernelArgs& a, int seg, int64_t first, int count,
                              int64_t local0, int warp, int warps, int lane) {
    if constexpr (!COMP && !ROT && (sizeof(T) == 4 || ECHO_P2P_PLAIN_PUSH_16)) {
      push_plain(a, seg, first, count, local0, warp, warps, lane);
      return;
    }
    const int j = lane % kLanes;
    const uint32_t sm = sign_mask(j);
    uint8_t* slot = a.ws[seg] + push_slot(a.me, a.slot_bytes);
    uint16_t* prm = reinterpret_cast<uint16_t*>(slot + a.params_offset);
    // q0 is the same for the 32 lanes of a warp, so every shuffle runs with the whole warp;
    // the lanes of a group past the tile's end compute on zeros and store nothing.
    prefetch_start<kPrefetchPush>(a, seg, first, count, warp, lane);
    for (int q0 = warp * kGpw, s = 0; q0 < count; q0 += warps * kGpw, s ^= 1) {
      prefetch_next<kPrefetchPush>(a, seg, first, count, q0, warps, warp, lane, s);
      const int q = q0 + lane / kLanes;
      const bool valid = q < count;
      const int64_t e0 = (seg * a.seg_groups + first + q) * G;
      float v[kLoads][kVec];
#pragma unroll
      for (int k = 0; k < kLoads; ++k) {
        if (valid) {
          load_contrib<kPrefetchPush>(a, e0 + L::index(j, in_piece(j, k), 0), v[k],
                                      staged_piece(warp, s, in_piece(j, k), lane));
        } else {
#pragma unroll
          for (int t = 0; t < kVec; ++t) v[k][t] = 0.0f;
        }
      }
      if constexpr (ROT) rotate_group(v, j, sm, a.rot_scale);
      uint32_t wire;
      const fast::Encoder enc = group_encoder(a, v, &wire);
      if (!valid) continue;
      if (j == 0) fast::store_wire(prm, local0 + q, a.policy, wire);
#pragma unroll
      for (int k = 0; k < kLoads; ++k) {
        uint32_t codes[kVec];
#pragma unroll
        for (int t = 0; t < kVec; ++t) codes[t] = fast::encode<BITS>(v[k][t], enc);
        fast::store_piece<kVec, BITS>(slot + piece_byte(local0 + q, code_lane(j), code_piece(j, k)),
                                      codes, enc.mask);
      }
    }
  }

  // The reduce stage's end with the rotation: the codes of the rotated sum go to every rank's
  // gather slot, their decoded values are rotated back (all lanes: shuffles) before the stores.
  __device__ static void reduce_rotated_output(const KernelArgs& a,
                                               const float (&acc)[kLoads][kVec],
                                               const fast::Encoder& enc, uint32_t wire, bool valid,
                                               int64_t local, int64_t e0, int j,
                                               uint32_t sm_out) {
    const int64_t gather = gather_slot(a.me, a.P, a.slot_bytes);
    if (valid && j == 0) {
      for (int r = 0; r < a.P; ++r)
        fast::store_wire(reinterpret_cast<uint16_t*>(a.ws[r] + gather + a.params_offset), local,
                         a.policy, wire);
    }
    const DequantParams d = fast::decoder_of<BITS>(wire, a.policy);
    float y[kLoads][kVec];
#pragma unroll
    for (int k = 0; k < kLoads; ++k) {
      uint32_t codes[kVec];
#pragma unroll
      for (int t = 0; t < kVec; ++t) {
        codes[t] = fast::encode<BITS>(acc[k][t], enc) & enc.mask;
        y[k][t] = fast::decode_fast(codes[t], d);
      }
      if (valid) {
        for (int r = 0; r < a.P; ++r)
          fast::store_piece<kVec, BITS>(
              a.ws[r] + gather + piece_byte(local, code_lane(j), code_piece(j, k)), codes,
              0xFFFFFFFFu);
      }
    }
    unrotate_group(y, j, sm_out, a.rot_scale);
    if (!valid) return;
#pragma unroll
    for (int k = 0; k < kLoads; ++k) {
      UpdateIn in;
      load_update(a, e0 + L::index(out_lane(j), k, 0), in);
      store_output(a, e0 + L::index(out_lane(j), k, 0), y[k], in);
    }
  }

  // reduce + gather of the tile's groups of the own segment.
  __device__ static void reduce(const KernelArgs& a, int64_t first, int count, int64_t local0,
                                int warp, int warps, int lane) {
    const int j = lane % kLanes;
    const uint32_t sm = sign_mask(j);
    prefetch_start<kPrefetchReduce>(a, a.me, first, count, warp, lane);  // the own x
    for (int q0 = warp * kGpw, s = 0; q0 < count; q0 += warps * kGpw, s ^= 1) {
      prefetch_next<kPrefetchReduce>(a, a.me, first, count, q0, warps, warp, lane, s);
      const int q = q0 + lane / kLanes;
      const bool valid = q < count;
      const int64_t local = local0 + q;
      const int64_t e0 = (a.me * a.seg_groups + first + q) * G;
      // fp32 sum in rank order 0..P-1, the own full-precision contribution at its own position.
      float acc[kLoads][kVec];
      for (int r = 0; r < a.P; ++r) {
        float v[kLoads][kVec];
        if (!valid) {
#pragma unroll
          for (int k = 0; k < kLoads; ++k)
#pragma unroll
            for (int t = 0; t < kVec; ++t) v[k][t] = 0.0f;
        } else if (r == a.me) {
#pragma unroll
          for (int k = 0; k < kLoads; ++k)
            load_contrib<kPrefetchReduce>(a, e0 + L::index(j, in_piece(j, k), 0), v[k],
                                          staged_piece(warp, s, in_piece(j, k), lane));
        } else {
          const uint8_t* slot = a.ws[a.me] + push_slot(r, a.slot_bytes);
          const DequantParams d = fast::decoder_of<BITS>(
              fast::load_wire(reinterpret_cast<const uint16_t*>(slot + a.params_offset), local,
                              a.policy),
              a.policy);
#pragma unroll
          for (int k = 0; k < kLoads; ++k) {
            uint32_t codes[kVec];
            fast::unpack_piece_codes<kVec, BITS>(
                fast::load_piece_word<kVec, BITS>(
                    slot + piece_byte(local, code_lane(j), code_piece(j, k))),
                codes);
#pragma unroll
            for (int t = 0; t < kVec; ++t) v[k][t] = fast::decode_fast(codes[t], d);
          }
        }
        // The own contribution in the rotated basis, like the peers' codes (r is warp-uniform).
        if constexpr (ROT) {
          if (r == a.me) rotate_group(v, j, sm, a.rot_scale);
        }
#pragma unroll
        for (int k = 0; k < kLoads; ++k)
#pragma unroll
          for (int t = 0; t < kVec; ++t) acc[k][t] = r == 0 ? v[k][t] : add_rn(acc[k][t], v[k][t]);
      }
      uint32_t wire;
      const fast::Encoder enc = group_encoder(a, acc, &wire);
      if constexpr (ROT) {
        reduce_rotated_output(a, acc, enc, wire, valid, local, e0, j,
                              kExchange ? sign_mask_out(j) : sm);
      } else {
        // Written out in place: the same code as a helper like reduce_rotated_output (the
        // gather offset hoisted) took the fp32 kernel from 48 to 61 registers (ptxas, sm_90a,
        // g = 128), 4 instead of 5 blocks an SM.
        if (!valid) continue;
        UpdateIn in[kLoads];
        prefetch_update(a, e0, j, in);
        if (j == 0) {  // the parameters go to every rank's gather slot for this owner
          for (int r = 0; r < a.P; ++r)
            fast::store_wire(reinterpret_cast<uint16_t*>(a.ws[r] +
                                                         gather_slot(a.me, a.P, a.slot_bytes) +
                                                         a.params_offset),
                             local, a.policy, wire);
        }
        const DequantParams d = fast::decoder_of<BITS>(wire, a.policy);
#pragma unroll
        for (int k = 0; k < kLoads; ++k) {
          uint32_t codes[kVec];
          float y[kVec];
#pragma unroll
          for (int t = 0; t < kVec; ++t) {
            codes[t] = fast::encode<BITS>(acc[k][t], enc) & enc.mask;
            y[t] = fast::decode_fast(codes[t], d);  // the code peers receive
          }
          for (int r = 0; r < a.P; ++r)
            fast::store_piece<kVec, BITS>(a.ws[r] + gather_slot(a.me, a.P, a.slot_bytes) +
                                              piece_byte(local, j, k),
                                          codes, 0xFFFFFFFFu);
          store_output(a, e0 + L::index(j, k, 0), y, in[k]);
        }
      }
    }
  }

  // The tail with the rotation: every lane stays for the shuffles of the inverse rotation (a
  // lane past the tile's end decodes zeros and stores nothing).
  __device__ static void tail_rotated(const KernelArgs& a, int seg, int64_t first, int count,
                                      int64_t local0, int warp, int warps, int lane,
                                      const uint8_t* slot, const uint16_t* prm) {
    const int j = lane % kLanes;
    const uint32_t sm = kExchange ? sign_mask_out(j) : sign_mask(j);  // the inverse's
    for (int q0 = warp * kGpw; q0 < count; q0 += warps * kGpw) {
      const int q = q0 + lane / kLanes;
      const bool valid = q < count;
      const int64_t local = local0 + q;
      const int64_t e0 = (seg * a.seg_groups + first + q) * G;
      const DequantParams d =
          valid ? fast::decoder_of<BITS>(fast::load_wire(prm, local, a.policy), a.policy)
                : DequantParams{0.0f, 0.0f};
      uint2 words[kLoads];
#pragma unroll
      for (int k = 0; k < kLoads; ++k)
        words[k] = valid ? fast::load_piece_word<kVec, BITS>(
                               slot + piece_byte(local, code_lane(j), code_piece(j, k)))
                         : make_uint2(0, 0);
      float y[kLoads][kVec];
#pragma unroll
      for (int k = 0; k < kLoads; ++k) {
        uint32_t codes[kVec];
        fast::unpack_piece_codes<kVec, BITS>(words[k], codes);
#pragma unroll
        for (int t = 0; t < kVec; ++t) y[k][t] = fast::decode_fast(codes[t], d);
      }
      unrotate_group(y, j, sm, a.rot_scale);
      if (!valid) continue;
#pragma unroll
      for (int k = 0; k < kLoads; ++k) {
        UpdateIn in;
        load_update(a, e0 + L::index(out_lane(j), k, 0), in);
        store_output(a, e0 + L::index(out_lane(j), k, 0), y[k], in);
      }
    }
  }

  // tail: dequantize the tile's groups of owner seg's reduced code.
  __device__ static void tail(const KernelArgs& a, int seg, int64_t first, int count,
                              int64_t local0, int warp, int warps, int lane) {
    const uint8_t* slot = a.ws[a.me] + gather_slot(seg, a.P, a.slot_bytes);
    const uint16_t* prm = reinterpret_cast<const uint16_t*>(slot + a.params_offset);
    if constexpr (ROT) {
      tail_rotated(a, seg, first, count, local0, warp, warps, lane, slot, prm);
    } else {
      tail_plain(a, seg, first, count, local0, warp, warps, lane, slot, prm);
    }
  }

  __device__ static void tail_plain(const KernelArgs& a, int seg, int64_t first, int count,
                                    int64_t local0, int warp, int warps, int lane,
                                    const uint8_t* slot, const uint16_t* prm) {
    const int j = lane % kLanes;
    for (int q0 = warp * kGpw; q0 < count; q0 += warps * kGpw) {
      const int q = q0 + lane / kLanes;
      if (q >= count) continue;  // no shuffles here: lanes may leave
      const int64_t local = local0 + q;
      const int64_t e0 = (seg * a.seg_groups + first + q) * G;
      const DequantParams d = fast::decoder_of<BITS>(fast::load_wire(prm, local, a.policy), a.policy);
      uint2 words[kLoads];
#pragma unroll
      for (int k = 0; k < kLoads; ++k)  // every load of the group before the first store
        words[k] = fast::load_piece_word<kVec, BITS>(slot + piece_byte(local, j, k));
      UpdateIn in[kLoads];
      prefetch_update(a, e0, j, in);
#pragma unroll
      for (int k = 0; k < kLoads; ++k) {
        uint32_t codes[kVec];
        fast::unpack_piece_codes<kVec, BITS>(words[k], codes);
        float y[kVec];
#pragma unroll
        for (int t = 0; t < kVec; ++t) y[t] = fast::decode_fast(codes[t], d);
        store_output(a, e0 + L::index(j, k, 0), y, in[k]);
      }
    }
  }
};

// One rank's pipeline: push, reduce + gather, tail over the tiles of this chunk (Stages: the
// generic or the fast stages; T: the contribution's dtype, for the poisoned output). The body of
// both kernels below.
template <class Stages, typename T>
__device__ __forceinline__ void allreduce_pipeline(const KernelArgs& a) {
  __shared__ int give_up;
  const int warp = threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  const int warps = blockDim.x / kWarp;
  const int others = a.P - 1;
  const int ct = a.chunk_tiles;
  if (threadIdx.x == 0) give_up = 0;
  set_scaling(a);
  Stages::setup();
  __syncthreads();

  // Tile t of the chunk covers segment groups [(tile0 + t) * TG, ...) clipped to Gs.
  auto tile_groups = [&](int t, int64_t* first) {
    *first = (a.tile0 + t) * a.tile_groups;
    return static_cast<int>(min(static_cast<int64_t>(a.tile_groups), a.seg_groups - *first));
  };

  // a.twice (the stage-cost diagnostic) runs a stage's items twice: item i and i + items are the
  // same work (the same bytes written again). Not a loop around the stage: that raised the
  // registers (fp32 48 -> 72 a thread, ptxas sm_90a).
  const int push_items = others * ct;
  // push
  for (int pitem = blockIdx.x; pitem < (a.twice == 1 ? 2 : 1) * push_items; pitem += gridDim.x) {
    const int item = pitem < push_items ? pitem : pitem - push_items;
    const int j = item / ct;
    const int seg = j < a.me ? j : j + 1;
    const int t = item % ct;
    int64_t first;
    const int count = tile_groups(t, &first);
    Stages::push(a, seg, first, count, static_cast<int64_t>(t) * a.tile_groups, warp, warps, lane);
    // The barrier, then one system-scope release store: the release is cumulative, so it
    // publishes every write the block made before the barrier (the pattern of a grid barrier).
    // A system fence in each of the 256 threads per tile cost more than the fence is worth.
    __syncthreads();
    if (threadIdx.x == 0) st_release_sys(flag_ptr(a, seg, kStagePush, a.me, t), a.base);
  }

  // reduce + gather
  for (int rt = blockIdx.x; rt < (a.twice == 2 ? 2 : 1) * ct; rt += gridDim.x) {
    const int t = rt < ct ? rt : rt - ct;
    if (threadIdx.x < a.P && threadIdx.x != a.me) {
      if (!wait_flag(a, flag_ptr(a, a.me, kStagePush, threadIdx.x, t), a.base, kStagePush,
                     threadIdx.x))
        give_up = 1;
    }
    __syncthreads();
    if (give_up) break;
    int64_t first;
    const int count = tile_groups(t, &first);
    Stages::reduce(a, first, count, static_cast<int64_t>(t) * a.tile_groups, warp, warps, lane);
    __syncthreads();  // then one release per peer, as after push
    if (threadIdx.x < a.P && threadIdx.x != a.me)
      st_release_sys(flag_ptr(a, threadIdx.x, kStageGather, a.me, t), a.base + 2);
  }

  // tail
  for (int titem = blockIdx.x; titem < (a.twice == 3 ? 2 : 1) * push_items && !give_up;
       titem += gridDim.x) {
    const int item = titem < push_items ? titem : titem - push_items;
    const int j = item / ct;
    const int seg = j < a.me ? j : j + 1;
    const int t = item % ct;
    if (threadIdx.x == 0 &&
        !wait_flag(a, flag_ptr(a, a.me, kStageGather, seg, t), a.base + 2, kStageGather, seg))
      give_up = 1;
    __syncthreads();
    if (give_up) break;
    int64_t first;
    const int count = tile_groups(t, &first);
    Stages::tail(a, seg, first, count, static_cast<int64_t>(t) * a.tile_groups, warp, warps, lane);
  }

  // After a timeout the output must not look valid: poison this block's grid-stride share.
  __syncthreads();
  if (*abort_ptr(a, a.me) == static_cast<unsigned>(a.base)) {
    T* y = static_cast<T*>(a.y);
    for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < a.n;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x)
      y[i] = from_f32<T>(__int_as_float(0x7fc00000));
  }
}

// Two kernels over the same pipeline, because a second __launch_bounds__ argument of 1 is not
// "no bound" to ptxas: it raised the registers (fp32 uncompensated 48 -> 64, compensated
// 80 -> 104 a thread, g = 128). So only the instances whose Stages::kMinBlocks asks for more than
// one block an SM get one (echo_allreduce_kernel_bounded).
template <class Stages, typename T>
__global__ void __launch_bounds__(kThreads) echo_allreduce_kernel(KernelArgs a) {
  allreduce_pipeline<Stages, T>(a);
}
template <class Stages, typename T>
__global__ void __launch_bounds__(kThreads, Stages::kMinBlocks)
    echo_allreduce_kernel_bounded(KernelArgs a) {
  allreduce_pipeline<Stages, T>(a);
}

// The kernel of a Stages: the bounded one where Stages::kMinBlocks > 1.
template <class Stages, typename T>
constexpr void (*kernel_of())(KernelArgs) {
  if constexpr (Stages::kMinBlocks > 1) return echo_allreduce_kernel_bounded<Stages, T>;
  else return echo_allreduce_kernel<Stages, T>;
}

// ---------------------------------------------------------------------------------------------
// Host side: workspaces, groups, schedule cache.

std::string cuda_error_text(cudaError_t e) { return std::string(cudaGetErrorString(e)); }

#define ECHO_CUDA_RETURN(expr, what)                                                      \
  do {                                                                                    \
    cudaError_t echo_err_ = (expr);                                                       \
    if (echo_err_ != cudaSuccess)                                                         \
      return ffi::Error(ffi::ErrorCode::kInternal,                                        \
                        std::string("echo_jax p2p (CUDA): ") + what + ": " +              \
                            cuda_error_text(echo_err_));                                  \
  } while (0)

int64_t env_int(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == 0) return fallback;
  return std::strtoll(v, nullptr, 10);
}

// Bytes of one receive slot: ECHO_JAX_SLOT_MB (default 32 MiB). A workspace holds 2P slots, so a
// group of P ranks takes 2 * P * slot bytes per device plus ~2 MiB of flags; messages whose
// segment codes do not fit a slot run in several chunks.
int64_t slot_bytes_from_env() { return std::max<int64_t>(1, env_int("ECHO_JAX_SLOT_MB", 32)) << 20; }

// A diagnostic for placing time inside the kernel without hardware counters:
// ECHO_JAX_P2P_REPEAT_STAGE = push | reduce | tail runs that stage twice in every uncompensated
// call (the same bytes written twice, so the result is unchanged); the time a call gains is the
// stage's cost. Unset (or anything else): 0, each stage once. Read once a process.
int repeat_stage_from_env() {
  static const int stage = [] {
    const char* v = std::getenv("ECHO_JAX_P2P_REPEAT_STAGE");
    const std::string s = v == nullptr ? "" : v;
    return s == "push" ? 1 : s == "reduce" ? 2 : s == "tail" ? 3 : 0;
  }();
  return stage;
}

struct LaunchPlan {
  int tile_groups = 1;
  int64_t tiles_per_segment = 0;
  int chunk_tiles = 0;
  int64_t params_offset = 0;
  int grid = 1;
};

struct Group {
  std::vector<int> devices;  // device ordinal of each rank (all equal for virtual ranks)
  bool is_virtual = false;
  int P = 0;
  int64_t slot_bytes = 0;
  std::vector<uint8_t*> ws;
  std::vector<int*> host_error, dev_error;
  std::vector<uint64_t> calls;
  std::vector<cudaStream_t> streams;  // virtual ranks: one stream per rank
  cudaEvent_t fork = nullptr;
  std::vector<cudaEvent_t> joins;
  std::vector<int> max_resident;      // blocks of kThreads resident per device
  std::map<std::tuple<const void*, int, int, int, int64_t>, LaunchPlan> plans;  // the schedule cache
  int registered = 0;
  bool broken = false;
  std::string broken_reason;
  std::mutex mu;
  std::condition_variable cv;
};

std::mutex g_registry_mu;
std::map<std::string, std::unique_ptr<Group>> g_groups;

Group* get_group(const std::string& key) {
  std::lock_guard<std::mutex> lock(g_registry_mu);
  auto& slot = g_groups[key];
  if (!slot) slot = std::make_unique<Group>();
  return slot.get();
}

// Blocks of kThreads of `kernel` resident on `device` at once (all SMs).
int resident_blocks(const void* kernel, int device) {
  int per_sm = 0, sms = 0;
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, 0);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  return std::max(1, per_sm) * std::max(1, sms);
}

// Allocates rank r's workspace on its device (before any of this group's kernels can spin).
ffi::Error setup_rank_on_device(Group& grp, int r);

ffi::Error setup_rank(Group& grp, int r) {
  // XLA's thread keeps its current device: switch for the setup and back.
  int previous = 0;
  ECHO_CUDA_RETURN(cudaGetDevice(&previous), "cudaGetDevice");
  ECHO_CUDA_RETURN(cudaSetDevice(grp.devices[r]), "cudaSetDevice");
  ffi::Error err = setup_rank_on_device(grp, r);
  cudaSetDevice(previous);
  return err;
}

ffi::Error setup_rank_on_device(Group& grp, int r) {
  const int64_t bytes = workspace_bytes(grp.P, grp.slot_bytes);
  ECHO_CUDA_RETURN(cudaMalloc(&grp.ws[r], bytes), "workspace cudaMalloc");
  ECHO_CUDA_RETURN(cudaMemset(grp.ws[r], 0, bytes), "workspace cudaMemset");
  ECHO_CUDA_RETURN(cudaHostAlloc(&grp.host_error[r], sizeof(int), cudaHostAllocMapped),
                   "error word cudaHostAlloc");
  *grp.host_error[r] = 0;
  ECHO_CUDA_RETURN(cudaHostGetDevicePointer(&grp.dev_error[r], grp.host_error[r], 0),
                   "cudaHostGetDevicePointer");
  if (!grp.is_virtual) {
    for (int peer : grp.devices) {
      if (peer == grp.devices[r]) continue;
      int can = 0;
      ECHO_CUDA_RETURN(cudaDeviceCanAccessPeer(&can, grp.devices[r], peer), "cudaDeviceCanAccessPeer");
      if (!can)
        return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                          "echo_jax p2p (CUDA): device " + std::to_string(grp.devices[r]) +
                              " has no peer access to device " + std::to_string(peer) +
                              "; use transport='xla' (auto does)");
      cudaError_t e = cudaDeviceEnablePeerAccess(peer, 0);
      if (e == cudaErrorPeerAccessAlreadyEnabled) cudaGetLastError();
      else ECHO_CUDA_RETURN(e, "cudaDeviceEnablePeerAccess");
    }
  }
  ECHO_CUDA_RETURN(cudaDeviceSynchronize(), "workspace setup");
  return ffi::Error::Success();
}

// Plain string concatenation, no std::ostringstream: an ostream insertion inside the handler
// crashed on the device image (libstdc++ locale state of the loaded module), std::to_string
// does not touch the locale.
std::string describe_error(int code, int rank) {
  const int stage = (code - 1) / 256, peer = (code - 1) % 256;
  const bool push = stage == kStagePush;
  return "rank " + std::to_string(rank) + " timed out in the " + (push ? "reduce" : "tail") +
         " stage waiting for rank " + std::to_string(peer) + (push ? "'s push" : "'s gather") +
         " (a peer never arrived); the group's workspace is no longer usable in this process";
}

struct CallAttrs {
  int bits, g, policy, P;
  int64_t timeout_ms;
  int64_t rotate;       // 1: the Hadamard rotation inside the call (EchoConfig.rotation)
  CompCoeffs k;
  const float* factor;  // device f32[1], the rescaling's power of two
  bool state_bf16;      // the compensated call's m1, m2 are bf16 (else fp32)
  bool update;          // the compensated call updates m1, m2; false: the applied call
};

LaunchPlan make_plan(const Group& grp, const CallAttrs& at, int64_t seg_groups, int resident) {
  LaunchPlan pl;
  static const int64_t tile_values =
      std::max<int64_t>(1, env_int("ECHO_JAX_P2P_TILE_VALUES", kTileValues));
  const int max_tg = static_cast<int>(std::max<int64_t>(1, tile_values / at.g));
  pl.tile_groups = static_cast<int>(std::clamp<int64_t>(
      (seg_groups + kMinTilesPerSegment - 1) / kMinTilesPerSegment, 1, max_tg));
  pl.tiles_per_segment = (seg_groups + pl.tile_groups - 1) / pl.tile_groups;
  const int64_t cb = at.g * at.bits / 8;
  const int64_t per_group = cb + 2 * num_params(at.policy);
  const int64_t cap_groups = (grp.slot_bytes - 64) / per_group;
  int64_t cap_tiles = std::min<int64_t>(cap_groups / pl.tile_groups, kMaxTiles);
  pl.chunk_tiles = static_cast<int>(std::max<int64_t>(1, std::min(cap_tiles, pl.tiles_per_segment)));
  pl.params_offset = ((static_cast<int64_t>(pl.chunk_tiles) * pl.tile_groups * cb + 15) / 16) * 16;
  const int64_t items = (2 * (at.P - 1) + 1) * static_cast<int64_t>(pl.chunk_tiles);
  pl.grid = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(items, resident)));
  return pl;
}

// Launches `kernel` (an echo_allreduce_kernel(_bounded) instance) for one rank, one launch per
// chunk of tiles, with the schedule of the cache (computed at the first call of this shape).
ffi::Error launch(Group& grp, int rank, cudaStream_t stream, const CallAttrs& at,
                  void (*kernel)(KernelArgs), const void* x, void* y, void* m1, void* m2,
                  int64_t n, bool aligned, int ranks_on_device) {
  const int64_t groups = (std::max<int64_t>(n, 1) + at.g - 1) / at.g;
  const int64_t seg_groups = (groups + at.P - 1) / at.P;
  const auto key = std::make_tuple(reinterpret_cast<const void*>(kernel), at.bits, at.policy,
                                   at.g, seg_groups);
  LaunchPlan pl;
  {
    std::lock_guard<std::mutex> lock(grp.mu);
    auto it = grp.plans.find(key);
    if (it == grp.plans.end()) {
      const int resident = std::max(
          1, resident_blocks(reinterpret_cast<const void*>(kernel), grp.devices[rank]) /
                 ranks_on_device);
      it = grp.plans.emplace(key, make_plan(grp, at, seg_groups, resident)).first;
    }
    pl = it->second;
  }
  KernelArgs a{};
  a.x = x; a.y = y; a.m1 = m1; a.m2 = m2; a.factor = at.factor; a.n = n;
  a.seg_groups = seg_groups;
  a.me = rank; a.P = at.P; a.g = at.g; a.bits = at.bits; a.policy = at.policy;
  a.tile_groups = pl.tile_groups;
  a.slot_bytes = grp.slot_bytes;
  a.params_offset = pl.params_offset;
  a.timeout_ns = static_cast<uint64_t>(at.timeout_ms) * 1000000ull;
  a.error = grp.dev_error[rank];
  a.aligned = aligned;
  a.state_bf16 = at.state_bf16;
  a.rot_scale = at.rotate ? hadamard_scale(at.g) : 1.0f;
  a.twice = m1 == nullptr ? repeat_stage_from_env() : 0;  // a compensated update is not idempotent
  a.k = at.k;
  for (int r = 0; r < at.P; ++r) a.ws[r] = grp.ws[r];
  for (int64_t t0 = 0; t0 < pl.tiles_per_segment; t0 += pl.chunk_tiles) {
    a.tile0 = t0;
    a.chunk_tiles = static_cast<int>(std::min<int64_t>(pl.chunk_tiles, pl.tiles_per_segment - t0));
    a.base = 3 * (++grp.calls[rank]);
    kernel<<<pl.grid, kThreads, 0, stream>>>(a);
  }
  ECHO_CUDA_RETURN(cudaGetLastError(), "kernel launch");
  return ffi::Error::Success();
}

// The fast kernel instance for (T, g, bits, COMP, ROT, state type S, UPDATE), or nullptr when g
// has none.
template <typename T, bool COMP, bool ROT, typename S, bool UPDATE, int BITS, int... Gs>
void (*fast_kernel_for(int g))(KernelArgs) {
  void (*kernel)(KernelArgs) = nullptr;
  ((g == Gs ? (kernel = kernel_of<FastStages<T, Gs, BITS, COMP, ROT, S, UPDATE>, T>(), true)
            : false) ||
   ...);
  return kernel;
}

template <typename T, bool COMP, bool ROT, typename S = float, bool UPDATE = COMP>
void (*fast_kernel_for_bits(int bits, int g))(KernelArgs) {
  return bits == 4 ? fast_kernel_for<T, COMP, ROT, S, UPDATE, 4, 32, 64, 128, 256>(g)
                   : fast_kernel_for<T, COMP, ROT, S, UPDATE, 8, 32, 64, 128, 256>(g);
}

// The fast instance of a compensated call for its state's type, rotated or not.
template <typename T, typename S, bool UPDATE>
void (*fast_compensated_kernel(const CallAttrs& at))(KernelArgs) {
  return at.rotate ? fast_kernel_for_bits<T, true, true, S, UPDATE>(at.bits, at.g)
                   : fast_kernel_for_bits<T, true, false, S, UPDATE>(at.bits, at.g);
}

// The fast instance for a call: rotated or not, and for a compensated call its state's type
// (only compensated calls have bf16-state instances) and whether it updates the state (the
// applied call does not).
template <typename T, bool COMP>
void (*fast_kernel_for_call(const CallAttrs& at))(KernelArgs) {
  if constexpr (COMP) {
    if (at.state_bf16)
      return at.update ? fast_compensated_kernel<T, __nv_bfloat16, true>(at)
                       : fast_compensated_kernel<T, __nv_bfloat16, false>(at);
    return at.update ? fast_compensated_kernel<T, float, true>(at)
                     : fast_compensated_kernel<T, float, false>(at);
  }
  return at.rotate ? fast_kernel_for_bits<T, COMP, true>(at.bits, at.g)
                   : fast_kernel_for_bits<T, COMP, false>(at.bits, at.g);
}

// The generic instance for a call (any g; rotated or not).
template <typename T, bool COMP, bool UPDATE>
void (*generic_kernel(const CallAttrs& at))(KernelArgs) {
  if (at.rotate) return echo_allreduce_kernel<RotatedGenericStages<T, COMP, UPDATE>, T>;
  return at.g % 4 == 0   ? echo_allreduce_kernel<GenericStages<T, 4, COMP, UPDATE>, T>
         : at.g % 2 == 0 ? echo_allreduce_kernel<GenericStages<T, 2, COMP, UPDATE>, T>
                         : echo_allreduce_kernel<GenericStages<T, 1, COMP, UPDATE>, T>;
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// `fast_ok`: the caller allows the fast stages. The ranks of a virtual group must all run the
// same kernel: a kernel's first launch in a process loads it (lazy module loading), and loading
// waits for the kernels already running on the device, so a rank whose kernel is loaded while
// a peer's kernel spins waiting for it would deadlock until the timeout.
template <typename T, bool COMP>
ffi::Error run_rank(Group& grp, int rank, cudaStream_t stream, const CallAttrs& at, const void* x,
                    void* y, void* m1, void* m2, int64_t n, int ranks_on_device, bool fast_ok) {
  const bool aligned =
      aligned16(x) && aligned16(y) && (m1 == nullptr || (aligned16(m1) && aligned16(m2)));
  void (*kernel)(KernelArgs) = nullptr;
  if (fast_ok && aligned && fast::has_fast_policy(at.policy) && !fast::generic_kernels_forced()) {
    kernel = fast_kernel_for_call<T, COMP>(at);
  }
  if (kernel == nullptr) {
    if constexpr (COMP)
      kernel = at.update ? generic_kernel<T, true, true>(at) : generic_kernel<T, true, false>(at);
    else
      kernel = generic_kernel<T, false, false>(at);
  }
  return launch(grp, rank, stream, at, kernel, x, y, m1, m2, n, aligned, ranks_on_device);
}

template <bool COMP>
ffi::Error run_rank_dtype(ffi::DataType dt, Group& grp, int rank, cudaStream_t stream,
                          const CallAttrs& at, const void* x, void* y, void* m1, void* m2,
                          int64_t n, int ranks_on_device, bool fast_ok = true) {
  switch (dt) {
    case ffi::DataType::F32:
      return run_rank<float, COMP>(grp, rank, stream, at, x, y, m1, m2, n, ranks_on_device, fast_ok);
    case ffi::DataType::BF16:
      return run_rank<__nv_bfloat16, COMP>(grp, rank, stream, at, x, y, m1, m2, n, ranks_on_device, fast_ok);
    case ffi::DataType::F16:
      return run_rank<__half, COMP>(grp, rank, stream, at, x, y, m1, m2, n, ranks_on_device, fast_ok);
    default:
      return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                        "echo_jax p2p (CUDA): x must be float32, bfloat16 or float16");
  }
}

ffi::Error check_attrs(const CallAttrs& at) {
  const std::string format = echo::format_error(at.bits, at.g, at.policy);
  if (!format.empty()) return ffi::Error::InvalidArgument("echo_jax p2p (CUDA): " + format);
  if (at.factor == nullptr)
    return ffi::Error::InvalidArgument("echo_jax p2p (CUDA): the factor operand must be f32[1] "
                                       "(the rescaling's power of two; 1 when not rescaled)");
  if (at.rotate != 0 && at.rotate != 1)
    return ffi::Error::InvalidArgument("echo_jax p2p (CUDA): rotate must be 0 or 1, got " +
                                       std::to_string(at.rotate));
  if (at.rotate && (at.g > kMaxRotatedGroup || (at.g & (at.g - 1))))
    return ffi::Error::InvalidArgument(
        "echo_jax p2p (CUDA): the rotation in the call needs a power-of-two group_size of at most " +
        std::to_string(kMaxRotatedGroup) + ", got " + std::to_string(at.g) +
        " (larger groups rotate in JAX around the call)");
  if (at.P < 1 || at.P > kMaxCudaRanks)
    return ffi::Error::InvalidArgument("echo_jax p2p (CUDA): num_ranks must be in [1, " +
                                       std::to_string(kMaxCudaRanks) + "], got " +
                                       std::to_string(at.P));
  return ffi::Error::Success();
}

ffi::Error check_health(Group& grp, int rank) {
  if (grp.broken) return ffi::Error(ffi::ErrorCode::kAborted, grp.broken_reason);
  const int code = grp.host_error[rank] ? *reinterpret_cast<volatile int*>(grp.host_error[rank]) : 0;
  if (code != 0) {
    grp.broken = true;
    grp.broken_reason = "echo_jax p2p (CUDA): " + describe_error(code, rank);
    return ffi::Error(ffi::ErrorCode::kDeadlineExceeded, grp.broken_reason);
  }
  return ffi::Error::Success();
}

// --- the per-device handler (one rank per GPU, inside shard_map) -----------------------------

// The GPU of XLA's stream (cudaStreamGetDevice, CUDA >= 12.8): which rank this call is.
ffi::ErrorOr<int> stream_device(cudaStream_t stream) {
  int device = -1;
  cudaError_t e = cudaStreamGetDevice(stream, &device);
  if (e != cudaSuccess)
    return ffi::Error(ffi::ErrorCode::kInternal,
                      std::string("echo_jax p2p (CUDA): cudaStreamGetDevice: ") + cuda_error_text(e));
  return device;
}

// The compensated call's state: m1, m2 both fp32 or both bf16 (EchoConfig.state_dtype), each
// with x's element count; sets at.state_bf16. Nothing to check without a state.
ffi::Error check_state(const ffi::AnyBuffer& x, const std::optional<ffi::AnyBuffer>& m1,
                       const std::optional<ffi::AnyBuffer>& m2, CallAttrs& at) {
  if (!m1.has_value()) return ffi::Error::Success();
  const ffi::DataType t1 = m1->element_type(), t2 = m2->element_type();
  if (t1 != t2 || (t1 != ffi::DataType::F32 && t1 != ffi::DataType::BF16))
    return ffi::Error::InvalidArgument(
        "echo_jax p2p (CUDA): the state m1, m2 must be both float32 or both bfloat16 "
        "(EchoConfig.state_dtype), got dtype codes " + std::to_string(static_cast<int>(t1)) +
        " and " + std::to_string(static_cast<int>(t2)));
  if (m1->element_count() != x.element_count() || m2->element_count() != x.element_count())
    return ffi::Error::InvalidArgument(
        "echo_jax p2p (CUDA): the state m1, m2 have " + std::to_string(m1->element_count()) +
        " / " + std::to_string(m2->element_count()) + " elements, x has " +
        std::to_string(x.element_count()));
  at.state_bf16 = t1 == ffi::DataType::BF16;
  return ffi::Error::Success();
}

// m1_out, m2_out: the compensated call's results (updated in place); nullptr with a state: the
// applied call (at.update false), whose kernels only read m1, m2.
ffi::Error RankImpl(cudaStream_t stream, ffi::AnyBuffer x, std::optional<ffi::AnyBuffer> m1,
                    std::optional<ffi::AnyBuffer> m2, ffi::Result<ffi::AnyBuffer> y,
                    void* m1_out, void* m2_out, CallAttrs at, ffi::Span<const int64_t> groups) {
  ffi::Error err = check_attrs(at);
  if (err.failure()) return err;
  err = check_state(x, m1, m2, at);
  if (err.failure()) return err;
  ffi::ErrorOr<int> dev = stream_device(stream);
  if (dev.has_error()) return dev.error();
  const int device = dev.value();
  if (groups.size() % at.P != 0)
    return ffi::Error::InvalidArgument("echo_jax p2p (CUDA): the groups attribute (" +
                                       std::to_string(groups.size()) +
                                       " device ordinals) is not a multiple of num_ranks");
  int rank = -1;
  size_t first = 0;
  for (size_t i = 0; i < groups.size(); ++i)
    if (groups[i] == device) { rank = static_cast<int>(i % at.P); first = i - rank; }
  if (rank < 0)
    return ffi::Error::InvalidArgument("echo_jax p2p (CUDA): device " + std::to_string(device) +
                                       " is in no group of the groups attribute");
  std::string key = "gpu";
  std::vector<int> devs;
  for (int r = 0; r < at.P; ++r) {
    devs.push_back(static_cast<int>(groups[first + r]));
    key += ":" + std::to_string(devs.back());
  }
  Group* grp = get_group(key);
  {
    // First call: every rank allocates its workspace, then all wait until the group is
    // complete, so no kernel spins while a peer is still inside a blocking CUDA call.
    std::unique_lock<std::mutex> lock(grp->mu);
    if (grp->P == 0) {
      grp->P = at.P;
      grp->devices = devs;
      grp->slot_bytes = slot_bytes_from_env();
      grp->ws.assign(at.P, nullptr);
      grp->host_error.assign(at.P, nullptr);
      grp->dev_error.assign(at.P, nullptr);
      grp->calls.assign(at.P, 0);
    }
    if (grp->ws[rank] == nullptr) {
      lock.unlock();
      err = setup_rank(*grp, rank);
      lock.lock();
      if (err.failure()) return err;
      ++grp->registered;
      grp->cv.notify_all();
    }
    const bool ready = grp->cv.wait_for(lock, std::chrono::milliseconds(at.timeout_ms),
                                        [&] { return grp->registered == grp->P; });
    if (!ready)
      return ffi::Error(ffi::ErrorCode::kDeadlineExceeded,
                        "echo_jax p2p (CUDA): rank " + std::to_string(rank) +
                            " waited for its group's other ranks to set up; only " +
                            std::to_string(grp->registered) + " of " + std::to_string(at.P) +
                            " arrived");
  }
  err = check_health(*grp, rank);
  if (err.failure()) return err;
  const int64_t n = static_cast<int64_t>(x.element_count());
  at.update = m1_out != nullptr;
  void* pm1 = at.update || !m1.has_value() ? m1_out : m1->untyped_data();  // read-only if applied
  void* pm2 = at.update || !m1.has_value() ? m2_out : m2->untyped_data();
  if (at.update && m1_out != m1->untyped_data()) {  // no aliasing: start from the inputs
    cudaMemcpyAsync(m1_out, m1->untyped_data(), m1->size_bytes(), cudaMemcpyDeviceToDevice, stream);
    cudaMemcpyAsync(m2_out, m2->untyped_data(), m2->size_bytes(), cudaMemcpyDeviceToDevice, stream);
  }
  if (m1.has_value())
    return run_rank_dtype<true>(x.element_type(), *grp, rank, stream, at, x.untyped_data(),
                                y->untyped_data(), pm1, pm2, n, 1);
  return run_rank_dtype<false>(x.element_type(), *grp, rank, stream, at, x.untyped_data(),
                               y->untyped_data(), nullptr, nullptr, n, 1);
}

// --- virtual ranks: P rank pipelines on P streams of one GPU ----------------------------------

ffi::Error VirtualImpl(cudaStream_t stream, ffi::AnyBuffer x, std::optional<ffi::AnyBuffer> m1,
                       std::optional<ffi::AnyBuffer> m2, ffi::Result<ffi::AnyBuffer> y,
                       void* m1_out, void* m2_out, CallAttrs at, int absent_rank) {
  ffi::Error err = check_attrs(at);
  if (err.failure()) return err;
  err = check_state(x, m1, m2, at);
  if (err.failure()) return err;
  ffi::ErrorOr<int> dev = stream_device(stream);
  if (dev.has_error()) return dev.error();
  const int device = dev.value();
  const auto dims = x.dimensions();
  if (dims.size() != 2 || dims[0] != at.P)
    return ffi::Error::InvalidArgument("echo_jax p2p (CUDA, virtual ranks): x must be [P, n] with "
                                       "P = num_ranks = " + std::to_string(at.P));
  const int64_t n = dims[1];
  Group* grp = get_group("virtual:" + std::to_string(device) + ":" + std::to_string(at.P));
  {
    std::lock_guard<std::mutex> lock(grp->mu);
    if (grp->P == 0) {
      grp->P = at.P;
      grp->is_virtual = true;
      grp->devices.assign(at.P, device);
      grp->slot_bytes = slot_bytes_from_env();
      grp->ws.assign(at.P, nullptr);
      grp->host_error.assign(at.P, nullptr);
      grp->dev_error.assign(at.P, nullptr);
      grp->calls.assign(at.P, 0);
      for (int r = 0; r < at.P; ++r) {
        err = setup_rank(*grp, r);
        if (err.failure()) return err;
      }
      grp->streams.resize(at.P);
      grp->joins.resize(at.P);
      for (int r = 0; r < at.P; ++r) {
        ECHO_CUDA_RETURN(cudaStreamCreateWithFlags(&grp->streams[r], cudaStreamNonBlocking), "stream");
        ECHO_CUDA_RETURN(cudaEventCreateWithFlags(&grp->joins[r], cudaEventDisableTiming), "event");
      }
      ECHO_CUDA_RETURN(cudaEventCreateWithFlags(&grp->fork, cudaEventDisableTiming), "event");
      grp->registered = at.P;
    }
  }
  for (int r = 0; r < at.P; ++r) {
    err = check_health(*grp, r);
    if (err.failure()) return err;
  }
  const size_t esize = ffi::ByteWidth(x.element_type());
  const size_t ssize = at.state_bf16 ? 2 : 4;  // bytes of a state value
  at.update = m1_out != nullptr;  // with a state and no results: the applied call, m1, m2 read
  if (m1.has_value() && !at.update) {
    m1_out = m1->untyped_data();
    m2_out = m2->untyped_data();
  }
  if (at.update && m1_out != m1->untyped_data()) {
    cudaMemcpyAsync(m1_out, m1->untyped_data(), m1->size_bytes(), cudaMemcpyDeviceToDevice, stream);
    cudaMemcpyAsync(m2_out, m2->untyped_data(), m2->size_bytes(), cudaMemcpyDeviceToDevice, stream);
  }
  // One kernel for every rank (see run_rank): the fast stages only when every row is aligned.
  const bool fast_ok = aligned16(x.untyped_data()) && aligned16(y->untyped_data()) &&
                       (n * esize) % 16 == 0 &&
                       (!m1.has_value() || (aligned16(m1_out) && aligned16(m2_out) &&
                                            (n * ssize) % 16 == 0));
  ECHO_CUDA_RETURN(cudaEventRecord(grp->fork, stream), "fork event");
  for (int r = 0; r < at.P; ++r) {
    if (r == absent_rank) {  // test hook: this rank never arrives; its peers must time out
      ++grp->calls[r];
      continue;
    }
    ECHO_CUDA_RETURN(cudaStreamWaitEvent(grp->streams[r], grp->fork, 0), "fork wait");
    const char* xr = static_cast<const char*>(x.untyped_data()) + r * n * esize;
    char* yr = static_cast<char*>(y->untyped_data()) + r * n * esize;
    if (m1.has_value())
      err = run_rank_dtype<true>(x.element_type(), *grp, r, grp->streams[r], at, xr, yr,
                                 static_cast<char*>(m1_out) + r * n * ssize,
                                 static_cast<char*>(m2_out) + r * n * ssize, n, at.P, fast_ok);
    else
      err = run_rank_dtype<false>(x.element_type(), *grp, r, grp->streams[r], at, xr, yr, nullptr,
                                  nullptr, n, at.P, fast_ok);
    if (err.failure()) return err;
    ECHO_CUDA_RETURN(cudaEventRecord(grp->joins[r], grp->streams[r]), "join event");
    ECHO_CUDA_RETURN(cudaStreamWaitEvent(stream, grp->joins[r], 0), "join wait");
  }
  return ffi::Error::Success();
}

CallAttrs make_attrs(ffi::Buffer<ffi::F32> factor, int64_t bits, int64_t g, int64_t policy,
                     int64_t P, int64_t timeout_ms, int64_t rotate, float ea, float eb, float b1,
                     float c1, float b2, float c2, float inv_p) {
  return CallAttrs{static_cast<int>(bits), static_cast<int>(g), static_cast<int>(policy),
                   static_cast<int>(P), std::max<int64_t>(1, timeout_ms), rotate,
                   CompCoeffs{ea, eb, b1, c1, b2, c2, inv_p},
                   factor.element_count() == 1 ? factor.typed_data() : nullptr, false, true};
}

}  // namespace
}  // namespace cuda
}  // namespace echo

using echo::cuda::CallAttrs;
using echo::cuda::make_attrs;

// ---- handler bindings -------------------------------------------------------------------------

static ffi::Error EchoAllReduceCudaImpl(cudaStream_t stream, ffi::AnyBuffer x,
                                   ffi::Buffer<ffi::F32> factor, ffi::Result<ffi::AnyBuffer> y,
                                   int64_t bits, int64_t group_size, int64_t policy,
                                   int64_t num_ranks, int64_t timeout_ms, int64_t rotate,
                                   ffi::Span<const int64_t> groups) {
  const CallAttrs at = make_attrs(factor, bits, group_size, policy, num_ranks, timeout_ms, rotate,
                                  0, 0, 0, 0, 0, 0, 1.0f / static_cast<float>(num_ranks));
  return echo::cuda::RankImpl(stream, x, std::nullopt, std::nullopt, y, nullptr, nullptr,
                              at, groups);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    echo_allreduce_cuda, EchoAllReduceCudaImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's compute stream of this device
        .Arg<ffi::AnyBuffer>()                     // x: this rank's contribution, f32/bf16/f16
        .Arg<ffi::Buffer<ffi::F32>>()              // factor: f32[1], power of two (1: none)
        .Ret<ffi::AnyBuffer>()                     // y: the sum, same dtype and shape
        .Attr<int64_t>("bits")                     // 4 or 8
        .Attr<int64_t>("group_size")               // g
        .Attr<int64_t>("policy")                   // 0 asym, 1 sym, 2 asym_naive
        .Attr<int64_t>("num_ranks")                // P
        .Attr<int64_t>("timeout_ms")               // bound on every wait for a peer
        .Attr<int64_t>("rotate")                   // 1: Hadamard rotation in the call
        .Attr<ffi::Span<const int64_t>>("groups"));  // device ordinals, P per group

static ffi::Error EchoAllReduceCompCudaImpl(cudaStream_t stream, ffi::AnyBuffer x,
                                        ffi::AnyBuffer m1, ffi::AnyBuffer m2,
                                        ffi::Buffer<ffi::F32> factor,
                                        ffi::Result<ffi::AnyBuffer> y,
                                        ffi::Result<ffi::AnyBuffer> m1_out,
                                        ffi::Result<ffi::AnyBuffer> m2_out, int64_t bits,
                                        int64_t group_size, int64_t policy, int64_t num_ranks,
                                        int64_t timeout_ms, int64_t rotate,
                                        ffi::Span<const int64_t> groups, float ea, float eb,
                                        float b1, float c1, float b2, float c2, float inv_p) {
  const CallAttrs at = make_attrs(factor, bits, group_size, policy, num_ranks, timeout_ms, rotate,
                                  ea, eb, b1, c1, b2, c2, inv_p);
  return echo::cuda::RankImpl(stream, x, m1, m2, y, m1_out->untyped_data(),
                              m2_out->untyped_data(), at, groups);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    echo_allreduce_comp_cuda, EchoAllReduceCompCudaImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's compute stream of this device
        .Arg<ffi::AnyBuffer>()                     // x: contribution before compensation
        .Arg<ffi::AnyBuffer>()                     // m1: slow average, f32/bf16 (aliased to m1_out)
        .Arg<ffi::AnyBuffer>()                     // m2: fast average, m1's dtype (aliased to m2_out)
        .Arg<ffi::Buffer<ffi::F32>>()              // factor: f32[1], applied after x + c
        .Ret<ffi::AnyBuffer>()                     // y: the sum of the compensated x'
        .Ret<ffi::AnyBuffer>()                     // m1_out: updated in place, m1's dtype
        .Ret<ffi::AnyBuffer>()                     // m2_out: updated in place, m2's dtype
        .Attr<int64_t>("bits")
        .Attr<int64_t>("group_size")
        .Attr<int64_t>("policy")
        .Attr<int64_t>("num_ranks")
        .Attr<int64_t>("timeout_ms")
        .Attr<int64_t>("rotate")
        .Attr<ffi::Span<const int64_t>>("groups")
        .Attr<float>("ea")      // eta * a
        .Attr<float>("eb")      // eta * (1 - a)
        .Attr<float>("b1")      // beta1
        .Attr<float>("c1")      // 1 - beta1
        .Attr<float>("b2")      // beta2
        .Attr<float>("c2")      // 1 - beta2
        .Attr<float>("inv_p"));  // f32(1 / P)

// The applied call (EchoConfig.state_update = "separate"): the apply step in the entry pass, m1
// and m2 read only, y the one result; the update runs after it as its own op.
static ffi::Error EchoAllReduceAppliedCudaImpl(cudaStream_t stream, ffi::AnyBuffer x,
                                           ffi::AnyBuffer m1, ffi::AnyBuffer m2,
                                           ffi::Buffer<ffi::F32> factor,
                                           ffi::Result<ffi::AnyBuffer> y, int64_t bits,
                                           int64_t group_size, int64_t policy, int64_t num_ranks,
                                           int64_t timeout_ms, int64_t rotate,
                                           ffi::Span<const int64_t> groups, float ea, float eb) {
  const CallAttrs at = make_attrs(factor, bits, group_size, policy, num_ranks, timeout_ms, rotate,
                                  ea, eb, 0, 0, 0, 0, 1.0f / static_cast<float>(num_ranks));
  return echo::cuda::RankImpl(stream, x, m1, m2, y, nullptr, nullptr, at, groups);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    echo_allreduce_applied_cuda, EchoAllReduceAppliedCudaImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's compute stream of this device
        .Arg<ffi::AnyBuffer>()                     // x: contribution before compensation
        .Arg<ffi::AnyBuffer>()                     // m1: slow average, f32/bf16 (read only)
        .Arg<ffi::AnyBuffer>()                     // m2: fast average, m1's dtype (read only)
        .Arg<ffi::Buffer<ffi::F32>>()              // factor: f32[1], applied after x + c
        .Ret<ffi::AnyBuffer>()                     // y: the sum of the compensated x'
        .Attr<int64_t>("bits")
        .Attr<int64_t>("group_size")
        .Attr<int64_t>("policy")
        .Attr<int64_t>("num_ranks")
        .Attr<int64_t>("timeout_ms")
        .Attr<int64_t>("rotate")
        .Attr<ffi::Span<const int64_t>>("groups")
        .Attr<float>("ea")      // eta * a
        .Attr<float>("eb"));    // eta * (1 - a)

static ffi::Error EchoAllReduceVirtualCudaImpl(cudaStream_t stream, ffi::AnyBuffer x,
                                           ffi::Buffer<ffi::F32> factor,
                                           ffi::Result<ffi::AnyBuffer> y, int64_t bits,
                                           int64_t group_size, int64_t policy, int64_t num_ranks,
                                           int64_t timeout_ms, int64_t rotate,
                                           int64_t absent_rank) {
  const CallAttrs at = make_attrs(factor, bits, group_size, policy, num_ranks, timeout_ms, rotate,
                                  0, 0, 0, 0, 0, 0, 1.0f / static_cast<float>(num_ranks));
  return echo::cuda::VirtualImpl(stream, x, std::nullopt, std::nullopt, y, nullptr, nullptr,
                                 at, static_cast<int>(absent_rank));
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    echo_allreduce_virtual_cuda, EchoAllReduceVirtualCudaImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's stream: forks to P rank streams
        .Arg<ffi::AnyBuffer>()                     // x: [P, n], row r is rank r's contribution
        .Arg<ffi::Buffer<ffi::F32>>()              // factor: f32[1], shared by the P ranks
        .Ret<ffi::AnyBuffer>()                     // y: [P, n], every row the same sum
        .Attr<int64_t>("bits")
        .Attr<int64_t>("group_size")
        .Attr<int64_t>("policy")
        .Attr<int64_t>("num_ranks")
        .Attr<int64_t>("timeout_ms")
        .Attr<int64_t>("rotate")
        .Attr<int64_t>("absent_rank"));  // -1; a rank to leave out (tests of the timeout)

static ffi::Error EchoAllReduceVirtualCompCudaImpl(
    cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer m1, ffi::AnyBuffer m2,
    ffi::Buffer<ffi::F32> factor, ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> m1_out,
    ffi::Result<ffi::AnyBuffer> m2_out, int64_t bits, int64_t group_size, int64_t policy,
    int64_t num_ranks, int64_t timeout_ms, int64_t rotate, float ea, float eb, float b1, float c1,
    float b2, float c2, float inv_p) {
  const CallAttrs at = make_attrs(factor, bits, group_size, policy, num_ranks, timeout_ms, rotate,
                                  ea, eb, b1, c1, b2, c2, inv_p);
  return echo::cuda::VirtualImpl(stream, x, m1, m2, y, m1_out->untyped_data(),
                                 m2_out->untyped_data(), at, -1);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    echo_allreduce_virtual_comp_cuda, EchoAllReduceVirtualCompCudaImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's stream: forks to P rank streams
        .Arg<ffi::AnyBuffer>()                     // x: [P, n]
        .Arg<ffi::AnyBuffer>()                     // m1: [P, n] f32/bf16 (aliased to m1_out)
        .Arg<ffi::AnyBuffer>()                     // m2: [P, n] m1's dtype (aliased to m2_out)
        .Arg<ffi::Buffer<ffi::F32>>()              // factor: f32[1], shared by the P ranks
        .Ret<ffi::AnyBuffer>()                     // y: [P, n]
        .Ret<ffi::AnyBuffer>()                     // m1_out, m1's dtype
        .Ret<ffi::AnyBuffer>()                     // m2_out, m2's dtype
        .Attr<int64_t>("bits")
        .Attr<int64_t>("group_size")
        .Attr<int64_t>("policy")
        .Attr<int64_t>("num_ranks")
        .Attr<int64_t>("timeout_ms")
        .Attr<int64_t>("rotate")
        .Attr<float>("ea")
        .Attr<float>("eb")
        .Attr<float>("b1")
        .Attr<float>("c1")
        .Attr<float>("b2")
        .Attr<float>("c2")
        .Attr<float>("inv_p"));

static ffi::Error EchoAllReduceVirtualAppliedCudaImpl(
    cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer m1, ffi::AnyBuffer m2,
    ffi::Buffer<ffi::F32> factor, ffi::Result<ffi::AnyBuffer> y, int64_t bits, int64_t group_size,
    int64_t policy, int64_t num_ranks, int64_t timeout_ms, int64_t rotate, float ea, float eb) {
  const CallAttrs at = make_attrs(factor, bits, group_size, policy, num_ranks, timeout_ms, rotate,
                                  ea, eb, 0, 0, 0, 0, 1.0f / static_cast<float>(num_ranks));
  return echo::cuda::VirtualImpl(stream, x, m1, m2, y, nullptr, nullptr, at, -1);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    echo_allreduce_virtual_applied_cuda, EchoAllReduceVirtualAppliedCudaImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's stream: forks to P rank streams
        .Arg<ffi::AnyBuffer>()                     // x: [P, n]
        .Arg<ffi::AnyBuffer>()                     // m1: [P, n] f32/bf16 (read only)
        .Arg<ffi::AnyBuffer>()                     // m2: [P, n] m1's dtype (read only)
        .Arg<ffi::Buffer<ffi::F32>>()              // factor: f32[1], shared by the P ranks
        .Ret<ffi::AnyBuffer>()                     // y: [P, n]
        .Attr<int64_t>("bits")
        .Attr<int64_t>("group_size")
        .Attr<int64_t>("policy")
        .Attr<int64_t>("num_ranks")
        .Attr<int64_t>("timeout_ms")
        .Attr<int64_t>("rotate")
        .Attr<float>("ea")
        .Attr<float>("eb"));
