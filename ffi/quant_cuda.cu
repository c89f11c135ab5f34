// Standalone CUDA quantize / dequantize of the Echo wire format (echo_jax/quant.py). These
// handlers let the GPU tests compare the kernels with the pure-JAX reference bit for bit and let
// the benchmarks measure the quantizer's throughput against the device's copy bandwidth.
//
// Two kernels each way:
//
// Fast quantize (quantize_fast_kernel<T, G, BITS, POLICY>): g in {32, 64, ..., 1024}, x 16-byte
// aligned. Input dtype, group size, bits and policy are template constants, so the policy
// branches, the code packing and every loop disappear at compile time and the per-value work is
// a handful of instructions (the old kernel was instruction-bound: ~715 warp instructions per
// 128-value group at 15 % of DRAM bandwidth).
//   * Layout (quant_fast.cuh, QuantLayout): a group is handled by kLanes lanes of one warp, each
//     holding kLoads 16-byte loads of kVec = 16 / sizeof(T) values; load k of lane j holds the
//     values k * kLanes * kVec + j * kVec + [0, kVec), so every load instruction reads kLanes * 16
//     contiguous bytes of each of the warp's groups (full 32-byte sectors, coalesced). Four loads
//     a lane: fp32 16 values a lane (g/16 lanes a group: 2 .. 32 for g = 32 .. 512), bf16 / fp16
//     32 values a lane (g/32 lanes: 1 .. 32 for g = 32 .. 1024); fp32 g = 1024 keeps 32 lanes
//     and takes 8 loads. Why: four 16-byte loads put 64 bytes a lane in flight before the first
//     use, and fewer lanes a group means fewer shuffle rounds (log2(kLanes)) and fewer redundant
//     per-group parameter computations a value (every lane of a group computes the group's
//     parameters itself: ~50 instructions a lane spread over 16 or 32 values). Two loads a lane
//     were slower, and so were eight (59 registers: fewer warps resident; docs/gpu.md, timed
//     with ffi/tools/quant_stages.cu). The raw 16-byte words stay
//     in registers between the statistics and the encoding (one read of x; the register arrays
//     are indexed only by unrolled constants, so nothing goes to local memory).
//   * Grid: one tile of kGroupsPerWarp groups a warp, no grid stride (launch_quantize_fast).
//   * Statistics: lo / hi with PTX min.NaN / max.NaN (IEEE 754-2019 minimum / maximum: NaN
//     propagates, -0 < +0, so any reduction order gives min_f / max_f's bits), two values an
//     instruction on bf16x2 / f16x2 words for 16-bit inputs; reduced over the group's lanes with
//     __shfl_xor_sync; a group is finite iff lo and hi are (quant_fast.cuh). Integer order keys
//     (KEY_STATS) give the same bits at five instructions a value instead of two.
//   * Parameters and codes: make_params_fast / encode_fast (quant_fast.cuh) are make_params /
//     encode_value of echo_common.h in the same order of rounded operations (__fmul_rn,
//     __fadd_rn, __fsub_rn, __frcp_rn), with the bf16 scale rounded on its bits (as the
//     software path), the fp16 zero-point through the hardware conversion cvt.rn (equal to the
//     software one on every input it can get) and an fp32 clamp + an addition of 1.5 * 2^23 for
//     rne + clip (round_code: no int <-> float conversion). Lane 0 of a group
//     stores its parameters (one 4-byte store for asym); each load's kVec codes are stored as
//     one 2-, 4- or 8-byte word (kVec * bits / 8 bytes).
// Fast dequantize (dequantize_fast_kernel<BITS, POLICY>): g a power of two >= 4, y 16-byte
// aligned. The codes and outputs are one flat stream (value i's code is at byte i * bits / 8 of
// packed whatever g is), so each lane decodes 4 chunks of 4 consecutive values (warp tile: 512
// values; chunk c of lane l at 4 * (32 c + l), one 16-byte store each), loading each chunk's
// codes (2 or 4 bytes) and its group's parameters (group = i >> log2 g: g enters only as a shift,
// so it need not be a template constant) before decoding any of them. decode_value as in
// echo_common.h (code * s, then + m, both rounded), with the bf16 scale widened by a shift, the
// hardware fp16 -> fp32 conversion of the zero-point and the code's fp32 value from 2^23 + code
// (decode_fast: no int -> float conversion).
// Generic kernels (quantize_kernel / dequantize_kernel, one warp per group, bits / policy / g at
// run time): every other g, unaligned buffers, and whenever ECHO_JAX_GENERIC_QUANT=1 is set (read
// once per process; for comparisons).
//
// Exactness: every kernel returns the bits of quant.quantize_groups / dequantize_groups. The fast
// kernels are compiled like the rest (no fast-math, no flush-to-zero, --fmad=false) and use only
// correctly rounded operations in the reference's order; quant_fast.cuh says, step by step, why
// each hardware shortcut gives the reference's bits.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "echo_attrs.h"
#include "echo_common.h"
#include "echo_cuda.cuh"
#include "fast_io.cuh"
#include "quant_fast.cuh"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace echo {
namespace cuda {
namespace {

constexpr int kQuantThreads = 256;
constexpr int kRegChunks = 4;  // value chunks per lane kept in registers between the passes

// ---- fast kernels --------------------------------------------------------------------------

// The kLoads 16-byte words of lane j in group grp (zeros past the last group).
template <typename L, typename T>
__device__ __forceinline__ void load_group(const T* __restrict__ x, int64_t grp, int64_t groups,
                                           int j, uint4* raw) {
  constexpr int G = L::kLanes * L::kVec * L::kLoads;
  const bool valid = grp < groups;
  const uint4* src = reinterpret_cast<const uint4*>(x + grp * G) + j;
#pragma unroll
  for (int k = 0; k < L::kLoads; ++k)
    raw[k] = valid ? __ldg(src + k * L::kLanes) : make_uint4(0u, 0u, 0u, 0u);
}

// x [groups * G] (T, 16-byte aligned) -> packed [groups, G*BITS/8], params [groups, 1|2].
// Warp w handles groups w * kGroupsPerWarp + [0, kGroupsPerWarp), grid-striding over warps when
// the grid is smaller than the work (production launches one tile a warp). With PREFETCH the next
// tile's loads are issued before this tile is reduced and encoded (it paid at two loads a lane
// in a grid-striding wave; at four loads a lane there are enough bytes in flight without it).
// LANES (lanes a group), PREFETCH and KEY_STATS (the group range from integer order keys instead
// of min.NaN / max.NaN; same bits) default to the production choice; ffi/tools/quant_stages.cu
// times the alternatives.
template <typename T, int G, int BITS, int POLICY, int LANES = fast::default_lanes<T, G>(),
          bool PREFETCH = fast::QuantLayout<T, G, LANES>::kLoads <= 2, bool KEY_STATS = false>
__global__ void __launch_bounds__(kQuantThreads)
    quantize_fast_kernel(const T* __restrict__ x, int64_t groups, uint8_t* __restrict__ packed,
                         uint16_t* __restrict__ params) {
  using L = fast::QuantLayout<T, G, LANES>;
  constexpr int kVec = L::kVec, kLanes = L::kLanes, kLoads = L::kLoads;
  constexpr int kGpw = L::kGroupsPerWarp;
  constexpr int kPieceBytes = kVec * BITS / 8;
  constexpr int kCodeBytes = G * BITS / 8;
  constexpr bool kPrefetch = PREFETCH;
  const int lane = static_cast<int>(threadIdx.x) % kWarp;
  const int j = lane % kLanes;  // lane within the group
  const int64_t first = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x / kWarp;
  uint4 raw[kLoads];
  if constexpr (kPrefetch) load_group<L>(x, first * kGpw + lane / kLanes, groups, j, raw);
  // The loop condition is the same for the 32 lanes of a warp (w is), so every shuffle below
  // runs with the whole warp; lanes of a group past the end load zeros and store nothing.
  for (int64_t w = first; w * kGpw < groups; w += stride) {
    const int64_t grp = w * kGpw + lane / kLanes;
    const bool valid = grp < groups;
    uint4 next[kLoads];
    if constexpr (kPrefetch)
      load_group<L>(x, grp + stride * kGpw, groups, j, next);
    else
      load_group<L>(x, grp, groups, j, raw);

    fast::FastParams p;
    if constexpr (KEY_STATS) {
      int32_t kmin = fast::kKeyMax, kmax = fast::kKeyMin;
#pragma unroll
      for (int k = 0; k < kLoads; ++k) {
        float v[kVec];
        fast::unpack_values<T, kVec>(raw[k], v);
#pragma unroll
        for (int t = 0; t < kVec; ++t) fast::key_range_add(kmin, kmax, v[t]);
      }
      fast::key_range_reduce<kLanes>(kmin, kmax);  // within the group's aligned lanes
      p = fast::make_params_fast<BITS, POLICY>(__uint_as_float(fast::from_order_key(kmin)),
                                               __uint_as_float(fast::from_order_key(kmax)),
                                               fast::keys_finite(kmin, kmax));
    } else {
      fast::Range r = fast::range_empty();
      if constexpr (sizeof(T) == 2) {
        r = fast::range_of_words16<T, kLoads>(raw);  // two values an instruction
      } else {
#pragma unroll
        for (int k = 0; k < kLoads; ++k) {
          float v[kVec];
          fast::unpack_values<T, kVec>(raw[k], v);
#pragma unroll
          for (int t = 0; t < kVec; ++t) fast::range_add(r, v[t]);
        }
      }
      fast::range_reduce<kLanes>(r);
      p = fast::make_params_fast<BITS, POLICY>(r.lo, r.hi, fast::range_finite(r));
    }
    if (valid && j == 0) {
      if constexpr (POLICY == kPolicySym)
        params[grp] = static_cast<uint16_t>(p.wire);
      else
        *reinterpret_cast<uint32_t*>(params + 2 * grp) = p.wire;  // s16, z16 (little-endian)
    }
    const uint32_t mask = p.ok ? 0xFFFFFFFFu : 0u;  // a non-finite group's codes are all 0
    uint8_t* dst = packed + grp * kCodeBytes + j * kPieceBytes;
#pragma unroll
    for (int k = 0; k < kLoads; ++k) {
      float v[kVec];
      fast::unpack_values<T, kVec>(raw[k], v);
      uint32_t codes[kVec];
#pragma unroll
      for (int t = 0; t < kVec; ++t) codes[t] = fast::encode_fast<BITS, POLICY>(v[t], p);
      if (valid) fast::store_piece<kVec, BITS>(dst + k * kLanes * kPieceBytes, codes, mask);
    }
    if constexpr (kPrefetch) {
#pragma unroll
      for (int k = 0; k < kLoads; ++k) raw[k] = next[k];
    }
  }
}

// packed [n * BITS / 8] + params [n >> log2g, 1|2] -> y [n] fp32 (16-byte aligned); n is a
// multiple of the group size 2^log2g >= 4, so a 4-value chunk never leaves its group.
template <int BITS, int POLICY>
__global__ void __launch_bounds__(kQuantThreads)
    dequantize_fast_kernel(const uint8_t* __restrict__ packed,
                           const uint16_t* __restrict__ params, int64_t n, int log2g,
                           float* __restrict__ y) {
  constexpr int kChunks = 4;                   // 4-value chunks a lane per tile
  constexpr int kTile = kWarp * 4 * kChunks;   // values a warp per tile
  const int lane = static_cast<int>(threadIdx.x) % kWarp;
  const int64_t first = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x / kWarp;
  for (int64_t base = first * kTile; base < n; base += stride * kTile) {
    uint32_t cw[kChunks], pw[kChunks];
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {  // all loads first: several in flight
      const int64_t i = base + 4 * (c * kWarp + lane);
      const bool in = i < n;
      const int64_t grp = i >> log2g;
      if constexpr (BITS == 4)
        cw[c] = in ? __ldg(reinterpret_cast<const unsigned short*>(packed + i / 2)) : 0u;
      else
        cw[c] = in ? __ldg(reinterpret_cast<const unsigned int*>(packed + i)) : 0u;
      if constexpr (POLICY == kPolicySym)
        pw[c] = in ? __ldg(reinterpret_cast<const unsigned short*>(params + grp)) : 0u;
      else
        pw[c] = in ? __ldg(reinterpret_cast<const unsigned int*>(params + 2 * grp)) : 0u;
    }
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const int64_t i = base + 4 * (c * kWarp + lane);
      const DequantParams d = fast::dequant_params_fast<BITS, POLICY>(pw[c]);
      float4 out;
      out.x = fast::decode_fast((cw[c] >> (0 * BITS)) & ((1u << BITS) - 1), d);
      out.y = fast::decode_fast((cw[c] >> (1 * BITS)) & ((1u << BITS) - 1), d);
      out.z = fast::decode_fast((cw[c] >> (2 * BITS)) & ((1u << BITS) - 1), d);
      out.w = fast::decode_fast((cw[c] >> (3 * BITS)) & ((1u << BITS) - 1), d);
      if (i < n) *reinterpret_cast<float4*>(y + i) = out;
    }
  }
}

// ---- generic kernels -----------------------------------------------------------------------

// One warp per group, bits / policy / g at run time (the fallback of the fast kernels).
// x [G*g] (T) -> packed [G, g*bits/8] (u8), params [G, np] (u16: bf16 scale, fp16 zero-point).
template <typename T, int VEC>
__global__ void __launch_bounds__(kQuantThreads)
    quantize_kernel(const T* x, int64_t groups, int g, int bits, int policy, uint8_t* packed,
                    uint16_t* params, bool x_aligned) {
  const int lane = threadIdx.x % kWarp;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / kWarp);
  const int chunks = g / VEC;
  const int cb = g * bits / 8;
  const int np = num_params(policy);
  const int64_t n = groups * g;
  for (int64_t grp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
       grp < groups; grp += warps) {
    const int64_t e0 = grp * g;
    GroupStats st{__int_as_float(0x7f800000), __int_as_float(0xff800000), true};
    float cache[kRegChunks][VEC];  // one pass over x when g <= 32 * VEC * kRegChunks
    for (int c = lane, i = 0; c < chunks; c += kWarp, ++i) {
      float v[VEC];
      load_vec<T, VEC>(x, e0 + c * VEC, n, v, x_aligned);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        if (!is_finite(v[k])) st.finite = false;
        st.lo = min_f(st.lo, v[k]);
        st.hi = max_f(st.hi, v[k]);
        if (i < kRegChunks) cache[i][k] = v[k];
      }
    }
    warp_stats(st);
    const QuantParams p = make_params(st, bits, policy);
    if (lane == 0) {
      params[grp * np] = p.s16;
      if (np == 2) params[grp * np + 1] = p.z16;
    }
    for (int c = lane, i = 0; c < chunks; c += kWarp, ++i) {
      float v[VEC];
      if (i < kRegChunks) {
#pragma unroll
        for (int k = 0; k < VEC; ++k) v[k] = cache[i][k];
      } else {
        load_vec<T, VEC>(x, e0 + c * VEC, n, v, x_aligned);
      }
      uint8_t codes[VEC];
#pragma unroll
      for (int k = 0; k < VEC; ++k) codes[k] = encode_value(v[k], p, bits, policy);
      store_codes<VEC>(packed + grp * cb + c * VEC * bits / 8, bits, codes);
    }
  }
}

template <int VEC>
__global__ void __launch_bounds__(kQuantThreads)
    dequantize_kernel(const uint8_t* packed, const uint16_t* params, int64_t groups, int g,
                      int bits, int policy, float* y, bool y_aligned) {
  const int lane = threadIdx.x % kWarp;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / kWarp);
  const int chunks = g / VEC;
  const int cb = g * bits / 8;
  const int np = num_params(policy);
  const int64_t n = groups * g;
  for (int64_t grp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
       grp < groups; grp += warps) {
    const DequantParams d = load_dequant_params(params + grp * np, bits, policy);
    for (int c = lane; c < chunks; c += kWarp) {
      uint8_t codes[VEC];
      load_codes<VEC>(packed + grp * cb + c * VEC * bits / 8, bits, codes);
      float v[VEC];
#pragma unroll
      for (int k = 0; k < VEC; ++k) v[k] = decode_value(codes[k], d);
      store_vec<float, VEC>(y, grp * g + c * VEC, n, v, y_aligned);
    }
  }
}


// ---- launching -----------------------------------------------------------------------------

int sm_count() {
  int device = 0, sms = 1;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  return std::max(1, sms);
}

// Blocks for `warps` warps of work (kQuantThreads / kWarp warps a block) of `kernel`: at most
// one wave of resident blocks (the kernels grid-stride over the rest).
template <auto kKernel>
int grid_for_warps(int64_t warps) {
  static const int per_sm = [] {  // once per kernel instance (a template argument)
    int n = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kKernel, kQuantThreads, 0) != cudaSuccess)
      n = 0;
    return std::max(1, n);
  }();
  const int64_t per_block = kQuantThreads / kWarp;
  const int64_t blocks = (warps + per_block - 1) / per_block;
  const int64_t cap = int64_t{sm_count()} * per_sm;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(blocks, cap)));
}

int grid_for(int64_t groups) {  // generic kernels: one warp per group
  const int64_t blocks = (groups + kQuantThreads / kWarp - 1) / (kQuantThreads / kWarp);
  const int64_t cap = int64_t{sm_count()} * 16;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(blocks, cap)));
}

bool aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

ffi::Error check(int64_t bits, int64_t g, int64_t policy) {
  // No limit on group_size here beyond int64 (the quantize kernels loop over any g).
  const std::string format = echo::format_error(bits, g, policy, INT64_MAX);
  if (!format.empty()) return ffi::Error::InvalidArgument("echo_jax quantize (CUDA): " + format);
  return ffi::Error::Success();
}

// One tile a warp (no grid stride): with four loads a lane and no prefetch, the hardware's block
// scheduler keeps the SMs full better than one wave of grid-striding warps (docs/gpu.md).
template <typename T, int G, int BITS, int POLICY>
void launch_quantize_fast(cudaStream_t s, const T* x, int64_t groups, uint8_t* packed,
                          uint16_t* params) {
  constexpr int64_t kGpw = fast::QuantLayout<T, G>::kGroupsPerWarp;
  constexpr int64_t kWarpsPerBlock = kQuantThreads / kWarp;
  const int64_t warps = (groups + kGpw - 1) / kGpw;
  const int64_t blocks = std::max<int64_t>(1, (warps + kWarpsPerBlock - 1) / kWarpsPerBlock);
  quantize_fast_kernel<T, G, BITS, POLICY><<<static_cast<unsigned>(blocks), kQuantThreads, 0, s>>>(
      x, groups, packed, params);
}

// Calls f(bits, policy) with both as std::integral_constant: the run-time format -> a template
// instance.
template <typename F>
bool with_format(int bits, int policy, F&& f) {
  using std::integral_constant;
  using B4 = integral_constant<int, 4>;
  using B8 = integral_constant<int, 8>;
  using Asym = integral_constant<int, kPolicyAsym>;
  using Sym = integral_constant<int, kPolicySym>;
  using Naive = integral_constant<int, kPolicyAsymNaive>;
  if (bits == 4) {
    if (policy == kPolicyAsym) return f(B4{}, Asym{});
    if (policy == kPolicySym) return f(B4{}, Sym{});
    return f(B4{}, Naive{});
  }
  if (policy == kPolicyAsym) return f(B8{}, Asym{});
  if (policy == kPolicySym) return f(B8{}, Sym{});
  return f(B8{}, Naive{});
}

template <typename T, int BITS, int POLICY, int... Gs>
bool quantize_fast_g(cudaStream_t s, const T* x, int64_t groups, int g, uint8_t* packed,
                     uint16_t* params) {
  // Launches the instance whose G is g, if there is one.
  return ((g == Gs && (launch_quantize_fast<T, Gs, BITS, POLICY>(s, x, groups, packed, params),
                       true)) || ...);
}

// The fast kernel for (T, g, bits, policy) when there is one and the buffers allow it; false:
// nothing launched, use the generic kernel.
template <typename T>
bool quantize_fast(cudaStream_t s, const void* x, int64_t groups, int g, int bits, int policy,
                   uint8_t* packed, uint16_t* params) {
  if (fast::generic_kernels_forced() || !fast::has_fast_policy(policy) || !aligned(x, 16) ||
      !aligned(packed, 8) || !aligned(params, 4))
    return false;
  const T* xt = static_cast<const T*>(x);
  return with_format(bits, policy, [&](auto b, auto p) {
    return quantize_fast_g<T, decltype(b)::value, decltype(p)::value, 32, 64, 128, 256, 512, 1024>(
        s, xt, groups, g, packed, params);
  });
}

template <typename T>
void launch_quantize(cudaStream_t s, const void* x, int64_t groups, int g, int bits, int policy,
                     uint8_t* packed, uint16_t* params) {
  if (quantize_fast<T>(s, x, groups, g, bits, policy, packed, params)) return;
  const T* xt = static_cast<const T*>(x);
  const int grid = grid_for(groups);
  if (g % 4 == 0)
    quantize_kernel<T, 4><<<grid, kQuantThreads, 0, s>>>(xt, groups, g, bits, policy, packed,
                                                         params, aligned(x, 4 * sizeof(T)));
  else if (g % 2 == 0)
    quantize_kernel<T, 2><<<grid, kQuantThreads, 0, s>>>(xt, groups, g, bits, policy, packed,
                                                         params, aligned(x, 2 * sizeof(T)));
  else
    quantize_kernel<T, 1><<<grid, kQuantThreads, 0, s>>>(xt, groups, g, bits, policy, packed,
                                                         params, true);
}

template <int BITS, int POLICY>
void launch_dequantize_fast(cudaStream_t s, const uint8_t* packed, const uint16_t* params,
                            int64_t n, int log2g, float* y) {
  constexpr int64_t kTile = kWarp * 16;  // dequantize_fast_kernel's values a warp per tile
  constexpr auto kernel = dequantize_fast_kernel<BITS, POLICY>;
  kernel<<<grid_for_warps<kernel>((n + kTile - 1) / kTile), kQuantThreads, 0, s>>>(
      packed, params, n, log2g, y);
}

void launch_dequantize(cudaStream_t s, const uint8_t* packed, const uint16_t* params,
                       int64_t groups, int g, int bits, int policy, float* y) {
  int log2g = 0;
  while ((1 << log2g) < g) ++log2g;
  if (!fast::generic_kernels_forced() && fast::has_fast_policy(policy) && (1 << log2g) == g &&
      g >= 4 && aligned(y, 16) &&
      aligned(packed, 4) && aligned(params, 4)) {
    with_format(bits, policy, [&](auto b, auto p) {
      launch_dequantize_fast<decltype(b)::value, decltype(p)::value>(s, packed, params, groups * g,
                                                                     log2g, y);
      return true;
    });
    return;
  }
  const int grid = grid_for(groups);
  if (g % 4 == 0)
    dequantize_kernel<4><<<grid, kQuantThreads, 0, s>>>(packed, params, groups, g, bits, policy, y,
                                                        aligned(y, 16));
  else if (g % 2 == 0)
    dequantize_kernel<2><<<grid, kQuantThreads, 0, s>>>(packed, params, groups, g, bits, policy, y,
                                                        aligned(y, 8));
  else
    dequantize_kernel<1><<<grid, kQuantThreads, 0, s>>>(packed, params, groups, g, bits, policy, y,
                                                        true);
}

// The error of the call's kernel launch, if any.
ffi::Error launch_status(const char* call) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return ffi::Error::Internal(std::string("echo_jax ") + call + " (CUDA): " +
                                cudaGetErrorString(e));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace cuda
}  // namespace echo

static ffi::Error EchoQuantizeCudaImpl(cudaStream_t stream, ffi::AnyBuffer x,
                                   ffi::Result<ffi::Buffer<ffi::U8>> packed,
                                   ffi::Result<ffi::Buffer<ffi::U16>> params, int64_t bits,
                                   int64_t group_size, int64_t policy) {
  ffi::Error err = echo::cuda::check(bits, group_size, policy);
  if (err.failure()) return err;
  const int64_t n = static_cast<int64_t>(x.element_count());
  if (n % group_size != 0)
    return ffi::Error::InvalidArgument("echo_jax quantize (CUDA): x has " + std::to_string(n) +
                                       " values, not a multiple of group_size " +
                                       std::to_string(group_size));
  const int64_t groups = n / group_size;
  const int g = static_cast<int>(group_size), b = static_cast<int>(bits), p = static_cast<int>(policy);
  uint8_t* pk = packed->typed_data();
  uint16_t* pr = params->typed_data();
  switch (x.element_type()) {
    case ffi::DataType::F32:
      echo::cuda::launch_quantize<float>(stream, x.untyped_data(), groups, g, b, p, pk, pr); break;
    case ffi::DataType::BF16:
      echo::cuda::launch_quantize<__nv_bfloat16>(stream, x.untyped_data(), groups, g, b, p, pk, pr);
      break;
    case ffi::DataType::F16:
      echo::cuda::launch_quantize<__half>(stream, x.untyped_data(), groups, g, b, p, pk, pr); break;
    default:
      return ffi::Error::InvalidArgument("echo_jax quantize (CUDA): x must be f32, bf16 or f16");
  }
  return echo::cuda::launch_status("quantize");
}

// Attributes of both calls: the format (bits, group_size, policy; ffi/echo_attrs.h).
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    echo_quantize_cuda, EchoQuantizeCudaImpl,
    echo::BindFormatAttrs(ffi::Ffi::Bind()
                              .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's compute stream
                              .Arg<ffi::AnyBuffer>()         // x: [G * g] values (f32/bf16/f16)
                              .Ret<ffi::Buffer<ffi::U8>>()   // packed codes [G, g*bits/8]
                              .Ret<ffi::Buffer<ffi::U16>>()  // params bits [G, 1|2]
                          ));

static ffi::Error EchoDequantizeCudaImpl(cudaStream_t stream, ffi::Buffer<ffi::U8> packed,
                                     ffi::Buffer<ffi::U16> params,
                                     ffi::Result<ffi::Buffer<ffi::F32>> y, int64_t bits,
                                     int64_t group_size, int64_t policy) {
  ffi::Error err = echo::cuda::check(bits, group_size, policy);
  if (err.failure()) return err;
  const int64_t groups = static_cast<int64_t>(y->element_count()) / group_size;
  const int g = static_cast<int>(group_size), b = static_cast<int>(bits), p = static_cast<int>(policy);
  echo::cuda::launch_dequantize(stream, packed.typed_data(), params.typed_data(), groups, g, b, p,
                                y->typed_data());
  return echo::cuda::launch_status("dequantize");
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    echo_dequantize_cuda, EchoDequantizeCudaImpl,
    echo::BindFormatAttrs(ffi::Ffi::Bind()
                              .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's compute stream
                              .Arg<ffi::Buffer<ffi::U8>>()   // packed codes [G, g*bits/8]
                              .Arg<ffi::Buffer<ffi::U16>>()  // params bits [G, 1|2]
                              .Ret<ffi::Buffer<ffi::F32>>()  // y: [G * g] fp32
                          ));
