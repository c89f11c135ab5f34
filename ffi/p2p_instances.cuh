// The fast stages' kernel instances (p2p_fast.cuh: dtype, G, BITS, compensated, rotated, state
// type, update), one translation unit a contribution dtype (p2p_fast_f32.cu, p2p_fast_bf16.cu,
// p2p_fast_f16.cu), so that the build compiles them in parallel: they are most of the module's
// kernels, and in one unit with the rest they were its longest compile. p2p_dispatch.cuh asks
// fast_kernel_of<T> for the instance that serves a call.
#ifndef ECHO_JAX_FFI_P2P_INSTANCES_CUH_
#define ECHO_JAX_FFI_P2P_INSTANCES_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "p2p_layout.cuh"

namespace echo {
namespace cuda {

// The fast instance for a call with contribution dtype float / bf16 / fp16 (compensated or
// not), or nullptr where g, the bits or the state have none. Defined by ECHO_P2P_FAST_INSTANCES
// in the dtype's unit.
KernelFn fast_kernel_f32(const CallAttrs& at, bool compensated);
KernelFn fast_kernel_bf16(const CallAttrs& at, bool compensated);
KernelFn fast_kernel_f16(const CallAttrs& at, bool compensated);

template <typename T>
KernelFn fast_kernel_of(const CallAttrs& at, bool compensated) {
  if constexpr (std::is_same_v<T, float>) return fast_kernel_f32(at, compensated);
  else if constexpr (std::is_same_v<T, __nv_bfloat16>) return fast_kernel_bf16(at, compensated);
  else return fast_kernel_f16(at, compensated);
}

}  // namespace cuda
}  // namespace echo

#endif  // ECHO_JAX_FFI_P2P_INSTANCES_CUH_

// In a dtype's unit (ECHO_P2P_FAST_UNIT defined before the include): the templates that pick
// an instance, and the macro that instantiates them for the unit's dtype.
#if defined(ECHO_P2P_FAST_UNIT) && !defined(ECHO_JAX_FFI_P2P_INSTANCES_UNIT_)
#define ECHO_JAX_FFI_P2P_INSTANCES_UNIT_

#include "p2p_fast.cuh"
#include "p2p_pipeline.cuh"

namespace echo {
namespace cuda {
namespace {

// The fast kernel instance for (T, g, bits, COMP, ROT, state type S, UPDATE), or nullptr when g
// has none.
template <typename T, bool COMP, bool ROT, typename S, bool UPDATE, int BITS, int... Gs>
void (*fast_kernel_for(int g))(KernelArgs) {
  void (*kernel)(KernelArgs) = nullptr;
  ((g == Gs ? (kernel = kernel_of<FastStages<T, Gs, BITS, COMP, ROT, S, UPDATE>, T>(), true)
            : false) ||
   ...);
  return kernel;
}

// The int8 state's instance with the local residual (EchoConfig.residual = "local"): unrotated,
// g = kStateGroup; S = uint8_t: the int4 state's (packed codes).
template <typename T, int BITS, typename S = int8_t>
void (*fast_local_kernel(int g))(KernelArgs) {
  if (g != kStateGroup) return nullptr;
  return kernel_of<FastStages<T, kStateGroup, BITS, true, false, S, true, true>, T>();
}

template <typename T, bool COMP, bool ROT, typename S = float, bool UPDATE = COMP>
void (*fast_kernel_for_bits(int bits, int g))(KernelArgs) {
  return bits == 4 ? fast_kernel_for<T, COMP, ROT, S, UPDATE, 4, 32, 64, 128, 256>(g)
                   : fast_kernel_for<T, COMP, ROT, S, UPDATE, 8, 32, 64, 128, 256>(g);
}

// The fast instance of a compensated call for its state's type, rotated or not.
template <typename T, typename S, bool UPDATE>
void (*fast_compensated_kernel(const CallAttrs& at))(KernelArgs) {
  return at.rotate ? fast_kernel_for_bits<T, true, true, S, UPDATE>(at.bits, at.g)
                   : fast_kernel_for_bits<T, true, false, S, UPDATE>(at.bits, at.g);
}

// The fast instance of a compensated call with the int8 state: g = kStateGroup only (a wire
// group is a state group), the update in the call; nullptr otherwise. The int4 state
// (at.state_q4): the local residual's instances only.
template <typename T>
void (*fast_q8_kernel(const CallAttrs& at))(KernelArgs) {
  if (at.g != kStateGroup || !at.update) return nullptr;
  if (at.residual_local) {
    if (at.rotate) return nullptr;
    if (at.state_q4)
      return at.bits == 4 ? fast_local_kernel<T, 4, uint8_t>(at.g)
                          : fast_local_kernel<T, 8, uint8_t>(at.g);
    return at.bits == 4 ? fast_local_kernel<T, 4>(at.g) : fast_local_kernel<T, 8>(at.g);
  }
  if (at.state_q4) return nullptr;
  if (at.rotate)
    return at.bits == 4 ? fast_kernel_for<T, true, true, int8_t, true, 4, kStateGroup>(at.g)
                        : fast_kernel_for<T, true, true, int8_t, true, 8, kStateGroup>(at.g);
  return at.bits == 4 ? fast_kernel_for<T, true, false, int8_t, true, 4, kStateGroup>(at.g)
                      : fast_kernel_for<T, true, false, int8_t, true, 8, kStateGroup>(at.g);
}

// The fast instance for a call: rotated or not, and for a compensated call its state's type
// (only compensated calls have bf16-state instances) and whether it updates the state (the
// applied call does not).
template <typename T, bool COMP>
void (*fast_kernel_for_call(const CallAttrs& at))(KernelArgs) {
  if constexpr (COMP) {
    if (at.state_q8) return fast_q8_kernel<T>(at);
    if (at.state_bf16)
      return at.update ? fast_compensated_kernel<T, __nv_bfloat16, true>(at)
                       : fast_compensated_kernel<T, __nv_bfloat16, false>(at);
    return at.update ? fast_compensated_kernel<T, float, true>(at)
                     : fast_compensated_kernel<T, float, false>(at);
  }
  return at.rotate ? fast_kernel_for_bits<T, COMP, true>(at.bits, at.g)
                   : fast_kernel_for_bits<T, COMP, false>(at.bits, at.g);
}

}  // namespace
}  // namespace cuda
}  // namespace echo

// Defines fast_kernel_<name> for contribution dtype T (one unit each).
#define ECHO_P2P_FAST_INSTANCES(T, name)                                                \
  namespace echo {                                                                     \
  namespace cuda {                                                                     \
  KernelFn fast_kernel_##name(const CallAttrs& at, bool compensated) {                 \
    return compensated ? fast_kernel_for_call<T, true>(at) : fast_kernel_for_call<T, false>(at); \
  }                                                                                    \
  }                                                                                    \
  }

#endif  // ECHO_P2P_FAST_UNIT
