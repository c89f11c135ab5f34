// The attributes of the Echo all-reduce custom calls: one table for every handler binding (the
// CPU handler, ffi/echo_allreduce_cpu.cc, and the CUDA handlers, ffi/p2p_cuda.cu), read from the
// call's attribute dictionary by one parser. The Python declarations that write them are
// echo_jax/transports/cpu.py and echo_jax/transports/cuda.py.
//
// The bindings take the whole dictionary (`.Attrs()`), so a binding lists its operands and
// results only; what is particular to one side (the CPU handler's call site and test hooks, the
// CUDA handlers' device groups) is read from the same dictionary next to this table, and each
// side checks the ranges it supports (the CUDA handlers serve at most kMaxCudaRanks ranks).
#ifndef ECHO_JAX_FFI_ECHO_ATTRS_H_
#define ECHO_JAX_FFI_ECHO_ATTRS_H_

#include <cstdint>
#include <string_view>
#include <type_traits>
#include <utility>

#include "echo_common.h"
#include "ffi_helpers.h"

namespace echo {

// X(type, name, meaning): the wire format, which the standalone quantizer's calls take alone
// (ffi/quant_cuda.cu, BindFormatAttrs below) ...
#define ECHO_FORMAT_ATTRS(X)                                    \
  X(int64_t, bits, "4 or 8")                                    \
  X(int64_t, group_size, "g, values of one quantization group") \
  X(int64_t, policy, "0 asym, 1 sym, 2 asym_naive")
// ... and the format and the group of every all-reduce call.
#define ECHO_ALLREDUCE_ATTRS(X)                                           \
  ECHO_FORMAT_ATTRS(X)                                                    \
  X(int64_t, num_ranks, "P, the ranks of the group")                      \
  X(int64_t, timeout_ms, "the bound on every wait for a peer")            \
  X(int64_t, rotate, "1: the Hadamard rotation inside the call, 0: none")

// The compensator's coefficients (echo::CompCoeffs, the Echo paper Sec. 5.2, Algorithm 1): the
// apply step's two, which the applied call (EchoConfig.state_update = "separate") takes alone,
// and the update step's five, which the compensated call takes too.
#define ECHO_APPLY_ATTRS(X) \
  X(float, ea, "eta * a")   \
  X(float, eb, "eta * (1 - a)")
#define ECHO_UPDATE_ATTRS(X)    \
  X(float, b1, "beta1")         \
  X(float, c1, "1 - beta1")     \
  X(float, b2, "beta2")         \
  X(float, c2, "1 - beta2")     \
  X(float, inv_p, "f32(1 / P)")

// Which coefficients a call reads: none (uncompensated), the apply step's, or all seven.
enum class Coefficients { kNone, kApply, kAll };

struct AllReduceAttrs {
#define ECHO_ATTR_FIELD(type, name, meaning) type name;
  ECHO_ALLREDUCE_ATTRS(ECHO_ATTR_FIELD)
#undef ECHO_ATTR_FIELD
  CompCoeffs k;  // those not read: 0, and inv_p = f32(1 / P)
  // With the update's coefficients: 1 when the averages take each rank's local rounding errors
  // (EchoConfig.residual = "local": x' - Q(x') where the call pushes, s - Q(s) on the owned
  // segment), 0 for the Echo paper's u = x' - y / P (Eq. 4).
  int64_t residual_local = 0;
};

// Reads the table's attributes (and the coefficients `which` asks for) with the errors of
// GetAttr: a missing attribute or one of the wrong type names itself. Ranges are the caller's.
inline ffi::ErrorOr<AllReduceAttrs> ParseAllReduceAttrs(const Dictionary_Type& attrs,
                                                        Coefficients which,
                                                        std::string_view where) {
  AllReduceAttrs a{};
  // One block a read: ECHO_FFI_ASSIGN_OR_RETURN declares a temporary named after the line.
#define ECHO_ATTR_READ(type, name, meaning) \
  { ECHO_FFI_ASSIGN_OR_RETURN(a.name, GetAttr<type>(attrs, #name, where)); }
#define ECHO_COEFF_READ(type, name, meaning) \
  { ECHO_FFI_ASSIGN_OR_RETURN(a.k.name, GetAttr<type>(attrs, #name, where)); }
  ECHO_ALLREDUCE_ATTRS(ECHO_ATTR_READ)
  a.k = CompCoeffs{0, 0, 0, 0, 0, 0, 1.0f / static_cast<float>(a.num_ranks)};
  if (which != Coefficients::kNone) {
    ECHO_APPLY_ATTRS(ECHO_COEFF_READ)
  }
  if (which == Coefficients::kAll) {
    ECHO_UPDATE_ATTRS(ECHO_COEFF_READ)
    ECHO_FFI_ASSIGN_OR_RETURN(a.residual_local, GetAttr<int64_t>(attrs, "residual_local", where));
  }
#undef ECHO_COEFF_READ
#undef ECHO_ATTR_READ
  return a;
}

// ---- the operands and results of a binding ---------------------------------------------------
// After each side's context (CPU: the device ordinal and the run id; CUDA: XLA's stream):
//   x        the contribution, f32 / bf16 / f16: [n] a rank, or [P, n] for virtual ranks
//   m1, m2   with a state: the compensator's averages, f32 or bf16, x's element count (the
//            compensated call's are aliased to m1_out, m2_out, the applied call's read only);
//            with the int8 state (kCompensatedQ8) each is two operands, the codes (int8, x's
//            element count) and their scales (f32, one a kStateGroup values): m1, s1, m2, s2
//   Coords   the CPU handler's int32 [2] = (rank, group id); none on CUDA (void)
//   factor   f32 [1], the rescaling's power of two (the Echo paper Sec. 5.4; 1: not rescaled),
//            applied after the apply step x + c
//   y        the sum, x's dtype and shape, the same on every rank
//   m1_out, m2_out  the compensated call's updated state, m1's dtype (int8: m1, s1, m2, s2)
// then every attribute as one dictionary (the table above and each side's own).
enum class CallState { kNone, kApplied, kCompensated, kCompensatedQ8 };

// (A Binding cannot be moved or copied, only extended: every step is one call on the last.)
namespace internal {
template <int kStateOut, typename Binding>
auto BindResults(Binding&& b) {
  if constexpr (kStateOut == 4) {
    return std::move(b).template Ret<Buffer_Type>().template Ret<Buffer_Type>()
        .template Ret<Buffer_Type>().template Ret<Buffer_Type>().template Ret<Buffer_Type>()
        .Attrs();
  } else if constexpr (kStateOut == 2) {
    return std::move(b).template Ret<Buffer_Type>().template Ret<Buffer_Type>()
        .template Ret<Buffer_Type>().Attrs();
  } else {
    return std::move(b).template Ret<Buffer_Type>().Attrs();
  }
}
template <typename Coords, int kStateOut, typename Binding>
auto BindFactorAndResults(Binding&& b) {
  if constexpr (std::is_void_v<Coords>) {
    return BindResults<kStateOut>(std::move(b).template Arg<F32Buffer_Type>());
  } else {
    return BindResults<kStateOut>(
        std::move(b).template Arg<Coords>().template Arg<F32Buffer_Type>());
  }
}
}  // namespace internal

template <CallState S, typename Coords, typename Binding>
auto BindAllReduce(Binding&& context) {
  // The state's results: none, m1 and m2, or the int8 state's codes and scales.
  constexpr int kStateOut =
      S == CallState::kCompensated ? 2 : S == CallState::kCompensatedQ8 ? 4 : 0;
  if constexpr (S == CallState::kNone) {
    return internal::BindFactorAndResults<Coords, kStateOut>(
        std::move(context).template Arg<Buffer_Type>());
  } else if constexpr (S == CallState::kCompensatedQ8) {
    return internal::BindFactorAndResults<Coords, kStateOut>(
        std::move(context).template Arg<Buffer_Type>().template Arg<Buffer_Type>()
            .template Arg<Buffer_Type>().template Arg<Buffer_Type>()
            .template Arg<Buffer_Type>());
  } else {
    return internal::BindFactorAndResults<Coords, kStateOut>(
        std::move(context).template Arg<Buffer_Type>().template Arg<Buffer_Type>()
            .template Arg<Buffer_Type>());
  }
}

// The format attributes as typed attributes of a binding (the quantizer's handlers take them as
// int64_t arguments bits, group_size, policy, in this order).
template <typename Binding>
auto BindFormatAttrs(Binding&& b) {
#define ECHO_ATTR_BIND(type, name, meaning) .template Attr<type>(#name)
  return std::move(b) ECHO_FORMAT_ATTRS(ECHO_ATTR_BIND);
#undef ECHO_ATTR_BIND
}

}  // namespace echo

#endif  // ECHO_JAX_FFI_ECHO_ATTRS_H_
