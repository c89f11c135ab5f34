// The fast stages of the fused all-reduce: G and BITS compile-time, several groups a warp, the
// quantizer of quant_fast.cuh (the stages' own description is above FastStages). Included by
// p2p_cuda.cu.
#ifndef ECHO_JAX_FFI_P2P_FAST_CUH_
#define ECHO_JAX_FFI_P2P_FAST_CUH_

#include <type_traits>

#include "fast_io.cuh"
#include "p2p_layout.cuh"
#include "quant_fast.cuh"

namespace echo {
namespace cuda {
namespace {

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
// S: the compensator state's element type (float, __nv_bfloat16, or int8_t for the int8 state:
// codes with one scale a kStateGroup values, KernelArgs::s1 / s2; uint8_t for the int4 state:
// the same with 4-bit codes packed two a byte, local residual only; float when !COMP), a template
// parameter rather than KernelArgs::state_bf16: the run-time branch kept both paths' live ranges
// (the rotated fp32 compensated instance 64 -> 80 registers, g = 128, sm_90a), and with it the
// bf16 state was not faster than the fp32 one; as a template parameter it is.
// UPDATE (COMP only): the update step where y is produced; false: the applied call's instances
// (EchoConfig.state_update = "separate": the apply step alone, m1 and m2 only read). A template
// parameter: as a run-time flag (a uniform branch) it raised the compensated instances'
// registers (64 -> 79-90, 80 -> 89-95, ptxas sm_90a); the generic stages take it likewise.
// LOCAL (the int8 or int4 state, unrotated): the averages take this rank's local rounding errors
// (EchoConfig.residual = "local", echo_jax.transports.xla.xla_allreduce_local), updated where
// they are made: the push updates the state of the segments it sends from x' - Q(x') (push_local),
// the reduce the own segment's from s - Q(s), and the tail only stores y. Why: the update where
// y is produced reads x, m1, m2 again and writes m1, m2 (6 s + e bytes a value for an s-byte
// state value); here the entry's reads serve the update too (4 s bytes).
template <typename T, int G, int BITS, bool COMP, bool ROT, typename S = float, bool UPDATE = COMP,
          bool LOCAL = false>
struct FastStages {
  // Two loads a lane: the stages hold a piece's values, state and output at once (registers).
  // One in the compensated 16-bit instances: with two, the unrotated ones' update's prefetched
  // x, m1, m2 (3 x 16 values a lane) took 123-126 registers (2 blocks an SM), with one 64, and
  // the extra resident blocks pay; the same in the rotated compensated 16-bit instances
  // (121-127 -> 80 registers, 2 -> 3 blocks an SM). The uncompensated 16-bit instances keep two:
  // with one they were slower, rotated too despite 80 -> 48 registers (docs/gpu.md).
  // Four in every stage of the uncompensated rotated instances would take one shuffle stage a
  // rotation away (8 lanes a 128-group in fp32), but ptxas gave fp32 104-110 registers (64 with
  // two) and the 16-bit ones 650-750 bytes of spills under their 4-blocks bound (sm_90a; not
  // timed); the 4-bit push of 16-bit x alone takes four (kWidePush).
  // The int8 state: one load a lane too, so that a lane's piece is its whole share of the group
  // whose scale it helps to set (store_state_pair).
  static constexpr bool kStateQ8 = std::is_same_v<S, int8_t>;
  // The int4 state (S = uint8_t: codes packed two a byte, echo_common.h state_q4_at): as the
  // int8 one wherever kStateQ, its codes' words half as wide (CodeWord), the local residual only.
  static constexpr bool kStateQ4 = std::is_same_v<S, uint8_t>;
  static constexpr bool kStateQ = kStateQ8 || kStateQ4;
  static constexpr int kLoadsPerLane = (sizeof(T) == 2 && COMP) || kStateQ ? 1 : 2;
  using L = fast::QuantLayout<T, G, fast::lanes_for_loads<T, G, kLoadsPerLane>()>;
  static constexpr int kVec = L::kVec, kLanes = L::kLanes, kLoads = L::kLoads;
  static constexpr int kGpw = L::kGroupsPerWarp;
  static constexpr int kPieceBytes = kVec * BITS / 8;
  static constexpr int kCodeBytes = G * BITS / 8;
  // Blocks of kBlockThreads an SM that ptxas must fit (__launch_bounds__; kernel_of), uncompensated
  // instances (ECHO_P2P_MIN_BLOCKS_32 / _16, rotated: _ROT_32 / _ROT_16), the applied call's
  // unrotated 16-bit ones (_APPLIED_16) and the int8 state's fp32-x and rotated ones (_Q8);
  // 1: no bound.
  static constexpr int kMinBlocks =
      COMP ? (kStateQ ? (!ROT && sizeof(T) == 2 ? (LOCAL ? ECHO_P2P_MIN_BLOCKS_LOCAL_16 : 1)
                                                 : ECHO_P2P_MIN_BLOCKS_Q8)
              : !UPDATE && !ROT && sizeof(T) == 2 ? ECHO_P2P_MIN_BLOCKS_APPLIED_16 : 1)
      : ROT ? (sizeof(T) == 4 ? ECHO_P2P_MIN_BLOCKS_ROT_32 : ECHO_P2P_MIN_BLOCKS_ROT_16)
            : (sizeof(T) == 4 ? ECHO_P2P_MIN_BLOCKS_32 : ECHO_P2P_MIN_BLOCKS_16);
  // Threads a block (__launch_bounds__' first argument; the launch reads it back from the
  // kernel): ECHO_P2P_THREADS_ROT_16 / _LOCAL_16 for those instances, kThreads for the others.
  static constexpr int kBlockThreads =
      sizeof(T) == 2 && !COMP && ROT  ? ECHO_P2P_THREADS_ROT_16
      : sizeof(T) == 2 && LOCAL && !ROT ? ECHO_P2P_THREADS_LOCAL_16
                                        : kThreads;
  static_assert(kBlockThreads % 32 == 0 && kBlockThreads >= 64 && kBlockThreads <= kThreads,
                "ECHO_P2P_THREADS_*: a multiple of 32 in [64, kThreads]");
  // The local residual's reduce in LP's layout, bf16 x (reduce_local).
  static constexpr bool kWideReduce =
      ECHO_P2P_LOCAL_REDUCE_WIDE && LOCAL && std::is_same_v<T, __nv_bfloat16>;
  // Spills to shared memory (ECHO_P2P_SMEM_SPILLS; echo_allreduce_kernel_bounded): the
  // uncompensated 16-bit instances, whose bounds make ptxas spill, and the local residual's bf16
  // ones, whose reduce in LP's layout (kWideReduce) spills under their bound. Not the local
  // residual's fp16 ones, which have no spills at theirs (the pragma alone changed their SASS).
  static constexpr bool kSmemSpills =
      ECHO_P2P_SMEM_SPILLS && sizeof(T) == 2 && (!COMP || kWideReduce);

  __device__ __forceinline__ static void rotate_group(float (&v)[kLoads][kVec], int j,
                                                     uint32_t sm, float f) {
    fast::hadamard_rotate<L, !COMP>(v, j, sm, f);
  }
  __device__ __forceinline__ static void unrotate_group(float (&v)[kLoads][kVec], int j,
                                                       uint32_t sm_out, float f) {
    fast::hadamard_unrotate<L, !COMP>(v, j, sm_out, f);
  }

  // Lane j's sign mask (fast::hadamard_sign_mask), computed once a block: the hash costs
  // ~25 instructions a value, too much to repeat for every tile.
  __device__ static uint32_t* sign_masks() {
    __shared__ uint32_t masks[kLanes];
    return masks;
  }
  __device__ static void setup() {
    if constexpr (ROT) {
      if (threadIdx.x < kLanes)
        sign_masks()[threadIdx.x] = fast::hadamard_sign_mask<L>(threadIdx.x);
      if constexpr (kWidePush) {
        if (threadIdx.x < LW::kLanes)
          push_sign_masks()[threadIdx.x] = fast::hadamard_sign_mask<LW>(threadIdx.x);
      }
      if constexpr (kExactTail) {
        if (threadIdx.x < kXLanes)
          exact_sign_masks()[threadIdx.x] = fast::hadamard_sign_mask<LX>(threadIdx.x);
      }
    }
  }
  __device__ static uint32_t sign_mask(int j) {
    if constexpr (ROT) return sign_masks()[j];
    return 0;
  }

  static constexpr bool kStateBf16 = std::is_same_v<S, __nv_bfloat16>;
  static_assert(kStateBf16 || kStateQ || std::is_same_v<S, float>,
                "the state is float, bfloat16, int8 or packed int4 (uint8_t)");
  // A wire group is one state group, and the scale is set where the group is updated.
  static_assert(!kStateQ || (COMP && UPDATE && G == kStateGroup && kLoads == 1),
                "the int8 / int4 state: the compensated call, g = kStateGroup, one piece a lane");
  static_assert(!LOCAL || (kStateQ && !ROT), "the local residual: the int8 / int4 state, unrotated");
  static_assert(!kStateQ4 || LOCAL, "the int4 state: the local residual only");

  // kVec values of m (m1 or m2; s its scales for the int8 state) at element e as fp32; 0 past
  // n. A bf16 state (kVec * 2 bytes: one 8- or 16-byte access) is widened exactly; an int8 one
  // (kVec bytes: one 4- or 8-byte access) read as code times its group's scale.
  __device__ static void load_state(const KernelArgs& a, const void* m, const float* s,
                                    int64_t e, float* v) {
    if constexpr (kStateBf16)
      load_vec<__nv_bfloat16, kVec>(static_cast<const __nv_bfloat16*>(m), e, a.n, v);
    else if constexpr (kStateQ8)
      load_state_q8(static_cast<const int8_t*>(m), s, e, a.n, v);
    else if constexpr (kStateQ4)
      load_state_q4(static_cast<const uint8_t*>(m), s, e, a.n, v);
    else
      load_state_f32(static_cast<const float*>(m), e, a.n, v);
  }
  __device__ static void load_m1(const KernelArgs& a, int64_t e, float* v) {
    load_state(a, a.m1, a.s1, e, v);
  }
  __device__ static void load_m2(const KernelArgs& a, int64_t e, float* v) {
    load_state(a, a.m2, a.s2, e, v);
  }
  // kVec int8 codes as kVec / 4 words (one 4- or 8-byte access; e is a multiple of kVec); kVec
  // int4 codes as one 2- or 4-byte word at byte e / 2 (e is even: a lane's piece is whole bytes).
  static constexpr int kCodeWords = kVec / 4;
  using CodeWord = std::conditional_t<
      kStateQ4, std::conditional_t<kVec == 8, uint32_t, uint16_t>,
      std::conditional_t<kVec == 8, uint2, uint32_t>>;
  // The conversions run on the fp32 pipe (the conversion unit has a quarter of its rate), a
  // whole piece at a time, without a test per value: per value, in the full pieces (every piece
  // but the last of a row), a code costs a byte permute, an add and a multiply, a new value a
  // fused multiply-add and 3 / 4 of a byte permute; a bounds test (a 64-bit compare) and a NaN
  // select a value would cost more than the conversion itself.
  // Code to value: byte q ^ 0x80 = q + 128 under the exponent of 2^23 is the float
  // 2^23 + 128 + q; minus 2^23 + 128 it is q exactly, then q * s rounded once, as state_value.
  __device__ __forceinline__ static void codes_to_values(const uint32_t (&w)[kCodeWords], float s,
                                                         float* v) {
#pragma unroll
    for (int c = 0; c < kCodeWords; ++c) {
      const uint32_t u = w[c] ^ 0x80808080u;
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        const float biased = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7540u + b));
        v[4 * c + b] = mul_rn(sub_rn(biased, 8388736.0f), s);
      }
    }
  }
  // Value to code under the inverse scale inv of a finite group: v * inv is exact and
  // |v * inv| <= 127 (state_scale_of_bits), so fma(v, inv, 1.5 * 2^23) rounds it to the
  // nearest integer, ties to even, in the low mantissa bits, as add_rn(mul_rn(v, inv), 1.5 *
  // 2^23) does (a product below 2^-126 rounds to code 0 either way), and the low byte of those
  // bits is the code's two's complement (1.5 * 2^23's low byte is 0). The caller zeroes the
  // codes of a group without a finite scale (inv = 0), as state_code does.
  __device__ __forceinline__ static uint32_t code_byte_word(const float* v, float inv) {
    uint32_t b[4];
#pragma unroll
    for (int t = 0; t < 4; ++t) b[t] = __float_as_uint(__fmaf_rn(v[t], inv, 12582912.0f));
    return __byte_perm(__byte_perm(b[0], b[1], 0x0040u), __byte_perm(b[2], b[3], 0x0040u),
                       0x5410u);
  }
  __device__ static void load_state_q8(const int8_t* m, const float* s, int64_t e, int64_t n,
                                       float* v) {
    // Not __ldg: the scale is rewritten in this kernel (store_state_pair), after this read. A
    // group of padding alone (e >= n) has no scale.
    const float scale = e < n ? s[e / kStateGroup] : 0.0f;
    uint32_t w[kCodeWords];
    if (e + kVec <= n) {
      *reinterpret_cast<CodeWord*>(w) = *reinterpret_cast<const CodeWord*>(m + e);
      codes_to_values(w, scale, v);
    } else {  // the row's last piece: codes past n read as 0 and their values are 0
      int8_t q[kVec];
#pragma unroll
      for (int t = 0; t < kVec; ++t) q[t] = e + t < n ? m[e + t] : 0;
      memcpy(w, q, kVec);
      codes_to_values(w, scale, v);
#pragma unroll
      for (int t = 0; t < kVec; ++t) v[t] = e + t < n ? v[t] : 0.0f;
    }
  }
  // The int4 state's conversions (kStateQ4), the same fp32-pipe forms on nibbles, kVec codes a
  // word (element t at bits 4t). Code to value: nibble k ^ 8 = q + 8 under the exponent of 2^23
  // is the float 2^23 + 8 + q, minus 2^23 + 8 it is q exactly, then q * s rounded once, as
  // state_value. (Odd elements' nibbles taken in place, 16 (q + 8), times s / 16, would save
  // a shift a value, but the extra scale took the bf16 instances to 12-20 bytes of spills at
  // their 80 registers; ptxas, sm_90a.)
  // ECHO_P2P_NIBBLE_BYTES: the even and the odd nibbles of a word are first spread into the
  // bytes of two words (three logic ops a word), so that each value takes one byte permute, as
  // the int8 codes do, where a shift and a logic op a value took two.
  __device__ __forceinline__ static void nibbles_to_values(uint32_t w, float s, float* v) {
    const uint32_t u = w ^ 0x88888888u;
    if constexpr (ECHO_P2P_NIBBLE_BYTES) {
      const uint32_t even = u & 0x0F0F0F0Fu, odd = (u >> 4) & 0x0F0F0F0Fu;
#pragma unroll
      for (int t = 0; t < kVec; ++t) {
        const float biased =
            __uint_as_float(__byte_perm(t % 2 ? odd : even, 0x4B000000u, 0x7540u + t / 2));
        v[t] = mul_rn(sub_rn(biased, 8388616.0f), s);
      }
      return;
    }
#pragma unroll
    for (int t = 0; t < kVec; ++t) {
      const float biased = __uint_as_float(((u >> (4 * t)) & 0x0Fu) | 0x4B000000u);
      v[t] = mul_rn(sub_rn(biased, 8388616.0f), s);
    }
  }
  // Value to code (kStateQ4): as code_byte_word, with |v * inv| <= 7 (state_scale_q4_of_bits), so
  // the low nibble of fma(v, inv, 1.5 * 2^23)'s bits is the code's two's complement; the even
  // elements' low bytes and the odd ones' (shifted by 4) merged into the nibbles of one word.
  __device__ __forceinline__ static uint32_t code_nibble_word(const float* v, float inv) {
    uint32_t b[kVec];
#pragma unroll
    for (int t = 0; t < kVec; ++t) b[t] = __float_as_uint(__fmaf_rn(v[t], inv, 12582912.0f));
    uint32_t even, odd;
    if constexpr (kVec == 8) {
      even = __byte_perm(__byte_perm(b[0], b[2], 0x0040u), __byte_perm(b[4], b[6], 0x0040u),
                         0x5410u);
      odd = __byte_perm(__byte_perm(b[1], b[3], 0x0040u), __byte_perm(b[5], b[7], 0x0040u),
                        0x5410u);
    } else {  // the low two bytes count (CodeWord uint16_t)
      even = __byte_perm(b[0], b[2], 0x0040u);
      odd = __byte_perm(b[1], b[3], 0x0040u);
    }
    return (even & 0x0F0F0F0Fu) | ((odd << 4) & 0xF0F0F0F0u);
  }
  // The int4 codes of the row's last piece (e + kVec > n) at element e: the bytes before n, the
  // nibbles past n 0 (as the int8 state's codes past n).
  __device__ __forceinline__ static CodeWord partial_code_word_q4(const uint8_t* m, int64_t e,
                                                                  int64_t n) {
    uint32_t w = 0;
#pragma unroll
    for (int i = 0; i < kVec / 2; ++i) {
      if (e + 2 * i < n) {
        const uint32_t byte = m[e / 2 + i] & (e + 2 * i + 1 < n ? 0xFFu : 0x0Fu);
        w |= byte << (8 * i);
      }
    }
    return static_cast<CodeWord>(w);
  }
  __device__ static void load_state_q4(const uint8_t* m, const float* s, int64_t e, int64_t n,
                                       float* v) {
    const float scale = e < n ? s[e / kStateGroup] : 0.0f;  // not __ldg: as load_state_q8
    if (e + kVec <= n) {
      nibbles_to_values(*reinterpret_cast<const CodeWord*>(m + e / 2), scale, v);
    } else {
      nibbles_to_values(partial_code_word_q4(m, e, n), scale, v);
#pragma unroll
      for (int t = 0; t < kVec; ++t) v[t] = e + t < n ? v[t] : 0.0f;
    }
  }
  // The values of a piece's codes as one word (CodeWord) under scale s, for either state.
  __device__ __forceinline__ static void decode_codes(const CodeWord& c, float s, float* v) {
    if constexpr (kStateQ4)
      nibbles_to_values(c, s, v);
    else
      codes_to_values(reinterpret_cast<const uint32_t(&)[kCodeWords]>(c), s, v);
  }
  // The scale of a group from its largest |v|'s bits, for either state.
  __device__ __forceinline__ static StateScale scale_of_bits(uint32_t amax_bits) {
    if constexpr (kStateQ4)
      return state_scale_q4_of_bits(amax_bits);
    else
      return state_scale_of_bits(amax_bits);
  }

  // The entry and update loads of a piece with the int8 state, and with a bf16 state and
  // 16-bit x: x, m1, m2 (and the codes' scales), all issued in one basic block before any of
  // them is converted. Why: loaded by load_raw, load_m1 and load_m2, each behind its own test
  // for the row's last piece, the conversions of one array sat between the loads (a conversion
  // waits for its load), so a piece took three memory round trips one after another instead of
  // one (SASS, sm_90a; docs/gpu.md has the times). The fp32 state's instances keep the three
  // loaders: they run at their byte floor.
  static constexpr bool kJointLoads = kStateQ || (kStateBf16 && kVec == 8);
  __device__ static void load_x_and_state(const KernelArgs& a, int64_t e, float* x, float* m1,
                                          float* m2) {
    if (e + kVec <= a.n) {
      const uint4 xw = *reinterpret_cast<const uint4*>(static_cast<const T*>(a.x) + e);
      if constexpr (kStateQ8) {
        uint32_t w1[kCodeWords], w2[kCodeWords];
        *reinterpret_cast<CodeWord*>(w1) =
            *reinterpret_cast<const CodeWord*>(static_cast<const int8_t*>(a.m1) + e);
        *reinterpret_cast<CodeWord*>(w2) =
            *reinterpret_cast<const CodeWord*>(static_cast<const int8_t*>(a.m2) + e);
        const float s1 = a.s1[e / kStateGroup], s2 = a.s2[e / kStateGroup];  // not __ldg: above
        fast::unpack_values<T, kVec>(xw, x);
        codes_to_values(w1, s1, m1);
        codes_to_values(w2, s2, m2);
      } else if constexpr (kStateQ4) {
        const CodeWord w1 =
            *reinterpret_cast<const CodeWord*>(static_cast<const uint8_t*>(a.m1) + e / 2);
        const CodeWord w2 =
            *reinterpret_cast<const CodeWord*>(static_cast<const uint8_t*>(a.m2) + e / 2);
        const float s1 = a.s1[e / kStateGroup], s2 = a.s2[e / kStateGroup];  // not __ldg: above
        fast::unpack_values<T, kVec>(xw, x);
        nibbles_to_values(w1, s1, m1);
        nibbles_to_values(w2, s2, m2);
      } else {
        const uint4 w1 = *reinterpret_cast<const uint4*>(static_cast<const S*>(a.m1) + e);
        const uint4 w2 = *reinterpret_cast<const uint4*>(static_cast<const S*>(a.m2) + e);
        fast::unpack_values<T, kVec>(xw, x);
        fast::unpack_values<S, kVec>(w1, m1);
        fast::unpack_values<S, kVec>(w2, m2);
      }
    } else {  // the row's last piece
      load_raw(a, e, x);
      load_m1(a, e, m1);
      load_m2(a, e, m2);
    }
  }
  // The group statistics of the local residual's stages as fp32 min / max (min.NaN / max.NaN):
  // a group's range two instructions a value, and its largest |v| one (|v| is a modifier of the
  // max), where the order keys take a shift and a logic op a value before their three-input
  // integer min / max (32 fewer instructions in the bf16 4-bit push's loop; sass_mix, sm_90a).
  // The same bits: the range as the keys give it for finite groups (a non-finite group's
  // encoder discards it), and the largest |v| of values that are fp32 arithmetic results, whose
  // NaN is the canonical 0x7FFFFFFF, as max.NaN's. Why: those stages are bound by the
  // instructions they issue (docs/gpu.md). Not with fp16 x (as kFoldState): there it took
  // ptxas to 4 bytes of spills a thread (sm_90a).
  static constexpr bool kFloatStats =
      ECHO_P2P_FLOAT_STATS && LOCAL && !std::is_same_v<T, __half>;

  // The largest |v| of this lane's values before n, as the bits of |v| (an integer max: a NaN's
  // bits are above every other value's).
  __device__ __forceinline__ static uint32_t abs_max_bits(const float* v, int64_t e, int64_t n) {
    if constexpr (kFloatStats) {
      if (e + kVec <= n) {
        float amax = 0.0f;
#pragma unroll
        for (int t = 0; t < kVec; ++t) amax = fast::max_nan(amax, fabsf(v[t]));
        return __float_as_uint(amax);
      }
    }
    uint32_t amax = 0;
    if (e + kVec <= n) {
#pragma unroll
      for (int t = 0; t < kVec; ++t) amax = max(amax, __float_as_uint(v[t]) & 0x7FFFFFFFu);
    } else {
#pragma unroll
      for (int t = 0; t < kVec; ++t)
        if (e + t < n) amax = max(amax, __float_as_uint(v[t]) & 0x7FFFFFFFu);
    }
    return amax;
  }
  // This lane's kVec codes of a group under scale sc, stored at element e (none past n); the
  // scale by the group's first lane, unless the group is padding alone.
  __device__ __forceinline__ static void store_codes(int8_t* codes, float* s, int64_t e,
                                                     int64_t n, const float* v, StateScale sc,
                                                     bool first) {
    uint32_t w[kCodeWords];
#pragma unroll
    for (int c = 0; c < kCodeWords; ++c)
      w[c] = sc.inv != 0.0f ? code_byte_word(v + 4 * c, sc.inv) : 0u;
    if (e + kVec <= n) {
      *reinterpret_cast<CodeWord*>(codes + e) = *reinterpret_cast<const CodeWord*>(w);
    } else {
      int8_t q[kVec];
      memcpy(q, w, kVec);
#pragma unroll
      for (int t = 0; t < kVec; ++t)
        if (e + t < n) codes[e + t] = q[t];
    }
    if (first && e < n) s[e / kStateGroup] = sc.s;
  }
  // The same for the int4 state (kStateQ4): this lane's kVec / 2 bytes of packed codes at byte
  // e / 2 (e is even, so the lanes of a group write whole bytes of their own); in the row's last
  // piece the bytes before n, a nibble past n 0.
  __device__ __forceinline__ static void store_codes_q4(uint8_t* codes, float* s, int64_t e,
                                                        int64_t n, const float* v, StateScale sc,
                                                        bool first) {
    const uint32_t w = sc.inv != 0.0f ? code_nibble_word(v, sc.inv) : 0u;
    if (e + kVec <= n) {
      *reinterpret_cast<CodeWord*>(codes + e / 2) = static_cast<CodeWord>(w);
    } else {
#pragma unroll
      for (int i = 0; i < kVec / 2; ++i)
        if (e + 2 * i < n)
          codes[e / 2 + i] =
              static_cast<uint8_t>((w >> (8 * i)) & (e + 2 * i + 1 < n ? 0xFFu : 0x0Fu));
    }
    if (first && e < n) s[e / kStateGroup] = sc.s;
  }
  // store_codes / store_codes_q4 of the average m (m1 or m2), for the state's type.
  __device__ __forceinline__ static void store_state_codes(void* m, float* s, int64_t e,
                                                           int64_t n, const float* v,
                                                           StateScale sc, bool first) {
    if constexpr (kStateQ4)
      store_codes_q4(static_cast<uint8_t*>(m), s, e, n, v, sc, first);
    else
      store_codes(static_cast<int8_t*>(m), s, e, n, v, sc, first);
  }
  // The int8 state's store of this lane's kVec new values of m1 (v1) and m2 (v2) at element e:
  // each group's largest |v| over its kLanes lanes (values past n do not count; every lane of the
  // group calls this together), its scale (echo_common.h state_scale_of_bits), the codes, and the
  // scale by the group's first lane. The two averages' shuffles are interleaved (independent
  // chains in flight together). Each lane read the old scales before (load_update), and the
  // shuffles order those reads before the one write.
  __device__ static void store_state_pair(const KernelArgs& a, int64_t e, const float* v1,
                                          const float* v2) {
    uint32_t amax1 = abs_max_bits(v1, e, a.n), amax2 = abs_max_bits(v2, e, a.n);
    const unsigned lane = threadIdx.x % 32;
    const unsigned mask =
        kLanes == 32 ? 0xFFFFFFFFu : ((1u << kLanes) - 1u) << (lane / kLanes * kLanes);
#pragma unroll
    for (int off = kLanes / 2; off > 0; off /= 2) {
      const uint32_t o1 = __shfl_xor_sync(mask, amax1, off);
      const uint32_t o2 = __shfl_xor_sync(mask, amax2, off);
      amax1 = max(amax1, o1);
      amax2 = max(amax2, o2);
    }
    const bool first = lane % kLanes == 0;
    store_state_codes(a.m1, a.s1, e, a.n, v1, scale_of_bits(amax1), first);
    store_state_codes(a.m2, a.s2, e, a.n, v2, scale_of_bits(amax2), first);
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
  __device__ static void load_raw(const KernelArgs& a, int64_t e, float* v) {
    const T* x = static_cast<const T*>(a.x);
    if (e + kVec <= a.n) {
      fast::unpack_values<T, kVec>(*reinterpret_cast<const uint4*>(x + e), v);
    } else {
#pragma unroll
      for (int t = 0; t < kVec; ++t) v[t] = e + t < a.n ? to_f32<T>(x[e + t]) : 0.0f;
    }
  }

  // The contribution, after the compensator's apply step (Eq. 10) when COMP; the padding beyond
  // n stays 0 (not compensated, as in the reference): x, m1 and m2 load as 0 there, and the
  // apply step of zeros is +0 (x + (+-0 + +-0) with x = +0), so no test a value is needed.
  __device__ static void load_contrib(const KernelArgs& a, int64_t e, float* v) {
    float m1[kVec], m2[kVec];
    if constexpr (COMP && kJointLoads) {
      load_x_and_state(a, e, v, m1, m2);
    } else {
      load_raw(a, e, v);
      if constexpr (COMP) {
        load_m1(a, e, m1);
        load_m2(a, e, m2);
      }
    }
    apply_and_scale(a, v, m1, m2);
  }
  // The apply step (Eq. 10, COMP) on x in v, then the rescaling (Sec. 5.4).
  __device__ __forceinline__ static void apply_and_scale(const KernelArgs& a, float* v,
                                                         const float* m1, const float* m2) {
    if constexpr (COMP) {
#pragma unroll
      for (int t = 0; t < kVec; ++t) v[t] = comp_apply(v[t], m1[t], m2[t], a.k);
    }
    rescale(a, v);
  }
  // The same from the products p1 = (eta a) m1 and p2 = (eta (1 - a)) m2, as comp_apply
  // rounds them (folded_scale).
  __device__ __forceinline__ static void apply_products_and_scale(const KernelArgs& a, float* v,
                                                                  const float* p1,
                                                                  const float* p2) {
#pragma unroll
    for (int t = 0; t < kVec; ++t) v[t] = add_rn(v[t], add_rn(p1[t], p2[t]));
    rescale(a, v);
  }
  // The rescaling (Sec. 5.4), after the apply step: v * f; in the local residual's stages
  // nothing when f is 1 (x * 1 = x; skip_unit_factor).
  __device__ __forceinline__ static void rescale(const KernelArgs& a, float* v) {
    const float f = scale_of(a);
    if (!skip_unit_factor(f)) {
#pragma unroll
      for (int t = 0; t < kVec; ++t) v[t] = mul_rn(v[t], f);
    }
  }

  // The int8 state's values times a coefficient of Eq. 10 / 11, folded into the group's scale
  // (ECHO_P2P_FOLD_STATE_SCALE): a value is q s with q an integer code and s a power of two
  // (2^-106 <= s <= 2^121, or 0, or not finite), so for a coefficient c that is 0 or in
  // [2^-20, 1] the product c s is exact (a normal float, or 0, or not finite as s is), and
  // round((c s) q) = round(c (q s)), comp_apply's and comp_update_residual's product, bit for
  // bit (+-0, NaN and inf included). The call's coefficients are checked on the host
  // (state_coefficients_fold). Why: one multiply a value instead of two (the decode's and the
  // coefficient's) in the instruction-bound local stages.
  // Not with fp16 x: there the fold took ptxas to 8-40 bytes of spills a thread (80 registers,
  // sm_90a), 24-48 with skip_unit_factor, against none without either.
  static constexpr bool kFoldState =
      ECHO_P2P_FOLD_STATE_SCALE && LOCAL && !std::is_same_v<T, __half>;
  __device__ __forceinline__ static float folded_scale(float c, float s) {
    return kFoldState ? mul_rn(c, s) : s;
  }
  // Whether the multiplies by the rescaling's factor f (or its inverse) may be skipped: f is 1
  // in the local residual's stages (ECHO_P2P_SKIP_UNIT_FACTOR; as kFoldState, not with fp16 x).
  // Only there: the same uniform branch in the uncompensated 16-bit push made p2p4 23 % slower
  // (one H100, docs/gpu.md).
  __device__ __forceinline__ static bool skip_unit_factor(float f) {
    return ECHO_P2P_SKIP_UNIT_FACTOR && LOCAL && !std::is_same_v<T, __half> && f == 1.0f;
  }

  // The reduce stage's own piece in the int8 state's unrotated 16-bit instances: x, m1, m2 and
  // the scales as stored, loaded once before the sum, so that they are in flight with the
  // peers' codes, and kept in registers (10 words a lane) for the update, which needs the same
  // values; the peers are read one ahead (load_peer_words). Without it the own contribution was
  // loaded where its turn in the rank-order sum came, then x, m1, m2 again after the sum: two
  // more round trips, and 2 s + e bytes a value of the own segment read twice. Not in the other
  // compensated instances: it took the bf16 state's from 64 to 78-96 registers and the fp32-x
  // int8 ones from 48 to 60, and those ran slower (docs/gpu.md has the times).
  static constexpr bool kKeepOwn = COMP && UPDATE && !ROT && kStateQ && sizeof(T) == 2;
  // The codes as one word each (CodeWord), loaded as push_local loads them: held as
  // Pack<int8_t, kVec> they took byte permutes and logic ops (61-67 more instructions in each
  // kernel with kKeepOwn, the same registers and time; cuobjdump, sm_90a; docs/gpu.md).
  struct OwnWords {
    uint4 x;            // kVec values of T
    CodeWord m1, m2;    // kVec int8 (int4) codes of m1, m2 as stored
    float s1, s2;       // their groups' scales
  };
  // The words of the piece at element e; past n, zeros (x, m1, m2 then read as +0, as
  // load_raw / load_state give them; a group of padding alone has scale 0).
  __device__ static void load_own(const KernelArgs& a, int64_t e, OwnWords& o) {
    load_local_piece(a, e, a.n, o.x, o.m1, o.m2);
    // not __ldg: rewritten in this kernel (load_state_q8)
    o.s1 = e < a.n ? a.s1[e / kStateGroup] : 0.0f;
    o.s2 = e < a.n ? a.s2[e / kStateGroup] : 0.0f;
  }
  // With kKeepOwn, the reduce stage reads its peers one ahead: the next peer's parameters and
  // code word are loaded before this one's are decoded, so the P - 1 peers' loads overlap
  // instead of taking a round trip each (3 more words a lane).
  __device__ __forceinline__ static void load_peer_words(const KernelArgs& a, int r,
                                                         int64_t local, int j, uint32_t& wire,
                                                         uint2& word) {
    const uint8_t* slot = a.ws[a.me] + push_slot(r, a.slot_bytes);
    wire = fast::load_wire(reinterpret_cast<const uint16_t*>(slot + a.params_offset), local,
                           a.policy);
    word = fast::load_piece_word<kVec, BITS>(slot + piece_byte(local, j, 0));
  }
  // x, and the codes of m1, m2 times f1, f2: the scales as stored (the values) or folded with
  // a coefficient (folded_scale: the products).
  __device__ __forceinline__ static void unpack_own(const OwnWords& o, float* x, float* m1,
                                                    float* m2, float f1, float f2) {
    fast::unpack_values<T, kVec>(o.x, x);
    decode_codes(o.m1, f1, m1);
    decode_codes(o.m2, f2, m2);
  }

  // What the state update of a piece reads (COMP): x as fp32 and m1, m2. The unrotated stages
  // load it for all kLoads pieces of a group before the first store (prefetch_update), so that
  // every load of the update is in flight at once (a load after a store of y or m1 / m2 could
  // alias it and waits for it). The rotated stages load it piece by piece (load_update):
  // prefetched, their registers went up and the rotated fused compensator got slower.
  struct UpdateIn {
    float x[kVec], m1[kVec], m2[kVec];
  };
  __device__ static void load_update(const KernelArgs& a, int64_t e, UpdateIn& in) {
    if constexpr (COMP && UPDATE && kJointLoads) {
      load_x_and_state(a, e, in.x, in.m1, in.m2);
    } else if constexpr (COMP && UPDATE) {
      load_raw(a, e, in.x);
      load_m1(a, e, in.m1);
      load_m2(a, e, in.m2);
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
    if constexpr (COMP && UPDATE && !LOCAL) {  // the applied call: the update is its own op;
      float n1[kVec], n2[kVec];                   // LOCAL: push and reduce updated the state
#pragma unroll
      for (int t = 0; t < kVec; ++t) {
        const float xp = comp_apply(in.x[t], in.m1[t], in.m2[t], a.k);
        comp_update(xp, y[t], in.m1[t], in.m2[t], a.k, &n1[t], &n2[t]);
      }
      if constexpr (kStateQ) {
        store_state_pair(a, e, n1, n2);
      } else {
        store_state(a, a.m1, e, n1);
        store_state(a, a.m2, e, n2);
      }
    }
  }

  // The encoder of the group whose lanes hold v (order-key min / max over the group's lanes).
  // min.NaN / max.NaN (the standalone quantizer's range) took 4-6 more registers here, and the
  // virtual-rank benchmark showed no gain with it; only the plain fp32 push (push_plain), which
  // takes the range before scaling, is faster with it. The local residual's stages take it too
  // (kFloatStats).
  // LDS, LNS: the pieces a lane and the lanes a group (L's by default; push_local's LP).
  template <int LDS = kLoads, int LNS = kLanes>
  __device__ static fast::Encoder group_encoder(const KernelArgs& a, const float (&v)[LDS][kVec],
                                                uint32_t* wire) {
    if constexpr (kFloatStats) {
      fast::Range r = fast::range_empty();
#pragma unroll
      for (int k = 0; k < LDS; ++k) {
#pragma unroll
        for (int t = 0; t < kVec; ++t) fast::range_add(r, v[k][t]);
      }
      fast::range_reduce<LNS>(r);
      return fast::make_encoder<BITS>(a.policy, r.lo, r.hi, fast::range_finite(r), wire);
    }
    int32_t kmin = fast::kKeyMax, kmax = fast::kKeyMin;
#pragma unroll
    for (int k = 0; k < LDS; ++k) {
#pragma unroll
      for (int t = 0; t < kVec; ++t) fast::key_range_add(kmin, kmax, v[k][t]);
    }
    fast::key_range_reduce<LNS>(kmin, kmax);  // within the group's aligned lanes
    return fast::make_encoder<BITS>(a.policy, __uint_as_float(fast::from_order_key(kmin)),
                                    __uint_as_float(fast::from_order_key(kmax)),
                                    fast::keys_finite(kmin, kmax), wire);
  }

  template <int LNS = kLanes>
  __device__ static int64_t piece_byte(int64_t local, int j, int k) {
    return local * kCodeBytes + static_cast<int64_t>(k * LNS + j) * kPieceBytes;
  }

  // Issuing the loads of two group sets per warp before using either, and the P - 1 peers'
  // code words of a group before the sum, raised the registers (fp32 48 -> 73, bf16 64 -> 90 a
  // thread), so fewer blocks fit an SM, and made the call slower: one group set a warp at a
  // time, loads issued per stage as below (the int8 state's reduce reads one peer ahead:
  // kKeepOwn).

  // push of the uncompensated unrotated fp32 call: the group's range from x as loaded, with
  // min.NaN / max.NaN (two instructions a value; order keys take five), then scaled. Scaling by
  // the power-of-two factor f is monotone and keeps signs, so the min / max of the scaled values
  // are the scaled lo / hi bit for bit (-0 < +0 included); fewer instructions, a faster push.
  // The 16-bit instances keep the keys: the same change with their min.NaN.bf16x2 words spilled
  // 300-350 bytes a thread under their 5-blocks bound and made them slower, and this push over
  // their unpacked fp32 values was no faster than the keys (docs/gpu.md).
  __device__ static void push_plain(const KernelArgs& a, int seg, int64_t first, int count,
                                    int64_t local0, int warp, int warps, int lane) {
    const int j = lane % kLanes;
    uint8_t* slot = a.ws[seg] + push_slot(a.me, a.slot_bytes);
    uint16_t* prm = reinterpret_cast<uint16_t*>(slot + a.params_offset);
    const float f = scale_of(a);
    for (int q0 = warp * kGpw; q0 < count; q0 += warps * kGpw) {
      const int q = q0 + lane / kLanes;
      const bool valid = q < count;
      const int64_t e0 = (seg * a.seg_groups + first + q) * G;
      float v[kLoads][kVec];
      fast::Range r = fast::range_empty();
#pragma unroll
      for (int k = 0; k < kLoads; ++k) {
        if (valid) {
          load_raw(a, e0 + L::index(j, k, 0), v[k]);
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

  // The local residual's update of a piece in the reduce (LOCAL): u = (v - decoded) / f for the
  // kVec values v as quantized (scaled) and the values their codes decode to, then Eq. 11 from
  // the state as read at entry, stored as int8 codes (store_state_pair: every lane of the group
  // together).
  // kFoldOwn: m1 and m2 hold the products beta1 m1, beta2 m2 (the own piece's codes times
  // folded_scale), else the values. Only with the local residual: the output residual's update
  // needs both products of each value (comp_apply's and comp_update's), and folding its apply
  // step alone gave its 8-bit instance 8 bytes of spills (ptxas, sm_90a).
  static constexpr bool kFoldOwn = kKeepOwn && kFoldState;
  __device__ __forceinline__ static void update_local(const KernelArgs& a, int64_t e,
                                                      const float* v, const float* decoded,
                                                      const float* m1, const float* m2) {
    const float inv = unscale_of(a);
    float u[kVec], n1[kVec], n2[kVec];
#pragma unroll
    for (int t = 0; t < kVec; ++t) u[t] = sub_rn(v[t], decoded[t]);
    if (!skip_unit_factor(inv)) {
#pragma unroll
      for (int t = 0; t < kVec; ++t) u[t] = mul_rn(u[t], inv);
    }
#pragma unroll
    for (int t = 0; t < kVec; ++t) {
      if constexpr (kFoldOwn) {  // comp_update_residual's sums
        n1[t] = add_rn(m1[t], mul_rn(a.k.c1, u[t]));
        n2[t] = add_rn(m2[t], mul_rn(a.k.c2, u[t]));
      } else {
        comp_update_residual(u[t], m1[t], m2[t], a.k, &n1[t], &n2[t]);
      }
    }
    store_state_pair(a, e, n1, n2);
  }

  // The layout of the local residual's push (push_local) and tail: two loads a lane (half of
  // L's lanes a group), so that a lane's share of a group's fixed work (its addresses, the
  // encoder, the shuffle reductions of the range and of each average's largest value, the
  // scales) is spread over twice the values. Why: with L's one piece a lane that fixed work was about half of the
  // push's instructions, and the push issued about 2.5 warp instructions a value, three times
  // the plain push's (ffi/tools/sass_mix.py; docs/gpu.md). The wire layout is L's: piece (j, k)
  // of LP is piece k * LP::kLanes + j of the group, its values in index order either way.
  using LP = fast::QuantLayout<T, G, fast::lanes_for_loads<T, G, 2>()>;

  // The int8 state's words of the piece at element e (push_local, and the reduce's own piece:
  // load_own): x (+0 past n) and the codes of m1, m2 (0 past n), loaded together, decoded where
  // they are used. The codes as one word (CodeWord): held as Pack<int8_t, kVec> they took byte
  // permutes and logic ops (272 more instructions in push_local, the same 80 registers) and the
  // call ran 7 % slower (one H100, docs/gpu.md).
  // n: the row's length, or kNoEnd where the caller knows the piece is whole (push_local).
  __device__ __forceinline__ static void load_local_piece(const KernelArgs& a, int64_t e,
                                                          int64_t n, uint4& x, CodeWord& c1,
                                                          CodeWord& c2) {
    const T* xs = static_cast<const T*>(a.x);
    if constexpr (kStateQ4) {  // the codes at byte e / 2
      const uint8_t* q1 = static_cast<const uint8_t*>(a.m1);
      const uint8_t* q2 = static_cast<const uint8_t*>(a.m2);
      if (e + kVec <= n) {
        x = *reinterpret_cast<const uint4*>(xs + e);
        c1 = *reinterpret_cast<const CodeWord*>(q1 + e / 2);
        c2 = *reinterpret_cast<const CodeWord*>(q2 + e / 2);
      } else {  // the row's last piece
        Pack<T, kVec> xv;
#pragma unroll
        for (int t = 0; t < kVec; ++t) xv.v[t] = e + t < n ? xs[e + t] : from_f32<T>(0.0f);
        x = *reinterpret_cast<const uint4*>(&xv);
        c1 = partial_code_word_q4(q1, e, n);
        c2 = partial_code_word_q4(q2, e, n);
      }
      return;
    }
    const int8_t* q1 = static_cast<const int8_t*>(a.m1);
    const int8_t* q2 = static_cast<const int8_t*>(a.m2);
    if (e + kVec <= n) {
      x = *reinterpret_cast<const uint4*>(xs + e);
      c1 = *reinterpret_cast<const CodeWord*>(q1 + e);
      c2 = *reinterpret_cast<const CodeWord*>(q2 + e);
    } else {  // the row's last piece
      Pack<T, kVec> xv;
      int8_t b1[kVec], b2[kVec];
#pragma unroll
      for (int t = 0; t < kVec; ++t) {
        const bool in = e + t < n;
        xv.v[t] = in ? xs[e + t] : from_f32<T>(0.0f);
        b1[t] = in ? q1[e + t] : 0;
        b2[t] = in ? q2[e + t] : 0;
      }
      x = *reinterpret_cast<const uint4*>(&xv);
      memcpy(&c1, b1, kVec);
      memcpy(&c2, b2, kVec);
    }
  }
  // The values of the int8 codes c of the piece at element e under scale s; 0 past n (as
  // load_state_q8 gives them).
  __device__ __forceinline__ static void decode_state_piece(const CodeWord& c, float s, int64_t e,
                                                            int64_t n, float* v) {
    decode_codes(c, s, v);
    if (e + kVec > n) {
#pragma unroll
      for (int t = 0; t < kVec; ++t) v[t] = e + t < n ? v[t] : 0.0f;
    }
  }

  // The local residual's update of one average (M1: m1, else m2) of the group at element e0
  // whose lanes hold the residuals u (LP: every lane of the group together, shuffles): Eq. 11
  // from the codes c and the scale s as read at entry, the new values stored as int8 codes under
  // the group's new scale, which its first lane stores. One average at a time, each decoded
  // again from its codes: the two at once held 32 more values a lane. kWhole: every lane of the
  // warp is here and its group is whole (n is kNoEnd; push_local_groups).
  template <bool M1, bool kWhole>
  __device__ __forceinline__ static void update_local_average(
      const KernelArgs& a, int64_t e0, int64_t n, int j, const float (&u)[LP::kLoads][kVec],
      const CodeWord (&c)[LP::kLoads], float s) {
    float nv[LP::kLoads][kVec];
    uint32_t amax = 0;
    const float f = folded_scale(M1 ? a.k.b1 : a.k.b2, s);
#pragma unroll
    for (int k = 0; k < LP::kLoads; ++k) {
      const int64_t e = e0 + LP::index(j, k, 0);
      float m[kVec];  // the values, or beta m with kFoldState
      decode_state_piece(c[k], f, e, n, m);
#pragma unroll
      for (int t = 0; t < kVec; ++t) {
        if constexpr (kFoldState) {  // comp_update_residual's sum
          nv[k][t] = add_rn(m[t], mul_rn(M1 ? a.k.c1 : a.k.c2, u[k][t]));
        } else {
          float n1, n2;  // the other average's half of comp_update_residual is dead code
          comp_update_residual(u[k][t], M1 ? m[t] : 0.0f, M1 ? 0.0f : m[t], a.k, &n1, &n2);
          nv[k][t] = M1 ? n1 : n2;
        }
      }
      amax = max(amax, abs_max_bits(nv[k], e, n));
    }
    constexpr int kLn = LP::kLanes;
    const unsigned lane = threadIdx.x % 32;
    // The group's lanes; the whole warp where every lane is here (a run-time mask costs the
    // shuffles a divergence check each).
    const unsigned mask = kLn == 32 || kWhole ? 0xFFFFFFFFu
                                              : ((1u << kLn) - 1u) << (lane / kLn * kLn);
#pragma unroll
    for (int off = kLn / 2; off > 0; off /= 2) amax = max(amax, __shfl_xor_sync(mask, amax, off));
    const StateScale sc = scale_of_bits(amax);
#pragma unroll
    for (int k = 0; k < LP::kLoads; ++k)
      store_state_codes(M1 ? a.m1 : a.m2, M1 ? a.s1 : a.s2, e0 + LP::index(j, k, 0), n, nv[k],
                        sc, j == 0 && k == 0);
  }

  // push with the local residual (LOCAL: the int8 state; LP, two pieces a lane): x, m1, m2
  // loaded once, x' quantized and sent, and the state of these values updated from x' - Q(x')
  // (the value the owner decodes) while the codes of m1, m2 are still in registers. Each lane
  // read the old scales at entry; the shuffles of each average's update order those reads
  // before its first lane's write.
  // A warp's groups are nearly always whole and all present: then (kWhole) the group set runs
  // with n = kNoEnd, so every test for the row's last piece folds away at compile time, and the
  // shuffles take the whole warp. Why: those tests (a 64-bit compare and a branch each, a dozen
  // a group set) and the run-time shuffle masks' divergence checks are instructions in stages
  // bound by the instructions they issue; with both changes the local row runs 7 % faster
  // alone on one H100 (docs/gpu.md).
  // bf16 x only: with fp32 and fp16 x the second copy of the push took ptxas to 4-16 bytes of
  // spills a thread (sm_90a), against none without it.
  static constexpr bool kWholeSets = ECHO_P2P_WHOLE_SETS && std::is_same_v<T, __nv_bfloat16>;
  static constexpr int64_t kNoEnd = INT64_MAX;
  __device__ static void push_local(const KernelArgs& a, int seg, int64_t first, int count,
                                    int64_t local0, int warp, int warps, int lane) {
    constexpr int kGroups = LP::kGroupsPerWarp;
    const int j = lane % LP::kLanes;
    uint8_t* slot = a.ws[seg] + push_slot(a.me, a.slot_bytes);
    for (int q0 = warp * kGroups; q0 < count; q0 += warps * kGroups) {
      const int64_t end = (seg * a.seg_groups + first + q0 + kGroups) * G;  // the set's end
      if (kWholeSets && q0 + kGroups <= count && end <= a.n)  // uniform in the warp
        push_local_groups<true>(a, seg, first, count, local0, q0, lane, j, slot);
      else
        push_local_groups<false>(a, seg, first, count, local0, q0, lane, j, slot);
    }
  }
  // push_local's group set at q0 (kWhole: all there and whole).
  template <bool kWhole>
  __device__ static void push_local_groups(const KernelArgs& a, int seg, int64_t first, int count,
                                           int64_t local0, int q0, int lane, int j,
                                           uint8_t* slot) {
    constexpr int kLd = LP::kLoads, kLn = LP::kLanes;
    const int64_t n = kWhole ? kNoEnd : a.n;
    uint16_t* prm = reinterpret_cast<uint16_t*>(slot + a.params_offset);
    const int q = q0 + lane / kLn;
    const bool valid = kWhole || q < count;
    const int64_t e0 = (seg * a.seg_groups + first + q) * G;
    uint4 xw[kLd];
    CodeWord c1[kLd], c2[kLd];
    float s1 = 0.0f, s2 = 0.0f;  // a group of padding alone has no scale
#pragma unroll
    for (int k = 0; k < kLd; ++k) {
      xw[k] = make_uint4(0, 0, 0, 0);
      c1[k] = c2[k] = CodeWord{};
      if (valid) load_local_piece(a, e0 + LP::index(j, k, 0), n, xw[k], c1[k], c2[k]);
    }
    if (valid && (kWhole || e0 < a.n)) {  // not __ldg: rewritten below (update_local_average)
      s1 = a.s1[e0 / kStateGroup];
      s2 = a.s2[e0 / kStateGroup];
    }
    float v[kLd][kVec];  // x' (Eq. 10, rescaled), then the residual
#pragma unroll
    for (int k = 0; k < kLd; ++k) {
      const int64_t e = e0 + LP::index(j, k, 0);
      float m1[kVec], m2[kVec];
      fast::unpack_values<T, kVec>(xw[k], v[k]);
      if constexpr (kFoldState) {  // (eta a) m1, (eta (1 - a)) m2
        decode_state_piece(c1[k], folded_scale(a.k.ea, s1), e, n, m1);
        decode_state_piece(c2[k], folded_scale(a.k.eb, s2), e, n, m2);
        apply_products_and_scale(a, v[k], m1, m2);
      } else {
        decode_state_piece(c1[k], s1, e, n, m1);
        decode_state_piece(c2[k], s2, e, n, m2);
        apply_and_scale(a, v[k], m1, m2);
      }
    }
    uint32_t wire;
    const fast::Encoder enc = group_encoder<kLd, kLn>(a, v, &wire);  // every lane: shuffles
    if (!valid) return;  // a group's lanes leave together (update_local_average's shuffles)
    if (j == 0) fast::store_wire(prm, local0 + q, a.policy, wire);
    const DequantParams d = fast::decoder_of<BITS>(wire, a.policy);
    const float inv = unscale_of(a);
#pragma unroll
    for (int k = 0; k < kLd; ++k) {
      uint32_t codes[kVec];
#pragma unroll
      for (int t = 0; t < kVec; ++t) {
        codes[t] = fast::encode<BITS>(v[k][t], enc) & enc.mask;
        // u = (x' - what the owner decodes) in x's units
        v[k][t] = sub_rn(v[k][t], fast::decode_fast(codes[t], d));
      }
      if (!skip_unit_factor(inv)) {
#pragma unroll
        for (int t = 0; t < kVec; ++t) v[k][t] = mul_rn(v[k][t], inv);
      }
      fast::store_piece<kVec, BITS>(slot + piece_byte<kLn>(local0 + q, j, k), codes,
                                    0xFFFFFFFFu);
    }
    update_local_average<true, kWhole>(a, e0, n, j, v, c1, s1);
    update_local_average<false, kWhole>(a, e0, n, j, v, c2, s2);
  }

  // The rotated uncompensated 4-bit push of 16-bit x, g = 64 or 128, takes four pieces a lane
  // (LW): a 128-group is then 4 lanes and crosses lanes twice in the forward rotation, not three
  // times (two pieces, 8 lanes), with the same stage order, so the same bits (the wire's piece
  // bytes follow the values, piece_byte). Not g = 256 (bf16: 104 bytes of spills a thread under
  // the 4 blocks' 64 registers) nor 8 bits (fp16, g = 128: 100 bytes; ptxas, sm_90a).
  static constexpr bool kWidePush = ECHO_P2P_ROT_PUSH_WIDE && ROT && !COMP && BITS == 4 &&
                                    sizeof(T) == 2 && (G == 64 || G == 128);
  using LW = fast::QuantLayout<T, G, fast::lanes_for_loads<T, G, 4>()>;
  using LPush = std::conditional_t<kWidePush, LW, L>;
  __device__ static uint32_t* push_sign_masks() {
    if constexpr (kWidePush) {
      __shared__ uint32_t masks[LW::kLanes];
      return masks;
    } else {
      return sign_masks();
    }
  }

  // push: quantize the tile's groups of segment seg into owner seg's push slot for this rank.
  __device__ static void push(const KernelArgs& a, int seg, int64_t first, int count,
                              int64_t local0, int warp, int warps, int lane) {
    if constexpr (!COMP && !ROT && sizeof(T) == 4) {
      push_plain(a, seg, first, count, local0, warp, warps, lane);
      return;
    }
    if constexpr (LOCAL) {
      push_local(a, seg, first, count, local0, warp, warps, lane);
      return;
    }
    push_groups<LPush>(a, seg, first, count, local0, warp, warps, lane);
  }
  // The push of the groups in layout LP (L, or LW for kWidePush).
  template <class LP>
  __device__ static void push_groups(const KernelArgs& a, int seg, int64_t first, int count,
                                     int64_t local0, int warp, int warps, int lane) {
    constexpr int kLd = LP::kLoads, kLn = LP::kLanes, kGw = LP::kGroupsPerWarp;
    const int j = lane % kLn;
    const uint32_t sm = ROT ? push_sign_masks()[j] : 0u;
    uint8_t* slot = a.ws[seg] + push_slot(a.me, a.slot_bytes);
    uint16_t* prm = reinterpret_cast<uint16_t*>(slot + a.params_offset);
    // q0 is the same for the 32 lanes of a warp, so every shuffle runs with the whole warp;
    // the lanes of a group past the tile's end compute on zeros and store nothing.
    for (int q0 = warp * kGw; q0 < count; q0 += warps * kGw) {
      const int q = q0 + lane / kLn;
      const bool valid = q < count;
      const int64_t e0 = (seg * a.seg_groups + first + q) * G;
      float v[kLd][kVec];
#pragma unroll
      for (int k = 0; k < kLd; ++k) {
        if (valid) {
          load_contrib(a, e0 + LP::index(j, k, 0), v[k]);
        } else {
#pragma unroll
          for (int t = 0; t < kVec; ++t) v[k][t] = 0.0f;
        }
      }
      if constexpr (ROT) fast::hadamard_rotate<LP, !COMP>(v, j, sm, a.rot_scale);
      uint32_t wire;
      const fast::Encoder enc = group_encoder<kLd, kLn>(a, v, &wire);
      if (!valid) continue;
      if (j == 0) fast::store_wire(prm, local0 + q, a.policy, wire);
#pragma unroll
      for (int k = 0; k < kLd; ++k) {
        uint32_t codes[kVec];
#pragma unroll
        for (int t = 0; t < kVec; ++t) codes[t] = fast::encode<BITS>(v[k][t], enc);
        fast::store_piece<kVec, BITS>(slot + piece_byte<kLn>(local0 + q, j, k), codes,
                                      enc.mask);
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
          fast::store_piece<kVec, BITS>(a.ws[r] + gather + piece_byte(local, j, k), codes,
                                        0xFFFFFFFFu);
      }
    }
    unrotate_group(y, j, sm_out, a.rot_scale);
    if (!valid) return;
#pragma unroll
    for (int k = 0; k < kLoads; ++k) {
      UpdateIn in;
      load_update(a, e0 + L::index(j, k, 0), in);
      store_output(a, e0 + L::index(j, k, 0), y[k], in);
    }
  }

  // reduce with the local residual in LP's layout (kWideReduce): two pieces a lane, as
  // push_local, so that a lane's share of a group's fixed work (the encoder, the shuffles of
  // the range and of each average's largest value, the scales) is spread over twice the values.
  // Why: in L's layout (one piece a lane) the reduce cost about three times the push's extra
  // time a value over p2p4's (ECHO_JAX_P2P_REPEAT_STAGE; docs/gpu.md). The same bits: the sum in
  // rank order, the wire's pieces in index order (piece (j, k) of LP is piece k * LP::kLanes + j
  // of the group), the update as push_local's (update_local_average). bf16 x (kWideReduce, as
  // kWholeSets).
  __device__ static void reduce_local(const KernelArgs& a, int64_t first, int count,
                                      int64_t local0, int warp, int warps, int lane) {
    constexpr int kGroups = LP::kGroupsPerWarp;
    const int j = lane % LP::kLanes;
    for (int q0 = warp * kGroups; q0 < count; q0 += warps * kGroups) {
      const int64_t end = (a.me * a.seg_groups + first + q0 + kGroups) * G;  // the set's end
      if (q0 + kGroups <= count && end <= a.n)  // uniform in the warp
        reduce_local_groups<true>(a, first, count, local0, q0, lane, j);
      else
        reduce_local_groups<false>(a, first, count, local0, q0, lane, j);
    }
  }
  // reduce_local's group set at q0 (kWhole: all there and whole, as push_local_groups).
  template <bool kWhole>
  __device__ static void reduce_local_groups(const KernelArgs& a, int64_t first, int count,
                                             int64_t local0, int q0, int lane, int j) {
    constexpr int kLd = LP::kLoads, kLn = LP::kLanes;
    const int64_t n = kWhole ? kNoEnd : a.n;
    const int q = q0 + lane / kLn;
    const bool valid = kWhole || q < count;
    const int64_t local = local0 + q;
    const int64_t e0 = (a.me * a.seg_groups + first + q) * G;
    // The own piece's words and the first peer's, loaded together; each peer's words are then
    // loaded one peer ahead of its sum (as load_peer_words).
    uint4 xw[kLd];
    CodeWord c1[kLd], c2[kLd];
    float s1 = 0.0f, s2 = 0.0f;  // a group of padding alone has no scale
    uint32_t ahead_wire = 0;
    uint2 ahead[kLd];
    const int first_peer = a.me == 0 ? 1 : 0;
#pragma unroll
    for (int k = 0; k < kLd; ++k) {
      xw[k] = make_uint4(0, 0, 0, 0);
      c1[k] = c2[k] = CodeWord{};
      ahead[k] = make_uint2(0, 0);
    }
    if (valid) {
      load_peer_set(a, first_peer, local, j, ahead_wire, ahead);
#pragma unroll
      for (int k = 0; k < kLd; ++k)
        load_local_piece(a, e0 + LP::index(j, k, 0), n, xw[k], c1[k], c2[k]);
      if (kWhole || e0 < a.n) {  // not __ldg: rewritten below (update_local_average)
        s1 = a.s1[e0 / kStateGroup];
        s2 = a.s2[e0 / kStateGroup];
      }
    }
    // fp32 sum in rank order 0..P-1: the peers before this rank, the own contribution (Eq. 10,
    // rescaled), the peers after it; each part adds its values as it makes them (one loop with
    // a branch for the own part spilled: its values array, common to the branches, held 16
    // more registers a lane).
    float acc[kLd][kVec];
#pragma unroll
    for (int k = 0; k < kLd; ++k)
#pragma unroll
      for (int t = 0; t < kVec; ++t) acc[k][t] = 0.0f;
    auto add_peer = [&](int r) {
      const uint32_t wire = ahead_wire;
      uint2 words[kLd];
#pragma unroll
      for (int k = 0; k < kLd; ++k) words[k] = ahead[k];
      const int next = r + 1 == a.me ? r + 2 : r + 1;
      if (next < a.P) load_peer_set(a, next, local, j, ahead_wire, ahead);
      const DequantParams d = fast::decoder_of<BITS>(wire, a.policy);
#pragma unroll
      for (int k = 0; k < kLd; ++k) {
        uint32_t codes[kVec];
        fast::unpack_piece_codes<kVec, BITS>(words[k], codes);
#pragma unroll
        for (int t = 0; t < kVec; ++t) {
          const float v = fast::decode_fast(codes[t], d);
          acc[k][t] = r == 0 ? v : add_rn(acc[k][t], v);
        }
      }
    };
    if (valid) {
      for (int r = 0; r < a.me; ++r) add_peer(r);
#pragma unroll
      for (int k = 0; k < kLd; ++k) {
        const int64_t e = e0 + LP::index(j, k, 0);
        float v[kVec], m1[kVec], m2[kVec];
        fast::unpack_values<T, kVec>(xw[k], v);
        if constexpr (kFoldState) {  // (eta a) m1, (eta (1 - a)) m2
          decode_state_piece(c1[k], folded_scale(a.k.ea, s1), e, n, m1);
          decode_state_piece(c2[k], folded_scale(a.k.eb, s2), e, n, m2);
          apply_products_and_scale(a, v, m1, m2);
        } else {
          decode_state_piece(c1[k], s1, e, n, m1);
          decode_state_piece(c2[k], s2, e, n, m2);
          apply_and_scale(a, v, m1, m2);
        }
#pragma unroll
        for (int t = 0; t < kVec; ++t) acc[k][t] = a.me == 0 ? v[t] : add_rn(acc[k][t], v[t]);
      }
      for (int r = a.me + 1; r < a.P; ++r) add_peer(r);
    }
    uint32_t wire;
    const fast::Encoder enc = group_encoder<kLd, kLn>(a, acc, &wire);  // every lane: shuffles
    if (!valid) return;  // a group's lanes leave together (update_local_average's shuffles)
    const int64_t gather = gather_slot(a.me, a.P, a.slot_bytes);
    if (j == 0) {  // the parameters go to every rank's gather slot for this owner
      for (int r = 0; r < a.P; ++r)
        fast::store_wire(reinterpret_cast<uint16_t*>(a.ws[r] + gather + a.params_offset), local,
                         a.policy, wire);
    }
    const DequantParams d = fast::decoder_of<BITS>(wire, a.policy);
    const float inv = unscale_of(a);
    T* out = static_cast<T*>(a.y);
#pragma unroll
    for (int k = 0; k < kLd; ++k) {
      const int64_t e = e0 + LP::index(j, k, 0);
      uint32_t codes[kVec];
      float y[kVec];
#pragma unroll
      for (int t = 0; t < kVec; ++t) {
        codes[t] = fast::encode<BITS>(acc[k][t], enc) & enc.mask;
        y[t] = fast::decode_fast(codes[t], d);  // the code peers receive
        // the residual s - Q(s) in x's units (update_local)
        acc[k][t] = sub_rn(acc[k][t], y[t]);
      }
      for (int r = 0; r < a.P; ++r)
        fast::store_piece<kVec, BITS>(a.ws[r] + gather + piece_byte<kLn>(local, j, k), codes,
                                      0xFFFFFFFFu);
      if (!skip_unit_factor(inv)) {
#pragma unroll
        for (int t = 0; t < kVec; ++t) acc[k][t] = mul_rn(acc[k][t], inv);
      }
#pragma unroll
      for (int t = 0; t < kVec; ++t) y[t] = mul_rn(y[t], inv);  // y in x's units (store_output)
      if (kWhole || e + kVec <= a.n) {
        *reinterpret_cast<uint4*>(out + e) = fast::pack_values<T>(y);
      } else {
#pragma unroll
        for (int t = 0; t < kVec; ++t)
          if (e + t < a.n) out[e + t] = from_f32<T>(y[t]);
      }
    }
    update_local_average<true, kWhole>(a, e0, n, j, acc, c1, s1);
    update_local_average<false, kWhole>(a, e0, n, j, acc, c2, s2);
  }
  // A peer's wire parameters and its kLd piece words of the group at `local` in LP's layout.
  __device__ __forceinline__ static void load_peer_set(const KernelArgs& a, int r, int64_t local,
                                                       int j, uint32_t& wire,
                                                       uint2 (&words)[LP::kLoads]) {
    const uint8_t* slot = a.ws[a.me] + push_slot(r, a.slot_bytes);
    wire = fast::load_wire(reinterpret_cast<const uint16_t*>(slot + a.params_offset), local,
                           a.policy);
#pragma unroll
    for (int k = 0; k < LP::kLoads; ++k)
      words[k] = fast::load_piece_word<kVec, BITS>(slot + piece_byte<LP::kLanes>(local, j, k));
  }

  // reduce + gather of the tile's groups of the own segment.
  __device__ static void reduce(const KernelArgs& a, int64_t first, int count, int64_t local0,
                                int warp, int warps, int lane) {
    if constexpr (kWideReduce) {
      reduce_local(a, first, count, local0, warp, warps, lane);
      return;
    }
    const int j = lane % kLanes;
    const uint32_t sm = sign_mask(j);
    for (int q0 = warp * kGpw; q0 < count; q0 += warps * kGpw) {
      const int q = q0 + lane / kLanes;
      const bool valid = q < count;
      const int64_t local = local0 + q;
      const int64_t e0 = (a.me * a.seg_groups + first + q) * G;
      OwnWords own;
      uint32_t ahead_wire = 0;
      uint2 ahead_word = make_uint2(0, 0);
      if constexpr (kKeepOwn) {
        if (valid) {
          const int first_peer = a.me == 0 ? 1 : 0;
          if (first_peer < a.P)
            load_peer_words(a, first_peer, local, j, ahead_wire, ahead_word);
          load_own(a, e0 + L::index(j, 0, 0), own);
        }
      }
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
          if constexpr (kKeepOwn) {
            float m1[kVec], m2[kVec];
            if constexpr (kFoldOwn) {  // (eta a) m1, (eta (1 - a)) m2
              unpack_own(own, v[0], m1, m2, folded_scale(a.k.ea, own.s1),
                         folded_scale(a.k.eb, own.s2));
              apply_products_and_scale(a, v[0], m1, m2);
            } else {
              unpack_own(own, v[0], m1, m2, own.s1, own.s2);
              apply_and_scale(a, v[0], m1, m2);
            }
          } else {
#pragma unroll
            for (int k = 0; k < kLoads; ++k)
              load_contrib(a, e0 + L::index(j, k, 0), v[k]);
          }
        } else if constexpr (kKeepOwn) {
          // This peer's words, loaded one peer before; the next peer's loads go out first.
          const uint32_t wire = ahead_wire;
          const uint2 word = ahead_word;
          const int next = r + 1 == a.me ? r + 2 : r + 1;
          if (next < a.P) load_peer_words(a, next, local, j, ahead_wire, ahead_word);
          uint32_t codes[kVec];
          fast::unpack_piece_codes<kVec, BITS>(word, codes);
          const DequantParams d = fast::decoder_of<BITS>(wire, a.policy);
#pragma unroll
          for (int t = 0; t < kVec; ++t) v[0][t] = fast::decode_fast(codes[t], d);
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
                fast::load_piece_word<kVec, BITS>(slot + piece_byte(local, j, k)), codes);
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
                              sm);
      } else {
        // Written out in place: the same code as a helper like reduce_rotated_output (the
        // gather offset hoisted) took the fp32 kernel from 48 to 61 registers (ptxas, sm_90a,
        // g = 128), 4 instead of 5 blocks an SM.
        if (!valid) continue;
        UpdateIn in[kLoads];
        if constexpr (kFoldOwn)  // beta1 m1, beta2 m2 (update_local)
          unpack_own(own, in[0].x, in[0].m1, in[0].m2, folded_scale(a.k.b1, own.s1),
                     folded_scale(a.k.b2, own.s2));
        else if constexpr (kKeepOwn)
          unpack_own(own, in[0].x, in[0].m1, in[0].m2, own.s1, own.s2);
        else
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
          // LOCAL: the own segment's residual is the sum's rounding error s - Q(s).
          if constexpr (LOCAL) update_local(a, e0 + L::index(j, k, 0), acc[k], y, in[k].m1, in[k].m2);
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
    const uint32_t sm = sign_mask(lane % kLanes);
    for (int q0 = warp * kGpw; q0 < count; q0 += warps * kGpw)
      tail_rotated_set(a, seg, first, count, local0, q0, lane, slot, prm, sm);
  }

  // One group set of tail_rotated: the groups q0 + lane / kLanes of the tile.
  __device__ static void tail_rotated_set(const KernelArgs& a, int seg, int64_t first, int count,
                                          int64_t local0, int q0, int lane, const uint8_t* slot,
                                          const uint16_t* prm, uint32_t sm) {
    const int j = lane % kLanes;
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
      words[k] = valid ? fast::load_piece_word<kVec, BITS>(slot + piece_byte(local, j, k))
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
    if (!valid) return;
#pragma unroll
    for (int k = 0; k < kLoads; ++k) {
      UpdateIn in;
      load_update(a, e0 + L::index(j, k, 0), in);
      store_output(a, e0 + L::index(j, k, 0), y[k], in);
    }
  }

  // The tail's inverse rotation in exact fp16 pairs (fast::ExactDecoder says when it is exact):
  // 4-bit codes, g <= 128, the uncompensated call. A lane holds kXVals values of a group, word
  // i of them the 8 values 8 (kXLanes i + j) .. of lane j: the group's lanes store 16-byte
  // words side by side (a lane's 32 values as one run of the group, each store half of a
  // 32-byte sector, ran slower; docs/gpu.md). So g = 128 crosses lanes twice with one shuffle
  // for two values, where the fp32 stages (16-bit x) cross three times with one a value; 64
  // values a lane would cross once, but took 336 bytes of spills (bf16, under the 4 blocks' 64
  // registers). A warp whose group set has a group that is not exact runs those groups with
  // the fp32 stages (tail_rotated_set).
  static constexpr bool kExactTail =
      ECHO_P2P_EXACT_UNROTATE && ROT && !COMP && BITS == 4 && G <= 128;
  static constexpr int kXVals = 32;  // values a lane
  // Pieces of 8 values (one 32-bit word of codes, one 16-byte store of 16-bit y), G / 32 lanes
  // a group (1, 2 or 4 for g = 32 .. 128), 4 pieces a lane.
  using LX = fast::QuantLayout<__half, G, (G >= kXVals ? G / kXVals : 1)>;
  static constexpr int kXLanes = LX::kLanes;            // lanes a group
  static constexpr int kXWords = LX::kLoads;            // 32-bit code words a lane
  static constexpr int kXGroups = LX::kGroupsPerWarp;   // groups a warp
  static_assert(!kExactTail || LX::kValuesPerLane == kXVals, "32 values a lane");
  static_assert(!kExactTail || kXGroups % kGpw == 0, "whole fp32 group sets in an exact set");

  // Lane j's sign mask in the exact tail's layout (bit 8 i + t: value LX::index(j, i, t)).
  __device__ static uint32_t* exact_sign_masks() {
    __shared__ uint32_t masks[kXLanes];
    return masks;
  }

  __device__ static void tail_exact(const KernelArgs& a, int seg, int64_t first, int count,
                                    int64_t local0, int warp, int warps, int lane,
                                    const uint8_t* slot, const uint16_t* prm) {
    const int j = lane % kXLanes;
    const uint32_t neg = exact_sign_masks()[j];
    const uint32_t sm = sign_mask(lane % kLanes);  // the fp32 stages'
    const float f = a.rot_scale;
    for (int q0 = warp * kXGroups; q0 < count; q0 += warps * kXGroups) {
      const int q = q0 + lane / kXLanes;
      const bool valid = q < count;
      const int64_t local = local0 + q;
      const fast::ExactDecoder d =
          fast::exact_decoder(valid ? fast::load_wire(prm, local, a.policy) : 0u, a.policy);
      if (!__all_sync(0xffffffffu, d.ok || !valid)) {
        for (int q1 = q0; q1 < q0 + kXGroups; q1 += kGpw)
          tail_rotated_set(a, seg, first, count, local0, q1, lane, slot, prm, sm);
        continue;
      }
      uint32_t w[kXWords];
      const unsigned* src = reinterpret_cast<const unsigned*>(slot + local * kCodeBytes);
#pragma unroll
      for (int i = 0; i < kXWords; ++i) w[i] = valid ? __ldcg(src + LX::index(j, i, 0) / 8) : 0u;
      __half2 r[kXWords][4];
#pragma unroll
      for (int i = 0; i < kXWords; ++i) fast::exact_decode_word(w[i], d, r[i]);
      fast::exact_stages_in_lane<kXWords>(r);
      fast::exact_stages_across_lanes<kXLanes, kXWords>(r, j);
      if (!valid) continue;
      const float s = d.s, neg_s = -d.s;
      const int64_t e0 = (seg * a.seg_groups + first + q) * G;
#pragma unroll
      for (int i = 0; i < kXWords; ++i) {
        float y[8];
#pragma unroll
        for (int p = 0; p < 4; ++p) {
          const float2 v = __half22float2(r[i][p]);
          y[p] = v.x;
          y[p + 4] = v.y;
        }
#pragma unroll
        for (int t = 0; t < 8; ++t)  // (s I) (+-f): s I exact, the one rounding the reference's
          y[t] = mul_rn(mul_rn(y[t], ((neg >> (8 * i + t)) & 1u) ? neg_s : s), f);
        UpdateIn in;  // unused: uncompensated
#pragma unroll
        for (int t = 0; t < 8; t += kVec) store_output(a, e0 + LX::index(j, i, t), y + t, in);
      }
    }
  }

  // tail: dequantize the tile's groups of owner seg's reduced code.
  __device__ static void tail(const KernelArgs& a, int seg, int64_t first, int count,
                              int64_t local0, int warp, int warps, int lane) {
    const uint8_t* slot = a.ws[a.me] + gather_slot(seg, a.P, a.slot_bytes);
    const uint16_t* prm = reinterpret_cast<const uint16_t*>(slot + a.params_offset);
    if constexpr (kExactTail) {
      tail_exact(a, seg, first, count, local0, warp, warps, lane, slot, prm);
    } else if constexpr (ROT) {
      tail_rotated(a, seg, first, count, local0, warp, warps, lane, slot, prm);
    } else if constexpr (LOCAL) {  // y alone: LP's two pieces a lane
      tail_plain<LP::kLoads, LP::kLanes>(a, seg, first, count, local0, warp, warps, lane, slot,
                                         prm);
    } else {
      tail_plain(a, seg, first, count, local0, warp, warps, lane, slot, prm);
    }
  }

  // LDS, LNS: the pieces a lane and the lanes a group (L's, or LP's in the local residual's
  // instances).
  template <int LDS = kLoads, int LNS = kLanes>
  __device__ static void tail_plain(const KernelArgs& a, int seg, int64_t first, int count,
                                    int64_t local0, int warp, int warps, int lane,
                                    const uint8_t* slot, const uint16_t* prm) {
    const int j = lane % LNS;
    constexpr int kGroups = 32 / LNS;
    for (int q0 = warp * kGroups; q0 < count; q0 += warps * kGroups) {
      const int q = q0 + lane / LNS;
      if (q >= count) continue;  // a group's lanes leave together (the int8 state's shuffles)
      const int64_t local = local0 + q;
      const int64_t e0 = (seg * a.seg_groups + first + q) * G;
      const uint32_t wire = fast::load_wire(prm, local, a.policy);
      // Where the group's parameters are decoded: in the compensated instances after the
      // update's loads are issued (decoded first, the tail waits for them before it issues
      // those loads: two round trips a piece); first in the int8 state's, which ran slower
      // decoding late (docs/gpu.md has the times), and in the uncompensated ones, which have no
      // update loads.
      constexpr bool kDecodeLate = COMP && !kStateQ;
      const DequantParams d_early =
          kDecodeLate ? DequantParams{0.0f, 0.0f} : fast::decoder_of<BITS>(wire, a.policy);
      uint2 words[LDS];
#pragma unroll
      for (int k = 0; k < LDS; ++k)  // every load of the group before the first store
        words[k] = fast::load_piece_word<kVec, BITS>(slot + piece_byte<LNS>(local, j, k));
      UpdateIn in[LDS];
      if constexpr (!LOCAL) prefetch_update(a, e0, j, in);  // LOCAL: the state is updated
      const DequantParams d = kDecodeLate ? fast::decoder_of<BITS>(wire, a.policy) : d_early;
#pragma unroll
      for (int k = 0; k < LDS; ++k) {
        uint32_t codes[kVec];
        fast::unpack_piece_codes<kVec, BITS>(words[k], codes);
        float y[kVec];
#pragma unroll
        for (int t = 0; t < kVec; ++t) y[t] = fast::decode_fast(codes[t], d);
        store_output(a, e0 + fast::QuantLayout<T, G, LNS>::index(j, k, 0), y, in[k]);
      }
    }
  }
};

}  // namespace
}  // namespace cuda
}  // namespace echo

#endif  // ECHO_JAX_FFI_P2P_FAST_CUH_
