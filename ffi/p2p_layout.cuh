// What every stage of the fused CUDA all-reduce shares (p2p_cuda.cu describes the protocol):
// the constants and build switches, the kernel's arguments, the layout of a rank's workspace
// and its flags, and the entry loads (the compensator's apply step, the rescaling) and output
// stores (the state update) of the generic stages. Included by p2p_cuda.cu.
#ifndef ECHO_JAX_FFI_P2P_LAYOUT_CUH_
#define ECHO_JAX_FFI_P2P_LAYOUT_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "echo_common.h"
#include "echo_cuda.cuh"

namespace echo {
namespace cuda {
namespace {

constexpr int kMaxCudaRanks = 8;     // ranks of one group on one host (NVLink domain)
constexpr int kThreads = 256;        // 8 warps per block: one group per warp at a time
// Values per tile at most (8 KiB of 4-bit codes); the environment's ECHO_JAX_P2P_TILE_VALUES
// overrides it. Each tile costs a block barrier and a flag round trip, so smaller tiles pay
// more of them; larger ones leave too few tiles to spread over the blocks of a smaller message
// (docs/gpu.md, "Build-time choices").
constexpr int kTileValues = 16384;
constexpr int kMinTilesPerSegment = 64;
constexpr int kMaxTiles = 16384;     // flag words per (peer, stage) in a workspace
constexpr int kCacheChunks = 4;      // per-lane register cache of the reduce stage
// Blocks of kThreads an SM that ptxas must fit in the uncompensated unrotated fast instances
// (FastStages::kMinBlocks; a build may override them): 6 (40 registers) for fp32 and for 16-bit
// x, against 5 (48) and 4 (64) that ptxas picks by itself; both spill (16-bit x to shared
// memory, ECHO_P2P_SMEM_SPILLS). The pipeline waits on memory with few bytes in flight a warp,
// so more resident warps pay, more than the spills cost (docs/gpu.md, "Build switches").
#ifndef ECHO_P2P_MIN_BLOCKS_32
#define ECHO_P2P_MIN_BLOCKS_32 6
#endif
#ifndef ECHO_P2P_MIN_BLOCKS_16
#define ECHO_P2P_MIN_BLOCKS_16 6
#endif
// Threads a block of the uncompensated rotated 16-bit instances (_ROT_16) and of the local
// residual's 16-bit ones (_LOCAL_16): kThreads or 128. Why 128: registers are granted a block
// at a time, so with 256 threads a bound of 56 registers still leaves 4 blocks (32 warps) an SM
// and one of 72 still 3 (24 warps), what 64 and 80 give; with 128 threads they give 9 blocks
// (36 warps) and 7 (28 warps). The launch takes the size from the kernel (p2p_groups.cuh,
// prepare_launch). The rotated ones take 128 (faster, docs/gpu.md); the local ones 256 (128
// at 7 blocks was not faster).
#ifndef ECHO_P2P_THREADS_ROT_16
#define ECHO_P2P_THREADS_ROT_16 128
#endif
#ifndef ECHO_P2P_THREADS_LOCAL_16
#define ECHO_P2P_THREADS_LOCAL_16 kThreads
#endif
// The same bound for the uncompensated rotated instances: 16-bit x 9 blocks of 128 threads (56
// registers, 36 warps) or, with ECHO_P2P_THREADS_ROT_16=256, 4 blocks (64 registers) against the
// 3 of ptxas' own 80; fp32 stays unbounded (5 blocks, 48 registers): a bound was not clearly
// better there.
#ifndef ECHO_P2P_MIN_BLOCKS_ROT_32
#define ECHO_P2P_MIN_BLOCKS_ROT_32 1
#endif
#ifndef ECHO_P2P_MIN_BLOCKS_ROT_16
#define ECHO_P2P_MIN_BLOCKS_ROT_16 (ECHO_P2P_THREADS_ROT_16 == 128 ? 9 : 4)
#endif
// The applied call's unrotated 16-bit instances (EchoConfig.state_update = "separate"): ptxas
// gives them 70-73 registers with an fp32 state (3 blocks an SM; 55 with a bf16 state) against
// the 64 of the compensated ones that also update; no bound (1) until a bound is shown to pay.
// A build may try 4 (64 registers).
#ifndef ECHO_P2P_MIN_BLOCKS_APPLIED_16
#define ECHO_P2P_MIN_BLOCKS_APPLIED_16 1
#endif
// The int8 state's fp32-x and rotated instances (compensated, g = 128): fp32 x ran slower
// bound to 4; the rotated ones (79-80 registers) were not timed bound. The unrotated 16-bit
// ones take no bound: ptxas gives them 64 registers (4 blocks an SM) by itself, and a bound of
// 4 adds spills.
// The int8 / int4 state's unrotated 16-bit instances with the local residual (EchoConfig.residual
// = "local", two pieces a lane in the push and the tail, and in bf16's reduce): bound to 3
// blocks an SM (80 registers; bf16 spills 44-100 bytes a thread, to shared memory, fp16 none);
// unbounded ptxas takes 128 (2 blocks), and bound to 4 (64) they spilled about 200 bytes a
// thread and ran slower (docs/gpu.md, "Build switches", has the times).
#ifndef ECHO_P2P_MIN_BLOCKS_LOCAL_16
#define ECHO_P2P_MIN_BLOCKS_LOCAL_16 3
#endif
#ifndef ECHO_P2P_MIN_BLOCKS_Q8
#define ECHO_P2P_MIN_BLOCKS_Q8 1
#endif
// 1: the bounded uncompensated 16-bit fast instances (their bounds make ptxas spill) spill
// to shared memory first (PTX .pragma "enable_smem_spilling", CUDA 13.0), where a spilled value
// is a few cycles away instead of a round trip through L1 / L2. Their static shared memory grows
// by a block's spills (p2p4: 13 KB at 6 blocks; rotated: up to 9 KB at 9 blocks), which the
// occupancy query counts; the launch asks for the largest shared-memory carveout for kernels
// with that much (p2p_groups.cuh). The local residual's bf16 instances spill there too (their
// reduce in two pieces a lane, ECHO_P2P_LOCAL_REDUCE_WIDE). 0: local memory, as fp32 x's and the
// other compensated instances' always (fp32 x's bounds were timed so; the local residual's fp16
// ones have no spills at theirs).
#ifndef ECHO_P2P_SMEM_SPILLS
#define ECHO_P2P_SMEM_SPILLS 1
#endif
// Arithmetic the int8 state's local-residual stages skip (bf16 and fp32 x; both exact, so every
// setting gives the same bits): ECHO_P2P_FOLD_STATE_SCALE multiplies each coefficient of Eq. 10 /
// 11 into a group's state scale once, so a state value's product with it is one multiply instead
// of two (FastStages::folded_scale); ECHO_P2P_SKIP_UNIT_FACTOR skips the rescaling's multiplies
// by 1, the factor of every call that is not rescaled (uniform branches). docs/gpu.md has the
// times.
#ifndef ECHO_P2P_FOLD_STATE_SCALE
#define ECHO_P2P_FOLD_STATE_SCALE 1
#endif
#ifndef ECHO_P2P_SKIP_UNIT_FACTOR
#define ECHO_P2P_SKIP_UNIT_FACTOR 1
#endif
// ECHO_P2P_FLOAT_STATS: the same stages take a group's range and each average's largest |v| with
// fp32 min.NaN / max.NaN instead of integer order keys (FastStages::kFloatStats; the same bits).
#ifndef ECHO_P2P_FLOAT_STATS
#define ECHO_P2P_FLOAT_STATS 1
#endif
// ECHO_P2P_WHOLE_SETS: the local residual's push runs a warp's whole group sets with every test
// for the row's last piece folded away (FastStages::push_local; the same bits).
#ifndef ECHO_P2P_WHOLE_SETS
#define ECHO_P2P_WHOLE_SETS 1
#endif
// ECHO_P2P_EXACT_UNROTATE: the uncompensated rotated 4-bit tail (g <= 128) rotates a group back
// in fp16 pairs, exact in integers, wherever its zero point allows (FastStages::tail_exact; the
// same bits).
#ifndef ECHO_P2P_EXACT_UNROTATE
#define ECHO_P2P_EXACT_UNROTATE 1
#endif

// ECHO_P2P_ROT_PUSH_WIDE: the rotated uncompensated push of 16-bit x, g = 64 or 128, holds four
// pieces a lane, so the forward rotation crosses lanes once less (FastStages::kWidePush; the
// same bits).
#ifndef ECHO_P2P_ROT_PUSH_WIDE
#define ECHO_P2P_ROT_PUSH_WIDE 1
#endif

// ECHO_P2P_NIBBLE_BYTES: the int4 state's codes decode with a byte permute a value
// (FastStages::nibbles_to_values; the same bits).
#ifndef ECHO_P2P_NIBBLE_BYTES
#define ECHO_P2P_NIBBLE_BYTES 1
#endif

// ECHO_P2P_LOCAL_REDUCE_WIDE: the local residual's reduce of bf16 x holds two pieces a lane, as
// its push does (FastStages::reduce_local; the same bits).
#ifndef ECHO_P2P_LOCAL_REDUCE_WIDE
#define ECHO_P2P_LOCAL_REDUCE_WIDE 1
#endif

// Error codes written to the host-mapped error word (1 + stage * 256 + peer).
enum Stage : int { kStagePush = 0, kStageGather = 1 };

}  // namespace

// The kernel's arguments and the host's view of a call's attributes have external linkage: the
// fast stages' instances are compiled in translation units of their own (p2p_instances.cuh),
// whose kernel lookups take and return them.
struct KernelArgs {
  const void* x;      // this rank's contribution [n] (T)
  void* y;            // this rank's output [n] (T)
  void* m1;           // compensator state [n] (fp32, or bf16 when state_bf16; int8 codes for
  void* m2;           // the fast stages' int8 instances, packed int4 ones for their int4
                      // instances) or nullptr
  float* s1;          // the int8 state's scales of m1, m2 [ceil(n / kStateGroup)], updated in
  float* s2;          // place (FastStages with S = int8_t); nullptr otherwise
  const float* factor;  // device f32[1]: the rescaling's power of two (1: not rescaled)
  int64_t n;
  int64_t seg_groups;  // Gs: groups per segment
  int me, P, g, bits, policy;
  int tile_groups;     // groups per tile
  int64_t tile0;       // first segment tile of this chunk
  int chunk_tiles;     // tiles of each segment in this chunk
  int64_t slot_bytes;  // bytes of one receive slot
  int64_t params_offset;  // offset of the 16-bit group parameters inside a slot
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

// A call's attributes as the host side uses them (p2p_cuda.cu reads them: ffi/echo_attrs.h).
struct CallAttrs {
  int bits, g, policy, P;
  int64_t timeout_ms;
  int64_t rotate;       // 1: the Hadamard rotation inside the call (EchoConfig.rotation)
  CompCoeffs k;
  const float* factor;  // device f32[1], the rescaling's power of two
  bool state_bf16;      // the compensated call's m1, m2 are bf16 (else fp32)
  bool update;          // the compensated call updates m1, m2; false: the applied call
  bool state_q8 = false;  // m1, m2 are int8 (or int4: state_q4) codes with the scales s1, s2
                          // (EchoConfig.state_dtype "int8" / "int4"): a quantized state
  bool state_q4 = false;  // with state_q8: the codes are int4, packed two a byte (XLA's S4)
  float* s1 = nullptr;    // this rank's scales of m1, m2 (int8 state; updated in place)
  float* s2 = nullptr;
  // The averages take this rank's local rounding errors (EchoConfig.residual = "local"), updated
  // where the push and the reduce quantize; false: u = x' - y / P where y is produced.
  bool residual_local = false;
};

// A kernel of the fused all-reduce (an echo_allreduce_kernel(_bounded) instance).
using KernelFn = void (*)(KernelArgs);

namespace {

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
// shared words: the kernel is instruction-bound, and reading the operand and taking a correctly
// rounded reciprocal per 16-byte piece made it slower.
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

}  // namespace
}  // namespace cuda
}  // namespace echo

#endif  // ECHO_JAX_FFI_P2P_LAYOUT_CUH_
