// Standalone CUDA quantize / dequantize of the Echo wire format (echo_jax/quant.py), one warp per
// group. The all-reduce kernel (p2p_cuda.cu) uses the same device helpers; these handlers let the
// GPU tests compare the kernels with the pure-JAX reference bit for bit and let the benchmarks
// measure the quantizer's throughput against the device's copy bandwidth.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "echo_common.h"
#include "echo_cuda.cuh"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace echo {
namespace cuda {
namespace {

constexpr int kQuantThreads = 256;
constexpr int kRegChunks = 4;  // value chunks per lane kept in registers between the passes

// x [G*g] (T) -> packed [G, g*bits/8] (u8), params [G, np] (u16 holding fp16 bits).
template <typename T, int VEC>
__global__ void __launch_bounds__(kQuantThreads)
    quantize_kernel(const T* x, int64_t groups, int g, int bits, int policy, uint8_t* packed,
                    uint16_t* params) {
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
      load_vec<T, VEC>(x, e0 + c * VEC, n, v);
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
        load_vec<T, VEC>(x, e0 + c * VEC, n, v);
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
                      int bits, int policy, float* y) {
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
      store_vec<float, VEC>(y, grp * g + c * VEC, n, v);
    }
  }
}

int grid_for(int64_t groups) {
  int device = 0, sms = 1;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  const int64_t warps_needed = groups;
  const int64_t blocks = (warps_needed + kQuantThreads / kWarp - 1) / (kQuantThreads / kWarp);
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(blocks, int64_t{sms} * 16)));
}

ffi::Error check(int64_t bits, int64_t g, int64_t policy) {
  if (bits != 4 && bits != 8)
    return ffi::Error::InvalidArgument("echo_jax quantize (CUDA): bits must be 4 or 8, got " +
                                       std::to_string(bits));
  if (g <= 0 || (bits == 4 && g % 2))
    return ffi::Error::InvalidArgument("echo_jax quantize (CUDA): bad group_size " +
                                       std::to_string(g));
  if (policy < 0 || policy > 2)
    return ffi::Error::InvalidArgument("echo_jax quantize (CUDA): bad policy code " +
                                       std::to_string(policy));
  return ffi::Error::Success();
}

template <typename T>
void launch_quantize(cudaStream_t s, const void* x, int64_t groups, int g, int bits, int policy,
                     uint8_t* packed, uint16_t* params) {
  const T* xt = static_cast<const T*>(x);
  const int grid = grid_for(groups);
  if (g % 4 == 0)
    quantize_kernel<T, 4><<<grid, kQuantThreads, 0, s>>>(xt, groups, g, bits, policy, packed, params);
  else if (g % 2 == 0)
    quantize_kernel<T, 2><<<grid, kQuantThreads, 0, s>>>(xt, groups, g, bits, policy, packed, params);
  else
    quantize_kernel<T, 1><<<grid, kQuantThreads, 0, s>>>(xt, groups, g, bits, policy, packed, params);
}

}  // namespace
}  // namespace cuda
}  // namespace echo

static ffi::Error EchoQuantizeCuda(cudaStream_t stream, ffi::AnyBuffer x,
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
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return ffi::Error::Internal(std::string("echo_jax quantize (CUDA): ") + cudaGetErrorString(e));
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    echo_quantize_cuda, EchoQuantizeCuda,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's compute stream
        .Arg<ffi::AnyBuffer>()                     // x: [G * g] values (f32/bf16/f16)
        .Ret<ffi::Buffer<ffi::U8>>()               // packed codes [G, g*bits/8]
        .Ret<ffi::Buffer<ffi::U16>>()              // fp16 parameters as bits [G, 1 or 2]
        .Attr<int64_t>("bits")                     // 4 or 8
        .Attr<int64_t>("group_size")               // g
        .Attr<int64_t>("policy"));                 // 0 asym, 1 sym, 2 asym_naive

static ffi::Error EchoDequantizeCuda(cudaStream_t stream, ffi::Buffer<ffi::U8> packed,
                                     ffi::Buffer<ffi::U16> params,
                                     ffi::Result<ffi::Buffer<ffi::F32>> y, int64_t bits,
                                     int64_t group_size, int64_t policy) {
  ffi::Error err = echo::cuda::check(bits, group_size, policy);
  if (err.failure()) return err;
  const int64_t groups = static_cast<int64_t>(y->element_count()) / group_size;
  const int g = static_cast<int>(group_size), b = static_cast<int>(bits), p = static_cast<int>(policy);
  if (g % 4 == 0)
    echo::cuda::dequantize_kernel<4><<<echo::cuda::grid_for(groups), echo::cuda::kQuantThreads, 0, stream>>>(
        packed.typed_data(), params.typed_data(), groups, g, b, p, y->typed_data());
  else if (g % 2 == 0)
    echo::cuda::dequantize_kernel<2><<<echo::cuda::grid_for(groups), echo::cuda::kQuantThreads, 0, stream>>>(
        packed.typed_data(), params.typed_data(), groups, g, b, p, y->typed_data());
  else
    echo::cuda::dequantize_kernel<1><<<echo::cuda::grid_for(groups), echo::cuda::kQuantThreads, 0, stream>>>(
        packed.typed_data(), params.typed_data(), groups, g, b, p, y->typed_data());
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return ffi::Error::Internal(std::string("echo_jax dequantize (CUDA): ") + cudaGetErrorString(e));
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    echo_dequantize_cuda, EchoDequantizeCuda,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's compute stream
        .Arg<ffi::Buffer<ffi::U8>>()               // packed codes [G, g*bits/8]
        .Arg<ffi::Buffer<ffi::U16>>()              // fp16 parameters as bits [G, 1 or 2]
        .Ret<ffi::Buffer<ffi::F32>>()              // y: [G * g] fp32
        .Attr<int64_t>("bits")
        .Attr<int64_t>("group_size")
        .Attr<int64_t>("policy"));
