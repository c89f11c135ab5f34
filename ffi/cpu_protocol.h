// One rank's part of the CPU all-reduce: the waits for a peer's flag, the loads and stores of x,
// y and the state, the quantization of a segment into a slot and its dequantization into y, and
// the protocol's stages on a joined workspace (ffi/echo_allreduce_cpu.cc describes them).
// Included by echo_allreduce_cpu.cc only.
#ifndef ECHO_JAX_FFI_CPU_PROTOCOL_H_
#define ECHO_JAX_FFI_CPU_PROTOCOL_H_

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <exception>
#include <string>
#include <thread>
#include <vector>

#include "cpu_call.h"
#include "cpu_workspace.h"
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
namespace {

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

// How the compensator's state is stored (EchoConfig.state_dtype).
enum class StateFormat { kF32, kBF16, kQ8, kQ4 };

// Whether the state is codes with one scale a kStateGroup values (int8 or int4), stored a
// whole group at a time (StoreStateGroups) because a group's scale depends on all its values.
inline bool GroupedState(StateFormat f) { return f == StateFormat::kQ8 || f == StateFormat::kQ4; }

// The bytes of an array of n state values: an int4 state packs two codes a byte (XLA's layout
// of an int4 array, echo::state_q4_at).
inline size_t StateBytes(StateFormat f, int64_t n) {
  switch (f) {
    case StateFormat::kF32:
      return static_cast<size_t>(n) * 4;
    case StateFormat::kBF16:
      return static_cast<size_t>(n) * 2;
    case StateFormat::kQ8:
      return static_cast<size_t>(n);
    default:
      return static_cast<size_t>((n + 1) / 2);
  }
}

// Views of one rank's operands.
struct RankIO {
  const void* x;     // cfg.dtype: float, or the uint16 bits of a bf16 / fp16
  const void* m1;    // compensated only: float, the uint16 bits of bf16, int8 codes (kQ8) or
                     // packed int4 codes (kQ4, two a byte)
  const void* m2;
  void* y;           // cfg.dtype, like x
  void* m1_out;      // m1's dtype; may alias m1 (input_output_aliases)
  void* m2_out;
  float factor;      // the shared power of two of the rescaling (Sec. 5.4); 1 when not rescaled
  float inv_factor;  // 1 / factor (exact: a power of two)
  StateFormat state;
  // kQ8, kQ4: the scales of m1, m2 (one a kStateGroup values) and their results (may alias
  // them).
  const float* s1 = nullptr;
  const float* s2 = nullptr;
  float* s1_out = nullptr;
  float* s2_out = nullptr;
};

// Element k of a state array (m1 or m2, with its scales s for kQ8, kQ4) in fp32: a bf16 state
// is widened exactly, an int8 or int4 one read back as q * s.
inline float LoadState(const RankIO& io, const void* m, const float* s, int64_t k) {
  switch (io.state) {
    case StateFormat::kBF16:
      return echo::bf16_to_f32(static_cast<const uint16_t*>(m)[k]);
    case StateFormat::kQ8:
      return echo::state_value(static_cast<const int8_t*>(m)[k], s[k / echo::kStateGroup]);
    case StateFormat::kQ4:
      return echo::state_value(echo::state_q4_at(static_cast<const uint8_t*>(m), k),
                               s[k / echo::kStateGroup]);
    default:
      return static_cast<const float*>(m)[k];
  }
}
inline float LoadM1(const RankIO& io, int64_t k) { return LoadState(io, io.m1, io.s1, k); }
inline float LoadM2(const RankIO& io, int64_t k) { return LoadState(io, io.m2, io.s2, k); }

// Stores an fp32 state value as element k; a bf16 state rounds to nearest even (the
// reference's reduce_precision + convert; only the stored state is rounded). Not for kQ8, kQ4,
// which store whole groups (StoreStateGroup).
inline void StoreState(const RankIO& io, void* m, int64_t k, float v) {
  if (io.state == StateFormat::kBF16)
    static_cast<uint16_t*>(m)[k] = echo::f32_to_bf16(v);
  else
    static_cast<float*>(m)[k] = v;
}

// Stores the `count` fp32 values v of the int8 (kQ8) or int4 (kQ4) state group that starts at
// element k0 (a multiple of kStateGroup): its scale from the group's largest |v|, then the codes
// (int4: packed two a byte; k0 is even, so the group owns whole bytes, and each byte is cleared
// before its first nibble, so that an odd count's last byte gets a high nibble 0, as XLA packs
// an odd-length int4 array, whatever the result buffer held).
inline void StoreStateGroup(StateFormat format, void* m, float* s, int64_t k0, const float* v,
                            int count) {
  uint32_t amax_bits = 0;  // max|v| as bits (a NaN's are the largest)
  for (int t = 0; t < count; ++t)
    amax_bits = std::max(amax_bits, echo::f32_bits(v[t]) & 0x7FFFFFFFu);
  const bool q8 = format == StateFormat::kQ8;
  const echo::StateScale sc =
      q8 ? echo::state_scale_of_bits(amax_bits) : echo::state_scale_q4_of_bits(amax_bits);
  if (q8) {
    int8_t* q = static_cast<int8_t*>(m) + k0;
    for (int t = 0; t < count; ++t) q[t] = echo::state_code(v[t], sc.inv);
  } else {
    uint8_t* packed = static_cast<uint8_t*>(m);
    for (int t = 0; t < count; ++t) {
      const int64_t k = k0 + t;
      if ((k & 1) == 0) packed[k >> 1] = 0;
      echo::state_q4_put(packed, k, echo::state_code_q4(v[t], sc.inv));
    }
  }
  s[k0 / echo::kStateGroup] = sc.s;
}

// A new state value pair of element k (t-th of its group): kept in the group's buffers for an
// int8 or int4 state (StoreStateGroups stores a group's values, then its scale), else stored
// now.
inline void PutStatePair(const RankIO& io, int64_t k, int t, float n1, float n2,
                         std::vector<float>& new1, std::vector<float>& new2) {
  if (GroupedState(io.state)) {
    new1[t] = n1;
    new2[t] = n2;
  } else {
    StoreState(io, io.m1_out, k, n1);
    StoreState(io, io.m2_out, k, n2);
  }
}

// kQ8, kQ4: the group's new m1, m2 (count values from element k0), codes and then scales. A
// wire group is one state group (group_size == kStateGroup, k0 a multiple of it), whose old
// scale every load of the group has read before.
inline void StoreStateGroups(const RankIO& io, int64_t k0, const std::vector<float>& new1,
                             const std::vector<float>& new2, int count) {
  if (GroupedState(io.state)) {
    StoreStateGroup(io.state, io.m1_out, io.s1_out, k0, new1.data(), count);
    StoreStateGroup(io.state, io.m2_out, io.s2_out, k0, new2.data(), count);
  }
}

// The local residual's update (cfg.residual_local, EchoConfig.residual = "local") of the wire
// group that starts at element k0: v are the g values the call quantized (x' or the segment sum,
// times the factor) and dec what their code decodes to (what the owner adds, or what every rank
// receives), so u = (v - dec) * (1 / factor): one fp32 difference, then the exact product, as in
// echo_jax.transports.xla.xla_allreduce_local. Elements past n (padding) have no state. The
// caller has already read this group's old state for the apply step; the old m1, m2 are read
// again here, each before its own store (m1_out may alias m1). Eq. 11 is the arithmetic of
// echo::comp_update_residual (compensator.update_with_residual).
inline void UpdateLocalGroup(const CallConfig& cfg, const RankIO& io, int64_t k0, const float* v,
                             const float* dec) {
  if (k0 >= cfg.n) return;
  const int count = static_cast<int>(std::min<int64_t>(cfg.group_size, cfg.n - k0));
  thread_local std::vector<float> new1, new2;  // kQ8, kQ4: the group's updated m1, m2
  if (GroupedState(io.state)) {
    new1.resize(cfg.group_size);
    new2.resize(cfg.group_size);
  }
  for (int t = 0; t < count; ++t) {
    const int64_t k = k0 + t;
    const float u = echo::mul_rn(echo::sub_rn(v[t], dec[t]), io.inv_factor);
    float n1, n2;
    echo::comp_update_residual(u, LoadM1(io, k), LoadM2(io, k), cfg.k, &n1, &n2);
    PutStatePair(io, k, t, n1, n2, new1, new2);
  }
  StoreStateGroups(io, k0, new1, new2, count);
}

// Quantizes the g values v of the group at element k0 into its codes gc and parameters gp and,
// with cfg.residual_local, updates the group's state from v - D(Q(v)) (dec: g floats of room).
inline void QuantizeGroup(const CallConfig& cfg, const RankIO& io, int64_t k0, const float* v,
                          uint8_t* gc, uint16_t* gp, float* dec) {
  const int g = cfg.group_size;
  echo::quantize_group(v, g, cfg.bits, cfg.policy, gc, gp);
  if (cfg.residual_local && k0 < cfg.n) {
    echo::dequantize_group(gc, gp, g, cfg.bits, cfg.policy, dec);
    UpdateLocalGroup(cfg, io, k0, v, dec);
  }
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
                         ? echo::comp_apply(x, LoadM1(io, k), LoadM2(io, k), cfg.k)
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
// [Gs * nparams 16-bit parameters (bf16 scale, fp16 zero-point)][Gs * g*bits/8 code bytes].
// With cfg.residual_local it also updates the state of the segment's elements from their push
// error: each group's codes are decoded as its owner will decode them (this rank reads those
// elements nowhere else, so their state is final here).
void QuantizeSegment(const CallConfig& cfg, const RankIO& io, int64_t seg, uint8_t* slot,
                     std::vector<float>& buf) {
  const int g = cfg.group_size;
  uint16_t* params = SlotParams(slot);
  uint8_t* codes = SlotCodes(cfg, slot);
  thread_local std::vector<float> dec;  // residual_local: the decoded group
  if (cfg.residual_local) dec.resize(g);
  for (int64_t gi = 0; gi < cfg.seg_groups; ++gi) {
    const int64_t k0 = seg * cfg.seg_elems + gi * g;
    LoadGroup(cfg, io, k0, buf.data());
    QuantizeGroup(cfg, io, k0, buf.data(), codes + gi * cfg.code_bytes,
                  params + gi * cfg.nparams, dec.data());
  }
}

// Dequantizes the codes of segment `seg` into y (unpadded part, stored in y's dtype) and, for the
// compensated call (not the applied one), runs the state update of those elements (the update
// step, inside the call) with the fp32 sum, before its rounding to a 16-bit y. With
// cfg.residual_local the state was updated where the call quantized (push, reduce), so this
// stores y only. With cfg.rotate every group is decoded whole (the padding positions of a last
// partial group included) and rotated back before it is divided by the factor and its first
// values are stored. `buf` holds g floats.
void FinishSegment(const CallConfig& cfg, const RankIO& io, int64_t seg, uint8_t* slot,
                   std::vector<float>& buf) {
  const int g = cfg.group_size;
  const uint16_t* params = SlotParams(slot);
  const uint8_t* codes = SlotCodes(cfg, slot);
  const bool update = cfg.update && !cfg.residual_local;  // u = x' - y / P (Eq. 4)
  thread_local std::vector<float> new1, new2;  // kQ8, kQ4: a group's updated m1, m2
  if (update && GroupedState(io.state)) {
    new1.resize(g);
    new2.resize(g);
  }
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
      if (update) {
        const float m1 = LoadM1(io, k);  // read before writing: m1_out may alias m1
        const float m2 = LoadM2(io, k);
        const float xp = echo::comp_apply(LoadX(cfg, io, k), m1, m2, cfg.k);
        float n1, n2;
        echo::comp_update(xp, y, m1, m2, cfg.k, &n1, &n2);
        PutStatePair(io, k, t, n1, n2, new1, new2);
      }
    }
    if (update) StoreStateGroups(io, k0, new1, new2, count);
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
      const size_t bytes = StateBytes(io.state, cfg.n);
      if (io.m1_out != io.m1) std::memcpy(io.m1_out, io.m1, bytes);
      if (io.m2_out != io.m2) std::memcpy(io.m2_out, io.m2, bytes);
      if (GroupedState(io.state)) {
        const size_t scale_bytes = static_cast<size_t>(
            (cfg.n + echo::kStateGroup - 1) / echo::kStateGroup) * sizeof(float);
        if (io.s1_out != io.s1) std::memcpy(io.s1_out, io.s1, scale_bytes);
        if (io.s2_out != io.s2) std::memcpy(io.s2_out, io.s2, scale_bytes);
      }
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
          "; every rank must pass the same n, dtype, bits, group_size, policy, rotation, "
          "compensator state (or none) and EchoConfig.state_update / residual");
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
      // The owned elements' local residual is the sum's rounding error s - Q(s), against the
      // code every rank decodes. Their old state was read by LoadGroup (r == me) above, the only
      // read of it in this call, so it is overwritten after that.
      QuantizeGroup(cfg, io, k0, acc.data(), out_codes + gi * cfg.code_bytes,
                    out_params + gi * cfg.nparams, tmp.data());
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

}  // namespace
}  // namespace cpu
}  // namespace echo

#endif  // ECHO_JAX_FFI_CPU_PROTOCOL_H_
