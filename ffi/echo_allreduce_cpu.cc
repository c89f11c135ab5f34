// The CPU handlers of the Echo custom call: the quantized all-reduce (paper Sec. 4, App. C) run
// by host threads, one per rank, over shared host memory.
//
// Inside jax.shard_map every rank of the reduced axis is one (fake) CPU device, and XLA runs each
// device's part of the execution on its own host thread(s); each rank's call of the handler runs
// the protocol on a thread of its own (see "Execution"), so the P ranks of a group work
// concurrently. They meet in a workspace shared by the group and run the protocol of
// echo_jax/collective.py (the "xla" transport is its pure-JAX reference; both give the same bits):
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

#include "echo_common.h"
#include "ffi_helpers.h"
#include "xla/ffi/api/ffi.h"

#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
#include <immintrin.h>
#define ECHO_CPU_RELAX() _mm_pause()
#elif defined(__aarch64__)
#define ECHO_CPU_RELAX() asm volatile("yield" ::: "memory")
#else
#define ECHO_CPU_RELAX() \
  do {                   \
  } while (0)
#endif

namespace echo {
namespace cpu {

// Host utilities exported to the nanobind module (ffi/module.cc declares them too).
void GetCpuRegistryStats(int64_t* workspaces, int64_t* pending_joins, int64_t* cached_bindings);
void ReleaseCpuWorkspaces();

namespace {

constexpr const char* kWhere = "p2p all-reduce (CPU)";
constexpr size_t kMaxWorkspaces = 1024;    // LRU cap of the persistent workspaces
constexpr size_t kMaxCachedBindings = 1 << 14;  // (device, call site) bindings

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
  size_t params_bytes;  // bytes of fp16 parameters per segment (slot prefix)
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
                 ": the sum has x's dtype (echo_jax/p2p.py declares it so)");
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
  ECHO_FFI_ASSIGN_OR_RETURN(int64_t num_ranks,
                            GetAttrInRange<int64_t>(attrs, "num_ranks", 1, echo::kMaxRanks, kWhere,
                                                    "ranks in the group, the axis size P"));
  ECHO_FFI_ASSIGN_OR_RETURN(int64_t bits, GetAttr<int64_t>(attrs, "bits", kWhere));
  ECHO_FFI_ASSIGN_OR_RETURN(int64_t g, GetAttr<int64_t>(attrs, "group_size", kWhere));
  ECHO_FFI_ASSIGN_OR_RETURN(int64_t policy, GetAttr<int64_t>(attrs, "policy", kWhere));
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
  ECHO_FFI_ASSIGN_OR_RETURN(
      c.timeout_ms, GetAttrInRange<int64_t>(attrs, "timeout_ms", 1, 86400000, kWhere,
                                            "wait limit in milliseconds"));
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
  ECHO_FFI_ASSIGN_OR_RETURN(
      int64_t rotate,
      GetAttrInRange<int64_t>(attrs, "rotate", 0, 1, kWhere,
                              "1: rotate every group by the randomized Hadamard matrix "
                              "(EchoConfig.rotation='hadamard'), 0: no rotation"));
  ECHO_FFI_CHECK(rotate == 0 || (g & (g - 1)) == 0, kWhere, "attribute 'rotate' is 1 but "
                 "group_size=", g, " is not a power of two (one Hadamard block per group)");
  c.rotate = rotate == 1;
  c.hadamard_f = c.rotate ? echo::hadamard_scale(g) : 1.0f;
  if (compensated) {
    ECHO_FFI_ASSIGN_OR_RETURN(c.k.ea, GetAttr<float>(attrs, "ea", kWhere));
    ECHO_FFI_ASSIGN_OR_RETURN(c.k.eb, GetAttr<float>(attrs, "eb", kWhere));
    ECHO_FFI_ASSIGN_OR_RETURN(c.k.b1, GetAttr<float>(attrs, "b1", kWhere));
    ECHO_FFI_ASSIGN_OR_RETURN(c.k.c1, GetAttr<float>(attrs, "c1", kWhere));
    ECHO_FFI_ASSIGN_OR_RETURN(c.k.b2, GetAttr<float>(attrs, "b2", kWhere));
    ECHO_FFI_ASSIGN_OR_RETURN(c.k.c2, GetAttr<float>(attrs, "c2", kWhere));
    ECHO_FFI_ASSIGN_OR_RETURN(c.k.inv_p, GetAttr<float>(attrs, "inv_p", kWhere));
  }
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
                     static_cast<uint64_t>(c.update)}) {
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

// -------------------------------------------------------------------------------------------
// Workspace of one group at one call site.
// -------------------------------------------------------------------------------------------

struct alignas(64) Flag {
  std::atomic<int64_t> value{2};  // "call 0 has completed": see the header comment
};

struct alignas(64) RankState {
  std::mutex call_mu;             // one call of this rank at a time on this workspace
  int64_t epoch = 0;              // calls this rank started here (guarded by call_mu)
  std::atomic<int64_t> run_id{0};        // execution of the current call (published by push)
  std::atomic<uint64_t> signature{0};    // shape/format of the current call
  std::vector<uint8_t> reduced;   // the owner's quantized segment sum (rank-local)
};

class Workspace {
 public:
  Workspace(int64_t site, std::vector<int32_t> ordinals)
      : site_(site),
        ordinals_(std::move(ordinals)),
        num_ranks_(static_cast<int>(ordinals_.size())),
        flags_(new Flag[num_ranks_]),
        ranks_(new RankState[num_ranks_]),
        push_slots_(static_cast<size_t>(num_ranks_) * num_ranks_),
        gather_slots_(static_cast<size_t>(num_ranks_) * num_ranks_) {}

  int num_ranks() const { return num_ranks_; }
  int64_t site() const { return site_; }
  int32_t ordinal(int rank) const { return ordinals_[rank]; }
  const std::vector<int32_t>& ordinals() const { return ordinals_; }
  std::atomic<int64_t>& flag(int rank) { return flags_[rank].value; }
  RankState& rank_state(int rank) { return ranks_[rank]; }
  // Receive slot `src` of owner `owner`: written by src in push, read by owner in reduce.
  std::vector<uint8_t>& push_slot(int owner, int src) {
    return push_slots_[static_cast<size_t>(owner) * num_ranks_ + src];
  }
  // Gather slot `owner` of rank `dst`: written by owner in gather, read by dst in tail.
  std::vector<uint8_t>& gather_slot(int dst, int owner) {
    return gather_slots_[static_cast<size_t>(dst) * num_ranks_ + owner];
  }

  // The poison word: false until the group fails, then true for the life of the workspace.
  // Written once, under error_mu_, after the reason (release); a waiting rank polls it (acquire)
  // and then reads the reason under error_mu_. The first failure wins.
  bool broken() const { return broken_.load(std::memory_order_acquire); }
  // A protocol failure seen by a rank waiting for its peers (timeout, disagreeing peers).
  void MarkBroken(const std::string& why) { Break(-1, why); }
  // Rank `rank` failed for a reason of its own; `why` names it and its original cause.
  void Poison(int rank, const std::string& why) { Break(rank, why); }
  std::string BrokenReason() {
    std::lock_guard<std::mutex> lock(error_mu_);
    return error_;
  }
  // The rank that poisoned the workspace, -1 for a protocol failure (or none).
  int FailedRank() {
    std::lock_guard<std::mutex> lock(error_mu_);
    return failed_rank_;
  }

 private:
  const int64_t site_;
  const std::vector<int32_t> ordinals_;
  const int num_ranks_;
  std::unique_ptr<Flag[]> flags_;
  std::unique_ptr<RankState[]> ranks_;
  std::vector<std::vector<uint8_t>> push_slots_;
  std::vector<std::vector<uint8_t>> gather_slots_;
  void Break(int rank, const std::string& why) {
    std::lock_guard<std::mutex> lock(error_mu_);
    if (!broken_.load(std::memory_order_relaxed)) {
      error_ = why;
      failed_rank_ = rank;
      broken_.store(true, std::memory_order_release);
    }
  }

  std::atomic<bool> broken_{false};
  std::mutex error_mu_;
  std::string error_;     // guarded by error_mu_
  int failed_rank_ = -1;  // guarded by error_mu_
};

// What a rank records when it fails for a reason it knows: its error, without the handler
// prefix, after its place in the group. Peers fail with this text.
std::string PoisonText(int rank, int32_t group, int num_ranks, int64_t site, int32_t ordinal,
                       const std::string& error) {
  std::string cause = error;
  const std::string prefix = StrCat("echo_jax ", kWhere, ": ");
  if (cause.compare(0, prefix.size(), prefix) == 0) cause.erase(0, prefix.size());
  return StrCat("rank ", rank, " of the group failed (group ", group, ", P=", num_ranks,
                ", call site ", site, ", device ", ordinal, "): ", cause);
}

// The error of rank `me` that gives up in `stage` because its workspace is broken.
Error_Type PeerFailed(Workspace& ws, int me, int32_t group, const char* stage) {
  if (ws.FailedRank() >= 0) {
    return Aborted(kWhere, "rank ", me, " of group ", group, " gave up in stage '", stage,
                   "': ", ws.BrokenReason());
  }
  return Aborted(kWhere, "rank ", me, " of group ", group, " gave up in stage '", stage,
                 "' because a peer failed: ", ws.BrokenReason());
}

std::string OrdinalList(const std::vector<int32_t>& ordinals) {
  std::string s = "[";
  for (size_t i = 0; i < ordinals.size(); ++i) {
    s += (i ? ", " : "") + std::to_string(ordinals[i]);
  }
  return s + "]";
}

// -------------------------------------------------------------------------------------------
// Process-wide registry: joins in flight, persistent workspaces, per-device bindings.
// -------------------------------------------------------------------------------------------

class Registry {
 public:
  // The workspace of this rank's group at this call site in this execution (see "Which ranks
  // meet" above). Blocks until all P ranks have arrived or the deadline passes.
  ffi::ErrorOr<std::shared_ptr<Workspace>> Join(const CallConfig& cfg, const Coords& c) {
    std::unique_lock<std::mutex> lock(mu_);
    const auto bkey = std::make_pair(c.ordinal, cfg.site);
    auto cached = bindings_.find(bkey);
    if (cached != bindings_.end() && cached->second.run_id == c.run_id) {
      Binding& b = cached->second;
      b.last_use = ++tick_;
      if (b.rank != c.rank || b.group != c.group ||
          b.ws->num_ranks() != cfg.num_ranks) {
        Error_Type err = InvalidArgument(
            kWhere, "device ", c.ordinal, " reached call site ", cfg.site,
            " twice in one execution as (rank ", b.rank, ", group ", b.group, ", P=",
            b.ws->num_ranks(), ") and as (rank ", c.rank, ", group ", c.group, ", P=",
            cfg.num_ranks, "): every mesh axis of size > 1 must be manual in the shard_map");
        // The group it joined first waits for this device: tell it.
        b.ws->Poison(b.rank, PoisonText(b.rank, b.group, b.ws->num_ranks(), cfg.site, c.ordinal,
                                        err.message()));
        ForgetLocked(b.ws);
        return err;
      }
      return b.ws;
    }
    const JoinKey key{c.run_id, cfg.site, c.group, cfg.num_ranks};
    std::shared_ptr<JoinEntry>& slot = joins_[key];
    if (!slot) slot = std::make_shared<JoinEntry>(cfg.num_ranks);
    std::shared_ptr<JoinEntry> entry = slot;
    int32_t& mine = entry->ordinals[c.rank];
    if (mine == -1) {
      mine = c.ordinal;
      ++entry->arrived;
    } else if (mine != c.ordinal) {
      Error_Type err = InvalidArgument(
          kWhere, "rank ", c.rank, " of group ", c.group, " (P=", cfg.num_ranks, ", site ",
          cfg.site, ") was claimed by devices ", mine, " and ", c.ordinal,
          " in one execution: the custom call was replicated over a mesh axis that is not manual "
          "(use jax.shard_map over every mesh axis of size > 1, or transport='xla')");
      PoisonEntryLocked(key, entry, c.rank,
                        PoisonText(c.rank, c.group, cfg.num_ranks, cfg.site, c.ordinal,
                                   err.message()));
      return err;
    }
    if (entry->arrived == cfg.num_ranks && !entry->ws && entry->error.empty()) {
      Complete(key, *entry, cfg, c.run_id);
    }
    const auto deadline = Clock::now() + std::chrono::milliseconds(cfg.timeout_ms);
    while (!entry->ws && entry->error.empty()) {
      if (entry->cv.wait_until(lock, deadline) == std::cv_status::timeout && !entry->ws &&
          entry->error.empty()) {
        std::vector<int> missing;
        for (int r = 0; r < cfg.num_ranks; ++r) {
          if (entry->ordinals[r] == -1) missing.push_back(r);
        }
        // Withdraw, so that a later retry of this execution starts clean.
        if (entry->ordinals[c.rank] == c.ordinal) {
          entry->ordinals[c.rank] = -1;
          --entry->arrived;
        }
        if (entry->arrived == 0) {
          auto it = joins_.find(key);
          if (it != joins_.end() && it->second == entry) joins_.erase(it);
        }
        std::string list;
        for (size_t i = 0; i < missing.size(); ++i) {
          list += (i ? ", " : "") + std::to_string(missing[i]);
        }
        return DeadlineExceeded(
            kWhere, "timed out after ", cfg.timeout_ms / 1000.0, " s in stage 'join': rank ",
            c.rank, " of group ", c.group, " (P=", cfg.num_ranks, ", call site ", cfg.site,
            ", device ", c.ordinal, ") waited for rank(s) [", list,
            "] to reach this all-reduce. Every rank of the group must run the same sequence of "
            "echo_psum calls (no rank-dependent control flow around them); the limit is "
            "ECHO_JAX_TIMEOUT_S");
      }
    }
    if (entry->poisoned) {  // a rank of the group failed before it could join: so do we
      if (entry->ordinals[c.rank] == c.ordinal) {
        entry->ordinals[c.rank] = -1;
        --entry->arrived;
      }
      Account(key, entry, c.rank);
      return Aborted(kWhere, "rank ", c.rank, " of group ", c.group, " gave up in stage 'join': ",
                     entry->error);
    }
    if (!entry->error.empty()) return InvalidArgument(kWhere, entry->error);
    return entry->ws;
  }

  // Tells the group of rank c.rank at `site` that this rank failed with `error`, a reason of
  // its own, so that its peers fail at once instead of waiting for it until the timeout: through
  // the workspace it is bound to in this execution (peers waiting on flags poll the poison
  // word), or else through the group's join (peers waiting there are woken, later ones fail on
  // arrival). The workspace is dropped from the registry, so the next execution starts afresh.
  void ReportFailure(const Coords& c, int64_t site, int num_ranks, const std::string& error) {
    const std::string why = PoisonText(c.rank, c.group, num_ranks, site, c.ordinal, error);
    std::lock_guard<std::mutex> lock(mu_);
    auto cached = bindings_.find(std::make_pair(c.ordinal, site));
    if (cached != bindings_.end() && cached->second.run_id == c.run_id &&
        cached->second.rank == c.rank && cached->second.group == c.group &&
        cached->second.ws->num_ranks() == num_ranks) {
      cached->second.ws->Poison(c.rank, why);
      ForgetLocked(cached->second.ws);
      return;
    }
    const JoinKey key{c.run_id, site, c.group, num_ranks};
    std::shared_ptr<JoinEntry>& slot = joins_[key];
    if (!slot) slot = std::make_shared<JoinEntry>(num_ranks);
    std::shared_ptr<JoinEntry> entry = slot;
    if (entry->ordinals[c.rank] == c.ordinal) {  // it had arrived: withdraw
      entry->ordinals[c.rank] = -1;
      --entry->arrived;
    }
    PoisonEntryLocked(key, entry, c.rank, why);
  }

  // Drops a broken workspace so that the next execution gets a fresh one.
  void Forget(const std::shared_ptr<Workspace>& ws) {
    std::lock_guard<std::mutex> lock(mu_);
    ForgetLocked(ws);
  }

  void Stats(int64_t* workspaces, int64_t* pending_joins, int64_t* cached_bindings) {
    std::lock_guard<std::mutex> lock(mu_);
    *workspaces = static_cast<int64_t>(workspaces_.size());
    *pending_joins = static_cast<int64_t>(joins_.size());
    *cached_bindings = static_cast<int64_t>(bindings_.size());
  }

  // Forgets every persistent workspace and binding. Only for when no Echo computation is running:
  // a rank of an execution in flight would join again and its group would time out.
  void Release() {
    std::lock_guard<std::mutex> lock(mu_);
    workspaces_.clear();
    bindings_.clear();
  }

 private:
  struct JoinKey {
    int64_t run_id;
    int64_t site;
    int32_t group;
    int32_t num_ranks;
    bool operator<(const JoinKey& o) const {
      return std::tie(run_id, site, group, num_ranks) <
             std::tie(o.run_id, o.site, o.group, o.num_ranks);
    }
  };
  struct JoinEntry {
    explicit JoinEntry(int num_ranks) : ordinals(num_ranks, -1), accounted(num_ranks, 0) {}
    std::vector<int32_t> ordinals;  // device of each rank, -1 until it arrives
    int arrived = 0;
    std::shared_ptr<Workspace> ws;  // set once all ranks arrived
    std::string error;              // set instead when the ranks do not form a valid group
    bool poisoned = false;          // error is a rank's own failure (ReportFailure)
    std::vector<char> accounted;    // poisoned: ranks that failed or have seen the failure
    int num_accounted = 0;
    std::condition_variable cv;
  };
  struct Binding {
    int64_t run_id;
    int32_t rank;
    int32_t group;
    std::shared_ptr<Workspace> ws;
    uint64_t last_use;
  };
  struct Persistent {
    std::shared_ptr<Workspace> ws;
    uint64_t last_use;
  };

  // With mu_ held: rank `rank` failed (`why`); wakes the ranks waiting in this join. The entry
  // stays until every rank has failed or seen the failure, so that late ones fail on arrival.
  void PoisonEntryLocked(const JoinKey& key, const std::shared_ptr<JoinEntry>& entry, int rank,
                         const std::string& why) {
    if (!entry->poisoned) {
      entry->poisoned = true;
      entry->error = why;
    }
    entry->cv.notify_all();
    Account(key, entry, rank);
  }

  // With mu_ held: `rank` is done with a poisoned join; the last one removes it.
  void Account(const JoinKey& key, const std::shared_ptr<JoinEntry>& entry, int rank) {
    if (!entry->accounted[rank]) {
      entry->accounted[rank] = 1;
      ++entry->num_accounted;
    }
    if (entry->num_accounted == static_cast<int>(entry->accounted.size())) {
      auto it = joins_.find(key);
      if (it != joins_.end() && it->second == entry) joins_.erase(it);
    }
  }

  // With mu_ held: drops a broken workspace from the registry. The bindings to it stay, so that
  // later calls of the same execution fail at once with its reason (a rank that joined again
  // would wait for peers that have stopped); the next execution replaces them.
  void ForgetLocked(const std::shared_ptr<Workspace>& ws) {
    auto it = workspaces_.find(std::make_pair(ws->site(), ws->ordinals()));
    if (it != workspaces_.end() && it->second.ws == ws) workspaces_.erase(it);
  }

  // Called with mu_ held by the last rank to arrive: hands the workspace to all P ranks.
  void Complete(const JoinKey& key, JoinEntry& entry, const CallConfig& cfg, int64_t run_id) {
    std::vector<int32_t> sorted = entry.ordinals;
    std::sort(sorted.begin(), sorted.end());
    if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end()) {
      entry.error = StrCat("one device holds several ranks of group ", key.group,
                           " (devices by rank: ", OrdinalList(entry.ordinals),
                           "): every mesh axis of size > 1 must be manual in the shard_map");
    } else {
      auto wkey = std::make_pair(cfg.site, entry.ordinals);
      auto it = workspaces_.find(wkey);
      if (it == workspaces_.end() || it->second.ws->broken()) {
        auto ws = std::make_shared<Workspace>(cfg.site, entry.ordinals);
        it = workspaces_.insert_or_assign(wkey, Persistent{ws, 0}).first;
      }
      it->second.last_use = ++tick_;
      entry.ws = it->second.ws;
      for (int r = 0; r < cfg.num_ranks; ++r) {
        bindings_[std::make_pair(entry.ordinals[r], cfg.site)] =
            Binding{run_id, r, key.group, entry.ws, tick_};
      }
      EvictLeastRecentlyUsed();
    }
    auto jt = joins_.find(key);
    if (jt != joins_.end() && jt->second.get() == &entry) joins_.erase(jt);
    entry.cv.notify_all();
  }

  // Dropping a workspace from the registry is always safe: executions that joined it keep it
  // alive (through their bindings), and a later execution joins a fresh one with all epochs at 0.
  // Bindings are dropped least recently used first once there are very many (thousands of traced
  // call sites); a rank whose binding was dropped in the middle of an execution joins again, and
  // its group then fails with a timeout rather than mixing two workspaces.
  void EvictLeastRecentlyUsed() {
    while (workspaces_.size() > kMaxWorkspaces) {
      auto oldest = workspaces_.begin();
      for (auto it = workspaces_.begin(); it != workspaces_.end(); ++it) {
        if (it->second.last_use < oldest->second.last_use) oldest = it;
      }
      workspaces_.erase(oldest);
    }
    if (bindings_.size() > kMaxCachedBindings) {
      std::vector<uint64_t> uses;
      uses.reserve(bindings_.size());
      for (const auto& b : bindings_) uses.push_back(b.second.last_use);
      const size_t drop = bindings_.size() - kMaxCachedBindings / 2;
      std::nth_element(uses.begin(), uses.begin() + drop, uses.end());
      const uint64_t cutoff = uses[drop];
      for (auto b = bindings_.begin(); b != bindings_.end();) {
        b = b->second.last_use < cutoff ? bindings_.erase(b) : std::next(b);
      }
    }
  }

  std::mutex mu_;
  std::map<JoinKey, std::shared_ptr<JoinEntry>> joins_;
  std::map<std::pair<int64_t, std::vector<int32_t>>, Persistent> workspaces_;
  std::map<std::pair<int32_t, int64_t>, Binding> bindings_;  // (device, site) -> this run's
  uint64_t tick_ = 0;
};

Registry& GetRegistry() {
  static Registry* registry = new Registry();  // never destroyed: handlers may run at exit
  return *registry;
}

// -------------------------------------------------------------------------------------------
// Waiting for a peer.
// -------------------------------------------------------------------------------------------

struct WaitSite {
  const CallConfig& cfg;
  const Coords& c;
  Workspace& ws;
  int64_t epoch;
};

// Spins until flag(peer) >= target: pause, then yield, then 50 us sleeps (the ranks may share
// few cores), checking the deadline and whether a peer has already failed.
Error_Type WaitFlag(const WaitSite& w, int peer, int64_t target, const char* stage,
                    const char* what) {
  std::atomic<int64_t>& flag = w.ws.flag(peer);
  if (flag.load(std::memory_order_acquire) >= target) return Error_Type::Success();
  const auto start = Clock::now();
  const auto deadline = start + std::chrono::milliseconds(w.cfg.timeout_ms);
  for (uint64_t it = 0;; ++it) {
    if (flag.load(std::memory_order_acquire) >= target) return Error_Type::Success();
    if (it < 256) {
      ECHO_CPU_RELAX();
      continue;
    }
    if (w.ws.broken()) return PeerFailed(w.ws, w.c.rank, w.c.group, stage);
    if (Clock::now() > deadline) {
      const int64_t seen = flag.load(std::memory_order_acquire);
      if (seen >= target) return Error_Type::Success();
      std::string msg = StrCat(
          "timed out after ", w.cfg.timeout_ms / 1000.0, " s in stage '", stage, "': rank ",
          w.c.rank, " of group ", w.c.group, " (P=", w.cfg.num_ranks, ", call site ", w.cfg.site,
          ", device ", w.c.ordinal, ", call ", w.epoch, ") waited for rank ", peer, " (device ",
          w.ws.ordinal(peer), ") ", what, " (its flag is ", seen, ", needs ", target,
          "). A peer never reached this call or stopped: every rank of the group must run the "
          "same sequence of echo_psum calls; the limit is ECHO_JAX_TIMEOUT_S");
      w.ws.MarkBroken(msg);
      return DeadlineExceeded(kWhere, msg);
    }
    if (it < 4096) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
}

// -------------------------------------------------------------------------------------------
// The protocol of one rank.
// -------------------------------------------------------------------------------------------

// Views of one rank's operands.
struct RankIO {
  const void* x;     // cfg.dtype: float, or the uint16 bits of a bf16 / fp16
  const void* m1;    // compensated only: float, or the uint16 bits of bf16 (state_bf16)
  const void* m2;
  void* y;           // cfg.dtype, like x
  void* m1_out;      // m1's dtype; may alias m1 (input_output_aliases)
  void* m2_out;
  float factor;      // the shared power of two of the rescaling (Sec. 5.4); 1 when not rescaled
  float inv_factor;  // 1 / factor (exact: a power of two)
  bool state_bf16;   // EchoConfig.state_dtype = "bfloat16"
};

// Element k of a state array (m1 or m2) in fp32: a bf16 state is widened exactly.
inline float LoadState(const RankIO& io, const void* m, int64_t k) {
  return io.state_bf16 ? echo::bf16_to_f32(static_cast<const uint16_t*>(m)[k])
                       : static_cast<const float*>(m)[k];
}

// Stores an fp32 state value as element k; a bf16 state rounds to nearest even (the
// reference's reduce_precision + convert; only the stored state is rounded).
inline void StoreState(const RankIO& io, void* m, int64_t k, float v) {
  if (io.state_bf16)
    static_cast<uint16_t*>(m)[k] = echo::f32_to_bf16(v);
  else
    static_cast<float*>(m)[k] = v;
}

// Element k of x in fp32 (exact for each of the three dtypes: the x.astype(f32) of the reference).
inline float LoadX(const CallConfig& cfg, const RankIO& io, int64_t k) {
  switch (cfg.dtype) {
    case ffi::DataType::BF16:
      return echo::bf16_to_f32(static_cast<const uint16_t*>(io.x)[k]);
    case ffi::DataType::F16:
      return echo::f16_to_f32(static_cast<const uint16_t*>(io.x)[k]);
    default:
      return static_cast<const float*>(io.x)[k];
  }
}

// Stores the fp32 sum v as element k of y, rounded to nearest even for bf16 / fp16 (the
// y32.astype(dtype) of the reference).
inline void StoreY(const CallConfig& cfg, const RankIO& io, int64_t k, float v) {
  switch (cfg.dtype) {
    case ffi::DataType::BF16:
      static_cast<uint16_t*>(io.y)[k] = echo::f32_to_bf16(v);
      break;
    case ffi::DataType::F16:
      static_cast<uint16_t*>(io.y)[k] = echo::f32_to_f16(v);
      break;
    default:
      static_cast<float*>(io.y)[k] = v;
  }
}

// The g values of the group that starts at element k0 of the padded layout, as the quantizer
// sees them: x + c (fused apply step) in the original units times the rescaling's factor (the
// compensator runs outside it, Sec. 5.4), 0 in the padding; with cfg.rotate the group is then
// rotated if it holds an element of x (a group of pure padding stays 0, as in the reference,
// which pads after its rotation).
inline void LoadGroup(const CallConfig& cfg, const RankIO& io, int64_t k0, float* v) {
  const int g = cfg.group_size;
  for (int t = 0; t < g; ++t) {
    const int64_t k = k0 + t;
    if (k >= cfg.n) {
      v[t] = 0.0f;
      continue;
    }
    const float x = LoadX(cfg, io, k);
    const float xp = cfg.compensated
                         ? echo::comp_apply(x, LoadState(io, io.m1, k), LoadState(io, io.m2, k), cfg.k)
                         : x;
    v[t] = echo::mul_rn(xp, io.factor);
  }
  if (cfg.rotate && k0 < cfg.n) echo::hadamard_rotate_group(v, g, cfg.hadamard_f);
}

inline uint16_t* SlotParams(uint8_t* slot) { return reinterpret_cast<uint16_t*>(slot); }
inline uint8_t* SlotCodes(const CallConfig& cfg, uint8_t* slot) {
  return slot + cfg.params_bytes;
}

// Quantizes segment `seg` of this rank's contribution into a slot laid out as
// [Gs * nparams fp16 parameters][Gs * g*bits/8 code bytes].
void QuantizeSegment(const CallConfig& cfg, const RankIO& io, int64_t seg, uint8_t* slot,
                     std::vector<float>& buf) {
  const int g = cfg.group_size;
  uint16_t* params = SlotParams(slot);
  uint8_t* codes = SlotCodes(cfg, slot);
  for (int64_t gi = 0; gi < cfg.seg_groups; ++gi) {
    const int64_t k0 = seg * cfg.seg_elems + gi * g;
    LoadGroup(cfg, io, k0, buf.data());
    echo::quantize_group(buf.data(), g, cfg.bits, cfg.policy, codes + gi * cfg.code_bytes,
                         params + gi * cfg.nparams);
  }
}

// Dequantizes the codes of segment `seg` into y (unpadded part, stored in y's dtype) and, for the
// compensated call (not the applied one), runs the state update of those elements (the update
// step, inside the call) with the fp32 sum, before its rounding to a 16-bit y. With cfg.rotate every group is decoded
// whole (the padding positions of a last partial group included) and rotated back before it is
// divided by the factor and its first values are stored. `buf` holds g floats.
void FinishSegment(const CallConfig& cfg, const RankIO& io, int64_t seg, uint8_t* slot,
                   std::vector<float>& buf) {
  const int g = cfg.group_size;
  const uint16_t* params = SlotParams(slot);
  const uint8_t* codes = SlotCodes(cfg, slot);
  for (int64_t gi = 0; gi < cfg.seg_groups; ++gi) {
    const int64_t k0 = seg * cfg.seg_elems + gi * g;
    if (k0 >= cfg.n) break;
    const int count = static_cast<int>(std::min<int64_t>(g, cfg.n - k0));
    const echo::DequantParams d =
        echo::dequant_params(params + gi * cfg.nparams, cfg.bits, cfg.policy);
    const uint8_t* gc = codes + gi * cfg.code_bytes;
    const int decoded = cfg.rotate ? g : count;
    for (int t = 0; t < decoded; ++t)
      buf[t] = echo::decode_value(echo::unpack_code(gc, t, cfg.bits), d);
    if (cfg.rotate) echo::hadamard_unrotate_group(buf.data(), g, cfg.hadamard_f);
    for (int t = 0; t < count; ++t) {
      const int64_t k = k0 + t;
      // Back to the original units: y and the state update never see the factor.
      const float y = echo::mul_rn(buf[t], io.inv_factor);
      StoreY(cfg, io, k, y);
      if (cfg.update) {
        const float m1 = LoadState(io, io.m1, k);  // read before writing: m1_out may alias m1
        const float m2 = LoadState(io, io.m2, k);
        const float xp = echo::comp_apply(LoadX(cfg, io, k), m1, m2, cfg.k);
        float n1, n2;
        echo::comp_update(xp, y, m1, m2, cfg.k, &n1, &n2);
        StoreState(io, io.m1_out, k, n1);
        StoreState(io, io.m2_out, k, n2);
      }
    }
  }
}

inline void GrowSlot(std::vector<uint8_t>& slot, size_t bytes) {
  if (slot.size() < bytes) slot.resize(bytes);  // never shrinks: steady state allocates nothing
}

// One rank's all-reduce on a joined workspace.
Error_Type RunProtocol(const CallConfig& cfg, const Coords& c, Workspace& ws, const RankIO& io) {
  const int P = cfg.num_ranks;
  const int me = c.rank;
  const int g = cfg.group_size;
  RankState& st = ws.rank_state(me);
  std::lock_guard<std::mutex> call_lock(st.call_mu);
  if (ws.broken()) {  // an earlier call of this execution failed: so does this one, at once
    return PeerFailed(ws, me, c.group, "start");
  }
  if (cfg.absent_rank == me) {  // test hook: behave like a peer that never arrives
    std::memset(io.y, 0, static_cast<size_t>(cfg.n) * ElementBytes(cfg.dtype));  // +0 in any dtype
    if (cfg.update) {
      const size_t bytes = static_cast<size_t>(cfg.n) * (io.state_bf16 ? 2 : 4);
      if (io.m1_out != io.m1) std::memcpy(io.m1_out, io.m1, bytes);
      if (io.m2_out != io.m2) std::memcpy(io.m2_out, io.m2, bytes);
    }
    return Error_Type::Success();
  }
  const int64_t epoch = ++st.epoch;
  const int64_t base = 3 * epoch;
  st.run_id.store(c.run_id, std::memory_order_relaxed);       // published by the push flag
  st.signature.store(cfg.signature, std::memory_order_relaxed);
  const WaitSite w{cfg, c, ws, epoch};
  thread_local std::vector<float> buf, acc, tmp;
  buf.resize(g);
  acc.resize(g);
  tmp.resize(g);

  // Stage 1, push: segment j goes to owner j's receive slot `me`, once j has finished reading
  // that slot in the previous call (its reduce published base - 2).
  for (int d = 1; d < P; ++d) {
    const int j = (me + d) % P;
    ECHO_FFI_RETURN_IF_ERROR(WaitFlag(w, j, base - 2, "push",
                                      "to finish reading its receive slots of the previous call"));
    std::vector<uint8_t>& slot = ws.push_slot(j, me);
    GrowSlot(slot, cfg.slot_bytes);
    QuantizeSegment(cfg, io, j, slot.data(), buf);
    if (cfg.failing_rank == me && cfg.failing_stage == kFailPush) {  // test hook
      return Internal(kWhere, cfg.failure, " (test hook debug_failing_rank: rank ", me,
                      " fails in stage 'push')");
    }
  }
  ws.flag(me).store(base, std::memory_order_release);

  // Stage 2, reduce: own segment plus the P-1 dequantized copies, in rank order 0..P-1.
  for (int d = 1; d < P; ++d) {
    const int i = (me + d) % P;
    ECHO_FFI_RETURN_IF_ERROR(WaitFlag(w, i, base, "reduce", "to push its copy of our segment"));
    RankState& peer = ws.rank_state(i);
    const int64_t peer_run = peer.run_id.load(std::memory_order_relaxed);
    const uint64_t peer_sig = peer.signature.load(std::memory_order_relaxed);
    if (peer_run != c.run_id || peer_sig != cfg.signature) {
      std::string msg = StrCat(
          "rank ", me, " of group ", c.group, " (call site ", cfg.site, ", call ", epoch,
          ") and rank ", i, " disagree on ",
          peer_run != c.run_id ? "the execution (two executions interleaved on one device)"
                               : "the shape or format of the all-reduce",
          "; every rank must pass the same n, dtype, bits, group_size and policy");
      ws.MarkBroken(msg);
      return Internal(kWhere, msg);
    }
  }
  std::vector<uint8_t>& reduced = st.reduced;
  GrowSlot(reduced, cfg.slot_bytes);
  {
    uint16_t* out_params = SlotParams(reduced.data());
    uint8_t* out_codes = SlotCodes(cfg, reduced.data());
    for (int64_t gi = 0; gi < cfg.seg_groups; ++gi) {
      const int64_t k0 = me * cfg.seg_elems + gi * g;
      for (int r = 0; r < P; ++r) {
        float* v = r == 0 ? acc.data() : tmp.data();
        if (r == me) {
          LoadGroup(cfg, io, k0, v);
        } else {
          uint8_t* slot = ws.push_slot(me, r).data();
          echo::dequantize_group(SlotCodes(cfg, slot) + gi * cfg.code_bytes,
                                 SlotParams(slot) + gi * cfg.nparams, g, cfg.bits, cfg.policy, v);
        }
        if (r > 0) {
          for (int t = 0; t < g; ++t) acc[t] = echo::add_rn(acc[t], tmp[t]);
        }
      }
      echo::quantize_group(acc.data(), g, cfg.bits, cfg.policy, out_codes + gi * cfg.code_bytes,
                           out_params + gi * cfg.nparams);
    }
  }
  ws.flag(me).store(base + 1, std::memory_order_release);  // our receive slots are free again

  // Stage 3, gather: every peer i has pushed this call (seen above), so its tail of the previous
  // call is over and its gather slot `me` can be overwritten.
  for (int d = 1; d < P; ++d) {
    const int i = (me + d) % P;
    std::vector<uint8_t>& slot = ws.gather_slot(i, me);
    GrowSlot(slot, cfg.slot_bytes);
    std::memcpy(slot.data(), reduced.data(), cfg.slot_bytes);
  }
  ws.flag(me).store(base + 2, std::memory_order_release);
  FinishSegment(cfg, io, me, reduced.data(), buf);  // the owner decodes the same code as peers

  // Stage 4, tail: the codes of the other owners.
  for (int d = 1; d < P; ++d) {
    const int j = (me + d) % P;
    ECHO_FFI_RETURN_IF_ERROR(WaitFlag(w, j, base + 2, "tail", "to gather its segment sum"));
    FinishSegment(cfg, io, j, ws.gather_slot(me, j).data(), buf);
  }
  if (cfg.failing_rank == me && cfg.failing_stage == kFailTail) {  // test hook
    return Internal(kWhere, cfg.failure, " (test hook debug_failing_rank: rank ", me,
                    " fails after its tail)");
  }
  return Error_Type::Success();
}

// The plain compute function: validated inputs in, the all-reduce (and state update) out.
// Blocks until the group has finished (or failed); runs on a TaskRunner thread.
//
// A failure of this rank's own (the test hook, an exception such as std::bad_alloc from growing
// a slot) poisons the workspace with this rank and its cause, so that the peers fail at once
// naming both; a rank that gives up because of its peers (timeout, disagreeing peers, a poisoned
// workspace) has marked the workspace broken before returning, and the first reason stays.
Error_Type EchoAllReduceHost(const CallConfig& cfg, const Coords& c, const RankIO& io) {
  std::shared_ptr<Workspace> ws;
  Error_Type err = Error_Type::Success();
  try {
    ffi::ErrorOr<std::shared_ptr<Workspace>> joined = GetRegistry().Join(cfg, c);
    if (joined.has_error()) return std::move(joined.error());  // Join has told the group
    ws = std::move(joined.value());
    err = RunProtocol(cfg, c, *ws, io);
  } catch (const std::exception& e) {
    err = Internal(kWhere, "rank ", c.rank, " of group ", c.group, " failed with an exception: ",
                   e.what());
  } catch (...) {
    err = Internal(kWhere, "rank ", c.rank, " of group ", c.group,
                   " failed with an unknown exception");
  }
  if (err.failure()) {
    if (ws == nullptr) {  // the exception came from the join
      GetRegistry().ReportFailure(c, cfg.site, cfg.num_ranks, err.message());
    } else {
      if (!ws->broken()) {
        ws->Poison(c.rank, PoisonText(c.rank, c.group, cfg.num_ranks, cfg.site, c.ordinal,
                                      err.message()));
      }
      GetRegistry().Forget(ws);
    }
  }
  return err;
}

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
                    1.0f / f, false}};
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
                    st == ffi::DataType::BF16}};
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

// echo_allreduce_cpu (platform "cpu"): y = QAR(x), the Echo quantized all-reduce.
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    echo_allreduce_cpu, echo::cpu::EchoAllReduceCpuImpl,
    echo::FFI::Bind()
        .Ctx<xla::ffi::DeviceOrdinal>()          // this rank's device (identifies it in the join)
        .Ctx<xla::ffi::RunId>()                  // this execution, shared by all its devices
        .Arg<echo::Buffer_Type>()            // x: [n] f32/bf16/f16, this rank's contribution
        .Arg<echo::S32Buffer_Type>()         // coords: int32 [2] = (rank, group id)
        .Arg<echo::F32Buffer_Type>()         // factor: f32 [1], power of two (1: no rescale)
        .Ret<echo::Buffer_Type>()            // y: [n] x's dtype, the sum, same on every rank
        .Attrs());  // num_ranks, bits, group_size, policy, segment_groups, site, timeout_ms,
                    // debug_absent_rank, debug_failing_rank, debug_failing_stage,
                    // debug_failure, rotate (see echo_jax/transports/cpu.py)

// echo_allreduce_comp_cpu (platform "cpu"): Algorithm 1 fused into the all-reduce.
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    echo_allreduce_comp_cpu, echo::cpu::EchoAllReduceCompCpuImpl,
    echo::FFI::Bind()
        .Ctx<xla::ffi::DeviceOrdinal>()          // this rank's device (identifies it in the join)
        .Ctx<xla::ffi::RunId>()                  // this execution, shared by all its devices
        .Arg<echo::Buffer_Type>()            // x: [n] f32/bf16/f16, before correction
        .Arg<echo::Buffer_Type>()            // m1: [n] f32/bf16, slow average (aliased to m1_out)
        .Arg<echo::Buffer_Type>()            // m2: [n] m1's dtype, fast average (aliased to m2_out)
        .Arg<echo::S32Buffer_Type>()         // coords: int32 [2] = (rank, group id)
        .Arg<echo::F32Buffer_Type>()         // factor: f32 [1], applied after x + c
        .Ret<echo::Buffer_Type>()            // y: [n] x's dtype, QAR(x + c), same on all ranks
        .Ret<echo::Buffer_Type>()            // m1_out: [n] m1's dtype, updated slow average
        .Ret<echo::Buffer_Type>()            // m2_out: [n] m2's dtype, updated fast average
        .Attrs());  // as above plus ea, eb, b1, c1, b2, c2, inv_p (fp32 coefficients)

// echo_allreduce_applied_cpu (platform "cpu"): the apply step fused into the all-reduce, the
// update left to its own op (EchoConfig.state_update = "separate").
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    echo_allreduce_applied_cpu, echo::cpu::EchoAllReduceAppliedCpuImpl,
    echo::FFI::Bind()
        .Ctx<xla::ffi::DeviceOrdinal>()          // this rank's device (identifies it in the join)
        .Ctx<xla::ffi::RunId>()                  // this execution, shared by all its devices
        .Arg<echo::Buffer_Type>()            // x: [n] f32/bf16/f16, before correction
        .Arg<echo::Buffer_Type>()            // m1: [n] f32/bf16, slow average (read only)
        .Arg<echo::Buffer_Type>()            // m2: [n] m1's dtype, fast average (read only)
        .Arg<echo::S32Buffer_Type>()         // coords: int32 [2] = (rank, group id)
        .Arg<echo::F32Buffer_Type>()         // factor: f32 [1], applied after x + c
        .Ret<echo::Buffer_Type>()            // y: [n] x's dtype, QAR(x + c), same on all ranks
        .Attrs());  // as the compensated call's (its b1, c1, b2, c2, inv_p are not used)
