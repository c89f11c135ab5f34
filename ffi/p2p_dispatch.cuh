// Which kernel instance serves a call: the fast stages where g, the policy and the alignment
// allow (their instances live in p2p_fast_<dtype>.cu, p2p_instances.cuh), else the generic ones
// (instantiated here); then the checks of a call's attributes and of its group's health.
// Included by p2p_cuda.cu.
#ifndef ECHO_JAX_FFI_P2P_DISPATCH_CUH_
#define ECHO_JAX_FFI_P2P_DISPATCH_CUH_

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "fast_io.cuh"
#include "p2p_generic.cuh"
#include "p2p_groups.cuh"
#include "p2p_instances.cuh"
#include "quant_fast.cuh"
#include "p2p_pipeline.cuh"
#include "xla/ffi/api/ffi.h"


namespace echo {
namespace cuda {
namespace {

// The generic instance for a call (any g; rotated or not).
template <typename T, bool COMP, bool UPDATE>
void (*generic_kernel(const CallAttrs& at))(KernelArgs) {
  if (at.rotate) return echo_allreduce_kernel<RotatedGenericStages<T, COMP, UPDATE>, T>;
  return at.g % 4 == 0   ? echo_allreduce_kernel<GenericStages<T, 4, COMP, UPDATE>, T>
         : at.g % 2 == 0 ? echo_allreduce_kernel<GenericStages<T, 2, COMP, UPDATE>, T>
                         : echo_allreduce_kernel<GenericStages<T, 1, COMP, UPDATE>, T>;
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Whether the int8 state's stages may fold the coefficients into the state's scales
// (FastStages::folded_scale): each of eta a, eta (1 - a), beta1, beta2 0 or in [2^-20, 1].
bool state_coefficients_fold(const CompCoeffs& k) {
  for (const float c : {k.ea, k.eb, k.b1, k.b2})
    if (!(c == 0.0f || (c >= 0x1p-20f && c <= 1.0f))) return false;
  return true;
}

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
    kernel = fast_kernel_of<T>(at, COMP);  // compiled in its own unit (p2p_instances.cuh)
  }
  if (at.residual_local && (!at.state_q8 || kernel == nullptr)) {
    // The local residual is formed where the fast int8 / int4-state stages quantize; the
    // generic stages and the other states' instances have no such update.
    return ffi::Error::InvalidArgument(
        "echo_jax p2p (CUDA): the local residual (attribute residual_local = 1, "
        "EchoConfig.residual='local') runs in the fast stages with the int8 or int4 state only: "
        "state_dtype='int8' or 'int4', group_size " + std::to_string(kStateGroup) +
        ", rotation 'none', 16-byte aligned x, y, m1, m2 and ECHO_JAX_GENERIC_QUANT unset; got "
        "group_size " + std::to_string(at.g) + (at.state_q8 ? "" : " and a float state") +
        " (use residual='output' otherwise)");
  }
  if (ECHO_P2P_FOLD_STATE_SCALE && at.state_q8 && !state_coefficients_fold(at.k)) {
    // EchoConfig refuses such coefficients with the quantized states first (state_dtype's docs).
    return ffi::Error::InvalidArgument(
        std::string("echo_jax p2p (CUDA): the ") + (at.state_q4 ? "int4" : "int8") +
        " state needs each of eta * blend, eta * (1 - blend), "
        "beta1 and beta2 to be 0 or at least 2^-20 (they multiply the state's scales exactly); "
        "got " + std::to_string(at.k.ea) + ", " + std::to_string(at.k.eb) + ", " +
        std::to_string(at.k.b1) + ", " + std::to_string(at.k.b2) +
        " (use state_dtype='bfloat16' otherwise)");
  }
  if (kernel == nullptr && at.state_q8) {  // the generic stages take no int8 / int4 state
    return ffi::Error::InvalidArgument(
        std::string("echo_jax p2p (CUDA): the ") + (at.state_q4 ? "int4" : "int8") +
        " state runs in the fast stages only: group_size " + std::to_string(kStateGroup) +
        ", the update in the call, 16-byte aligned x, y, m1, m2 (virtual ranks: a row of n "
        "values with n a multiple of " + (at.state_q4 ? "32" : "16") + ") and "
        "ECHO_JAX_GENERIC_QUANT unset; got group_size " + std::to_string(at.g) +
        " (use state_dtype='bfloat16' otherwise)");
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

}  // namespace
}  // namespace cuda
}  // namespace echo

#endif  // ECHO_JAX_FFI_P2P_DISPATCH_CUH_
