// The two kinds of CUDA all-reduce call: one rank a GPU (RankImpl: this device's rank of its
// group, found in the groups attribute) and P virtual ranks on one GPU (VirtualImpl: the rows of
// a [P, n] operand, on P streams forked from XLA's). Both check the call, join or set up the
// group's workspaces and run each rank's kernel (p2p_dispatch.cuh). Included by p2p_cuda.cu.
#ifndef ECHO_JAX_FFI_P2P_CALLS_CUH_
#define ECHO_JAX_FFI_P2P_CALLS_CUH_

#include <cuda_runtime.h>

#include <chrono>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "p2p_dispatch.cuh"
#include "xla/ffi/api/ffi.h"


namespace echo {
namespace cuda {
namespace {

// --- the per-device handler (one rank per GPU, inside shard_map) -----------------------------

// The GPU of XLA's stream (cudaStreamGetDevice, CUDA >= 12.8): which rank this call is.
ffi::ErrorOr<int> stream_device(cudaStream_t stream) {
  int device = -1;
  cudaError_t e = cudaStreamGetDevice(stream, &device);
  if (e != cudaSuccess)
    return ffi::Error(ffi::ErrorCode::kInternal,
                      std::string("echo_jax p2p (CUDA): cudaStreamGetDevice: ") + cuda_error_text(e));
  return device;
}

// The int8 / int4 state's scales (EchoConfig.state_dtype = "int8" / "int4"): the operands s1, s2 of m1, m2 and
// their results (updated in place), f32, one a kStateGroup values of each rank's n.
struct StateScales {
  ffi::AnyBuffer s1, s2;
  float* s1_out;
  float* s2_out;
};

int64_t state_groups(int64_t n) { return (n + kStateGroup - 1) / kStateGroup; }

// The quantized state's name in messages ("int8" or "int4").
const char* state_name(const CallAttrs& at) { return at.state_q4 ? "int4" : "int8"; }

// Bytes of a state buffer: XLA packs int4 (S4) two a byte (the FFI's size_bytes counts a byte
// an element for it).
size_t state_bytes(const ffi::AnyBuffer& m) {
  if (m.element_type() == ffi::DataType::S4) return (m.element_count() + 1) / 2;
  return m.size_bytes();
}

// The quantized state: m1, m2 int8 codes, or int4 codes (EchoConfig.state_dtype = "int4", XLA's
// S4: packed two a byte, element 2i in the low nibble of byte i; sets at.state_q4 too; the
// local residual only), both of one type with x's element count, s1, s2 their scales; sets
// at.state_q8.
ffi::Error check_q8_state(const ffi::AnyBuffer& x, const ffi::AnyBuffer& m1,
                          const ffi::AnyBuffer& m2, const StateScales& q, int64_t rows,
                          CallAttrs& at) {
  const int64_t groups = rows * state_groups(static_cast<int64_t>(x.element_count()) / rows);
  const ffi::DataType t1 = m1.element_type(), t2 = m2.element_type();
  if (t1 != t2 || (t1 != ffi::DataType::S8 && t1 != ffi::DataType::S4))
    return ffi::Error::InvalidArgument(
        "echo_jax p2p (CUDA): the quantized state's codes m1, m2 must be both int8 or both int4 "
        "(EchoConfig.state_dtype), got dtype codes " + std::to_string(static_cast<int>(t1)) +
        " and " + std::to_string(static_cast<int>(t2)));
  at.state_q4 = t1 == ffi::DataType::S4;
  for (const ffi::AnyBuffer* m : {&m1, &m2})
    if (m->element_count() != x.element_count())
      return ffi::Error::InvalidArgument(
          std::string("echo_jax p2p (CUDA): the ") + state_name(at) + " state's codes must have "
          "x's " + std::to_string(x.element_count()) + " elements, got " +
          std::to_string(m->element_count()));
  for (const ffi::AnyBuffer* s : {&q.s1, &q.s2})
    if (s->element_type() != ffi::DataType::F32 ||
        static_cast<int64_t>(s->element_count()) != groups)
      return ffi::Error::InvalidArgument(
          std::string("echo_jax p2p (CUDA): the ") + state_name(at) + " state's scales must be "
          "float32, " + std::to_string(groups) + " of them (one a " +
          std::to_string(kStateGroup) + " values), got " + std::to_string(s->element_count()));
  if (at.state_q4 && !at.residual_local)
    return ffi::Error::InvalidArgument(
        "echo_jax p2p (CUDA): the int4 state runs with residual='local' only (attribute "
        "residual_local = 1); with residual='output' the compensation runs in JAX around the "
        "plain call, or use state_dtype='int8'");
  at.state_q8 = true;
  return ffi::Error::Success();
}

// The compensated call's state: m1, m2 both fp32 or both bf16 (EchoConfig.state_dtype), each
// with x's element count; sets at.state_bf16; or the int8 / int4 state (q given:
// check_q8_state).
// Nothing to check without a state.
ffi::Error check_state(const ffi::AnyBuffer& x, const std::optional<ffi::AnyBuffer>& m1,
                       const std::optional<ffi::AnyBuffer>& m2, CallAttrs& at,
                       const StateScales* q = nullptr, int64_t rows = 1) {
  if (!m1.has_value()) return ffi::Error::Success();
  if (q != nullptr) return check_q8_state(x, *m1, *m2, *q, rows, at);
  const ffi::DataType t1 = m1->element_type(), t2 = m2->element_type();
  if (t1 != t2 || (t1 != ffi::DataType::F32 && t1 != ffi::DataType::BF16))
    return ffi::Error::InvalidArgument(
        "echo_jax p2p (CUDA): the state m1, m2 must be both float32 or both bfloat16 "
        "(EchoConfig.state_dtype), got dtype codes " + std::to_string(static_cast<int>(t1)) +
        " and " + std::to_string(static_cast<int>(t2)));
  if (m1->element_count() != x.element_count() || m2->element_count() != x.element_count())
    return ffi::Error::InvalidArgument(
        "echo_jax p2p (CUDA): the state m1, m2 have " + std::to_string(m1->element_count()) +
        " / " + std::to_string(m2->element_count()) + " elements, x has " +
        std::to_string(x.element_count()));
  at.state_bf16 = t1 == ffi::DataType::BF16;
  return ffi::Error::Success();
}

// The int8 state's scales as the kernels update them: the results, in place (a copy of the
// operands first where XLA did not alias them).
void use_q8_scales(const StateScales& q, cudaStream_t stream, CallAttrs& at) {
  if (q.s1_out != q.s1.untyped_data()) {
    cudaMemcpyAsync(q.s1_out, q.s1.untyped_data(), q.s1.size_bytes(), cudaMemcpyDeviceToDevice,
                    stream);
    cudaMemcpyAsync(q.s2_out, q.s2.untyped_data(), q.s2.size_bytes(), cudaMemcpyDeviceToDevice,
                    stream);
  }
  at.s1 = q.s1_out;
  at.s2 = q.s2_out;
}

// m1_out, m2_out: the compensated call's results (updated in place); nullptr with a state: the
// applied call (at.update false), whose kernels only read m1, m2.
// q: the int8 state's scales (m1, m2 its codes), or nullptr.
ffi::Error RankImpl(cudaStream_t stream, ffi::AnyBuffer x, std::optional<ffi::AnyBuffer> m1,
                    std::optional<ffi::AnyBuffer> m2, ffi::Result<ffi::AnyBuffer> y,
                    void* m1_out, void* m2_out, CallAttrs at, ffi::Span<const int64_t> groups,
                    const StateScales* q = nullptr) {
  ffi::Error err = check_attrs(at);
  if (err.failure()) return err;
  err = check_state(x, m1, m2, at, q);
  if (err.failure()) return err;
  ffi::ErrorOr<int> dev = stream_device(stream);
  if (dev.has_error()) return dev.error();
  const int device = dev.value();
  if (groups.size() % at.P != 0)
    return ffi::Error::InvalidArgument("echo_jax p2p (CUDA): the groups attribute (" +
                                       std::to_string(groups.size()) +
                                       " device ordinals) is not a multiple of num_ranks");
  int rank = -1;
  size_t first = 0;
  for (size_t i = 0; i < groups.size(); ++i)
    if (groups[i] == device) { rank = static_cast<int>(i % at.P); first = i - rank; }
  if (rank < 0)
    return ffi::Error::InvalidArgument("echo_jax p2p (CUDA): device " + std::to_string(device) +
                                       " is in no group of the groups attribute");
  std::string key = "gpu";
  std::vector<int> devs;
  for (int r = 0; r < at.P; ++r) {
    devs.push_back(static_cast<int>(groups[first + r]));
    key += ":" + std::to_string(devs.back());
  }
  Group* grp = get_group(key);
  {
    // First call: every rank allocates its workspace, then all wait until the group is
    // complete, so no kernel spins while a peer is still inside a blocking CUDA call.
    std::unique_lock<std::mutex> lock(grp->mu);
    if (grp->P == 0) {
      grp->P = at.P;
      grp->devices = devs;
      grp->slot_bytes = slot_bytes_from_env();
      grp->ws.assign(at.P, nullptr);
      grp->host_error.assign(at.P, nullptr);
      grp->dev_error.assign(at.P, nullptr);
      grp->calls.assign(at.P, 0);
    }
    if (grp->ws[rank] == nullptr) {
      lock.unlock();
      err = setup_rank(*grp, rank);
      lock.lock();
      if (err.failure()) return err;
      ++grp->registered;
      grp->cv.notify_all();
    }
    const bool ready = grp->cv.wait_for(lock, std::chrono::milliseconds(at.timeout_ms),
                                        [&] { return grp->registered == grp->P; });
    if (!ready)
      return ffi::Error(ffi::ErrorCode::kDeadlineExceeded,
                        "echo_jax p2p (CUDA): rank " + std::to_string(rank) +
                            " waited for its group's other ranks to set up; only " +
                            std::to_string(grp->registered) + " of " + std::to_string(at.P) +
                            " arrived");
  }
  err = check_health(*grp, rank);
  if (err.failure()) return err;
  const int64_t n = static_cast<int64_t>(x.element_count());
  at.update = m1_out != nullptr;
  void* pm1 = at.update || !m1.has_value() ? m1_out : m1->untyped_data();  // read-only if applied
  void* pm2 = at.update || !m1.has_value() ? m2_out : m2->untyped_data();
  if (at.update && m1_out != m1->untyped_data()) {  // no aliasing: start from the inputs
    cudaMemcpyAsync(m1_out, m1->untyped_data(), state_bytes(*m1), cudaMemcpyDeviceToDevice, stream);
    cudaMemcpyAsync(m2_out, m2->untyped_data(), state_bytes(*m2), cudaMemcpyDeviceToDevice, stream);
  }
  if (q != nullptr) use_q8_scales(*q, stream, at);
  if (m1.has_value())
    return run_rank_dtype<true>(x.element_type(), *grp, rank, stream, at, x.untyped_data(),
                                y->untyped_data(), pm1, pm2, n, 1);
  return run_rank_dtype<false>(x.element_type(), *grp, rank, stream, at, x.untyped_data(),
                               y->untyped_data(), nullptr, nullptr, n, 1);
}

// --- virtual ranks: P rank pipelines on P streams of one GPU ----------------------------------

ffi::Error VirtualImpl(cudaStream_t stream, ffi::AnyBuffer x, std::optional<ffi::AnyBuffer> m1,
                       std::optional<ffi::AnyBuffer> m2, ffi::Result<ffi::AnyBuffer> y,
                       void* m1_out, void* m2_out, CallAttrs at, int absent_rank,
                       const StateScales* q = nullptr) {
  ffi::Error err = check_attrs(at);
  if (err.failure()) return err;
  const auto dims = x.dimensions();
  if (dims.size() != 2 || dims[0] != at.P)
    return ffi::Error::InvalidArgument("echo_jax p2p (CUDA, virtual ranks): x must be [P, n] with "
                                       "P = num_ranks = " + std::to_string(at.P));
  err = check_state(x, m1, m2, at, q, at.P);  // the int8 state: scales [P, groups of a row]
  if (err.failure()) return err;
  ffi::ErrorOr<int> dev = stream_device(stream);
  if (dev.has_error()) return dev.error();
  const int device = dev.value();
  const int64_t n = dims[1];
  if (at.state_q4 && n % 32 != 0)  // a row's packed codes at byte r n / 2, 16-byte aligned
    return ffi::Error::InvalidArgument(
        "echo_jax p2p (CUDA, virtual ranks): the int4 state needs rows of a multiple of 32 "
        "values (each row's packed codes 16-byte aligned), got n = " + std::to_string(n));
  Group* grp = get_group("virtual:" + std::to_string(device) + ":" + std::to_string(at.P));
  {
    std::lock_guard<std::mutex> lock(grp->mu);
    if (grp->P == 0) {
      grp->P = at.P;
      grp->is_virtual = true;
      grp->devices.assign(at.P, device);
      grp->slot_bytes = slot_bytes_from_env();
      grp->ws.assign(at.P, nullptr);
      grp->host_error.assign(at.P, nullptr);
      grp->dev_error.assign(at.P, nullptr);
      grp->calls.assign(at.P, 0);
      for (int r = 0; r < at.P; ++r) {
        err = setup_rank(*grp, r);
        if (err.failure()) return err;
      }
      grp->streams.resize(at.P);
      grp->joins.resize(at.P);
      for (int r = 0; r < at.P; ++r) {
        ECHO_CUDA_RETURN(cudaStreamCreateWithFlags(&grp->streams[r], cudaStreamNonBlocking), "stream");
        ECHO_CUDA_RETURN(cudaEventCreateWithFlags(&grp->joins[r], cudaEventDisableTiming), "event");
      }
      ECHO_CUDA_RETURN(cudaEventCreateWithFlags(&grp->fork, cudaEventDisableTiming), "event");
      grp->registered = at.P;
    }
  }
  for (int r = 0; r < at.P; ++r) {
    err = check_health(*grp, r);
    if (err.failure()) return err;
  }
  const size_t esize = ffi::ByteWidth(x.element_type());
  // Bytes of a state row (int4: n / 2, n even above).
  const int64_t row_state_bytes =
      at.state_q4 ? n / 2 : n * (at.state_q8 ? 1 : at.state_bf16 ? 2 : 4);
  at.update = m1_out != nullptr;  // with a state and no results: the applied call, m1, m2 read
  if (m1.has_value() && !at.update) {
    m1_out = m1->untyped_data();
    m2_out = m2->untyped_data();
  }
  if (at.update && m1_out != m1->untyped_data()) {
    cudaMemcpyAsync(m1_out, m1->untyped_data(), state_bytes(*m1), cudaMemcpyDeviceToDevice, stream);
    cudaMemcpyAsync(m2_out, m2->untyped_data(), state_bytes(*m2), cudaMemcpyDeviceToDevice, stream);
  }
  if (q != nullptr) use_q8_scales(*q, stream, at);
  // One kernel for every rank (see run_rank): the fast stages only when every row is aligned.
  const bool fast_ok = aligned16(x.untyped_data()) && aligned16(y->untyped_data()) &&
                       (n * esize) % 16 == 0 &&
                       (!m1.has_value() || (aligned16(m1_out) && aligned16(m2_out) &&
                                            row_state_bytes % 16 == 0));
  ECHO_CUDA_RETURN(cudaEventRecord(grp->fork, stream), "fork event");
  for (int r = 0; r < at.P; ++r) {
    if (r == absent_rank) {  // test hook: this rank never arrives; its peers must time out
      ++grp->calls[r];
      continue;
    }
    ECHO_CUDA_RETURN(cudaStreamWaitEvent(grp->streams[r], grp->fork, 0), "fork wait");
    const char* xr = static_cast<const char*>(x.untyped_data()) + r * n * esize;
    char* yr = static_cast<char*>(y->untyped_data()) + r * n * esize;
    CallAttrs ar = at;  // the int8 / int4 state: rank r's row of scales
    if (q != nullptr) {
      ar.s1 = at.s1 + r * state_groups(n);
      ar.s2 = at.s2 + r * state_groups(n);
    }
    if (m1.has_value())
      err = run_rank_dtype<true>(x.element_type(), *grp, r, grp->streams[r], ar, xr, yr,
                                 static_cast<char*>(m1_out) + r * row_state_bytes,
                                 static_cast<char*>(m2_out) + r * row_state_bytes, n, at.P,
                                 fast_ok);
    else
      err = run_rank_dtype<false>(x.element_type(), *grp, r, grp->streams[r], at, xr, yr, nullptr,
                                  nullptr, n, at.P, fast_ok);
    if (err.failure()) return err;
    ECHO_CUDA_RETURN(cudaEventRecord(grp->joins[r], grp->streams[r]), "join event");
    ECHO_CUDA_RETURN(cudaStreamWaitEvent(stream, grp->joins[r], 0), "join wait");
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace cuda
}  // namespace echo

#endif  // ECHO_JAX_FFI_P2P_CALLS_CUH_
