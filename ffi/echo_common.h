// Shared arithmetic of the Echo wire format and compensator (host C++ and CUDA device code).
//
// This header is the C++ transcription of the formulas in echo_jax/quant.py's module docstring
// (the one definition of the wire format) and of echo_jax/compensator.py. Every function here
// reproduces the pure-JAX reference bit for bit, including the order of operations, so that the
// "p2p" custom call and the "xla" transport return the same bits.
//
// Rules that make the bits match:
//   * All arithmetic is IEEE fp32 with round-to-nearest-even, no fused multiply-add. Host code is
//     compiled with -ffp-contract=off (see CMakeLists.txt) and device code goes through the
//     __fmul_rn / __fadd_rn intrinsics (mul_rn / add_rn / sub_rn below), which nvcc never
//     contracts. Where the JAX reference uses `_no_fma` the product is rounded before the sum.
//   * fp32 <-> fp16 and fp32 <-> bf16 conversions are done in software on the bit patterns (round
//     to nearest even, correct for subnormals, infinities and NaNs), so they do not depend on
//     F16C, on the CUDA half intrinsics or on the denormal mode of the FPU.
//   * rne() rounds half to even (jnp.round): std::nearbyint on the host (XLA runs its CPU thunks
//     with the default round-to-nearest mode), rintf on the device.
//   * The reciprocal is the correctly rounded 1/s (0 when |s| < 2^-126), computed once per group.
#ifndef ECHO_JAX_FFI_ECHO_COMMON_H_
#define ECHO_JAX_FFI_ECHO_COMMON_H_

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#if defined(__CUDACC__)
#define ECHO_HD __host__ __device__ __forceinline__
#else
#include <cmath>
#define ECHO_HD inline
#endif

namespace echo {

// Policy codes of the FFI attribute "policy": the table of echo_jax/policies.py, in its order.
enum Policy : int { kPolicyAsym = 0, kPolicySym = 1, kPolicyAsymNaive = 2 };
constexpr int kNumPolicies = 3;  // codes 0 .. kNumPolicies - 1

// Limits shared by the handlers and the Python side (echo_jax/transports/base.py checks first).
constexpr int kMaxRanks = 256;             // ranks per group (num_ranks)
constexpr int kMaxGroupSize = 1 << 16;     // values per quantization group (group_size)
constexpr int64_t kMaxSegmentElems = (int64_t{1} << 31) - 1;  // segment_groups * group_size

// The one check of a wire format, shared by every handler (CPU custom call, host utilities,
// CUDA kernels): "" when (bits, group_size, policy code) is valid, else a sentence that names the
// bad value. max_group_size is the handler's limit on group_size (the quantize kernels have none).
inline std::string format_error(int64_t bits, int64_t group_size, int64_t policy,
                                int64_t max_group_size = kMaxGroupSize) {
  if (bits != 4 && bits != 8) return "bits must be 4 or 8, got " + std::to_string(bits);
  if (group_size < 1 || group_size > max_group_size) {
    return "group_size must be in [1, " + std::to_string(max_group_size) + "], got " +
           std::to_string(group_size);
  }
  if (bits == 4 && group_size % 2) {
    return "group_size must be even at 4 bits (two codes a byte), got " +
           std::to_string(group_size);
  }
  if (policy < 0 || policy >= kNumPolicies) {
    return "policy code must be in [0, " + std::to_string(kNumPolicies - 1) +
           "] (0 = asym, 1 = sym, 2 = asym_naive), got " + std::to_string(policy);
  }
  return "";
}

// 16-bit patterns and limits of the wire format (quant.py: a bf16 scale, an fp16 zero-point).
constexpr uint16_t kScaleNaN = 0x7FC0;     // bf16 NaN (quant.NAN_SCALE_BITS): a non-finite group
constexpr uint16_t kF16MinusOne = 0xBC00;  // fp16 -1.0: the zero-point of a constant asym group
constexpr float kScaleFloor = 7.8886090522101181e-31f;  // 2^-100 (quant.SCALE_FLOOR), exact
constexpr float kRangeLimit = 8.5070591730234616e37f;   // 2^126 (quant.RANGE_LIMIT), exact
constexpr float kNormalMin = 1.1754943508222875e-38f;   // 2^-126, fp32's smallest normal

// ----------------------------------------------------------------------------------------------
// Bit casts and IEEE fp32 operations without contraction.
// ----------------------------------------------------------------------------------------------

ECHO_HD uint32_t f32_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

ECHO_HD float f32_from_bits(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

// Rounded product / sum / difference. On the device the _rn intrinsics are never fused into an
// FMA by nvcc; on the host -ffp-contract=off gives the same guarantee for plain operators.
ECHO_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

ECHO_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

ECHO_HD float sub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

ECHO_HD bool is_finite(float f) { return (f32_bits(f) & 0x7F800000u) != 0x7F800000u; }

// jnp.abs: clears the sign bit (|-0| = +0).
ECHO_HD float abs_f(float f) { return f32_from_bits(f32_bits(f) & 0x7FFFFFFFu); }

// Round to the nearest integer, ties to even (jnp.round).
ECHO_HD float rne(float v) {
#if defined(__CUDA_ARCH__)
  return rintf(v);
#else
  return std::nearbyint(v);
#endif
}

// jnp.minimum / jnp.maximum / jnp.clip with XLA's semantics (IEEE 754-2019 minimum/maximum):
// NaN propagates and -0 < +0, so the result does not depend on the operand order (XLA reduces a
// group in an unspecified order; a group mixing +0 and -0 must still give the same lo and hi).
ECHO_HD float min_f(float a, float b) {
  if (a != a) return a;
  if (b != b) return b;
  if (a == b) return (f32_bits(a) & 0x80000000u) ? a : b;  // equal: prefer -0
  return b < a ? b : a;
}
ECHO_HD float max_f(float a, float b) {
  if (a != a) return a;
  if (b != b) return b;
  if (a == b) return (f32_bits(a) & 0x80000000u) ? b : a;  // equal: prefer +0
  return b > a ? b : a;
}
ECHO_HD float clip_f(float v, float lo, float hi) { return min_f(max_f(v, lo), hi); }

// 1/s, correctly rounded, and 0 when |s| < 2^-126 (quant._reciprocal): a scale below fp32's
// normal range (only a constant group's) would have an infinite reciprocal.
ECHO_HD float reciprocal(float s) {
  if (!(s >= kNormalMin || s <= -kNormalMin)) return s != s ? s : 0.0f;  // NaN stays NaN
#if defined(__CUDA_ARCH__)
  return __frcp_rn(s);
#else
  return 1.0f / s;
#endif
}

// ----------------------------------------------------------------------------------------------
// fp16 <-> fp32 in software.
// ----------------------------------------------------------------------------------------------

// fp32 -> fp16, round to nearest, ties to even (the astype(float16) of the reference).
ECHO_HD uint16_t f32_to_f16(float f) {
  const uint32_t x = f32_bits(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t a = x & 0x7FFFFFFFu;
  if (a > 0x7F800000u) {  // NaN: keep the top payload bits, force a quiet NaN
    return static_cast<uint16_t>(sign | 0x7E00u | ((a >> 13) & 0x03FFu));
  }
  if (a >= 0x477FF000u) {  // >= 65520 (halfway between 65504 and 2^16) rounds to infinity
    return static_cast<uint16_t>(sign | 0x7C00u);
  }
  if (a >= 0x38800000u) {  // >= 2^-14: a normal fp16
    // Rebias the exponent (127 -> 15) and round the 13 dropped mantissa bits to nearest even;
    // a carry out of the mantissa correctly bumps the exponent.
    const uint32_t odd = (a >> 13) & 1u;
    const uint32_t r = a + 0xC8000FFFu + odd;  // 0xC8000000 == -(112 << 23) mod 2^32
    return static_cast<uint16_t>(sign | (r >> 13));
  }
  if (a <= 0x33000000u) {  // <= 2^-25: half the smallest subnormal or less rounds to (signed) 0
    return sign;
  }
  // fp16 subnormal: value = m * 2^(e - 150) and the fp16 unit is 2^-24.
  const uint32_t e = a >> 23;                       // 102 .. 112
  const uint32_t m = (a & 0x007FFFFFu) | 0x00800000u;
  const uint32_t shift = 126u - e;                  // 14 .. 24
  uint32_t q = m >> shift;
  const uint32_t rem = m & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1u);
  if (rem > half || (rem == half && (q & 1u))) ++q;  // may carry into the smallest normal: fine
  return static_cast<uint16_t>(sign | q);
}

// fp16 -> fp32 (exact; a NaN stays a NaN with its payload, quieted like the hardware does).
ECHO_HD float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1Fu;
  uint32_t m = h & 0x03FFu;
  if (e == 0x1Fu) {
    return f32_from_bits(sign | 0x7F800000u | (m << 13) | (m ? 0x00400000u : 0u));
  }
  if (e == 0) {
    if (m == 0) return f32_from_bits(sign);
    // Subnormal fp16: normalise (the result is a normal fp32).
    int32_t exp = 113;  // 127 - 15 + 1
    while ((m & 0x0400u) == 0) {
      m <<= 1;
      --exp;
    }
    m &= 0x03FFu;
    return f32_from_bits(sign | (static_cast<uint32_t>(exp) << 23) | (m << 13));
  }
  return f32_from_bits(sign | ((e + 112u) << 23) | (m << 13));
}

ECHO_HD bool f16_is_finite(uint16_t h) { return (h & 0x7C00u) != 0x7C00u; }

// ----------------------------------------------------------------------------------------------
// bf16 <-> fp32 in software (the 16-bit contributions of the custom call).
// ----------------------------------------------------------------------------------------------

// fp32 -> bf16, round to nearest, ties to even, bit for bit XLA:CPU's convert (astype(bfloat16)).
// Finite values too large for bf16 round to infinity, subnormals round on their bits like any
// other value (nothing is flushed), and every NaN becomes the quiet NaN of its sign with no
// payload (0x7FC0 / 0xFFC0), as XLA's convert makes it (tests/echo_jax/test_p2p_cpu.py checks all three
// against XLA).
ECHO_HD uint16_t f32_to_bf16(float f) {
  const uint32_t x = f32_bits(f);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) {
    return static_cast<uint16_t>(((x >> 16) & 0x8000u) | 0x7FC0u);
  }
  // Add half an ulp of bf16 (minus one unless the kept part is odd) and truncate; a carry out of
  // the mantissa bumps the exponent, up to infinity (0x7F7FFFFF + 0x8000 = 0x7F807FFF).
  const uint32_t odd = (x >> 16) & 1u;
  return static_cast<uint16_t>((x + 0x7FFFu + odd) >> 16);
}

// bf16 -> fp32 (exact: bf16 is the top half of an fp32).
ECHO_HD float bf16_to_f32(uint16_t h) { return f32_from_bits(static_cast<uint32_t>(h) << 16); }

// quant.bf16_round_up: for v >= 0 (not NaN) the smallest bf16 >= v (overflow gives inf). A
// pattern with any of its 16 low bits set moves up to the next multiple of 2^16.
ECHO_HD uint16_t bf16_round_up(float v) {
  return static_cast<uint16_t>((f32_bits(v) + 0xFFFFu) >> 16);
}

// quant.bf16_round for a non-NaN v: round to nearest even on the bits (overflow gives inf).
ECHO_HD uint16_t bf16_round(float v) {
  const uint32_t x = f32_bits(v);
  return static_cast<uint16_t>((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}

// ----------------------------------------------------------------------------------------------
// Group quantizer (quant.quantize_groups / quant.dequantize_groups).
// ----------------------------------------------------------------------------------------------

ECHO_HD int num_params(int policy) { return policy == kPolicySym ? 1 : 2; }
ECHO_HD int code_bytes(int group_size, int bits) { return group_size * bits / 8; }

// Running statistics of one group, fed value by value in index order.
struct GroupStats {
  float lo;
  float hi;
  bool finite;
};

ECHO_HD GroupStats stats_init() { return GroupStats{0.0f, 0.0f, true}; }

ECHO_HD void stats_add(GroupStats& st, float v, bool first) {
  if (!is_finite(v)) st.finite = false;
  if (first) {
    st.lo = v;
    st.hi = v;
  } else {
    st.lo = min_f(st.lo, v);
    st.hi = max_f(st.hi, v);
  }
}

// Everything the encoder needs for one group, plus the 16-bit parameters that go on the wire.
struct QuantParams {
  float s;        // fp32 value of the stored scale
  float r;        // 1/s (0 when |s| < 2^-126)
  float m;        // asym: -(z * s); sym: unused
  uint16_t s16;   // wire scale, bf16 bits (kScaleNaN for a non-finite group)
  uint16_t z16;   // wire zero-point (asym only; 0 for a non-finite group)
  bool ok;        // false: non-finite group, every code is 0 and it dequantizes to NaN
};

// The per-group parameters of quant.quantize_groups, from the group's statistics.
ECHO_HD QuantParams make_params(const GroupStats& st, int bits, int policy) {
  QuantParams p{0.0f, 0.0f, 0.0f, kScaleNaN, 0, false};
  if (!st.finite) return p;  // the reference zeroes the group, then replaces the parameters
  const float lo = st.lo;
  const float hi = st.hi;
  const float amax = max_f(abs_f(lo), abs_f(hi));
  if (!(amax < kRangeLimit)) return p;  // |x| >= 2^126: sent as NaN like a non-finite group
  const bool constant = lo == hi;
  if (policy == kPolicySym) {
    const int qmax = (1 << (bits - 1)) - 1;
    // f32(1/Q): the Python constant np.float32(1.0 / qmax), rounded once from double.
    const float inv_q = static_cast<float>(1.0 / static_cast<double>(qmax));
    const uint16_t s16 = constant ? bf16_round(amax)
                                  : bf16_round_up(max_f(mul_rn(amax, inv_q), kScaleFloor));
    p.s = bf16_to_f32(s16);
    p.r = reciprocal(p.s);
    p.ok = true;
    p.s16 = s16;
    p.z16 = 0;
    return p;
  }
  const int levels = (1 << bits) - 1;
  const float inv_m = static_cast<float>(1.0 / static_cast<double>(levels));
  const float floor_scale = 0.0009765625f;  // 2^-10, exact
  const float s_raw = max_f(max_f(mul_rn(sub_rn(hi, lo), inv_m), mul_rn(amax, floor_scale)),
                            kScaleFloor);
  const uint16_t s16 = constant ? bf16_round(lo) : bf16_round_up(s_raw);
  const float s = bf16_to_f32(s16);
  const float r = reciprocal(s);
  const float zn = mul_rn(-lo, r);  // naive zero-point: the grid starts at the minimum
  // Zero-aware policy (quant.py docstring): every group that straddles zero gets an integer
  // zero-point, so 0 is a grid point however close it lies to an edge of [lo, hi]. Signed zeros
  // compare equal to 0, as in the reference's `lo < 0` / `hi > 0`.
  const bool straddles = lo < 0.0f && hi > 0.0f;
  const float z = (policy == kPolicyAsym && straddles) ? rne(zn) : zn;
  const uint16_t z16 = constant ? kF16MinusOne : f32_to_f16(z);
  const float zf = f16_to_f32(z16);
  p.s = s;
  p.r = r;
  p.m = -mul_rn(zf, s);  // exact: 11 x 8 significant bits, 0 or at least 2^-124
  p.ok = true;           // amax < 2^126: s, z and m are finite
  p.s16 = s16;
  p.z16 = z16;
  return p;
}

// The b-bit code of one value of a finite group (quant.quantize_groups, before packing).
ECHO_HD uint8_t encode_value(float x, const QuantParams& p, int bits, int policy) {
  if (!p.ok) return 0;
  if (policy == kPolicySym) {
    const float qmax = static_cast<float>((1 << (bits - 1)) - 1);
    const float q = clip_f(rne(mul_rn(x, p.r)), -qmax, qmax);
    return static_cast<uint8_t>(static_cast<int>(add_rn(q, qmax + 1.0f)));
  }
  const float levels = static_cast<float>((1 << bits) - 1);
  const float q = clip_f(rne(mul_rn(sub_rn(x, p.m), p.r)), 0.0f, levels);
  return static_cast<uint8_t>(static_cast<int>(q));
}

// Decoder constants of one group: x_hat = code * s + m (quant.dequantize_groups).
struct DequantParams {
  float s;
  float m;
};

ECHO_HD DequantParams dequant_params(const uint16_t* params, int bits, int policy) {
  const float s = bf16_to_f32(params[0]);
  const float z = policy == kPolicySym ? static_cast<float>(1 << (bits - 1))
                                       : f16_to_f32(params[1]);
  return DequantParams{s, -mul_rn(z, s)};
}

ECHO_HD float decode_value(uint8_t code, const DequantParams& d) {
  // code * s is exact (at most 8 x 8 significant bits), so this equals the fused form too.
  return add_rn(mul_rn(static_cast<float>(code), d.s), d.m);
}

// The k-th code of a packed group: 4 bits are two codes a byte, code 2k in the low nibble.
ECHO_HD uint8_t unpack_code(const uint8_t* packed, int k, int bits) {
  if (bits == 8) return packed[k];
  const uint8_t byte = packed[k >> 1];
  return (k & 1) ? static_cast<uint8_t>(byte >> 4) : static_cast<uint8_t>(byte & 0x0F);
}

// Quantizes one group of g fp32 values into packed codes (g*bits/8 bytes) and its 16-bit
// parameters (bf16 scale; fp16 zero-point for asym), exactly like quant.quantize_groups.
ECHO_HD void quantize_group(const float* x, int g, int bits, int policy, uint8_t* packed,
                            uint16_t* params) {
  GroupStats st = stats_init();
  for (int k = 0; k < g; ++k) stats_add(st, x[k], k == 0);
  const QuantParams p = make_params(st, bits, policy);
  params[0] = p.s16;
  if (policy != kPolicySym) params[1] = p.z16;
  if (bits == 8) {
    for (int k = 0; k < g; ++k) packed[k] = encode_value(x[k], p, bits, policy);
  } else {
    for (int k = 0; k < g; k += 2) {
      const uint8_t lo = encode_value(x[k], p, bits, policy);
      const uint8_t hi = encode_value(x[k + 1], p, bits, policy);
      packed[k >> 1] = static_cast<uint8_t>(lo | (hi << 4));
    }
  }
}

// Dequantizes one packed group into g fp32 values (quant.dequantize_groups).
ECHO_HD void dequantize_group(const uint8_t* packed, const uint16_t* params, int g, int bits,
                              int policy, float* out) {
  const DequantParams d = dequant_params(params, bits, policy);
  for (int k = 0; k < g; ++k) out[k] = decode_value(unpack_code(packed, k, bits), d);
}

// ----------------------------------------------------------------------------------------------
// Compensator (echo_jax/compensator.py, Algorithm 1 of the Echo paper).
// ----------------------------------------------------------------------------------------------

// fp32 coefficients, each rounded once from float64 in Python (compensator.Coefficients), plus
// inv_p = f32(1/P). They arrive as FFI attributes so that no rounding happens twice.
struct CompCoeffs {
  float ea;     // eta * a
  float eb;     // eta * (1 - a)
  float b1;     // beta1
  float c1;     // 1 - beta1
  float b2;     // beta2
  float c2;     // 1 - beta2
  float inv_p;  // 1 / P
};

// Eq. 10: x' = x + ((eta a) m1 + (eta (1-a)) m2), both products rounded before the sums.
ECHO_HD float comp_apply(float x, float m1, float m2, const CompCoeffs& k) {
  const float p1 = mul_rn(k.ea, m1);
  const float p2 = mul_rn(k.eb, m2);
  return add_rn(x, add_rn(p1, p2));
}

// Eq. 11 from a residual u: m1 = b1 m1 + c1 u; m2 = b2 m2 + c2 u (rounded products). With
// u = x' - y / P (comp_update) or a rank's local rounding error (EchoConfig.residual = "local").
ECHO_HD void comp_update_residual(float u, float m1, float m2, const CompCoeffs& k,
                                  float* m1_out, float* m2_out) {
  const float q1 = mul_rn(k.b1, m1);
  const float r1 = mul_rn(k.c1, u);
  const float q2 = mul_rn(k.b2, m2);
  const float r2 = mul_rn(k.c2, u);
  *m1_out = add_rn(q1, r1);
  *m2_out = add_rn(q2, r2);
}

// Eq. 4 and Eq. 11: u = x' - y * (1/P), then comp_update_residual.
ECHO_HD void comp_update(float x_prime, float y, float m1, float m2, const CompCoeffs& k,
                         float* m1_out, float* m2_out) {
  const float t = mul_rn(y, k.inv_p);
  comp_update_residual(sub_rn(x_prime, t), m1, m2, k, m1_out, m2_out);
}

// The int8 state (EchoConfig.state_dtype = "int8"; echo_jax/compensator.py state_scale /
// quantize_state / dequantize_state are the definition): each average m1, m2 is int8 codes with
// one fp32 scale a kStateGroup consecutive values of the rank's flattened array. A group of
// values v is stored as
//   s = the smallest power of two with 127 s >= max|v|,  q = rne(v / s)
// and read back as q * s. No division anywhere (XLA's GPU division is not correctly rounded):
// s and 1 / s come from max|v|'s bits and one comparison, and v / s, q * s are exact. A group
// whose max|v| is below 2^-100 gets s = 0 and codes 0; one with a NaN or an inf gets s = max|v|
// (not finite) and codes 0, so it reads back NaN. Why 8 bits with a scale: each rank's residual
// is data-scale (only its sum over ranks is the injected error, Eq. 4), so it needs a
// per-group range as the wire does.
// ----------------------------------------------------------------------------------------------
constexpr int kStateGroup = 128;  // compensator.STATE_GROUP

struct StateScale {
  float s;    // the group's scale
  float inv;  // 1 / s (exact), 0 where s is 0 or not finite
};

// The scale of a group whose codes reach +-kMaxCode (127: the int8 state, 7: the int4 state)
// from the bits of its largest |v| (amax_bits = f32_bits(max|v|), sign clear; a NaN's bits are
// above every other value's, so an integer max of |v|'s bits finds it): with K = floor(log2
// kMaxCode), kMaxCode * 2^(E-K) is max|v|'s exponent E with the mantissa of kMaxCode / 2^K
// (127 / 64 = 1.984375, 7 / 4 = 1.75), so s = 2^(E-K) where max|v| is at most that, else
// 2^(E-K+1).
template <int kMaxCode>
ECHO_HD StateScale state_scale_for_bits(uint32_t amax_bits) {
  constexpr uint32_t k = kMaxCode == 127 ? 6u : kMaxCode == 7 ? 2u : 0u;
  static_assert(k != 0, "the quantized states' largest codes are 127 and 7");
  constexpr uint32_t mantissa = (static_cast<uint32_t>(kMaxCode) << (23 - k)) & 0x007FFFFFu;
  if (amax_bits >= 0x7F800000u) return {f32_from_bits(amax_bits), 0.0f};  // inf or NaN
  if (amax_bits < (27u << 23)) return {0.0f, 0.0f};                        // below 2^-100
  const bool fits = amax_bits <= ((amax_bits & 0x7F800000u) | mantissa);
  const uint32_t e = (amax_bits >> 23) - (fits ? k : k - 1u);  // s's biased exponent
  return {f32_from_bits(e << 23), f32_from_bits((254u - e) << 23)};
}

// The int8 state's scale (codes in [-127, 127]).
ECHO_HD StateScale state_scale_of_bits(uint32_t amax_bits) {
  return state_scale_for_bits<127>(amax_bits);
}

// The code of v under the inverse scale inv: v * inv is exact (|v * inv| <= 127, or NaN).
ECHO_HD int8_t state_code(float v, float inv) {
  const float p = mul_rn(v, inv);
  if (p != p) return 0;  // inf * 0 or a NaN: XLA's convert gives 0
  return static_cast<int8_t>(clip_f(rne(p), -127.0f, 127.0f));
}

// A stored value: q * s (exact).
ECHO_HD float state_value(int8_t q, float s) { return mul_rn(static_cast<float>(q), s); }

// The int4 state (EchoConfig.state_dtype = "int4"; the same compensator.py functions are the
// definition): as the int8 state with codes in [-7, 7] and
//   s = the smallest power of two with 7 s >= max|v|,
// the same 2^-100 and non-finite rules. The codes are packed two a byte, as two's complement
// nibbles, the value of even element 2i in the low nibble of byte i and of 2i + 1 in the high one
// (the wire's order, unpack_code); an odd count leaves the last byte's high nibble 0. Why 4 bits:
// with the local residual (EchoConfig.residual = "local") each rank's residual is error-scale,
// and its 4-bit rounding is a second-order term next to the wire's 4-bit error, while the
// state's bytes are most of what the compensated call moves beyond the plain one on one GPU.
constexpr int kStateQ4Max = 7;

// The int4 state's scale (codes in [-7, 7]).
ECHO_HD StateScale state_scale_q4_of_bits(uint32_t amax_bits) {
  return state_scale_for_bits<kStateQ4Max>(amax_bits);
}

// The int4 code of v under the inverse scale inv (|v * inv| <= 7, or NaN), as state_code.
ECHO_HD int8_t state_code_q4(float v, float inv) {
  const float p = mul_rn(v, inv);
  if (p != p) return 0;
  return static_cast<int8_t>(clip_f(rne(p), -7.0f, 7.0f));
}

// Code k of packed int4 codes, sign-extended from its nibble.
ECHO_HD int8_t state_q4_at(const uint8_t* packed, int64_t k) {
  const uint8_t byte = packed[k >> 1];
  const int nib = (k & 1) ? (byte >> 4) : (byte & 0x0F);
  return static_cast<int8_t>(nib >= 8 ? nib - 16 : nib);
}

// Stores code q (in [-7, 7]) as element k of packed int4 codes, keeping the other nibble.
ECHO_HD void state_q4_put(uint8_t* packed, int64_t k, int8_t q) {
  const uint8_t nib = static_cast<uint8_t>(q) & 0x0F;
  uint8_t& byte = packed[k >> 1];
  byte = (k & 1) ? static_cast<uint8_t>((byte & 0x0F) | (nib << 4))
                 : static_cast<uint8_t>((byte & 0xF0) | nib);
}

// ----------------------------------------------------------------------------------------------
// The randomized block Hadamard rotation (EchoConfig.rotation = "hadamard"; echo_jax/rotation.py
// is the definition, these are its bit-exact C++ form). A group of g values (g a power of two) is
// rotated by R = H_g / sqrt(g) . diag(s) and back by R^T = diag(s) . H_g / sqrt(g):
//   forward  v_i <- v_i * s_i (exact), then the butterfly stages, then v_i <- v_i * f
//   inverse  the butterfly stages, then v_i <- v_i * (s_i f)
// with f = fp32(1 / sqrt(g)) (rounded once from double) and stage h = 1, 2, 4, ..., g / 2 mapping
// the pair (i, i + h) of every block of 2h values to (a + b, a - b), each a rounded fp32 operation.
// Stages run in that order everywhere: fp32 sums do not commute across stages bit for bit.
// ----------------------------------------------------------------------------------------------

constexpr uint64_t kHadamardSignSeed = 0x4563686Full;  // rotation.SIGN_SEED ("Echo")

// Whether s_i = -1: the top bit of splitmix64((seed << 32) + i) (rotation._signs).
ECHO_HD bool hadamard_sign_negative(int64_t i) {
  uint64_t z = (kHadamardSignSeed << 32) + static_cast<uint64_t>(i);
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return (z >> 63) != 0;
}

// f = fp32(1 / sqrt(g)), as numpy's np.float32(1.0 / np.sqrt(g)) (correctly rounded double
// sqrt and division, then one rounding to fp32). Host only: kernels take it as an argument.
inline float hadamard_scale(int64_t g) {
  return static_cast<float>(1.0 / std::sqrt(static_cast<double>(g)));
}

// The butterfly stages on one group of g contiguous values (host reference form; the CUDA kernels
// run the same stages across registers and lanes).
inline void hadamard_stages(float* v, int64_t g) {
  for (int64_t h = 1; h < g; h *= 2)
    for (int64_t i0 = 0; i0 < g; i0 += 2 * h)
      for (int64_t i = i0; i < i0 + h; ++i) {
        const float a = v[i], b = v[i + h];
        v[i] = add_rn(a, b);
        v[i + h] = sub_rn(a, b);
      }
}

// Forward rotation of one group in place (rotation.hadamard_rotate on one block).
inline void hadamard_rotate_group(float* v, int64_t g, float f) {
  for (int64_t i = 0; i < g; ++i) v[i] = mul_rn(v[i], hadamard_sign_negative(i) ? -1.0f : 1.0f);
  hadamard_stages(v, g);
  for (int64_t i = 0; i < g; ++i) v[i] = mul_rn(v[i], f);
}

// Inverse rotation of one group in place (rotation.hadamard_unrotate on one block).
inline void hadamard_unrotate_group(float* v, int64_t g, float f) {
  hadamard_stages(v, g);
  for (int64_t i = 0; i < g; ++i) v[i] = mul_rn(v[i], hadamard_sign_negative(i) ? -f : f);
}

}  // namespace echo

#endif  // ECHO_JAX_FFI_ECHO_COMMON_H_
