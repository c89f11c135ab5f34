// The CPU handlers of the Echo custom call: the quantized all-reduce (paper Sec. 4, App. C) run
// by host threads, one per rank, over shared host memory.
//
// Inside jax.shard_map every rank of the reduced axis is one (fake) CPU device, and XLA runs each
// device's part of the execution on its own host thread(s); each rank's call of the handler runs
// the protocol on a thread of its own (see "Execution"), so the P ranks of a group work
// concurrently. They meet in a workspace shared by the group and run the protocol of the "xla"
// transport (echo_jax/transports/xla.py, its pure-JAX reference; both give the same bits):
//
//   push    rank i quantizes every segment j != i of its (compensated) contribution x' and writes
//           it into owner j's receive slot i;                       then publishes flag_i = base
//   reduce  owner j waits for flag_i >= base of every pusher i, dequantizes the P-1 copies, adds
//           them to its own full-precision segment in rank order 0..P-1, quantizes the sum once;
//                                                                    then publishes flag_j = base+1
//   gather  owner j writes that code into every peer's gather slot j;
//                                                                    then publishes flag_j = base+2
//           and dequantizes its own code into y (the compensated call also updates m1, m2 here)
//   tail    rank i waits for flag_j >= base+2 of every owner j, dequantizes their codes into y
//           (and updates the state of those segments).
//
// The applied call (EchoConfig.state_update = "separate") runs the compensated call's apply step
// where x is loaded and nothing else of the compensator: m1, m2 are read-only operands and y the
// only result; the update runs after it as its own op (echo_jax.compensator.update_beside).
//
// Dtypes: x and y are float32, bfloat16 or float16 (y in x's dtype), so a 16-bit contribution
// needs no fp32 copy in XLA around the call. Every load widens x to fp32 exactly, the protocol
// runs in fp32, and the final store rounds the fp32 sum to y's dtype to nearest even, bit for bit
// as XLA's convert does (ffi/echo_common.h): the bits of
// xla_allreduce(x.astype(f32)).astype(dtype). The compensated call's state m1, m2 is fp32 or
// bf16 (EchoConfig.state_dtype; widened exactly on load, the update in fp32 rounded to nearest
// even on store) and is updated with the fp32 sum, before its rounding.
//
// Local residual (attribute residual_local = 1, EchoConfig.residual = "local"; the compensated
// call only, without rotation): the averages take each rank's own rounding errors instead of
// u = x' - y / P (Eq. 4), and they are updated where the call quantizes rather than in the tail.
// In push, every group this rank quantizes is decoded again (as its owner will decode it) and
// u = x' f - D(Q(x' f)) updates the state of its elements; in reduce, the owned segment's
// u = s - D(Q(s)) with s the fp32 sum in rank order, against the code every rank decodes, after
// the own x' was loaded into the sum (its only read of the state). Both residuals are then
// divided by the factor f (exact); the tail stores y only. The reference, bit for bit, is
// echo_jax.transports.xla.xla_allreduce_local with compensator.update_with_residual.
//
// Rescaling (the Echo paper Sec. 5.4): the factor operand, a power of two shared by the ranks,
// multiplies x' (after the apply step) where it is loaded and divides the fp32 sum before it is
// stored and before the state update, so y and m1, m2 stay in x's units; both products are exact
// and a factor of 1 leaves every bit as it was (echo_jax.collective.xla_allreduce_scaled).
//
// Rotation (attribute rotate = 1, EchoConfig.rotation = "hadamard"): every group of g values of
// the padded layout that holds an element of x is rotated by the randomized Hadamard matrix
// (echo::hadamard_rotate_group, the bit-exact form of echo_jax/rotation.py) where it is loaded,
// after the apply step and the factor, with the padding positions of a last partial group at 0
// before the rotation (they become nonzero and are quantized and summed like the others); groups
// of pure padding stay 0, as the reference pads them after its rotation. The protocol then runs
// in the rotated basis unchanged, and every dequantized group of the sum is rotated back and
// divided by the factor before its first n values are stored and the state is updated (the state
// stays in the original basis). Bit for bit the reference is the pure-JAX rotation around the
// "xla" transport (echo_jax.transports.xla.rotated_allreduce): times the factor, pad to whole
// groups, rotate, xla_allreduce, unrotate, times 1 / factor, cut to n.
//
// Flags, epochs and slot reuse
// ----------------------------
// Every rank has one monotone readiness flag (an int64 on its own cache line). A rank's k-th call
// on a workspace uses base = 3k: push publishes base, reduce base+1, gather base+2, so no value is
// used twice in the life of the workspace and nothing is ever cleared; a consumer that reads a
// value of an earlier call sees a smaller number and keeps polling. Flags start at 2 ("call 0 has
// completed"). Stores are release, loads acquire, so the slot contents written before a store
// are visible to the thread that observes the flag.
//
// A rank can run ahead of its peers by at most one call (it cannot finish call k before every
// owner has gathered call k, and it cannot get past reduce of call k+1 before every peer has
// pushed call k+1). Two waits keep a fast rank from overwriting what a slow peer still reads:
//   * push slot [owner j][src i] of call k+1 is written only after flag_j >= 3(k+1) - 2 = 3k+1,
//     i.e. after owner j has finished reading its push slots of call k (its reduce);
//   * gather slot [dst i][owner j] of call k+1 is written by owner j only after it has seen
//     flag_i >= 3(k+1) (i pushed call k+1), and i pushes call k+1 only after its tail of call k
//     has read every gather slot: the final reads of the tail are covered by the next push.
// Because each slot is only (re)written when its reader is provably done with it, the writer owns
// the slot's allocation: it grows the slot (never shrinks it) right before writing when a call
// needs more room. Shapes may therefore change from call to call without any extra barrier; in
// steady state nothing is allocated.
//
// Which ranks meet: joining a workspace
// -------------------------------------
// The handler learns its rank and group id from an int32 operand computed in Python
// (lax.axis_index over the reduced axis and the indices over the other manual mesh axes), its
// device from the FFI context (DeviceOrdinal) and its execution from RunId (shared by all devices
// of one execution). The first call of a call site ("site", an attribute unique per traced call)
// in an execution joins: the P ranks of (run, site, group) exchange their device ordinals, and the
// workspace is looked up by (site, ordinal of every rank). The result is cached per (device, site)
// for the rest of the execution, so a jitted loop joins once. Keying by run and devices keeps
// apart executions that run at the same time on disjoint devices; keying by site keeps apart
// independent all-reduces of one program that XLA may run concurrently or in different orders on
// different devices. Executions on one device run one after another, so every rank of a workspace
// sees the same sequence of calls and the per-rank call counters (epochs) agree. Two clones of one
// site in one program (remat) are serialised per rank by a mutex; they compute the same values.
//
// Execution: the handlers are asynchronous (they return an ffi::Future). Each rank-call runs on a
// thread of a grow-on-demand pool, so XLA's own threads never block in Echo code; see "Asynchronous
// execution" below for why a blocking handler could deadlock when XLA issues independent calls
// in different orders on different devices.
//
// Failure: every wait spins (pause, then yield, then short sleeps) against a deadline (attribute
// timeout_ms, 10 s by default, ECHO_JAX_TIMEOUT_S in Python) and fails with DEADLINE_EXCEEDED
// naming the stage, the group, the rank and the peer it waited for. The workspace is then marked
// broken (peers still waiting abort at once) and dropped from the registry, so the next execution
// starts from a fresh one with consistent epochs.
//
// Poison: a rank that fails for a reason of its own does not leave its peers to time out. After
// it joined (an error inside its protocol, an exception such as std::bad_alloc, or a join error
// it detects itself) it poisons the workspace: the poison word (Workspace::broken_, stored with
// release after the reason and the failing rank are written under a mutex) is polled (acquire)
// by every wait, so peers abort within microseconds with "rank r of the group failed (...):
// <cause>", and the bindings of the execution keep the poisoned workspace, so the next calls of
// the same call site in that execution fail at once with it too. Before it joined (its operands
// or attributes fail validation, no thread could be started for it) it poisons the group's join
// entry instead, found by (execution, call site, group id, P): ranks waiting there are woken and
// ranks arriving later fail on arrival; the entry goes once every rank has failed or seen it.
// Not reported (the peers time out as for a rank that never arrives): a validation failure that
// leaves the group unknown (attribute num_ranks or site missing or out of range, a coords operand
// that is not a valid (rank, group id)), an operand of the wrong type or rank (XLA rejects the
// call before this handler runs), a crash of the process, and a device whose execution fails
// before it reaches the custom call.
//
// Tiling: the GPU pipeline splits segments into tiles so that quantization overlaps transfers;
// host threads gain nothing from that, so the CPU handler signals once per stage and rank.
//
// The handler's parts: cpu_call.h (the call's attributes and operands), cpu_workspace.h (the
// workspaces and the registry that joins ranks), cpu_protocol.h (one rank's protocol); here the
// asynchronous execution and the handler bindings.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cfenv>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <system_error>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "cpu_call.h"
#include "cpu_protocol.h"
#include "cpu_workspace.h"
#include "echo_attrs.h"
#include "echo_common.h"
#include "ffi_helpers.h"
#include "xla/ffi/api/ffi.h"

namespace echo {
namespace cpu {

// Host utilities exported to the nanobind module (ffi/module.cc declares them too).
void GetCpuRegistryStats(int64_t* workspaces, int64_t* pending_joins, int64_t* cached_bindings);
void ReleaseCpuWorkspaces();

namespace {

// -------------------------------------------------------------------------------------------
// Asynchronous execution.
//
// The handlers return an ffi::Future and run the protocol on a thread of their own. XLA's CPU
// runtime may run independent thunks of one program concurrently and in a different order on
// each device (and it runs each device's thunks on few threads); a handler that blocked XLA's
// thread while waiting for a peer could then wait for a call that its peer cannot start until
// some other call finishes: a deadlock. With asynchronous handlers XLA's threads never block in
// Echo code, every rank-call gets a thread as soon as XLA reaches it, and the ranks of each call
// meet no matter in which order the devices issue independent calls.
// -------------------------------------------------------------------------------------------

// Threads that grow on demand: a submitted task never waits behind a task that may block on it.
class TaskRunner {
 public:
  // Returns false (and drops the task) when no thread could be started for it.
  bool Submit(std::function<void()> task) {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(task));
    if (queue_.size() > static_cast<size_t>(idle_)) {
      try {
        std::thread([this] { Loop(); }).detach();  // every queued task has a thread of its own
      } catch (const std::system_error&) {
        queue_.pop_back();
        return false;
      }
    }
    cv_.notify_all();
    return true;
  }

 private:
  void Loop() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      ++idle_;
      const bool got = cv_.wait_for(lock, std::chrono::seconds(5), [&] { return !queue_.empty(); });
      --idle_;
      if (!got) return;  // idle for a while: let the thread go
      std::function<void()> task = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      task();
      lock.lock();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  int idle_ = 0;
};

TaskRunner& GetRunner() {
  static TaskRunner* runner = new TaskRunner();  // never destroyed: its threads may outlive main
  return *runner;
}

// The floating-point environment of XLA's thread (rounding mode, and on x86 the denormal
// flushing bits of MXCSR), replayed on the worker so that the C++ arithmetic sees the same
// environment as the XLA kernels of the reference.
struct FpEnv {
#if defined(__x86_64__) || defined(_M_X64)
  unsigned int mxcsr;
  static FpEnv Capture() { return FpEnv{_mm_getcsr()}; }
  void Apply() const { _mm_setcsr(mxcsr); }
#else
  std::fenv_t env;
  static FpEnv Capture() {
    FpEnv e;
    std::fegetenv(&e.env);
    return e;
  }
  void Apply() const { std::fesetenv(&env); }
#endif
};

struct Job {
  CallConfig cfg;
  Coords c;
  RankIO io;
};

// Where a rank that failed before joining reports it: its coordinates, call site and group size
// when those could be read.
struct FailureAddress {
  Coords c;
  int64_t site;
  int num_ranks;
};

// Reads the group of a call whose validation failed, leniently (only what identifies the group:
// the attributes num_ranks and site and the coords operand). Without it (one of them is missing
// or out of range) the failure cannot be told to the peers, which then time out.
std::optional<FailureAddress> AddressOf(int32_t device_ordinal, ffi::RunId run_id,
                                        const S32Buffer_Type& coords,
                                        const Dictionary_Type& attrs) {
  ffi::ErrorOr<int64_t> num_ranks =
      GetAttrInRange<int64_t>(attrs, "num_ranks", 1, echo::kMaxRanks, kWhere, "");
  ffi::ErrorOr<int64_t> site = GetAttrInRange<int64_t>(attrs, "site", 0, INT64_MAX, kWhere, "");
  if (num_ranks.has_error() || site.has_error() || coords.element_count() != 2) {
    return std::nullopt;
  }
  const int32_t rank = coords.typed_data()[0];
  const int32_t group = coords.typed_data()[1];
  if (rank < 0 || rank >= num_ranks.value() || group < 0) return std::nullopt;
  return FailureAddress{Coords{rank, group, device_ordinal, run_id.run_id}, site.value(),
                        static_cast<int>(num_ranks.value())};
}

// Runs `job` (or reports its validation error) and returns the future XLA waits on. The operand
// and result buffers stay valid until the future completes. A validation error is also reported
// to the rank's group where the call's coords and attributes say which group that is.
ffi::Future Launch(ffi::ErrorOr<Job> job, int32_t device_ordinal, ffi::RunId run_id,
                   const S32Buffer_Type& coords, const Dictionary_Type& attrs) {
  ffi::Promise promise;
  ffi::Future future(promise);
  if (job.has_error()) {
    const std::optional<FailureAddress> address = AddressOf(device_ordinal, run_id, coords, attrs);
    if (address.has_value()) {
      GetRegistry().ReportFailure(address->c, address->site, address->num_ranks,
                                  job.error().message());
    }
    promise.SetError(std::move(job.error()));
    return future;
  }
  const FpEnv env = FpEnv::Capture();
  const bool started = GetRunner().Submit([job = job.value(), env, promise]() mutable {
    env.Apply();
    Error_Type err = EchoAllReduceHost(job.cfg, job.c, job.io);
    // Every lock is released here: XLA may continue the execution on this thread.
    if (err.failure()) {
      promise.SetError(std::move(err));
    } else {
      promise.SetAvailable();
    }
  });
  if (!started) {
    Error_Type err = Internal(kWhere, "could not start a host thread for rank ", job->c.rank,
                              " of group ", job->c.group, " (thread limit reached?)");
    GetRegistry().ReportFailure(job->c, job->cfg.site, job->cfg.num_ranks, err.message());
    promise.SetError(std::move(err));
  }
  return future;
}

ffi::ErrorOr<Coords> ReadCoords(S32Buffer_Type coords, int32_t device_ordinal, ffi::RunId run_id,
                                int num_ranks) {
  ECHO_FFI_CHECK(coords.element_count() == 2, kWhere,
                 "operand 'coords' must be int32[2] (rank, group id), got ",
                 coords.element_count(), " elements");
  const int32_t rank = coords.typed_data()[0];
  const int32_t group = coords.typed_data()[1];
  ECHO_FFI_CHECK(rank >= 0 && rank < num_ranks, kWhere, "rank ", rank, " is outside [0, ",
                 num_ranks, "): num_ranks must be the size of the reduced axis");
  ECHO_FFI_CHECK(group >= 0, kWhere, "group id must be >= 0, got ", group);
  return Coords{rank, group, device_ordinal, run_id.run_id};
}

// Test hook: the validation of rank cfg.failing_rank fails (before the rank joins its group).
Error_Type DebugFailValidation(const CallConfig& cfg, const Coords& c) {
  if (cfg.failing_rank == c.rank && cfg.failing_stage == kFailValidate) {
    return InvalidArgument(kWhere, cfg.failure, " (test hook debug_failing_rank: rank ", c.rank,
                           " fails its validation)");
  }
  return Error_Type::Success();
}

// The rescaling factor operand: f32[1], a positive normal power of two (the Echo paper Sec. 5.4,
// chosen by echo_jax.collective.rescale_factor; 1 when the call is not rescaled).
ffi::ErrorOr<float> ReadFactor(F32Buffer_Type factor) {
  if (factor.element_count() != 1)
    return InvalidArgument(kWhere, "the factor operand must be f32[1], got ",
                           factor.element_count(), " elements");
  const float f = factor.typed_data()[0];
  int e = 0;
  const bool power_of_two = std::isfinite(f) && f > 0.0f && std::frexp(f, &e) == 0.5f &&
                            std::fpclassify(f) == FP_NORMAL &&
                            std::fpclassify(1.0f / f) == FP_NORMAL;
  if (!power_of_two)
    return InvalidArgument(kWhere, "the factor operand must be a normal power of two (so that "
                           "scaling is exact), got ", f);
  return f;
}

ffi::ErrorOr<Job> PrepareAllReduce(int32_t device_ordinal, ffi::RunId run_id, Buffer_Type x,
                                   S32Buffer_Type coords, F32Buffer_Type factor, Result_Type y,
                                   const Dictionary_Type& attrs) {
  ECHO_FFI_RETURN_IF_ERROR(CheckContribution(x, y));
  const int64_t n = static_cast<int64_t>(x.element_count());
  ECHO_FFI_ASSIGN_OR_RETURN(CallConfig cfg,
                            ParseConfig(attrs, n, x.element_type(), /*compensated=*/false,
                                        /*update=*/false));
  ECHO_FFI_ASSIGN_OR_RETURN(Coords c, ReadCoords(coords, device_ordinal, run_id, cfg.num_ranks));
  ECHO_FFI_RETURN_IF_ERROR(DebugFailValidation(cfg, c));
  ECHO_FFI_ASSIGN_OR_RETURN(float f, ReadFactor(factor));
  return Job{cfg, c,
             RankIO{x.untyped_data(), nullptr, nullptr, y->untyped_data(), nullptr, nullptr, f,
                    1.0f / f, StateFormat::kF32}};
}

// The compensated call (m1_out, m2_out given: apply and update) or the applied call (both null:
// the apply step only, m1 and m2 read-only).
ffi::ErrorOr<Job> PrepareAllReduceCompensated(int32_t device_ordinal, ffi::RunId run_id,
                                              Buffer_Type x, Buffer_Type m1,
                                              Buffer_Type m2, S32Buffer_Type coords,
                                              F32Buffer_Type factor, Result_Type y,
                                              Result_Type* m1_out, Result_Type* m2_out,
                                              const Dictionary_Type& attrs) {
  ECHO_FFI_RETURN_IF_ERROR(CheckContribution(x, y));
  const bool update = m1_out != nullptr;
  const int64_t n = static_cast<int64_t>(x.element_count());
  const ffi::DataType st = m1.element_type();
  ECHO_FFI_CHECK((st == ffi::DataType::F32 || st == ffi::DataType::BF16) &&
                     m2.element_type() == st &&
                     (!update || ((*m1_out)->element_type() == st &&
                                  (*m2_out)->element_type() == st)),
                 kWhere, "the state m1, m2 (and their results) must be all float32 or all "
                 "bfloat16 (EchoConfig.state_dtype), got dtype codes ",
                 static_cast<int>(st), " / ", static_cast<int>(m2.element_type()));
  ECHO_FFI_CHECK(static_cast<int64_t>(m1.element_count()) == n &&
                     static_cast<int64_t>(m2.element_count()) == n,
                 kWhere, "state m1/m2 have ", m1.element_count(), "/", m2.element_count(),
                 " elements, the contribution has ", n, "; use echo_jax.init_state(x)");
  ECHO_FFI_CHECK(!update || (static_cast<int64_t>((*m1_out)->element_count()) == n &&
                             static_cast<int64_t>((*m2_out)->element_count()) == n),
                 kWhere, "every result must have ", n, " elements");
  ECHO_FFI_ASSIGN_OR_RETURN(
      CallConfig cfg, ParseConfig(attrs, n, x.element_type(), /*compensated=*/true, update));
  ECHO_FFI_ASSIGN_OR_RETURN(Coords c, ReadCoords(coords, device_ordinal, run_id, cfg.num_ranks));
  ECHO_FFI_RETURN_IF_ERROR(DebugFailValidation(cfg, c));
  ECHO_FFI_ASSIGN_OR_RETURN(float f, ReadFactor(factor));
  return Job{cfg, c,
             RankIO{x.untyped_data(), m1.untyped_data(), m2.untyped_data(), y->untyped_data(),
                    update ? (*m1_out)->untyped_data() : nullptr,
                    update ? (*m2_out)->untyped_data() : nullptr, f, 1.0f / f,
                    st == ffi::DataType::BF16 ? StateFormat::kBF16 : StateFormat::kF32}};
}

// The compensated call with the int8 or int4 state (EchoConfig.state_dtype = "int8" / "int4"):
// m1, m2 are int8 codes (S8) or int4 codes (S4: XLA packs them two a byte, element 2i in the low
// nibble of byte i, and the FFI buffer counts elements, not bytes) with fp32 scales s1, s2 (one a
// kStateGroup values), all updated in place. One target for both: they differ only in how a
// group is stored, so the codes' element type picks the format at run time. A wire group is one
// state group: group_size must be kStateGroup (echo_jax.transports.call_modes plans it so).
ffi::ErrorOr<Job> PrepareAllReduceCompensatedQ8(int32_t device_ordinal, ffi::RunId run_id,
                                                Buffer_Type x, Buffer_Type m1, Buffer_Type s1,
                                                Buffer_Type m2, Buffer_Type s2,
                                                S32Buffer_Type coords, F32Buffer_Type factor,
                                                Result_Type y, Result_Type m1_out,
                                                Result_Type s1_out, Result_Type m2_out,
                                                Result_Type s2_out, const Dictionary_Type& attrs) {
  ECHO_FFI_RETURN_IF_ERROR(CheckContribution(x, y));
  const int64_t n = static_cast<int64_t>(x.element_count());
  const int64_t groups = (n + echo::kStateGroup - 1) / echo::kStateGroup;
  const ffi::DataType code_type = m1.element_type();
  ECHO_FFI_CHECK(code_type == ffi::DataType::S8 || code_type == ffi::DataType::S4, kWhere,
                 "the quantized state's m1 codes must be int8 (EchoConfig.state_dtype='int8') or "
                 "int4 (state_dtype='int4'), got ", DTypeName(code_type),
                 "; use echo_jax.init_state(x, config)");
  const bool q4 = code_type == ffi::DataType::S4;
  const char* state_name = q4 ? "int4" : "int8";
  for (const auto& [name, codes, scales] :
       {std::tuple{"m1", &m1, &s1}, std::tuple{"m2", &m2, &s2},
        std::tuple{"m1 result", &*m1_out, &*s1_out},
        std::tuple{"m2 result", &*m2_out, &*s2_out}}) {
    // m1 and m2 are read and stored in one format: an int8 m2 beside int4 m1 codes (or the
    // reverse) is two states mixed up, not a format this call could pick.
    ECHO_FFI_CHECK(codes->element_type() == code_type &&
                       scales->element_type() == ffi::DataType::F32,
                   kWhere, "the ", state_name, " state's ", name, " must be ", state_name,
                   " codes (as m1's) with float32 scales, got ",
                   DTypeName(codes->element_type()), " codes and ",
                   DTypeName(scales->element_type()), " scales; m1 and m2 must both come "
                   "from echo_jax.init_state(x, config) with one EchoConfig.state_dtype");
    ECHO_FFI_CHECK(static_cast<int64_t>(codes->element_count()) == n &&
                       static_cast<int64_t>(scales->element_count()) == groups,
                   kWhere, "the ", state_name, " state's ", name, " has ",
                   codes->element_count(), " codes and ", scales->element_count(),
                   " scales; the contribution of ", n, " values needs ", n, " and ", groups,
                   "; use echo_jax.init_state(x, config)");
  }
  ECHO_FFI_ASSIGN_OR_RETURN(
      CallConfig cfg, ParseConfig(attrs, n, x.element_type(), /*compensated=*/true, true));
  ECHO_FFI_CHECK(cfg.group_size == echo::kStateGroup, kWhere, "the ", state_name, " state needs "
                 "group_size ", echo::kStateGroup, " (one wire group a state group), got ",
                 cfg.group_size);
  ECHO_FFI_ASSIGN_OR_RETURN(Coords c, ReadCoords(coords, device_ordinal, run_id, cfg.num_ranks));
  ECHO_FFI_RETURN_IF_ERROR(DebugFailValidation(cfg, c));
  ECHO_FFI_ASSIGN_OR_RETURN(float f, ReadFactor(factor));
  RankIO io{x.untyped_data(), m1.untyped_data(), m2.untyped_data(), y->untyped_data(),
            m1_out->untyped_data(), m2_out->untyped_data(), f, 1.0f / f,
            q4 ? StateFormat::kQ4 : StateFormat::kQ8};
  io.s1 = s1.typed_data<float>();
  io.s2 = s2.typed_data<float>();
  io.s1_out = s1_out->typed_data<float>();
  io.s2_out = s2_out->typed_data<float>();
  return Job{cfg, c, io};
}

// -------------------------------------------------------------------------------------------
// Impl functions over ffi::Buffer.
// -------------------------------------------------------------------------------------------

ffi::Future EchoAllReduceCpuImpl(int32_t device_ordinal, ffi::RunId run_id, Buffer_Type x,
                                 S32Buffer_Type coords, F32Buffer_Type factor, Result_Type y,
                                 Dictionary_Type attrs) {
  ffi::ErrorOr<Job> job = PrepareAllReduce(device_ordinal, run_id, x, coords, factor, y, attrs);
  return Launch(std::move(job), device_ordinal, run_id, coords, attrs);
}

ffi::Future EchoAllReduceCompCpuImpl(int32_t device_ordinal, ffi::RunId run_id,
                                            Buffer_Type x, Buffer_Type m1,
                                            Buffer_Type m2, S32Buffer_Type coords,
                                            F32Buffer_Type factor, Result_Type y,
                                            Result_Type m1_out, Result_Type m2_out,
                                            Dictionary_Type attrs) {
  ffi::ErrorOr<Job> job = PrepareAllReduceCompensated(device_ordinal, run_id, x, m1, m2, coords,
                                                      factor, y, &m1_out, &m2_out, attrs);
  return Launch(std::move(job), device_ordinal, run_id, coords, attrs);
}

ffi::Future EchoAllReduceCompQ8CpuImpl(int32_t device_ordinal, ffi::RunId run_id,
                                       Buffer_Type x, Buffer_Type m1, Buffer_Type s1,
                                       Buffer_Type m2, Buffer_Type s2, S32Buffer_Type coords,
                                       F32Buffer_Type factor, Result_Type y, Result_Type m1_out,
                                       Result_Type s1_out, Result_Type m2_out,
                                       Result_Type s2_out, Dictionary_Type attrs) {
  ffi::ErrorOr<Job> job = PrepareAllReduceCompensatedQ8(device_ordinal, run_id, x, m1, s1, m2,
                                                        s2, coords, factor, y, m1_out, s1_out,
                                                        m2_out, s2_out, attrs);
  return Launch(std::move(job), device_ordinal, run_id, coords, attrs);
}

ffi::Future EchoAllReduceAppliedCpuImpl(int32_t device_ordinal, ffi::RunId run_id,
                                        Buffer_Type x, Buffer_Type m1, Buffer_Type m2,
                                        S32Buffer_Type coords, F32Buffer_Type factor,
                                        Result_Type y, Dictionary_Type attrs) {
  ffi::ErrorOr<Job> job = PrepareAllReduceCompensated(device_ordinal, run_id, x, m1, m2, coords,
                                                      factor, y, nullptr, nullptr, attrs);
  return Launch(std::move(job), device_ordinal, run_id, coords, attrs);
}

}  // namespace

void GetCpuRegistryStats(int64_t* workspaces, int64_t* pending_joins, int64_t* cached_bindings) {
  GetRegistry().Stats(workspaces, pending_joins, cached_bindings);
}
void ReleaseCpuWorkspaces() { GetRegistry().Release(); }

}  // namespace cpu
}  // namespace echo

// -------------------------------------------------------------------------------------------
// Handler bindings (C symbols, wrapped into capsules by ffi/module.cc).
// -------------------------------------------------------------------------------------------

namespace echo {
namespace cpu {
namespace {
// The context of every CPU binding (the operands and results: ffi/echo_attrs.h, with coords):
// this rank's device, which identifies it in the join, and the execution, shared by its devices.
template <CallState S>
auto BindCpuCall() {
  return BindAllReduce<S, S32Buffer_Type>(
      FFI::Bind().Ctx<xla::ffi::DeviceOrdinal>().Ctx<xla::ffi::RunId>());
}
}  // namespace
}  // namespace cpu
}  // namespace echo

// echo_allreduce_cpu (platform "cpu"): y = QAR(x), the Echo quantized all-reduce. Attributes:
// the table of ffi/echo_attrs.h and segment_groups, site, debug_absent_rank,
// debug_failing_rank, debug_failing_stage, debug_failure (echo_jax/transports/cpu.py).
XLA_FFI_DEFINE_HANDLER_SYMBOL(echo_allreduce_cpu, echo::cpu::EchoAllReduceCpuImpl,
                              echo::cpu::BindCpuCall<echo::CallState::kNone>());

// echo_allreduce_comp_cpu (platform "cpu"): Algorithm 1 fused into the all-reduce; attributes
// as above plus the compensator's seven coefficients and residual_local (1: the local residual).
XLA_FFI_DEFINE_HANDLER_SYMBOL(echo_allreduce_comp_cpu, echo::cpu::EchoAllReduceCompCpuImpl,
                              echo::cpu::BindCpuCall<echo::CallState::kCompensated>());

// echo_allreduce_comp_q8_cpu (platform "cpu"): the compensated call with the int8 or int4
// state (its codes, int8 or int4 by their element type, and scales in place); the compensated
// call's attributes, group_size 128.
XLA_FFI_DEFINE_HANDLER_SYMBOL(echo_allreduce_comp_q8_cpu, echo::cpu::EchoAllReduceCompQ8CpuImpl,
                              echo::cpu::BindCpuCall<echo::CallState::kCompensatedQ8>());

// echo_allreduce_applied_cpu (platform "cpu"): the apply step fused into the all-reduce, the
// update left to its own op (EchoConfig.state_update = "separate"); the compensated call's
// attributes (its b1, c1, b2, c2, inv_p are not used; residual_local must be 0).
XLA_FFI_DEFINE_HANDLER_SYMBOL(echo_allreduce_applied_cpu, echo::cpu::EchoAllReduceAppliedCpuImpl,
                              echo::cpu::BindCpuCall<echo::CallState::kApplied>());
