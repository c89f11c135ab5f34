// Fast arithmetic of the Echo group quantizer (echo_jax/quant.py, transcribed in echo_common.h),
// for kernels whose bits, policy and group size are compile-time constants.
//
// Everything here gives the same bits as echo_common.h's make_params / encode_value /
// decode_value; only the way each step is computed changes:
//   * Group statistics are integer min / max over an order key of the fp32 bit pattern (a total
//     order in which -0 < +0), so lo and hi are the exact values min_f / max_f pick, sign of zero
//     included, in any reduction order, and no float min/max semantics are relied on. The key of
//     a NaN or an infinity lies outside the keys of the finite numbers, so a group is finite iff
//     the smallest and largest key of the group are inside that range: one test per group
//     instead of a flag per value.
//   * The bf16 scale is rounded on its bits (bf16_round_up / bf16_round of echo_common.h: two
//     integer instructions) and widened by a shift. The fp16 zero-point uses the hardware
//     conversion cvt.rn.f16.f32 (round to nearest even, fp16 subnormals, overflow to inf: IEEE
//     754, what f32_to_f16 implements in software), never given a NaN on a path whose result is
//     kept (see make_params_fast). No .ftz: fp32 subnormal inputs are converted exactly. fp16 ->
//     fp32 is cvt.f32.f16 (exact).
//   * rne + clip + cast of a code, and the code's fp32 value when it is decoded, are fp32
//     additions around 2^23 (round_code, code_to_f32 below), not conversions: cvt between int
//     and float runs at a quarter of the fp32 add rate, and every value of an all-reduce is
//     encoded at least once and decoded at least once. In a finite group (x - m) * r and x * r
//     are finite or +-inf, never NaN (r is 0 only when s is 0, and then |x - m| is tiny).
// On the host the conversions fall back to echo_common.h's software versions, so a host build
// of this header (ffi/tools/round_code_check.cc) can check the restructured arithmetic.
#ifndef ECHO_JAX_FFI_QUANT_FAST_CUH_
#define ECHO_JAX_FFI_QUANT_FAST_CUH_

#include <cstdint>

#include "echo_common.h"

namespace echo {
namespace fast {

// ---- order keys ----------------------------------------------------------------------------
// key(x) = bits(x) for x >= +0, bits(x) ^ 0x7FFFFFFF for a set sign bit: signed-integer order of
// the keys is the IEEE total order (-NaN < -inf < ... < -0 < +0 < ... < +inf < +NaN). The map is
// an involution.
ECHO_HD int32_t order_key(uint32_t bits) {
  const uint32_t neg = static_cast<uint32_t>(static_cast<int32_t>(bits) >> 31);  // 0 or ~0
  return static_cast<int32_t>(bits ^ (neg & 0x7FFFFFFFu));
}
ECHO_HD uint32_t from_order_key(int32_t key) {
  const uint32_t neg = static_cast<uint32_t>(key >> 31);
  return static_cast<uint32_t>(key) ^ (neg & 0x7FFFFFFFu);
}
// Keys of the finite numbers are exactly the open interval (key(-inf), key(+inf)).
constexpr int32_t kKeyNegInf = static_cast<int32_t>(0x807FFFFFu);  // key(0xFF800000)
constexpr int32_t kKeyPosInf = 0x7F800000;
constexpr int32_t kKeyMin = static_cast<int32_t>(0x80000000u);
constexpr int32_t kKeyMax = 0x7FFFFFFF;

ECHO_HD int32_t imin(int32_t a, int32_t b) { return b < a ? b : a; }
ECHO_HD int32_t imax(int32_t a, int32_t b) { return b > a ? b : a; }

// Whether a group whose smallest / largest keys are kmin / kmax holds only finite values.
ECHO_HD bool keys_finite(int32_t kmin, int32_t kmax) {
  return kmin > kKeyNegInf && kmax < kKeyPosInf;
}

// ---- conversions ---------------------------------------------------------------------------

// fp32 -> fp16 bits, round to nearest even (f32_to_f16 for every non-NaN input).
ECHO_HD uint16_t f16_rn(float f) {
#if defined(__CUDA_ARCH__)
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
#else
  return f32_to_f16(f);
#endif
}

// fp16 bits -> fp32 (exact).
ECHO_HD float f16_f32(uint16_t h) {
#if defined(__CUDA_ARCH__)
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
#else
  return f16_to_f32(h);
#endif
}

// ---- codes and fp32 without the conversion unit ------------------------------------------
// cvt.rni.s32.f32 / cvt.rn.f32.u32 issue on the conversion unit, 16 a clock an SM on sm_80 and
// sm_90 against 128 fp32 adds; the all-reduce's stages at 4 virtual ranks and 256 MB of bf16 a
// rank make about 1.5 G of them a call (an encode per value pushed or reduced, a decode per code
// summed or dequantized). The forms below changed no timing beyond run-to-run spread (the
// conversions overlapped the rest; docs/gpu.md), and they stay
// as they give the same bits with fewer slow-unit instructions. Between 2^23 and 2^24 the fp32
// ulp is exactly 1, so fp32 additions do the same work on the fp32 pipes:
//   * code -> fp32: the pattern 0x4B000000 | c is 2^23 + c; subtracting 2^23 leaves c exactly.
//   * fp32 -> code: v clamped to the integers [lo, hi] (|lo|, |hi| <= 255) plus C = 1.5 * 2^23 +
//     off is rounded to an integer, ties to even, and since C is an even integer the sum is
//     rne(v) + C: rne(clip(v)) = clip(rne(v)) for integer bounds, and C's pattern is 0x4B400000 +
//     off, so the low bits of the sum's pattern are rne(v) + off. A saturating cvt of +-inf and a
//     clamp gave lo / hi; fminf / fmaxf give the same. ffi/tools/round_code_check.cc checks
//     both against the conversions over every non-NaN fp32 input and every code.
constexpr float kTwoPow23 = 8388608.0f;
constexpr float kRoundMagic = 12582912.0f;  // 1.5 * 2^23, pattern 0x4B400000

// The fp32 value of a code c < 2^23 (exact).
ECHO_HD float code_to_f32(uint32_t c) { return sub_rn(f32_from_bits(0x4B000000u | c), kTwoPow23); }

// decode_value of echo_common.h (c * s + m, each step rounded) without the conversion.
ECHO_HD float decode_fast(uint32_t c, const DequantParams& d) {
  return add_rn(mul_rn(code_to_f32(c), d.s), d.m);
}

// rne(clip(v, lo, hi)) + off as a BITS-bit code; lo, hi integers, magic_off = kRoundMagic + off.
template <int BITS>
ECHO_HD uint32_t round_code(float v, float lo, float hi, float magic_off) {
  return f32_bits(add_rn(fminf(fmaxf(v, lo), hi), magic_off)) & ((1u << BITS) - 1u);
}

// round(a * b + c), one rounding (used where a * b is exact).
ECHO_HD float fma_rn(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

// ---- group range -------------------------------------------------------------------------
// lo / hi of a group with PTX min.NaN / max.NaN (sm_80+): IEEE 754-2019 minimum / maximum, as
// min_f / max_f (NaN propagates, -0 < +0), so the result is their bits in any reduction order;
// an inf lands in lo or hi and a NaN in both, so a group is finite iff lo and hi are. Two
// instructions a value (the order keys above take five).
ECHO_HD float min_nan(float a, float b) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("min.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return min_f(a, b);
#endif
}
ECHO_HD float max_nan(float a, float b) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return max_f(a, b);
#endif
}

struct Range {
  float lo, hi;
};
ECHO_HD Range range_empty() {  // (+inf, -inf): any value narrows it
  return Range{f32_from_bits(0x7F800000u), f32_from_bits(0xFF800000u)};
}
ECHO_HD void range_add(Range& r, float v) {
  r.lo = min_nan(r.lo, v);
  r.hi = max_nan(r.hi, v);
}
ECHO_HD bool range_finite(const Range& r) { return is_finite(r.lo) && is_finite(r.hi); }

// Whether a policy has fast (templated) kernels: the three of echo_common.h's table today. A new
// policy runs the generic kernels (its make_params / encode_value in echo_common.h) until it is
// added here and to the dispatches (ffi/quant_cuda.cu with_format, fast_io.cuh make_encoder).
ECHO_HD constexpr bool has_fast_policy(int policy) {
  return policy == kPolicyAsym || policy == kPolicySym || policy == kPolicyAsymNaive;
}

// ---- parameters ----------------------------------------------------------------------------

// What the encoder of one group needs, and the group's parameters as they go on the wire.
struct FastParams {
  float r;        // 1/s (0 when |s| < 2^-126)
  float m;        // asym: -(z * s); sym: 0 (unused)
  uint32_t wire;  // s16 (sym) or s16 | z16 << 16 (asym): params[2g], params[2g+1] little-endian
  bool ok;        // false: non-finite group or |x| >= 2^126; every code is 0, wire (0x7FC0, 0)
};

// make_params of echo_common.h, step for step, for a group with statistics lo, hi (the values
// min_f / max_f give) and finiteness `finite`. Branch-free: a non-finite group computes garbage
// from its lo / hi (possibly NaN), and ok = false then discards all of it.
template <int BITS, int POLICY>
ECHO_HD FastParams make_params_fast(float lo, float hi, bool finite) {
  static_assert(BITS == 4 || BITS == 8, "bits");
  FastParams p;
  // |lo| and |hi| have a clear sign bit, so for non-NaN inputs fmaxf picks the same bits as max_f
  // (equal values are the same bit pattern).
  const float amax = fmaxf(abs_f(lo), abs_f(hi));
  const bool constant = lo == hi;  // +0 == -0, as in the reference
  // A finite group below 2^126 has finite s, z and m (quant.py); amax is not NaN when finite.
  const bool ok = finite && amax < kRangeLimit;
  if constexpr (POLICY == kPolicySym) {
    constexpr int qmax = (1 << (BITS - 1)) - 1;
    constexpr float inv_q = static_cast<float>(1.0 / static_cast<double>(qmax));
    // amax * inv_q >= +0 and kScaleFloor > 0, so fmaxf equals max_f.
    const uint16_t s16 = constant ? bf16_round(amax)
                                  : bf16_round_up(fmaxf(mul_rn(amax, inv_q), kScaleFloor));
    const float s = bf16_to_f32(s16);
    p.r = reciprocal(s);
    p.m = 0.0f;
    p.ok = ok;
    p.wire = ok ? uint32_t{s16} : uint32_t{kScaleNaN};
  } else {
    constexpr int levels = (1 << BITS) - 1;
    constexpr float inv_m = static_cast<float>(1.0 / static_cast<double>(levels));
    constexpr float floor_scale = 0.0009765625f;  // 2^-10, exact
    // Every operand is >= +0 and never -0 (hi - lo >= +0 for lo <= hi; x - x is +0), so fmaxf
    // equals max_f; the result is >= 2^-100 (or +inf in a group that is not ok).
    const float s_raw =
        fmaxf(fmaxf(mul_rn(sub_rn(hi, lo), inv_m), mul_rn(amax, floor_scale)), kScaleFloor);
    const uint16_t s16 = constant ? bf16_round(lo) : bf16_round_up(s_raw);
    const float s = bf16_to_f32(s16);
    const float r = reciprocal(s);
    const float zn = mul_rn(-lo, r);  // finite in an ok group: |zn| <= 1024 (r = 0: zn = 0)
    const bool straddles = lo < 0.0f && hi > 0.0f;
    const float z = (POLICY == kPolicyAsym && straddles) ? rne(zn) : zn;
    const uint16_t z16 = constant ? kF16MinusOne : f16_rn(z);
    const float zf = f16_f32(z16);
    p.r = r;
    p.m = -mul_rn(zf, s);  // exact: 11 x 8 significant bits, 0 or at least 2^-124
    p.ok = ok;
    p.wire = ok ? (uint32_t{s16} | (uint32_t{z16} << 16)) : uint32_t{kScaleNaN};
  }
  return p;
}

// The code of value x of a group (encode_value before the ok mask: the caller zeroes the codes
// of a group with ok == false).
template <int BITS, int POLICY>
ECHO_HD uint32_t encode_fast(float x, const FastParams& p) {
  if constexpr (POLICY == kPolicySym) {
    constexpr int qmax = (1 << (BITS - 1)) - 1;
    return round_code<BITS>(mul_rn(x, p.r), -qmax, qmax, kRoundMagic + (qmax + 1));
  } else {
    constexpr int levels = (1 << BITS) - 1;
    return round_code<BITS>(mul_rn(sub_rn(x, p.m), p.r), 0.0f, levels, kRoundMagic);
  }
}

// ---- decoding ------------------------------------------------------------------------------

// dequant_params of echo_common.h from the wire word of quantize (s16 | z16 << 16 for asym).
template <int BITS, int POLICY>
ECHO_HD DequantParams dequant_params_fast(uint32_t wire) {
  const float s = f32_from_bits(wire << 16);  // the bf16 scale in the low half: exact
  const float z = POLICY == kPolicySym ? static_cast<float>(1 << (BITS - 1))
                                       : f16_f32(static_cast<uint16_t>(wire >> 16));
  return DequantParams{s, -mul_rn(z, s)};
}

// ---- layout of the fast quantize kernel ------------------------------------------------------
// A group of G values of type T is read by kLanes lanes of one warp, each with kLoads 16-byte
// loads of kVec values; load k of lane j holds values k * kLanes * kVec + j * kVec + [0, kVec), so
// each load instruction of a group's lanes reads kLanes * 16 contiguous bytes. Two loads a lane
// (the all-reduce's stages) or four (the standalone quantizer: default_lanes), more once a group
// has 32 lanes.
// Lanes a group for LOADS 16-byte loads a lane (1 .. 32 lanes).
template <typename T, int G, int LOADS>
constexpr int lanes_for_loads() {
  constexpr int lanes = G / (LOADS * (16 / static_cast<int>(sizeof(T))));
  return lanes < 1 ? 1 : lanes > 32 ? 32 : lanes;
}

// The standalone quantizer's choice: four loads a lane (64 bytes in flight a lane; fp32 8 lanes
// a 128-group, 16-bit 4): faster than two, and eight were slower again (fewer warps resident:
// 59-65 registers; docs/gpu.md).
template <typename T, int G>
constexpr int default_lanes() {
  return lanes_for_loads<T, G, 4>();
}

template <typename T, int G, int LANES = default_lanes<T, G>()>
struct QuantLayout {
  static constexpr int kVec = 16 / static_cast<int>(sizeof(T));
  static constexpr int kLanes = LANES;
  static constexpr int kLoads = G / (kLanes * kVec);
  static constexpr int kGroupsPerWarp = 32 / kLanes;
  static constexpr int kValuesPerLane = kLoads * kVec;
  static_assert(kLanes >= 1 && kLanes <= 32 && (kLanes & (kLanes - 1)) == 0,
                "lanes per group: a power of two <= 32");
  static_assert(kLoads >= 1 && kLanes * kVec * kLoads == G, "G: a power of two >= kLanes * kVec");
  // Index in the group of element t of load k of lane j.
  ECHO_HD static constexpr int index(int j, int k, int t) { return k * kLanes * kVec + j * kVec + t; }
};

// ---- the Hadamard rotation over a QuantLayout (echo_common.h's definition) -------------------
// The butterfly stage h pairs the values i and i + h of every block of 2h; in the layout the
// index bits split into t (in a piece), j (the lane) and k (the piece), low to high, so stages
// h < kVec pair values of one piece, kVec <= h < kVec * kLanes values of the lanes j and
// j ^ (h / kVec) (one shuffle, both lanes of a pair compute their own half), and larger h values
// of pieces k and k ^ h'. Stage order h = 1, 2, 4, ... as the reference: fp32 sums do not commute
// across stages bit for bit. Every lane of the warp must call these (shuffles), valid or not.

// Bit k * kVec + t set: value (k, t) of lane j has s_i = -1 (at most 32 values a lane).
template <class L>
__device__ __forceinline__ uint32_t hadamard_sign_mask(int j) {
  static_assert(L::kValuesPerLane <= 32, "a lane's sign mask holds 32 values");
  uint32_t m = 0;
#pragma unroll
  for (int k = 0; k < L::kLoads; ++k)
#pragma unroll
    for (int t = 0; t < L::kVec; ++t)
      if (hadamard_sign_negative(L::index(j, k, t))) m |= 1u << (k * L::kVec + t);
  return m;
}

// The butterflies within a piece (stages h < kVec), every piece of the lane.
template <class L>
__device__ __forceinline__ void piece_stages(float (&v)[L::kLoads][L::kVec]) {
#pragma unroll
  for (int h = 1; h < L::kVec; h *= 2)
#pragma unroll
    for (int k = 0; k < L::kLoads; ++k)
#pragma unroll
      for (int t = 0; t < L::kVec; ++t)
        if (!(t & h)) {
          const float a = v[k][t], b = v[k][t + h];
          v[k][t] = add_rn(a, b);
          v[k][t + h] = sub_rn(a, b);
        }
}

// The butterfly between pieces k and k + h of the lane (h a power of two < kLoads).
template <class L, int h>
__device__ __forceinline__ void pieces_stage(float (&v)[L::kLoads][L::kVec]) {
#pragma unroll
  for (int k = 0; k < L::kLoads; ++k)
    if (!(k & h)) {
#pragma unroll
      for (int t = 0; t < L::kVec; ++t) {
        const float a = v[k][t], b = v[k + h][t];
        v[k][t] = add_rn(a, b);
        v[k + h][t] = sub_rn(a, b);
      }
    }
}

// v <- v * s: the sign bit flipped where bit k * kVec + t of sign_mask is set (exact).
template <class L>
__device__ __forceinline__ void flip_signs(float (&v)[L::kLoads][L::kVec], uint32_t sign_mask) {
#pragma unroll
  for (int k = 0; k < L::kLoads; ++k)
#pragma unroll
    for (int t = 0; t < L::kVec; ++t)
      v[k][t] = __uint_as_float(__float_as_uint(v[k][t]) ^
                                (((sign_mask >> (k * L::kVec + t)) & 1u) << 31));
}

// v <- v * f, or v * (s f) with the signs of sign_mask: one rounded product a value.
template <class L>
__device__ __forceinline__ void scale_values(float (&v)[L::kLoads][L::kVec], float f) {
#pragma unroll
  for (int k = 0; k < L::kLoads; ++k)
#pragma unroll
    for (int t = 0; t < L::kVec; ++t) v[k][t] = mul_rn(v[k][t], f);
}
template <class L>
__device__ __forceinline__ void scale_signed(float (&v)[L::kLoads][L::kVec], uint32_t sign_mask,
                                             float f) {
  const float neg_f = -f;
#pragma unroll
  for (int k = 0; k < L::kLoads; ++k)
#pragma unroll
    for (int t = 0; t < L::kVec; ++t)
      v[k][t] = mul_rn(v[k][t], ((sign_mask >> (k * L::kVec + t)) & 1u) ? neg_f : f);
}

// Stages h = 2^S .. of the pieces (S from 0 while 2^S < kLoads), in order.
template <class L, int S = 0>
__device__ __forceinline__ void pieces_stages(float (&v)[L::kLoads][L::kVec]) {
  if constexpr ((1 << S) < L::kLoads) {
    pieces_stage<L, (1 << S)>(v);
    pieces_stages<L, S + 1>(v);
  }
}

// kFmaAcrossLanes: the low lane of a pair keeps v + other, the high one other - v; both are one
// fma(+-1, v, other) (+-v is exact, so its one rounding is the sum's or the difference's, -0
// included) instead of a sum, a difference and a select: faster in the uncompensated rotated
// instances; but the +-1 of each stage stays in a register, and the compensated rotated
// instances went from 64 to 80 (fp32) and 80 to 96 (16-bit, fp32 state) registers and got
// slower, so they keep the select (false; docs/gpu.md).
template <class L, bool kFmaAcrossLanes>
__device__ __forceinline__ void hadamard_stages(float (&v)[L::kLoads][L::kVec], int j) {
  piece_stages<L>(v);
#pragma unroll
  for (int o = 1; o < L::kLanes; o *= 2) {
    const float sign = (j & o) ? -1.0f : 1.0f;
#pragma unroll
    for (int k = 0; k < L::kLoads; ++k)
#pragma unroll
      for (int t = 0; t < L::kVec; ++t) {
        const float other = __shfl_xor_sync(0xffffffffu, v[k][t], o);
        if constexpr (kFmaAcrossLanes)
          v[k][t] = fma_rn(sign, v[k][t], other);
        else
          v[k][t] = (j & o) ? sub_rn(other, v[k][t]) : add_rn(v[k][t], other);
      }
  }
  pieces_stages<L>(v);
}

// Forward: v <- v * s (a sign flip, exact), the stages, v <- v * f.
template <class L, bool kFmaAcrossLanes>
__device__ __forceinline__ void hadamard_rotate(float (&v)[L::kLoads][L::kVec], int j,
                                                uint32_t sign_mask, float f) {
  flip_signs<L>(v, sign_mask);
  hadamard_stages<L, kFmaAcrossLanes>(v, j);
  scale_values<L>(v, f);
}

// Inverse: the stages, then v <- v * (s f).
template <class L, bool kFmaAcrossLanes>
__device__ __forceinline__ void hadamard_unrotate(float (&v)[L::kLoads][L::kVec], int j,
                                                  uint32_t sign_mask, float f) {
  hadamard_stages<L, kFmaAcrossLanes>(v, j);
  scale_signed<L>(v, sign_mask, f);
}

}  // namespace fast
}  // namespace echo

#endif  // ECHO_JAX_FFI_QUANT_FAST_CUH_
