// Device-side I/O of the fast kernels (ffi/quant_cuda.cu, ffi/p2p_cuda.cu): 16-byte words of
// values, packed code pieces, and the group format chosen at run time where a kernel keeps only
// the group size and the bits as template constants.
//
// A "piece" is the kVec = 16 / sizeof(T) consecutive values of one 16-byte load, and their
// kVec * BITS / 8 bytes of codes (2, 4 or 8 bytes: one store, one load). Pieces of one group are
// laid out as fast::QuantLayout says, so the codes of a piece are contiguous in the wire format
// (value i's code is at bit i * BITS of its group) whatever lane holds them.
#ifndef ECHO_JAX_FFI_FAST_IO_CUH_
#define ECHO_JAX_FFI_FAST_IO_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "echo_common.h"
#include "quant_fast.cuh"
#include "quant_fast.cuh"

namespace echo {
namespace fast {

// ECHO_JAX_GENERIC_QUANT=1 (any value but empty or "0") makes every handler run its generic
// kernels instead of the fast ones (for comparisons); read once per process.
inline bool generic_kernels_forced() {
  static const bool forced = [] {
    const char* v = std::getenv("ECHO_JAX_GENERIC_QUANT");
    return v != nullptr && v[0] != '\0' && std::strcmp(v, "0") != 0;
  }();
  return forced;
}

// ---- values ----------------------------------------------------------------------------------

// Element t (a constant) of a 16-byte word of T values, as fp32 (exact).
template <typename T, int t>
__device__ __forceinline__ float element(const uint4& w) {
  constexpr int kPer = 4 / static_cast<int>(sizeof(T));  // values per 32-bit word
  const uint32_t u = t / kPer == 0 ? w.x : t / kPer == 1 ? w.y : t / kPer == 2 ? w.z : w.w;
  if constexpr (sizeof(T) == 4) {
    return __uint_as_float(u);
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __uint_as_float(t % 2 == 0 ? u << 16 : u & 0xFFFF0000u);  // bf16 -> fp32: exact
  } else {
    return f16_f32(static_cast<uint16_t>(t % 2 == 0 ? u & 0xFFFFu : u >> 16));
  }
}

template <typename T, int N, int t = 0>
__device__ __forceinline__ void unpack_values(const uint4& w, float* v) {
  if constexpr (t < N) {
    v[t] = element<T, t>(w);
    unpack_values<T, N, t + 1>(w, v);
  }
}

// kVec = 16 / sizeof(T) fp32 values -> one 16-byte word of T, rounded to nearest even (XLA's
// convert; fp32 is copied as it is). 16-bit values are converted two an instruction
// (cvt.rn.bf16x2.f32 / cvt.rn.f16x2.f32: the same rounding as one at a time, half the
// conversions), the first value in the low half.
template <typename T>
__device__ __forceinline__ uint4 pack_values(const float* v) {
  uint32_t u[4];
  if constexpr (sizeof(T) == 4) {
#pragma unroll
    for (int k = 0; k < 4; ++k) u[k] = __float_as_uint(v[k]);
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const __nv_bfloat162 h = __floats2bfloat162_rn(v[2 * k], v[2 * k + 1]);
      u[k] = *reinterpret_cast<const uint32_t*>(&h);
    }
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const __half2 h = __floats2half2_rn(v[2 * k], v[2 * k + 1]);
      u[k] = *reinterpret_cast<const uint32_t*>(&h);
    }
  }
  return make_uint4(u[0], u[1], u[2], u[3]);
}

// The warp reduction of the fast kernels (p2p and quantizer): lo, hi of a group over its LANES
// aligned lanes of the warp, a butterfly of shuffles (LANES a power of two <= 32; every lane of
// the warp takes part: the shuffles are warp-wide). min_op / max_op: exact in any order.
template <int LANES, typename V, typename Min, typename Max>
__device__ __forceinline__ void warp_min_max(V& lo, V& hi, Min min_op, Max max_op) {
#pragma unroll
  for (int off = LANES / 2; off > 0; off >>= 1) {
    lo = min_op(lo, __shfl_xor_sync(0xffffffffu, lo, off));
    hi = max_op(hi, __shfl_xor_sync(0xffffffffu, hi, off));
  }
}

// Reduces a group's range (min.NaN / max.NaN) over its LANES aligned lanes.
template <int LANES>
__device__ __forceinline__ void range_reduce(Range& r) {
  warp_min_max<LANES>(r.lo, r.hi, [](float a, float b) { return min_nan(a, b); },
                      [](float a, float b) { return max_nan(a, b); });
}

// The same with order keys (quant_fast.cuh): a lane folds its values into its smallest and
// largest key (start from kKeyMax, kKeyMin), then key_range_reduce combines the group's lanes.
__device__ __forceinline__ void key_range_add(int32_t& kmin, int32_t& kmax, float v) {
  const int32_t key = order_key(__float_as_uint(v));
  kmin = imin(kmin, key);
  kmax = imax(kmax, key);
}
template <int LANES>
__device__ __forceinline__ void key_range_reduce(int32_t& kmin, int32_t& kmax) {
  warp_min_max<LANES>(kmin, kmax, [](int32_t a, int32_t b) { return imin(a, b); },
                      [](int32_t a, int32_t b) { return imax(a, b); });
}

// The range of a lane's 16-bit values, two a instruction: min.NaN / max.NaN on bf16x2 / f16x2
// words (IEEE 754-2019 minimum / maximum per half, like the fp32 forms), then the two halves
// widened exactly to fp32 and combined. Same lo / hi bits as range_add over the fp32 values.
template <typename T, int kLoads>
__device__ __forceinline__ Range range_of_words16(const uint4 (&raw)[kLoads]) {
  static_assert(sizeof(T) == 2, "16-bit values");
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  uint32_t lo2 = kBf16 ? 0x7F807F80u : 0x7C007C00u;  // +inf, +inf
  uint32_t hi2 = kBf16 ? 0xFF80FF80u : 0xFC00FC00u;  // -inf, -inf
#pragma unroll
  for (int k = 0; k < kLoads; ++k) {
    const uint32_t w[4] = {raw[k].x, raw[k].y, raw[k].z, raw[k].w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if constexpr (kBf16) {
        asm("min.NaN.bf16x2 %0, %0, %1;" : "+r"(lo2) : "r"(w[i]));
        asm("max.NaN.bf16x2 %0, %0, %1;" : "+r"(hi2) : "r"(w[i]));
      } else {
        asm("min.NaN.f16x2 %0, %0, %1;" : "+r"(lo2) : "r"(w[i]));
        asm("max.NaN.f16x2 %0, %0, %1;" : "+r"(hi2) : "r"(w[i]));
      }
    }
  }
  const uint4 both = make_uint4(lo2, hi2, 0u, 0u);
  return Range{min_nan(element<T, 0>(both), element<T, 1>(both)),
               max_nan(element<T, 2>(both), element<T, 3>(both))};
}

// ---- codes -----------------------------------------------------------------------------------

// Stores the kVec codes of one piece (kVec * BITS / 8 bytes, low nibble first at 4 bits); `mask`
// is 0 for a non-finite group (all its codes are 0).
template <int kVec, int BITS>
__device__ __forceinline__ void store_piece(uint8_t* dst, const uint32_t* codes, uint32_t mask) {
  constexpr int kBytes = kVec * BITS / 8;
  constexpr int kPerWord = 32 / BITS;
  uint32_t w[2] = {0u, 0u};
#pragma unroll
  for (int t = 0; t < kVec; ++t) w[t / kPerWord] |= codes[t] << (BITS * (t % kPerWord));
  if constexpr (kBytes == 2) {
    *reinterpret_cast<uint16_t*>(dst) = static_cast<uint16_t>(w[0] & mask);
  } else if constexpr (kBytes == 4) {
    *reinterpret_cast<uint32_t*>(dst) = w[0] & mask;
  } else {
    static_assert(kBytes == 8, "piece");
    *reinterpret_cast<uint2*>(dst) = make_uint2(w[0] & mask, w[1] & mask);
  }
}

// Loads the codes of one piece (2, 4 or 8 bytes) through L2 only (__ldcg: a peer wrote them
// after this SM may have cached an older copy of the line in an earlier call).
template <int kVec, int BITS>
__device__ __forceinline__ uint2 load_piece_word(const uint8_t* src) {
  constexpr int kBytes = kVec * BITS / 8;
  if constexpr (kBytes == 2) {
    return make_uint2(__ldcg(reinterpret_cast<const unsigned short*>(src)), 0u);
  } else if constexpr (kBytes == 4) {
    return make_uint2(__ldcg(reinterpret_cast<const unsigned int*>(src)), 0u);
  } else {
    static_assert(kBytes == 8, "piece");
    return __ldcg(reinterpret_cast<const uint2*>(src));
  }
}

// Code t of a piece word, in codes[t].
template <int kVec, int BITS>
__device__ __forceinline__ void unpack_piece_codes(const uint2& w, uint32_t* codes) {
  constexpr int kPerWord = 32 / BITS;
  constexpr uint32_t kMask = (1u << BITS) - 1u;
#pragma unroll
  for (int t = 0; t < kVec; ++t)
    codes[t] = ((t / kPerWord == 0 ? w.x : w.y) >> (BITS * (t % kPerWord))) & kMask;
}

// ---- the group format at run time --------------------------------------------------------------
// The fast all-reduce kernel keeps only G and BITS as template constants (T x G x BITS x
// compensation instances); the policy is a warp-uniform run-time value, which costs one branch a
// group in make_params and one fp32 subtraction a value for sym (x - (+0) = x exactly, -0
// included, so the code is encode_fast<BITS, sym>'s).

// An encoder of one group: code = clamp(rne((x - m) * r), lo, hi) + off (round_code: magic_off
// = kRoundMagic + off); mask 0 when not ok.
struct Encoder {
  float r, m, lo, hi, magic_off;
  uint32_t mask;
};

template <int BITS>
__device__ __forceinline__ Encoder make_encoder(int policy, float lo, float hi, bool finite,
                                                uint32_t* wire) {
  constexpr int qmax = (1 << (BITS - 1)) - 1;
  constexpr int levels = (1 << BITS) - 1;
  FastParams p;
  if (policy == kPolicySym) {
    p = make_params_fast<BITS, kPolicySym>(lo, hi, finite);
    *wire = p.wire;
    return Encoder{p.r, 0.0f, -qmax, qmax, kRoundMagic + (qmax + 1), p.ok ? 0xFFFFFFFFu : 0u};
  }
  p = policy == kPolicyAsym ? make_params_fast<BITS, kPolicyAsym>(lo, hi, finite)
                            : make_params_fast<BITS, kPolicyAsymNaive>(lo, hi, finite);
  *wire = p.wire;
  return Encoder{p.r, p.m, 0.0f, levels, kRoundMagic, p.ok ? 0xFFFFFFFFu : 0u};
}

template <int BITS>
__device__ __forceinline__ uint32_t encode(float x, const Encoder& e) {
  return round_code<BITS>(mul_rn(sub_rn(x, e.m), e.r), e.lo, e.hi, e.magic_off);
}

// Stores a group's wire parameters (2 bytes sym, 4 bytes asym) at group index `local`.
__device__ __forceinline__ void store_wire(uint16_t* params, int64_t local, int policy,
                                           uint32_t wire) {
  if (policy == kPolicySym)
    params[local] = static_cast<uint16_t>(wire);
  else
    *reinterpret_cast<uint32_t*>(params + 2 * local) = wire;
}

// Loads a group's wire parameters (as store_wire stored them) through L2 only.
__device__ __forceinline__ uint32_t load_wire(const uint16_t* params, int64_t local, int policy) {
  if (policy == kPolicySym) return __ldcg(reinterpret_cast<const unsigned short*>(params + local));
  return __ldcg(reinterpret_cast<const unsigned int*>(params + 2 * local));
}

// ---- the inverse rotation of 4-bit codes, exact in fp16 pairs --------------------------------
// A group decodes to s (c - z) (decode_fast: c s, z s and their difference are exact) when its
// zero point z is an integer in [0, 15]: sym (z = 8), and asym wherever the group's range
// straddles 0 (z = rne(-lo / s)), as the rotated sums nearly always do. Then every partial sum
// of the inverse rotation's butterflies is s times an integer of at most 15 g <= 1920 in
// magnitude (g <= 128): exact in fp32 while s < 2^117, and a zero only as +0 (a sum of exact
// values that cancel). So the reference's stages give s I, I = H (c - z), whatever their order,
// and I is exact in fp16 (integers up to 2048): the stages can run on two values a register
// (half2), half the instructions and half the shuffles of fp32, and y = (s I) (+-f) keeps the
// reference's one rounding. A group that is not so (a fractional zero point, as most ranges on
// one side of 0 give; a constant or non-finite group; s >= 2^117) takes the fp32 stages.
struct ExactDecoder {
  __half2 z1024;     // 1024 + z in both halves
  __half2 neg_z64;   // -(64 + z) in both halves
  float s;           // the group's scale
  bool ok;           // the group decodes to s (c - z) as above
};

__device__ __forceinline__ __half2 half2_from_bits(uint32_t u) {
  __half2 h;
  memcpy(&h, &u, sizeof(h));
  return h;
}

__device__ __forceinline__ ExactDecoder exact_decoder(uint32_t wire, int policy) {
  ExactDecoder d;
  d.s = f32_from_bits(wire << 16);  // the bf16 scale in the low half
  const float z = policy == kPolicySym ? 8.0f : f16_f32(static_cast<uint16_t>(wire >> 16));
  // false for NaN s or z; 2^117 is 0x7A000000
  d.ok = d.s > 0.0f && d.s < __uint_as_float(0x7A000000u) && z >= 0.0f && z <= 15.0f &&
         z == rintf(z);
  d.z1024 = __float2half2_rn(1024.0f + z);
  d.neg_z64 = __float2half2_rn(-(64.0f + z));
  return d;
}

// The 8 codes of word w (code n at bits 4n) as c - z, two a register: r[p] holds codes p (low
// half) and p + 4 (high half). A nibble under fp16 1024's exponent is 1024 + c (bits 0-3) or
// 1024 + 16 c (bits 4-7); every step is exact.
__device__ __forceinline__ void exact_decode_word(uint32_t w, const ExactDecoder& d,
                                                  __half2 (&r)[4]) {
  constexpr uint32_t kMagic = 0x64006400u;  // fp16 1024 in both halves
  const __half2 sixteenth = __float2half2_rn(0.0625f);
  const uint32_t w8 = w >> 8;
  r[0] = __hsub2(half2_from_bits((w & 0x000F000Fu) | kMagic), d.z1024);
  r[1] = __hfma2(half2_from_bits((w & 0x00F000F0u) | kMagic), sixteenth, d.neg_z64);
  r[2] = __hsub2(half2_from_bits((w8 & 0x000F000Fu) | kMagic), d.z1024);
  r[3] = __hfma2(half2_from_bits((w8 & 0x00F000F0u) | kMagic), sixteenth, d.neg_z64);
}

// (a, b) -> (a + b, a - b), two registers.
__device__ __forceinline__ void butterfly_pair(__half2& a, __half2& b) {
  const __half2 sum = __hadd2(a, b);
  b = __hsub2(a, b);
  a = sum;
}

// The butterflies of a lane's W words of decoded codes (r[w][p]: codes p and p + 4 of word w):
// index bits 0 and 1 between registers p, bit 2 between a register's halves, the bits that
// number the words between words. Exact, so in any order of the index bits.
template <int W>
__device__ __forceinline__ void exact_stages_in_lane(__half2 (&r)[W][4]) {
  const __half2 plus_minus = __floats2half2_rn(1.0f, -1.0f);
#pragma unroll
  for (int w = 0; w < W; ++w) {
    butterfly_pair(r[w][0], r[w][1]);
    butterfly_pair(r[w][2], r[w][3]);
    butterfly_pair(r[w][0], r[w][2]);
    butterfly_pair(r[w][1], r[w][3]);
#pragma unroll
    for (int p = 0; p < 4; ++p)  // (a, b) -> (b + a, -b + a)
      r[w][p] = __hfma2(__high2half2(r[w][p]), plus_minus, __low2half2(r[w][p]));
  }
#pragma unroll
  for (int h = 1; h < W; h *= 2)
#pragma unroll
    for (int w = 0; w < W; ++w)
      if (!(w & h)) {
#pragma unroll
        for (int p = 0; p < 4; ++p) butterfly_pair(r[w][p], r[w + h][p]);
      }
}

// The butterflies across the LANES lanes of a group (lane j of the group, j the index bits that
// number the lanes): one shuffle a register; the low lane of a pair keeps own + other, the
// high one other - own, one fma(+-1, own, other) each (exact).
template <int LANES, int W>
__device__ __forceinline__ void exact_stages_across_lanes(__half2 (&r)[W][4], int j) {
#pragma unroll
  for (int o = 1; o < LANES; o *= 2) {
    const __half2 sign = __float2half2_rn((j & o) ? -1.0f : 1.0f);
#pragma unroll
    for (int w = 0; w < W; ++w)
#pragma unroll
      for (int p = 0; p < 4; ++p)
        r[w][p] = __hfma2(sign, r[w][p], __shfl_xor_sync(0xffffffffu, r[w][p], o));
  }
}

// The decoder (dequant_params of echo_common.h) of a group's wire parameters.
template <int BITS>
__device__ __forceinline__ DequantParams decoder_of(uint32_t wire, int policy) {
  return policy == kPolicySym ? dequant_params_fast<BITS, kPolicySym>(wire & 0xFFFFu)
                              : dequant_params_fast<BITS, kPolicyAsym>(wire);
}

}  // namespace fast
}  // namespace echo

#endif  // ECHO_JAX_FFI_FAST_IO_CUH_
