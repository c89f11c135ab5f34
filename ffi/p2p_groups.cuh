// Host side of the CUDA all-reduce: the groups of ranks that meet in workspaces (one per rank,
// allocated on its device), the schedule cache (tiles, chunks and grid of a call shape), and the
// launch of one rank's kernel. Included by p2p_cuda.cu.
#ifndef ECHO_JAX_FFI_P2P_GROUPS_CUH_
#define ECHO_JAX_FFI_P2P_GROUPS_CUH_

#include <cuda_runtime.h>

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "p2p_layout.cuh"
#include "p2p_pipeline.cuh"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;


namespace echo {
namespace cuda {
namespace {

std::string cuda_error_text(cudaError_t e) { return std::string(cudaGetErrorString(e)); }

#define ECHO_CUDA_RETURN(expr, what)                                                      \
  do {                                                                                    \
    cudaError_t echo_err_ = (expr);                                                       \
    if (echo_err_ != cudaSuccess)                                                         \
      return ffi::Error(ffi::ErrorCode::kInternal,                                        \
                        std::string("echo_jax p2p (CUDA): ") + what + ": " +              \
                            cuda_error_text(echo_err_));                                  \
  } while (0)

int64_t env_int(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == 0) return fallback;
  return std::strtoll(v, nullptr, 10);
}

// Bytes of one receive slot: ECHO_JAX_SLOT_MB (default 32 MiB). A workspace holds 2P slots, so a
// group of P ranks takes 2 * P * slot bytes per device plus ~2 MiB of flags; messages whose
// segment codes do not fit a slot run in several chunks.
int64_t slot_bytes_from_env() { return std::max<int64_t>(1, env_int("ECHO_JAX_SLOT_MB", 32)) << 20; }

// A diagnostic for placing time inside the kernel without hardware counters:
// ECHO_JAX_P2P_REPEAT_STAGE = push | reduce | tail runs that stage twice in every uncompensated
// call (the same bytes written twice, so the result is unchanged); the time a call gains is the
// stage's cost. Unset (or anything else): 0, each stage once. Read once a process. A build with
// ECHO_P2P_REPEAT_COMP=1 runs it in compensated calls too, for their timing only (the state is
// updated twice there, so the result and the state differ).
#ifndef ECHO_P2P_REPEAT_COMP
#define ECHO_P2P_REPEAT_COMP 0
#endif
int repeat_stage_from_env() {
  static const int stage = [] {
    const char* v = std::getenv("ECHO_JAX_P2P_REPEAT_STAGE");
    const std::string s = v == nullptr ? "" : v;
    return s == "push" ? 1 : s == "reduce" ? 2 : s == "tail" ? 3 : 0;
  }();
  return stage;
}

struct LaunchPlan {
  int tile_groups = 1;
  int64_t tiles_per_segment = 0;
  int chunk_tiles = 0;
  int64_t params_offset = 0;
  int grid = 1;
  int threads = kThreads;  // a block's (prepare_launch)
};

struct Group {
  std::vector<int> devices;  // device ordinal of each rank (all equal for virtual ranks)
  bool is_virtual = false;
  int P = 0;
  int64_t slot_bytes = 0;
  std::vector<uint8_t*> ws;
  std::vector<int*> host_error, dev_error;
  std::vector<uint64_t> calls;
  std::vector<cudaStream_t> streams;  // virtual ranks: one stream per rank
  cudaEvent_t fork = nullptr;
  std::vector<cudaEvent_t> joins;
  std::map<std::tuple<const void*, int, int, int, int64_t>, LaunchPlan> plans;  // the schedule cache
  int registered = 0;
  bool broken = false;
  std::string broken_reason;
  std::mutex mu;
  std::condition_variable cv;
};

std::mutex g_registry_mu;
std::map<std::string, std::unique_ptr<Group>> g_groups;

Group* get_group(const std::string& key) {
  std::lock_guard<std::mutex> lock(g_registry_mu);
  auto& slot = g_groups[key];
  if (!slot) slot = std::make_unique<Group>();
  return slot.get();
}

// Static shared memory of a block from which the launch asks for the largest carveout: the
// kernels that spill there (ECHO_P2P_SMEM_SPILLS: 3.6 KB and more) and the rotated generic
// stages' buffers; the others take a few bytes.
constexpr int kSharedCarveoutBytes = 2048;

// Prepares the first launch of `kernel` and returns the threads a block takes (*threads): its
// __launch_bounds__' first argument (Stages::kBlockThreads), which the runtime reports as the
// kernel's largest block. A kernel with kSharedCarveoutBytes of shared memory or more asks for
// the largest shared-memory carveout (with ECHO_P2P_SMEM_SPILLS), so that the occupancy query
// and the launches see the same carveout: every block of the pipeline must be resident at once.
cudaError_t prepare_launch(const void* kernel, int* threads) {
  cudaFuncAttributes attr{};
  cudaError_t e = cudaFuncGetAttributes(&attr, kernel);
  *threads = std::clamp(attr.maxThreadsPerBlock / kWarp * kWarp, kWarp, kThreads);
  if (e == cudaSuccess && ECHO_P2P_SMEM_SPILLS && attr.sharedSizeBytes >= kSharedCarveoutBytes)
    e = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                             cudaSharedmemCarveoutMaxShared);
  return e;
}

// Blocks of `threads` threads of `kernel` resident on `device` at once (all SMs).
int resident_blocks(const void* kernel, int device, int threads) {
  int per_sm = 0, sms = 0;
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  return std::max(1, per_sm) * std::max(1, sms);
}

// Allocates rank r's workspace on its device (before any of this group's kernels can spin).
ffi::Error setup_rank_on_device(Group& grp, int r);

ffi::Error setup_rank(Group& grp, int r) {
  // XLA's thread keeps its current device: switch for the setup and back.
  int previous = 0;
  ECHO_CUDA_RETURN(cudaGetDevice(&previous), "cudaGetDevice");
  ECHO_CUDA_RETURN(cudaSetDevice(grp.devices[r]), "cudaSetDevice");
  ffi::Error err = setup_rank_on_device(grp, r);
  cudaSetDevice(previous);
  return err;
}

ffi::Error setup_rank_on_device(Group& grp, int r) {
  const int64_t bytes = workspace_bytes(grp.P, grp.slot_bytes);
  ECHO_CUDA_RETURN(cudaMalloc(&grp.ws[r], bytes), "workspace cudaMalloc");
  ECHO_CUDA_RETURN(cudaMemset(grp.ws[r], 0, bytes), "workspace cudaMemset");
  ECHO_CUDA_RETURN(cudaHostAlloc(&grp.host_error[r], sizeof(int), cudaHostAllocMapped),
                   "error word cudaHostAlloc");
  *grp.host_error[r] = 0;
  ECHO_CUDA_RETURN(cudaHostGetDevicePointer(&grp.dev_error[r], grp.host_error[r], 0),
                   "cudaHostGetDevicePointer");
  if (!grp.is_virtual) {
    for (int peer : grp.devices) {
      if (peer == grp.devices[r]) continue;
      int can = 0;
      ECHO_CUDA_RETURN(cudaDeviceCanAccessPeer(&can, grp.devices[r], peer), "cudaDeviceCanAccessPeer");
      if (!can)
        return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                          "echo_jax p2p (CUDA): device " + std::to_string(grp.devices[r]) +
                              " has no peer access to device " + std::to_string(peer) +
                              "; use transport='xla' (auto does)");
      cudaError_t e = cudaDeviceEnablePeerAccess(peer, 0);
      if (e == cudaErrorPeerAccessAlreadyEnabled) cudaGetLastError();
      else ECHO_CUDA_RETURN(e, "cudaDeviceEnablePeerAccess");
    }
  }
  ECHO_CUDA_RETURN(cudaDeviceSynchronize(), "workspace setup");
  return ffi::Error::Success();
}

// Plain string concatenation, no std::ostringstream: an ostream insertion inside the handler
// crashed on the device image (libstdc++ locale state of the loaded module), std::to_string
// does not touch the locale.
std::string describe_error(int code, int rank) {
  const int stage = (code - 1) / 256, peer = (code - 1) % 256;
  const bool push = stage == kStagePush;
  return "rank " + std::to_string(rank) + " timed out in the " + (push ? "reduce" : "tail") +
         " stage waiting for rank " + std::to_string(peer) + (push ? "'s push" : "'s gather") +
         " (a peer never arrived); the group's workspace is no longer usable in this process";
}

LaunchPlan make_plan(const Group& grp, const CallAttrs& at, int64_t seg_groups, int resident,
                     int threads) {
  LaunchPlan pl;
  pl.threads = threads;
  static const int64_t tile_values =
      std::max<int64_t>(1, env_int("ECHO_JAX_P2P_TILE_VALUES", kTileValues));
  const int max_tg = static_cast<int>(std::max<int64_t>(1, tile_values / at.g));
  pl.tile_groups = static_cast<int>(std::clamp<int64_t>(
      (seg_groups + kMinTilesPerSegment - 1) / kMinTilesPerSegment, 1, max_tg));
  pl.tiles_per_segment = (seg_groups + pl.tile_groups - 1) / pl.tile_groups;
  const int64_t cb = at.g * at.bits / 8;
  const int64_t per_group = cb + 2 * num_params(at.policy);
  const int64_t cap_groups = (grp.slot_bytes - 64) / per_group;
  int64_t cap_tiles = std::min<int64_t>(cap_groups / pl.tile_groups, kMaxTiles);
  pl.chunk_tiles = static_cast<int>(std::max<int64_t>(1, std::min(cap_tiles, pl.tiles_per_segment)));
  pl.params_offset = ((static_cast<int64_t>(pl.chunk_tiles) * pl.tile_groups * cb + 15) / 16) * 16;
  const int64_t items = (2 * (at.P - 1) + 1) * static_cast<int64_t>(pl.chunk_tiles);
  pl.grid = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(items, resident)));
  return pl;
}

// Launches `kernel` (an echo_allreduce_kernel(_bounded) instance) for one rank, one launch per
// chunk of tiles, with the schedule of the cache (computed at the first call of this shape).
ffi::Error launch(Group& grp, int rank, cudaStream_t stream, const CallAttrs& at,
                  void (*kernel)(KernelArgs), const void* x, void* y, void* m1, void* m2,
                  int64_t n, bool aligned, int ranks_on_device) {
  const int64_t groups = (std::max<int64_t>(n, 1) + at.g - 1) / at.g;
  const int64_t seg_groups = (groups + at.P - 1) / at.P;
  const auto key = std::make_tuple(reinterpret_cast<const void*>(kernel), at.bits, at.policy,
                                   at.g, seg_groups);
  LaunchPlan pl;
  {
    std::lock_guard<std::mutex> lock(grp.mu);
    auto it = grp.plans.find(key);
    if (it == grp.plans.end()) {
      const void* k = reinterpret_cast<const void*>(kernel);
      int threads = kThreads;
      ECHO_CUDA_RETURN(prepare_launch(k, &threads),
                       "cudaFuncGetAttributes / cudaFuncSetAttribute (shared memory carveout)");
      const int resident =
          std::max(1, resident_blocks(k, grp.devices[rank], threads) / ranks_on_device);
      it = grp.plans.emplace(key, make_plan(grp, at, seg_groups, resident, threads)).first;
    }
    pl = it->second;
  }
  KernelArgs a{};
  a.x = x; a.y = y; a.m1 = m1; a.m2 = m2; a.s1 = at.s1; a.s2 = at.s2; a.factor = at.factor;
  a.n = n;
  a.seg_groups = seg_groups;
  a.me = rank; a.P = at.P; a.g = at.g; a.bits = at.bits; a.policy = at.policy;
  a.tile_groups = pl.tile_groups;
  a.slot_bytes = grp.slot_bytes;
  a.params_offset = pl.params_offset;
  a.timeout_ns = static_cast<uint64_t>(at.timeout_ms) * 1000000ull;
  a.error = grp.dev_error[rank];
  a.aligned = aligned;
  a.state_bf16 = at.state_bf16;
  a.rot_scale = at.rotate ? hadamard_scale(at.g) : 1.0f;
  // a compensated update is not idempotent: there only with ECHO_P2P_REPEAT_COMP (above)
  a.twice = m1 == nullptr || ECHO_P2P_REPEAT_COMP ? repeat_stage_from_env() : 0;
  a.k = at.k;
  for (int r = 0; r < at.P; ++r) a.ws[r] = grp.ws[r];
  for (int64_t t0 = 0; t0 < pl.tiles_per_segment; t0 += pl.chunk_tiles) {
    a.tile0 = t0;
    a.chunk_tiles = static_cast<int>(std::min<int64_t>(pl.chunk_tiles, pl.tiles_per_segment - t0));
    a.base = 3 * (++grp.calls[rank]);
    kernel<<<pl.grid, pl.threads, 0, stream>>>(a);
  }
  ECHO_CUDA_RETURN(cudaGetLastError(), "kernel launch");
  return ffi::Error::Success();
}

}  // namespace
}  // namespace cuda
}  // namespace echo

#endif  // ECHO_JAX_FFI_P2P_GROUPS_CUH_
