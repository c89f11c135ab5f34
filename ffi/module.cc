// nanobind module echo_jax._ffi: the Echo custom-call handlers as PyCapsules for
// jax.ffi.register_ffi_target (echo_jax/transports/cpu.py), plus small host utilities: the
// workspace registry's statistics and release, and the C++ quantizer (ffi/echo_common.h) on
// NumPy arrays, so that tests can compare it with the pure-JAX reference directly.

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include "echo_common.h"
#include "xla/ffi/api/c_api.h"
#include "xla/ffi/api/api.h"

namespace nb = nanobind;

#ifndef ECHO_JAX_HEADERS_JAXLIB  // set by CMakeLists.txt: the jaxlib release of the FFI headers
#define ECHO_JAX_HEADERS_JAXLIB "unknown"
#endif

// Handlers defined in ffi/echo_allreduce_cpu.cc.
XLA_FFI_DECLARE_HANDLER_SYMBOL(echo_allreduce_cpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(echo_allreduce_comp_cpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(echo_allreduce_applied_cpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(echo_allreduce_comp_q8_cpu);

// (The CUDA handlers live in a second module, echo_jax._ffi_cuda: ffi/module_cuda.cc.)

namespace echo {
namespace cpu {
void GetCpuRegistryStats(int64_t* workspaces, int64_t* pending_joins, int64_t* cached_bindings);
void ReleaseCpuWorkspaces();
}  // namespace cpu
}  // namespace echo

namespace {

template <typename T>
nb::capsule EncapsulateFfiHandler(T* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, T, XLA_FFI_CallFrame*>,
                "Encapsulated function must be an XLA FFI handler");
  return nb::capsule(reinterpret_cast<void*>(fn));
}

void CheckFormat(int64_t group_size, int bits, int policy) {
  const std::string err = echo::format_error(bits, group_size, policy);
  if (!err.empty()) throw nb::value_error(err.c_str());
}

// Optionally runs the host utilities with subnormals flushed (x86 MXCSR FTZ | DAZ), the
// floating-point environment XLA:CPU executes its kernels in; the custom-call handlers replay the
// environment of the XLA thread that called them, so they need no such switch.
class ScopedFlushDenormals {
 public:
  explicit ScopedFlushDenormals(bool on) {
#if defined(__x86_64__) || defined(_M_X64)
    if (on) {
      saved_ = _mm_getcsr();
      _mm_setcsr(saved_ | 0x8040u);
      active_ = true;
    }
#else
    (void)on;
#endif
  }
  ~ScopedFlushDenormals() {
#if defined(__x86_64__) || defined(_M_X64)
    if (active_) _mm_setcsr(saved_);
#endif
  }

 private:
  unsigned int saved_ = 0;
  bool active_ = false;
};

template <typename T>
nb::ndarray<nb::numpy, T, nb::ndim<2>> NewArray(size_t rows, size_t cols) {
  T* data = new T[rows * cols == 0 ? 1 : rows * cols]();
  nb::capsule owner(data, [](void* p) noexcept { delete[] static_cast<T*>(p); });
  return nb::ndarray<nb::numpy, T, nb::ndim<2>>(data, {rows, cols}, owner);
}

using F32In = nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using U8In = nb::ndarray<const uint8_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using U16In = nb::ndarray<const uint16_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using U32In1 = nb::ndarray<const uint32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

}  // namespace

NB_MODULE(_ffi, m) {
  m.doc() = "Echo custom-call handlers (XLA FFI) and host utilities; used by echo_jax.p2p.";

  m.def(
      "registrations",
      []() {
        nb::dict d;
        d["echo_allreduce_cpu"] = EncapsulateFfiHandler(echo_allreduce_cpu);
        d["echo_allreduce_comp_cpu"] = EncapsulateFfiHandler(echo_allreduce_comp_cpu);
        d["echo_allreduce_applied_cpu"] = EncapsulateFfiHandler(echo_allreduce_applied_cpu);
        d["echo_allreduce_comp_q8_cpu"] = EncapsulateFfiHandler(echo_allreduce_comp_q8_cpu);
        return d;
      },
      "FFI target name -> handler capsule of the CPU handlers (platform 'cpu').");

  m.def(
      "build_info",
      []() {
        nb::dict d;
        d["jaxlib"] = ECHO_JAX_HEADERS_JAXLIB;
        d["xla_ffi_api"] = nb::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR);
        return d;
      },
      "The XLA FFI headers this module was compiled against: {'jaxlib': the jaxlib release they "
      "came from ('unknown' when the build did not say), 'xla_ffi_api': (major, minor)}.");

  m.def(
      "platforms", []() { return nb::make_tuple("cpu"); },
      "Platforms this module has handlers for: ('cpu',). The CUDA handlers are built as the "
      "separate module echo_jax._ffi_cuda (echo_jax.p2p_cuda) when nvcc is found.");

  m.def(
      "registry_stats",
      []() {
        int64_t workspaces = 0, joins = 0, bindings = 0;
        echo::cpu::GetCpuRegistryStats(&workspaces, &joins, &bindings);
        nb::dict d;
        d["workspaces"] = workspaces;
        d["pending_joins"] = joins;
        d["cached_bindings"] = bindings;
        return d;
      },
      "Counts of the CPU handler's persistent workspaces, joins in flight and per-device "
      "bindings.");

  m.def("release_workspaces", &echo::cpu::ReleaseCpuWorkspaces,
        "Forget the CPU handler's persistent workspaces. Call only while no Echo computation runs.");

  m.def(
      "quantize_groups",
      [](F32In x, int bits, int policy, bool flush_denormals) {
        const size_t rows = x.shape(0), g = x.shape(1);
        CheckFormat(static_cast<int64_t>(g), bits, policy);
        ScopedFlushDenormals fp_env(flush_denormals);
        const size_t cb = static_cast<size_t>(echo::code_bytes(static_cast<int>(g), bits));
        const size_t np = static_cast<size_t>(echo::num_params(policy));
        auto packed = NewArray<uint8_t>(rows, cb);
        auto params = NewArray<uint16_t>(rows, np);
        for (size_t i = 0; i < rows; ++i) {
          echo::quantize_group(x.data() + i * g, static_cast<int>(g), bits, policy,
                               packed.data() + i * cb, params.data() + i * np);
        }
        return nb::make_tuple(packed, params);
      },
      nb::arg("x"), nb::arg("bits"), nb::arg("policy"), nb::arg("flush_denormals") = false,
      "C++ quantizer on fp32 [G, g] -> (packed uint8 [G, g*bits/8], fp16 bits uint16 [G, 1|2]); "
      "flush_denormals=True computes like XLA:CPU (subnormal fp32 treated as zero).");

  m.def(
      "dequantize_groups",
      [](U8In packed, U16In params, int group_size, int bits, int policy, bool flush_denormals) {
        CheckFormat(group_size, bits, policy);
        ScopedFlushDenormals fp_env(flush_denormals);
        const size_t rows = packed.shape(0);
        const size_t cb = static_cast<size_t>(echo::code_bytes(group_size, bits));
        const size_t np = static_cast<size_t>(echo::num_params(policy));
        if (packed.shape(1) != cb || params.shape(0) != rows || params.shape(1) != np) {
          throw nb::value_error("packed must be [G, g*bits/8] and params [G, 1 (sym) or 2]");
        }
        auto out = NewArray<float>(rows, static_cast<size_t>(group_size));
        for (size_t i = 0; i < rows; ++i) {
          echo::dequantize_group(packed.data() + i * cb, params.data() + i * np, group_size, bits,
                                 policy, out.data() + i * group_size);
        }
        return out;
      },
      nb::arg("packed"), nb::arg("params"), nb::arg("group_size"), nb::arg("bits"),
      nb::arg("policy"), nb::arg("flush_denormals") = false,
      "C++ dequantizer, the inverse of quantize_groups: fp32 [G, g].");

  m.def(
      "f32_to_f16_bits",
      [](U32In1 bits) {
        const size_t n = bits.shape(0);
        auto out = NewArray<uint16_t>(1, n);
        for (size_t i = 0; i < n; ++i) {
          out.data()[i] = echo::f32_to_f16(echo::f32_from_bits(bits.data()[i]));
        }
        return out;
      },
      nb::arg("bits"), "Software fp32 -> fp16 (round to nearest even) on uint32 bit patterns.");

  m.def(
      "f32_to_bf16_bits",
      [](U32In1 bits) {
        const size_t n = bits.shape(0);
        auto out = NewArray<uint16_t>(1, n);
        for (size_t i = 0; i < n; ++i) {
          out.data()[i] = echo::f32_to_bf16(echo::f32_from_bits(bits.data()[i]));
        }
        return out;
      },
      nb::arg("bits"),
      "Software fp32 -> bf16 (round to nearest even, the CPU handler's store of a bfloat16 sum) "
      "on uint32 bit patterns.");
}
