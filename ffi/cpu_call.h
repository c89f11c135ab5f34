// The CPU handler's description of a call (ffi/echo_allreduce_cpu.cc describes the protocol):
// its attributes parsed and validated into a CallConfig (the shared ones through
// ffi/echo_attrs.h), the checks of x and y, and where a rank stands (Coords). Included by
// echo_allreduce_cpu.cc only.
#ifndef ECHO_JAX_FFI_CPU_CALL_H_
#define ECHO_JAX_FFI_CPU_CALL_H_

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>

#include "echo_attrs.h"
#include "echo_common.h"
#include "ffi_helpers.h"
#include "xla/ffi/api/ffi.h"

namespace echo {
namespace cpu {
namespace {

constexpr const char* kWhere = "p2p all-reduce (CPU)";

using Clock = std::chrono::steady_clock;

// Stages of the test hook debug_failing_rank (echo_jax/transports/cpu.py `debug_failing_rank`).
constexpr int64_t kFailValidate = 0;  // the rank's validation fails, before it joins its group
constexpr int64_t kFailPush = 1;      // the rank fails in push, after it joined and wrote a slot
constexpr int64_t kFailTail = 2;      // the rank fails after its tail: its peers have its data

// -------------------------------------------------------------------------------------------
// Call description (attributes, validated).
// -------------------------------------------------------------------------------------------

struct CallConfig {
  ffi::DataType dtype;  // of x and y: F32, BF16 or F16 (the state m1, m2: see RankIO)
  int num_ranks;
  int bits;
  int group_size;
  int policy;
  int nparams;
  int64_t n;            // elements of x (unpadded)
  int64_t seg_groups;   // groups per segment (Gs)
  int64_t seg_elems;    // Gs * g
  int64_t code_bytes;   // bytes of codes per group
  size_t params_bytes;  // bytes of 16-bit group parameters per segment (slot prefix)
  size_t slot_bytes;    // params_bytes + Gs * code_bytes
  int64_t site;
  int64_t timeout_ms;
  int64_t absent_rank;  // test hook: this rank joins but never takes part (-1: none)
  int64_t failing_rank;   // test hook: this rank fails with `failure` (-1: none) ...
  int64_t failing_stage;  // ... in validation, in push or after its tail (kFail*)
  std::string failure;    // the cause it reports
  bool compensated;     // the apply step x' = x + c where x is loaded (m1, m2 operands)
  bool update;          // compensated: the update step too, where y is produced (m1_out, m2_out)
  bool rotate;          // the randomized Hadamard rotation of every group (attribute rotate)
  // update: the averages take this rank's local rounding errors (attribute residual_local,
  // EchoConfig.residual = "local"), updated where the call quantizes (push, reduce) instead of
  // from u = x' - y / P where y is produced.
  bool residual_local;
  float hadamard_f;     // fp32(1 / sqrt(g)) of the rotation (echo::hadamard_scale)
  echo::CompCoeffs k;
  uint64_t signature;   // hash of the shape and format, compared between the ranks of a call
};

// The dtypes of x and y: the contribution enters and the sum leaves the call in x's own dtype.
bool IsContributionType(ffi::DataType t) {
  return t == ffi::DataType::F32 || t == ffi::DataType::BF16 || t == ffi::DataType::F16;
}

size_t ElementBytes(ffi::DataType t) { return t == ffi::DataType::F32 ? 4 : 2; }

// The NumPy name of a dtype, for error messages.
std::string DTypeName(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::BF16: return "bfloat16";
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::F64: return "float64";
    case ffi::DataType::S4: return "int4";
    case ffi::DataType::S8: return "int8";
    case ffi::DataType::U8: return "uint8";
    case ffi::DataType::S32: return "int32";
    case ffi::DataType::S64: return "int64";
    case ffi::DataType::PRED: return "bool";
    default: return StrCat("XLA element type ", static_cast<int>(t));
  }
}

std::string ShapeText(ffi::Span<const int64_t> dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

// Checks the contribution x ([n] float32, bfloat16 or float16) and the sum y (x's dtype and n).
Error_Type CheckContribution(const Buffer_Type& x, const Result_Type& y) {
  ECHO_FFI_CHECK(IsContributionType(x.element_type()) && x.dimensions().size() == 1, kWhere,
                 "operand x must be a flat float32, bfloat16 or float16 array, got ",
                 DTypeName(x.element_type()), ShapeText(x.dimensions()),
                 "; pass jnp.ravel(x) (cast other dtypes to float32 first)");
  ECHO_FFI_CHECK(y->element_type() == x.element_type(), kWhere, "result y is ",
                 DTypeName(y->element_type()), " but operand x is ", DTypeName(x.element_type()),
                 ": the sum has x's dtype (echo_jax/transports/cpu.py declares it so)");
  ECHO_FFI_CHECK(y->element_count() == x.element_count(), kWhere, "result has ",
                 y->element_count(), " elements, operand x has ", x.element_count());
  return Error_Type::Success();
}

uint64_t Mix(uint64_t h, uint64_t v) {
  h ^= v + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
  return h;
}

// Reads and validates the attributes (limits documented in echo_jax/transports/cpu.py).
ffi::ErrorOr<CallConfig> ParseConfig(const Dictionary_Type& attrs, int64_t n, ffi::DataType dtype,
                                     bool compensated, bool update) {
  CallConfig c{};
  c.dtype = dtype;
  c.n = n;
  c.compensated = compensated;
  c.update = compensated && update;
  // The attributes every all-reduce binding shares (ffi/echo_attrs.h; the applied call passes
  // the compensated call's seven coefficients and uses two), then this handler's own.
  ECHO_FFI_ASSIGN_OR_RETURN(
      const echo::AllReduceAttrs at,
      echo::ParseAllReduceAttrs(attrs, compensated ? echo::Coefficients::kAll
                                                   : echo::Coefficients::kNone, kWhere));
  const int64_t num_ranks = at.num_ranks, bits = at.bits, g = at.group_size, policy = at.policy;
  ECHO_FFI_RETURN_IF_ERROR(CheckAttrInRange<int64_t>(
      num_ranks, "num_ranks", 1, echo::kMaxRanks, kWhere, "ranks in the group, the axis size P"));
  const std::string format = echo::format_error(bits, g, policy);
  ECHO_FFI_CHECK(format.empty(), kWhere, "attribute ", format);
  ECHO_FFI_ASSIGN_OR_RETURN(int64_t seg_groups,
                            GetAttr<int64_t>(attrs, "segment_groups", kWhere));
  // The wire layout of echo_jax.transports.base.segment_layout: ceil(ceil(max(n, 1) / g) / P).
  const int64_t groups = (std::max<int64_t>(n, 1) + g - 1) / g;
  const int64_t expect = (groups + num_ranks - 1) / num_ranks;
  ECHO_FFI_CHECK(seg_groups == expect, kWhere, "attribute 'segment_groups' is ", seg_groups,
                 " but n=", n, ", group_size=", g, ", num_ranks=", num_ranks, " need ", expect,
                 " (echo_jax.collective.segment_layout)");
  ECHO_FFI_CHECK(seg_groups * g <= echo::kMaxSegmentElems, kWhere, "a segment of ",
                 seg_groups * g, " elements (n=", n, ", P=", num_ranks,
                 ") exceeds the limit of 2^31-1; split the all-reduce");
  ECHO_FFI_ASSIGN_OR_RETURN(
      c.site, GetAttrInRange<int64_t>(attrs, "site", 0, INT64_MAX, kWhere, "call-site id"));
  c.timeout_ms = at.timeout_ms;
  ECHO_FFI_RETURN_IF_ERROR(CheckAttrInRange<int64_t>(c.timeout_ms, "timeout_ms", 1, 86400000,
                                                     kWhere, "wait limit in milliseconds"));
  ECHO_FFI_ASSIGN_OR_RETURN(
      c.absent_rank, GetAttrInRange<int64_t>(attrs, "debug_absent_rank", -1, num_ranks - 1,
                                             kWhere, "test hook, -1 normally"));
  ECHO_FFI_ASSIGN_OR_RETURN(
      c.failing_rank, GetAttrInRange<int64_t>(attrs, "debug_failing_rank", -1, num_ranks - 1,
                                              kWhere, "test hook, -1 normally"));
  ECHO_FFI_ASSIGN_OR_RETURN(
      c.failing_stage, GetAttrInRange<int64_t>(attrs, "debug_failing_stage", kFailValidate,
                                               kFailTail, kWhere, "test hook, 0 normally"));
  ECHO_FFI_ASSIGN_OR_RETURN(std::string_view failure,
                            GetAttr<std::string_view>(attrs, "debug_failure", kWhere));
  c.failure = std::string(failure);
  const int64_t rotate = at.rotate;
  ECHO_FFI_RETURN_IF_ERROR(CheckAttrInRange<int64_t>(
      rotate, "rotate", 0, 1, kWhere,
      "1: rotate every group by the randomized Hadamard matrix "
      "(EchoConfig.rotation='hadamard'), 0: no rotation"));
  ECHO_FFI_CHECK(rotate == 0 || (g & (g - 1)) == 0, kWhere, "attribute 'rotate' is 1 but "
                 "group_size=", g, " is not a power of two (one Hadamard block per group)");
  c.rotate = rotate == 1;
  // Read with the update's coefficients only (0 for the uncompensated call). The local residual
  // is each rank's rounding error where it quantizes, in the basis the wire carries, so it needs
  // the unrotated protocol and a call that writes the state.
  ECHO_FFI_RETURN_IF_ERROR(CheckAttrInRange<int64_t>(
      at.residual_local, "residual_local", 0, 1, kWhere,
      "1: the averages take each rank's local rounding errors (EchoConfig.residual='local'), "
      "0: u = x' - y / P"));
  ECHO_FFI_CHECK(at.residual_local == 0 || c.update, kWhere,
                 "attribute 'residual_local' is 1 on the applied call, which does not update the "
                 "state (EchoConfig.state_update='separate'); pass residual_local=0 "
                 "(EchoConfig.residual='output'), or run the compensated call "
                 "(state_update='in_call')");
  ECHO_FFI_CHECK(at.residual_local == 0 || !c.rotate, kWhere,
                 "attribute 'residual_local' is 1 with rotate=1: the local residual is taken where "
                 "the call quantizes, which needs the unrotated protocol; pass rotate=0 "
                 "(EchoConfig.rotation='none') or residual_local=0 (EchoConfig.residual='output')");
  c.residual_local = at.residual_local == 1;
  c.hadamard_f = c.rotate ? echo::hadamard_scale(g) : 1.0f;
  c.k = at.k;
  c.num_ranks = static_cast<int>(num_ranks);
  c.bits = static_cast<int>(bits);
  c.group_size = static_cast<int>(g);
  c.policy = static_cast<int>(policy);
  c.nparams = echo::num_params(c.policy);
  c.seg_groups = seg_groups;
  c.seg_elems = seg_groups * g;
  c.code_bytes = echo::code_bytes(c.group_size, c.bits);
  c.params_bytes = static_cast<size_t>(seg_groups) * c.nparams * sizeof(uint16_t);
  c.slot_bytes = c.params_bytes + static_cast<size_t>(seg_groups * c.code_bytes);
  uint64_t h = 0x6563686F6A617821ull;  // "echojax!"
  for (uint64_t v : {static_cast<uint64_t>(n), static_cast<uint64_t>(num_ranks),
                     static_cast<uint64_t>(bits), static_cast<uint64_t>(g),
                     static_cast<uint64_t>(policy), static_cast<uint64_t>(compensated),
                     static_cast<uint64_t>(dtype), static_cast<uint64_t>(rotate),
                     static_cast<uint64_t>(c.update),
                     static_cast<uint64_t>(c.residual_local)}) {
    h = Mix(h, v);
  }
  c.signature = h;
  return c;
}

// Where this rank stands: from the coords operand and the FFI context.
struct Coords {
  int rank;
  int group;
  int32_t ordinal;
  int64_t run_id;
};

}  // namespace
}  // namespace cpu
}  // namespace echo

#endif  // ECHO_JAX_FFI_CPU_CALL_H_
