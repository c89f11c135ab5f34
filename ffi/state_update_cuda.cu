// The compensator's separate update (EchoConfig.state_update = "separate"; Algorithm 1 of the
// Echo paper, Eqs. 4, 10 and 11) as one pass over x, y, m1 and m2 on the GPU:
//
//   x' = x + ((eta a) m1 + (eta (1 - a)) m2)      Eq. 10, recomputed from x and the state read
//   u  = x' - y * f32(1 / P)                       Eq. 4
//   m1 = beta1 m1 + (1 - beta1) u                  Eq. 11, in place
//   m2 = beta2 m2 + (1 - beta2) u
//
// Why a kernel: the JAX reference (echo_jax.compensator.update_beside) keeps every rounded product
// apart from the addition that follows it with optimization barriers, which split XLA's fusion
// into several passes over the arrays; here each value is read once and each new average written
// once, with correctly rounded operations in the reference's order (__fmul_rn, __fadd_rn,
// __fsub_rn: never contracted into a fused multiply-add), so the bits are the reference's.
//
// x and y: float32, bfloat16 or float16 (widened exactly). m1, m2: float32, or bfloat16 widened
// exactly on load and rounded to nearest even on store (the reference's reduce_precision +
// convert).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "echo_cuda.cuh"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace echo {
namespace cuda {
namespace {

// The fp32 constants of Algorithm 1, each rounded once from float64 (compensator.Coefficients).
struct UpdateCoefficients {
  float ea, eb, b1, c1, b2, c2, inv_p;
};

// One value: the arithmetic of compensator.apply_correction + update_state, operation by
// operation (to_f32 / from_f32 of echo_cuda.cuh: exact widening, round to nearest even).
template <typename S>
__device__ __forceinline__ void update_one(float x, float y, S& m1, S& m2,
                                           const UpdateCoefficients& k) {
  const float a1 = to_f32(m1), a2 = to_f32(m2);
  const float xp = __fadd_rn(x, __fadd_rn(__fmul_rn(k.ea, a1), __fmul_rn(k.eb, a2)));
  const float u = __fsub_rn(xp, __fmul_rn(y, k.inv_p));
  m1 = from_f32<S>(__fadd_rn(__fmul_rn(k.b1, a1), __fmul_rn(k.c1, u)));
  m2 = from_f32<S>(__fadd_rn(__fmul_rn(k.b2, a2), __fmul_rn(k.c2, u)));
}

constexpr int kVec = 8;         // values a thread takes per step: 16-byte loads of 16-bit data
constexpr int kThreads = 256;
// Packs a thread loads before it updates any: with two, every load of a step (x, y, m1, m2 of
// two packs) is in flight at once, and the update runs at its byte floor where one pack a step
// did not (docs/gpu.md, "Build switches", has the times). A build switch
// (CUDA_FLAGS=-DECHO_UPDATE_PACKS=1 for the one-pack loop).
#ifndef ECHO_UPDATE_PACKS
#define ECHO_UPDATE_PACKS 2
#endif
constexpr int kPacks = ECHO_UPDATE_PACKS;

// kVec values held together, so that a step is a few 16-byte loads and stores (one for 16-bit
// data, two for fp32).
template <typename T>
struct alignas(16) Pack16 {
  T v[kVec];
};

// Grid-stride over packs of kVec values, then the last n % kVec values one by one. PACKED false
// (a buffer not 16-byte aligned): every value one by one.
template <typename T, typename S, bool PACKED>
__global__ void __launch_bounds__(kThreads)
    state_update_kernel(const T* __restrict__ x, const T* __restrict__ y, S* __restrict__ m1,
                        S* __restrict__ m2, int64_t n, UpdateCoefficients k) {
  if constexpr (!PACKED) {
    const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
         i += stride)
      update_one(to_f32(x[i]), to_f32(y[i]), m1[i], m2[i], k);
    return;
  }
  const int64_t packs = n / kVec;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t p0 = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; p0 < packs;
       p0 += stride * kPacks) {
    Pack16<T> xv[kPacks], yv[kPacks];
    Pack16<S> a[kPacks], b[kPacks];
#pragma unroll
    for (int i = 0; i < kPacks; ++i) {  // every load of the step in flight at once
      const int64_t p = p0 + i * stride;
      if (i == 0 || p < packs) {
        xv[i] = reinterpret_cast<const Pack16<T>*>(x)[p];
        yv[i] = reinterpret_cast<const Pack16<T>*>(y)[p];
        a[i] = reinterpret_cast<Pack16<S>*>(m1)[p];
        b[i] = reinterpret_cast<Pack16<S>*>(m2)[p];
      }
    }
#pragma unroll
    for (int i = 0; i < kPacks; ++i) {
      const int64_t p = p0 + i * stride;
      if (i > 0 && p >= packs) break;
#pragma unroll
      for (int j = 0; j < kVec; ++j)
        update_one(to_f32(xv[i].v[j]), to_f32(yv[i].v[j]), a[i].v[j], b[i].v[j], k);
      reinterpret_cast<Pack16<S>*>(m1)[p] = a[i];
      reinterpret_cast<Pack16<S>*>(m2)[p] = b[i];
    }
  }
  const int64_t tail = packs * kVec + blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (tail < n) update_one(to_f32(x[tail]), to_f32(y[tail]), m1[tail], m2[tail], k);
}

template <typename T, typename S>
cudaError_t launch(cudaStream_t stream, const void* x, const void* y, void* m1, void* m2,
                   int64_t n, const UpdateCoefficients& k) {
  if (n == 0) return cudaSuccess;
  // Enough blocks to fill every SM several times over; the grid-stride loop takes the rest.
  int device = 0, sms = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  const int64_t packs = (n + kVec - 1) / kVec;
  const int64_t wanted = (packs + kThreads - 1) / kThreads;
  const int blocks = static_cast<int>(wanted < 8LL * sms ? wanted : 8LL * sms);
  const bool packed = ((reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(y) |
                        reinterpret_cast<uintptr_t>(m1) | reinterpret_cast<uintptr_t>(m2)) &
                       15) == 0;
  auto kernel = packed ? state_update_kernel<T, S, true> : state_update_kernel<T, S, false>;
  kernel<<<blocks > 0 ? blocks : 1, kThreads, 0, stream>>>(
      static_cast<const T*>(x), static_cast<const T*>(y), static_cast<S*>(m1),
      static_cast<S*>(m2), n, k);
  return cudaGetLastError();
}

template <typename S>
cudaError_t launch_for_x(ffi::DataType xt, cudaStream_t stream, const void* x, const void* y,
                         void* m1, void* m2, int64_t n, const UpdateCoefficients& k) {
  switch (xt) {
    case ffi::DataType::F32: return launch<float, S>(stream, x, y, m1, m2, n, k);
    case ffi::DataType::BF16: return launch<__nv_bfloat16, S>(stream, x, y, m1, m2, n, k);
    default: return launch<__half, S>(stream, x, y, m1, m2, n, k);
  }
}

bool is_contribution_type(ffi::DataType t) {
  return t == ffi::DataType::F32 || t == ffi::DataType::BF16 || t == ffi::DataType::F16;
}

}  // namespace
}  // namespace cuda
}  // namespace echo

// m1_out, m2_out alias m1, m2 (input_output_aliases): the update runs in place.
static ffi::Error EchoStateUpdateCudaImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer y,
                                         ffi::AnyBuffer m1, ffi::AnyBuffer m2,
                                         ffi::Result<ffi::AnyBuffer> m1_out,
                                         ffi::Result<ffi::AnyBuffer> m2_out, float ea, float eb,
                                         float b1, float c1, float b2, float c2, float inv_p) {
  const std::string where = "echo_jax state update (CUDA): ";
  const ffi::DataType xt = x.element_type(), st = m1.element_type();
  if (!echo::cuda::is_contribution_type(xt) || y.element_type() != xt)
    return ffi::Error::InvalidArgument(
        where + "x and y must be float32, bfloat16 or float16 and of one dtype");
  if (m2.element_type() != st || (st != ffi::DataType::F32 && st != ffi::DataType::BF16))
    return ffi::Error::InvalidArgument(
        where + "m1 and m2 must be both float32 or both bfloat16 (EchoConfig.state_dtype)");
  const int64_t n = static_cast<int64_t>(x.element_count());
  if (static_cast<int64_t>(y.element_count()) != n ||
      static_cast<int64_t>(m1.element_count()) != n ||
      static_cast<int64_t>(m2.element_count()) != n)
    return ffi::Error::InvalidArgument(where + "x, y, m1 and m2 must have the same element count");
  void* o1 = m1_out->untyped_data();
  void* o2 = m2_out->untyped_data();
  if (o1 != m1.untyped_data() || o2 != m2.untyped_data())
    return ffi::Error::InvalidArgument(
        where + "m1, m2 must be updated in place (input_output_aliases={2: 0, 3: 1})");
  const echo::cuda::UpdateCoefficients k{ea, eb, b1, c1, b2, c2, inv_p};
  const cudaError_t e =
      st == ffi::DataType::F32
          ? echo::cuda::launch_for_x<float>(xt, stream, x.untyped_data(), y.untyped_data(), o1, o2,
                                            n, k)
          : echo::cuda::launch_for_x<__nv_bfloat16>(xt, stream, x.untyped_data(),
                                                    y.untyped_data(), o1, o2, n, k);
  if (e != cudaSuccess) return ffi::Error::Internal(where + cudaGetErrorString(e));
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    echo_state_update_cuda, EchoStateUpdateCudaImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's compute stream
        .Arg<ffi::AnyBuffer>()                     // x: this rank's contribution before correction
        .Arg<ffi::AnyBuffer>()                     // y: the all-reduce's result (x's dtype)
        .Arg<ffi::AnyBuffer>()                     // m1 (state dtype), updated in place
        .Arg<ffi::AnyBuffer>()                     // m2 (state dtype), updated in place
        .Ret<ffi::AnyBuffer>()                     // m1, aliased to the m1 operand
        .Ret<ffi::AnyBuffer>()                     // m2, aliased to the m2 operand
        .Attr<float>("ea")                         // eta * a
        .Attr<float>("eb")                         // eta * (1 - a)
        .Attr<float>("b1")                         // beta1
        .Attr<float>("c1")                         // 1 - beta1
        .Attr<float>("b2")                         // beta2
        .Attr<float>("c2")                         // 1 - beta2
        .Attr<float>("inv_p"));                    // f32(1 / P)
