// nanobind module echo_jax._ffi_cuda: the capsules of the CUDA handlers (built only with nvcc).
#include <nanobind/nanobind.h>

#include "xla/ffi/api/c_api.h"

namespace nb = nanobind;

#ifndef ECHO_JAX_HEADERS_JAXLIB  // set by CMakeLists.txt: the jaxlib release of the FFI headers
#define ECHO_JAX_HEADERS_JAXLIB "unknown"
#endif
#ifndef ECHO_JAX_CUDA_VERSION  // set by CMakeLists.txt: the nvcc release that compiled the kernels
#define ECHO_JAX_CUDA_VERSION "unknown"
#endif
#ifndef ECHO_JAX_CUDA_ARCHITECTURES  // set by CMakeLists.txt: CMAKE_CUDA_ARCHITECTURES, comma-separated
#define ECHO_JAX_CUDA_ARCHITECTURES ""
#endif

extern "C" {
XLA_FFI_Error* echo_allreduce_cuda(XLA_FFI_CallFrame*);
XLA_FFI_Error* echo_allreduce_comp_cuda(XLA_FFI_CallFrame*);
XLA_FFI_Error* echo_allreduce_virtual_cuda(XLA_FFI_CallFrame*);
XLA_FFI_Error* echo_allreduce_virtual_comp_cuda(XLA_FFI_CallFrame*);
XLA_FFI_Error* echo_allreduce_applied_cuda(XLA_FFI_CallFrame*);
XLA_FFI_Error* echo_allreduce_virtual_applied_cuda(XLA_FFI_CallFrame*);
XLA_FFI_Error* echo_allreduce_comp_q8_cuda(XLA_FFI_CallFrame*);
XLA_FFI_Error* echo_allreduce_virtual_comp_q8_cuda(XLA_FFI_CallFrame*);
XLA_FFI_Error* echo_quantize_cuda(XLA_FFI_CallFrame*);
XLA_FFI_Error* echo_dequantize_cuda(XLA_FFI_CallFrame*);
XLA_FFI_Error* echo_state_update_cuda(XLA_FFI_CallFrame*);
}

template <typename F>
nb::capsule encapsulate(F* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

NB_MODULE(_ffi_cuda, m) {
  m.doc() = "CUDA XLA FFI handlers of the Echo all-reduce (see echo_jax/transports/cuda.py)";
  m.def("registrations", []() {
    nb::dict d;
    d["echo_allreduce_cuda"] = encapsulate(echo_allreduce_cuda);
    d["echo_allreduce_comp_cuda"] = encapsulate(echo_allreduce_comp_cuda);
    d["echo_allreduce_virtual_cuda"] = encapsulate(echo_allreduce_virtual_cuda);
    d["echo_allreduce_virtual_comp_cuda"] = encapsulate(echo_allreduce_virtual_comp_cuda);
    d["echo_allreduce_applied_cuda"] = encapsulate(echo_allreduce_applied_cuda);
    d["echo_allreduce_virtual_applied_cuda"] = encapsulate(echo_allreduce_virtual_applied_cuda);
    d["echo_allreduce_comp_q8_cuda"] = encapsulate(echo_allreduce_comp_q8_cuda);
    d["echo_allreduce_virtual_comp_q8_cuda"] = encapsulate(echo_allreduce_virtual_comp_q8_cuda);
    d["echo_quantize_cuda"] = encapsulate(echo_quantize_cuda);
    d["echo_dequantize_cuda"] = encapsulate(echo_dequantize_cuda);
    d["echo_state_update_cuda"] = encapsulate(echo_state_update_cuda);
    return d;
  });
  m.def("build_info", []() {
    nb::dict d;
    d["jaxlib"] = ECHO_JAX_HEADERS_JAXLIB;
    d["xla_ffi_api"] = nb::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR);
    d["cuda"] = ECHO_JAX_CUDA_VERSION;
    // CMake's spelling: "90a-real" is sm_90a machine code, "80-virtual" compute_80 PTX.
    d["cuda_architectures"] = ECHO_JAX_CUDA_ARCHITECTURES;
    return d;
  }, "What this module was compiled against: the XLA FFI headers (as echo_jax._ffi.build_info()), "
     "the CUDA release and the GPU architectures.");
}
