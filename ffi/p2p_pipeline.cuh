// One rank's pipeline of the fused all-reduce (push, reduce + gather, tail over the tiles of a
// chunk, the flags between them) and the two kernels that run it over a Stages type (the
// generic or the fast stages). Included by p2p_cuda.cu.
#ifndef ECHO_JAX_FFI_P2P_PIPELINE_CUH_
#define ECHO_JAX_FFI_P2P_PIPELINE_CUH_

#include "p2p_layout.cuh"

namespace echo {
namespace cuda {
namespace {

// One rank's pipeline: push, reduce + gather, tail over the tiles of this chunk (Stages: the
// generic or the fast stages; T: the contribution's dtype, for the poisoned output). The body of
// both kernels below.
template <class Stages, typename T>
__device__ __forceinline__ void allreduce_pipeline(const KernelArgs& a) {
  __shared__ int give_up;
  const int warp = threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  const int warps = blockDim.x / kWarp;
  const int others = a.P - 1;
  const int ct = a.chunk_tiles;
  if (threadIdx.x == 0) give_up = 0;
  set_scaling(a);
  Stages::setup();
  __syncthreads();

  // Tile t of the chunk covers segment groups [(tile0 + t) * TG, ...) clipped to Gs.
  auto tile_groups = [&](int t, int64_t* first) {
    *first = (a.tile0 + t) * a.tile_groups;
    return static_cast<int>(min(static_cast<int64_t>(a.tile_groups), a.seg_groups - *first));
  };

  // a.twice (the stage-cost diagnostic) runs a stage's items twice: item i and i + items are the
  // same work (the same bytes written again). Not a loop around the stage: that raised the
  // registers (fp32 48 -> 72 a thread, ptxas sm_90a).
  const int push_items = others * ct;
  // push
  for (int pitem = blockIdx.x; pitem < (a.twice == 1 ? 2 : 1) * push_items; pitem += gridDim.x) {
    const int item = pitem < push_items ? pitem : pitem - push_items;
    const int j = item / ct;
    const int seg = j < a.me ? j : j + 1;
    const int t = item % ct;
    int64_t first;
    const int count = tile_groups(t, &first);
    Stages::push(a, seg, first, count, static_cast<int64_t>(t) * a.tile_groups, warp, warps, lane);
    // The barrier, then one system-scope release store: the release is cumulative, so it
    // publishes every write the block made before the barrier (the pattern of a grid barrier).
    // A system fence in each of the 256 threads per tile cost more than the fence is worth.
    __syncthreads();
    if (threadIdx.x == 0) st_release_sys(flag_ptr(a, seg, kStagePush, a.me, t), a.base);
  }

  // reduce + gather
  for (int rt = blockIdx.x; rt < (a.twice == 2 ? 2 : 1) * ct; rt += gridDim.x) {
    const int t = rt < ct ? rt : rt - ct;
    if (threadIdx.x < a.P && threadIdx.x != a.me) {
      if (!wait_flag(a, flag_ptr(a, a.me, kStagePush, threadIdx.x, t), a.base, kStagePush,
                     threadIdx.x))
        give_up = 1;
    }
    __syncthreads();
    if (give_up) break;
    int64_t first;
    const int count = tile_groups(t, &first);
    Stages::reduce(a, first, count, static_cast<int64_t>(t) * a.tile_groups, warp, warps, lane);
    __syncthreads();  // then one release per peer, as after push
    if (threadIdx.x < a.P && threadIdx.x != a.me)
      st_release_sys(flag_ptr(a, threadIdx.x, kStageGather, a.me, t), a.base + 2);
  }

  // tail
  for (int titem = blockIdx.x; titem < (a.twice == 3 ? 2 : 1) * push_items && !give_up;
       titem += gridDim.x) {
    const int item = titem < push_items ? titem : titem - push_items;
    const int j = item / ct;
    const int seg = j < a.me ? j : j + 1;
    const int t = item % ct;
    if (threadIdx.x == 0 &&
        !wait_flag(a, flag_ptr(a, a.me, kStageGather, seg, t), a.base + 2, kStageGather, seg))
      give_up = 1;
    __syncthreads();
    if (give_up) break;
    int64_t first;
    const int count = tile_groups(t, &first);
    Stages::tail(a, seg, first, count, static_cast<int64_t>(t) * a.tile_groups, warp, warps, lane);
  }

  // After a timeout the output must not look valid: poison this block's grid-stride share.
  __syncthreads();
  if (*abort_ptr(a, a.me) == static_cast<unsigned>(a.base)) {
    T* y = static_cast<T*>(a.y);
    for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < a.n;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x)
      y[i] = from_f32<T>(__int_as_float(0x7fc00000));
  }
}

// Two kernels over the same pipeline, because a second __launch_bounds__ argument of 1 is not
// "no bound" to ptxas: it raised the registers (fp32 uncompensated 48 -> 64, compensated
// 80 -> 104 a thread, g = 128). So only the instances whose Stages::kMinBlocks asks for more than
// one block an SM get one (echo_allreduce_kernel_bounded).
// Both take Stages::kBlockThreads threads a block (kThreads; 128 for the uncompensated rotated
// 16-bit instances), which the launch reads back from the kernel (prepare_launch).
template <class Stages, typename T>
__global__ void __launch_bounds__(Stages::kBlockThreads) echo_allreduce_kernel(KernelArgs a) {
  allreduce_pipeline<Stages, T>(a);
}
template <class Stages, typename T>
__global__ void __launch_bounds__(Stages::kBlockThreads, Stages::kMinBlocks)
    echo_allreduce_kernel_bounded(KernelArgs a) {
  if constexpr (Stages::kSmemSpills)  // ECHO_P2P_SMEM_SPILLS
    asm volatile(".pragma \"enable_smem_spilling\";");  // in the kernel's scope, as PTX asks
  allreduce_pipeline<Stages, T>(a);
}

// The kernel of a Stages: the bounded one where Stages::kMinBlocks > 1.
template <class Stages, typename T>
constexpr void (*kernel_of())(KernelArgs) {
  if constexpr (Stages::kMinBlocks > 1) return echo_allreduce_kernel_bounded<Stages, T>;
  else return echo_allreduce_kernel<Stages, T>;
}

}  // namespace
}  // namespace cuda
}  // namespace echo

#endif  // ECHO_JAX_FFI_P2P_PIPELINE_CUH_
