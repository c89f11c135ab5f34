// The Echo all-reduce as a CUDA XLA FFI custom call (the Echo paper Sec. 4, 5.3 and App. C).
//
// One fused kernel per rank and call runs the four stages of the protocol over tiles of the
// segments, so the quantization of one tile overlaps the NVLink writes of others:
//   push    quantize tile t of segment j (j != me) and write codes + 16-bit parameters (bf16
//           scale, fp16 zero-point) straight into owner j's receive slot for this rank, then
//           raise j's push flag (me, t) to `base`;
//   reduce  wait until every peer's push flag (r, t) reached `base`, add the P-1 dequantized copies
//           and the own full-precision tile in fp32 in rank order 0..P-1, quantize the sum once;
//   gather  write that code into every rank's gather slot for this owner, raise each peer's gather
//           flag (me, t) to `base + 2`, dequantize it for the own output;
//   tail    wait for gather flag (j, t) >= base + 2 and dequantize owner j's code.
// The compensator (Algorithm 1) is fused: the entry loads apply x' = x + c in registers (x' never
// goes to memory) and the update of m1/m2 runs where y is produced (reduce for the own segment,
// tail for the others), overlapped with the transfers of the other tiles, in place. The state
// is fp32 or bf16 (EchoConfig.state_dtype; KernelArgs::state_bf16): a bf16 m1, m2 is widened on
// load and the fp32 update rounded to nearest even on store, the bits of echo_jax.compensator;
// or int8 codes with a scale a 128 values (the fast stages with g = 128 only): read as code times
// scale, and a group's scale and codes set where its new values are (FastStages::kStateQ8); or
// int4 codes packed two a byte, the same way, with the local residual only (kStateQ4).
// The rescaling's factor (Sec. 5.4; an f32[1] operand, 1 when not rescaled) multiplies x' in the
// entry loads and divides y before its store and the state update (exact powers of two).
// The Hadamard rotation (attribute rotate = 1; EchoConfig.rotation = "hadamard") rotates every
// group after the entry loads and the factor (the own contribution in the reduce stage too) and
// rotates the decoded sum back before the factor is divided out, the output and the update:
// push, reduce and gather run in the rotated basis, the state stays in the original one. The
// reference is echo_jax.transports.xla.rotated_allreduce, bit for bit.
//
// Readiness crosses GPUs through flags in the receiver's memory: monotonic 64-bit words raised to
// a per-call base that the host increases by 3 per call (push = base, gather = base + 2; the
// reduce stage, base + 1 in the paper's four-stream schedule, runs in the same block as gather
// here and needs no flag). A flag left from an earlier call is below every value the current call
// polls for, so nothing is ever cleared and the host never waits on the readiness path.
//
// Slot reuse needs no extra flag either: a rank starts call c+1 only after its kernel of call c
// ended, which required every owner's gather of call c, which in turn required that owner to have
// consumed all push slots of call c; and an owner writes a peer's gather slot of call c+1 only
// after that peer pushed for call c+1, i.e. after the peer finished reading its slots of call c.
//
// Kernel blocks are persistent (grid no larger than what is resident), because a block that polls
//
// The translation unit of the fused all-reduce's host side and generic kernels; its parts:
//   p2p_layout.cuh     constants, build switches, KernelArgs, CallAttrs, the workspace and its
//                      flags, the entry loads and output stores shared by every stage
//   p2p_generic.cuh    the generic stages (g, bits, policy at run time; rotated or not)
//   p2p_pipeline.cuh   one rank's pipeline over the tiles and the two kernels around it
//   p2p_groups.cuh     host side: groups of ranks, their workspaces, the schedule cache, launch
//   p2p_instances.cuh  the lookup of the fast stages' instances (p2p_fast.cuh: G, BITS
//                      compile-time; the quantizer of quant_fast.cuh), compiled in units of
//                      their own, one a dtype (p2p_fast_f32.cu, p2p_fast_bf16.cu, p2p_fast_f16.cu)
//   p2p_dispatch.cuh   which kernel instance serves a call, and the checks of its attributes
//   p2p_calls.cuh      the per-device call (one rank per GPU) and the virtual-rank call
// and below, the handler bindings (attributes: the table of ffi/echo_attrs.h).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#include "echo_attrs.h"
#include "ffi_helpers.h"
#include "p2p_layout.cuh"
#include "p2p_generic.cuh"
#include "p2p_pipeline.cuh"
#include "p2p_groups.cuh"
#include "p2p_dispatch.cuh"
#include "p2p_calls.cuh"
#include "xla/ffi/api/ffi.h"

namespace echo {
namespace cuda {
namespace {

constexpr const char* kWhere = "p2p (CUDA)";  // errors read "echo_jax p2p (CUDA): ..."

// The launch view of a call's attributes: the shared table (ffi/echo_attrs.h) and the factor.
ffi::ErrorOr<CallAttrs> read_attrs(const Dictionary_Type& attrs, Coefficients which,
                                   const F32Buffer_Type& factor) {
  ECHO_FFI_ASSIGN_OR_RETURN(const AllReduceAttrs a, ParseAllReduceAttrs(attrs, which, kWhere));
  CallAttrs at{static_cast<int>(a.bits), static_cast<int>(a.group_size),
               static_cast<int>(a.policy), static_cast<int>(a.num_ranks),
               std::max<int64_t>(1, a.timeout_ms), a.rotate, a.k,
               factor.element_count() == 1 ? factor.typed_data() : nullptr, false, true};
  at.residual_local = a.residual_local != 0;
  return at;
}

// Where a call's ranks are: one a GPU, inside shard_map (attribute groups: the device ordinals of
// every group, P a group), or the P virtual ranks of a [P, n] operand on XLA's GPU (the
// uncompensated call's attribute absent_rank: -1, or a rank left out by the tests of the timeout).
enum class Ranks { kDevice, kVirtual };

template <Ranks R>
ffi::Error run_call(cudaStream_t stream, const Dictionary_Type& attrs, Coefficients which,
                    ffi::AnyBuffer x, std::optional<ffi::AnyBuffer> m1,
                    std::optional<ffi::AnyBuffer> m2, const F32Buffer_Type& factor,
                    ffi::Result<ffi::AnyBuffer> y, void* m1_out, void* m2_out,
                    const StateScales* q = nullptr) {
  ECHO_FFI_ASSIGN_OR_RETURN(const CallAttrs at, read_attrs(attrs, which, factor));
  if constexpr (R == Ranks::kDevice) {
    ECHO_FFI_ASSIGN_OR_RETURN(const ffi::Span<const int64_t> groups,
                              GetAttr<ffi::Span<const int64_t>>(attrs, "groups", kWhere));
    return RankImpl(stream, x, m1, m2, y, m1_out, m2_out, at, groups, q);
  } else {
    int64_t absent_rank = -1;
    if (!m1.has_value()) {
      ECHO_FFI_ASSIGN_OR_RETURN(absent_rank, GetAttr<int64_t>(attrs, "absent_rank", kWhere));
    }
    return VirtualImpl(stream, x, m1, m2, y, m1_out, m2_out, at, static_cast<int>(absent_rank),
                       q);
  }
}

// The three calls, as ffi/echo_attrs.h binds their operands: uncompensated, compensated (the
// apply and update steps fused, m1, m2 updated in place) and applied (EchoConfig.state_update =
// "separate": the apply step alone, m1, m2 read only, the update its own op after the call).
template <Ranks R>
ffi::Error plain_call(cudaStream_t stream, ffi::AnyBuffer x, F32Buffer_Type factor,
                      ffi::Result<ffi::AnyBuffer> y, Dictionary_Type attrs) {
  return run_call<R>(stream, attrs, Coefficients::kNone, x, std::nullopt, std::nullopt, factor, y,
                     nullptr, nullptr);
}

template <Ranks R>
ffi::Error compensated_call(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer m1,
                            ffi::AnyBuffer m2, F32Buffer_Type factor,
                            ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> m1_out,
                            ffi::Result<ffi::AnyBuffer> m2_out, Dictionary_Type attrs) {
  return run_call<R>(stream, attrs, Coefficients::kAll, x, m1, m2, factor, y,
                     m1_out->untyped_data(), m2_out->untyped_data());
}

// The compensated call with the int8 or int4 state (EchoConfig.state_dtype = "int8" / "int4",
// told apart by the codes' element type, S8 / S4; the int4 state with the local residual only):
// m1, m2 are the codes with the f32 scales s1, s2, all four updated in place.
template <Ranks R>
ffi::Error compensated_q8_call(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer m1,
                               ffi::AnyBuffer s1, ffi::AnyBuffer m2, ffi::AnyBuffer s2,
                               F32Buffer_Type factor, ffi::Result<ffi::AnyBuffer> y,
                               ffi::Result<ffi::AnyBuffer> m1_out,
                               ffi::Result<ffi::AnyBuffer> s1_out,
                               ffi::Result<ffi::AnyBuffer> m2_out,
                               ffi::Result<ffi::AnyBuffer> s2_out, Dictionary_Type attrs) {
  const StateScales q{s1, s2, static_cast<float*>(s1_out->untyped_data()),
                      static_cast<float*>(s2_out->untyped_data())};
  return run_call<R>(stream, attrs, Coefficients::kAll, x, m1, m2, factor, y,
                     m1_out->untyped_data(), m2_out->untyped_data(), &q);
}

template <Ranks R>
ffi::Error applied_call(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer m1,
                        ffi::AnyBuffer m2, F32Buffer_Type factor, ffi::Result<ffi::AnyBuffer> y,
                        Dictionary_Type attrs) {
  return run_call<R>(stream, attrs, Coefficients::kApply, x, m1, m2, factor, y, nullptr, nullptr);
}

// XLA's compute stream of the device (virtual ranks: forked to P rank streams), then the operands.
template <CallState S>
auto bind_call() {
  return BindAllReduce<S, void>(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>());
}

}  // namespace
}  // namespace cuda
}  // namespace echo

// ---- handler bindings (C symbols, wrapped into capsules by ffi/module_cuda.cc) ----------------

// One call's two symbols: echo_allreduce_<name>cuda (a rank a GPU) and
// echo_allreduce_virtual_<name>cuda (virtual ranks), e.g. echo_allreduce_comp_cuda.
#define ECHO_CUDA_HANDLERS(name, call, state)                                                \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(echo_allreduce_##name##cuda,                                 \
                                echo::cuda::call<echo::cuda::Ranks::kDevice>,                \
                                echo::cuda::bind_call<echo::CallState::state>());            \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(echo_allreduce_virtual_##name##cuda,                         \
                                echo::cuda::call<echo::cuda::Ranks::kVirtual>,               \
                                echo::cuda::bind_call<echo::CallState::state>())

ECHO_CUDA_HANDLERS(, plain_call, kNone);
ECHO_CUDA_HANDLERS(comp_, compensated_call, kCompensated);
ECHO_CUDA_HANDLERS(applied_, applied_call, kApplied);
ECHO_CUDA_HANDLERS(comp_q8_, compensated_q8_call, kCompensatedQ8);
