// Small device helpers of the Echo CUDA kernels: peer-visible flags, warp reductions, vector
// loads/stores of 1, 2 or 4 values, and the warp-per-group quantizer built on echo_common.h.
#ifndef ECHO_JAX_FFI_ECHO_CUDA_CUH_
#define ECHO_JAX_FFI_ECHO_CUDA_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "echo_common.h"

namespace echo {
namespace cuda {

constexpr int kWarp = 32;

// ---- flags -------------------------------------------------------------------------------
// Flags are monotonic 64-bit words written by one peer and polled by one reader. The writer
// publishes with a system-scope release store after a __syncthreads: release is cumulative in
// the PTX memory model, so every byte its block wrote (ordered before the store through the
// barrier) is visible before the flag; the reader polls with acquire loads and the barrier after
// the poll orders its block's data reads after them.

__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// ---- element types -------------------------------------------------------------------------

template <typename T>
__device__ __forceinline__ float to_f32(T v);
template <>
__device__ __forceinline__ float to_f32<float>(float v) { return v; }
template <>
__device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <>
__device__ __forceinline__ float to_f32<__half>(__half v) { return __half2float(v); }

// fp32 -> output dtype with round-to-nearest-even (XLA's convert).
template <typename T>
__device__ __forceinline__ T from_f32(float v);
template <>
__device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half from_f32<__half>(float v) { return __float2half_rn(v); }

// VEC consecutive elements as one aligned load/store (16 bytes for 4 fp32: a 128-bit access).
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T v[VEC];
};

// Loads VEC values of x starting at element i (a multiple of VEC); elements >= n read as 0 (the
// padding of the wire layout). The vector access needs x itself aligned to VEC elements, which
// XLA's buffers are but the rows of a [P, n] array (virtual ranks) are not when n % VEC != 0:
// `aligned` says which case this is.
template <typename T, int VEC>
__device__ __forceinline__ void load_vec(const T* x, int64_t i, int64_t n, float* out,
                                         bool aligned = true) {
  if (aligned && i + VEC <= n) {
    Pack<T, VEC> p = *reinterpret_cast<const Pack<T, VEC>*>(x + i);
#pragma unroll
    for (int k = 0; k < VEC; ++k) out[k] = to_f32<T>(p.v[k]);
  } else {
#pragma unroll
    for (int k = 0; k < VEC; ++k) out[k] = (i + k < n) ? to_f32<T>(x[i + k]) : 0.0f;
  }
}

template <typename T, int VEC>
__device__ __forceinline__ void store_vec(T* y, int64_t i, int64_t n, const float* v,
                                          bool aligned = true) {
  if (aligned && i + VEC <= n) {
    Pack<T, VEC> p;
#pragma unroll
    for (int k = 0; k < VEC; ++k) p.v[k] = from_f32<T>(v[k]);
    *reinterpret_cast<Pack<T, VEC>*>(y + i) = p;
  } else {
#pragma unroll
    for (int k = 0; k < VEC; ++k)
      if (i + k < n) y[i + k] = from_f32<T>(v[k]);
  }
}

// ---- warp reductions of the group statistics (min and max are exact in any order) ----------

__device__ __forceinline__ void warp_stats(GroupStats& st) {
  unsigned fin = st.finite ? 1u : 0u;
#pragma unroll
  for (int off = kWarp / 2; off > 0; off >>= 1) {
    st.lo = min_f(st.lo, __shfl_xor_sync(0xffffffffu, st.lo, off));
    st.hi = max_f(st.hi, __shfl_xor_sync(0xffffffffu, st.hi, off));
    fin &= __shfl_xor_sync(0xffffffffu, fin, off);
  }
  st.finite = fin != 0;
}

// ---- packed codes ------------------------------------------------------------------------
// A chunk is VEC consecutive values of one group: VEC codes, VEC/2 bytes at 4 bits (low nibble
// first) or VEC bytes at 8 bits. Chunk c of a group starts at byte c * VEC * bits / 8.

template <int VEC>
__device__ __forceinline__ void store_codes(uint8_t* dst, int bits, const uint8_t* codes) {
  if (bits == 8) {
    if constexpr (VEC == 4) {
      *reinterpret_cast<uint32_t*>(dst) = codes[0] | (codes[1] << 8) | (codes[2] << 16) |
                                          (static_cast<uint32_t>(codes[3]) << 24);
    } else if constexpr (VEC == 2) {
      *reinterpret_cast<uint16_t*>(dst) = static_cast<uint16_t>(codes[0] | (codes[1] << 8));
    } else {
      dst[0] = codes[0];
    }
  } else {
    if constexpr (VEC == 4) {
      *reinterpret_cast<uint16_t*>(dst) =
          static_cast<uint16_t>(codes[0] | (codes[1] << 4) | (codes[2] << 8) | (codes[3] << 12));
    } else if constexpr (VEC == 2) {
      dst[0] = static_cast<uint8_t>(codes[0] | (codes[1] << 4));
    }
  }
}

// Reads through L2 only (__ldcg): the bytes were written by a peer after this SM may have cached
// an older copy of the line in an earlier call.
template <int VEC>
__device__ __forceinline__ void load_codes(const uint8_t* src, int bits, uint8_t* codes) {
  if (bits == 8) {
    if constexpr (VEC == 4) {
      const uint32_t w = __ldcg(reinterpret_cast<const unsigned int*>(src));
#pragma unroll
      for (int k = 0; k < 4; ++k) codes[k] = static_cast<uint8_t>(w >> (8 * k));
    } else if constexpr (VEC == 2) {
      const uint16_t w = __ldcg(reinterpret_cast<const unsigned short*>(src));
      codes[0] = static_cast<uint8_t>(w);
      codes[1] = static_cast<uint8_t>(w >> 8);
    } else {
      codes[0] = __ldcg(reinterpret_cast<const unsigned char*>(src));
    }
  } else {
    if constexpr (VEC == 4) {
      const uint16_t w = __ldcg(reinterpret_cast<const unsigned short*>(src));
#pragma unroll
      for (int k = 0; k < 4; ++k) codes[k] = static_cast<uint8_t>((w >> (4 * k)) & 0xF);
    } else if constexpr (VEC == 2) {
      const uint8_t w = __ldcg(reinterpret_cast<const unsigned char*>(src));
      codes[0] = w & 0xF;
      codes[1] = w >> 4;
    }
  }
}

__device__ __forceinline__ DequantParams load_dequant_params(const uint16_t* params, int bits,
                                                             int policy) {
  uint16_t p[2];
  p[0] = __ldcg(reinterpret_cast<const unsigned short*>(params));
  p[1] = policy == kPolicySym ? 0 : __ldcg(reinterpret_cast<const unsigned short*>(params + 1));
  return dequant_params(p, bits, policy);
}

}  // namespace cuda
}  // namespace echo

#endif  // ECHO_JAX_FFI_ECHO_CUDA_CUH_
