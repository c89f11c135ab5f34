// Stage timing of the quantizer kernels on one GPU (the goal: the custom call at the memory
// roofline). One process times, with CUDA events around each launch (no XLA in between):
//   * memory probes: a float4 copy (y = 2x), a read-only pass, and "pattern" kernels that make
//     the quantizer's exact loads and stores with no arithmetic: the floor of its access pattern;
//   * the production kernels (quantize_fast_kernel / dequantize_fast_kernel of quant_cuda.cu, as
//     its launchers start them) and the generic one-warp-a-group quantizer;
//   * variants of the quantize kernel: lanes a group (LANES), prefetch on / off, the group range
//     from order keys or min.NaN / max.NaN, and grid size (waves of resident blocks, or one tile
//     a warp with no grid stride).
// Every fast kernel's codes and parameters are compared with the generic kernel's byte for byte
// (the data holds NaN, +-inf, +-0, constant and subnormal groups), so a faster layout is known
// to be the same wire format before it is adopted (the GPU tests then check it against the
// pure-JAX reference).
//
// Build and run (on the GPU machine; the include path is jaxlib's, for the FFI header):
//   nvcc -std=c++17 -O3 -arch=sm_90a --fmad=false -diag-suppress=940,2473 \
//        -I"$(python3 -c 'import jaxlib,os;print(os.path.dirname(jaxlib.__file__))')/include" \
//        -Iffi ffi/tools/quant_stages.cu -o quant_stages && ./quant_stages 256
// Output: one JSON object a line: name, dtype, bits, bytes moved, median / min microseconds over
// the timed launches, GB/s, time as a multiple of the fp32 copy of the same element count, and
// "same" (byte-identical to production) for variants.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "../quant_cuda.cu"  // the production kernels and launchers (one translation unit)

namespace echo {
namespace cuda {
namespace {

#define CK(call)                                                                        \
  do {                                                                                  \
    cudaError_t e_ = (call);                                                            \
    if (e_ != cudaSuccess) {                                                            \
      std::fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); \
      std::exit(1);                                                                     \
    }                                                                                   \
  } while (0)

constexpr int kTimed = 30;

// ---- data ------------------------------------------------------------------------------------

__device__ uint32_t mix(uint64_t i) {  // splitmix64 -> 32 bits
  uint64_t z = i + 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return static_cast<uint32_t>(z ^ (z >> 31));
}

// Mostly N(0,1)-like values (sum of 4 uniforms), with adversarial groups of 128: group % 97 ==
// 1 holds a NaN, 2 an inf, 3 is constant, 4 all zeros with one -0, 5 subnormals, 6 huge (fp16
// overflowing scales), 7 all positive with a zero at the end.
__global__ void fill(float* x, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const uint32_t h = mix(i);
    float v = ((h & 0xFF) + ((h >> 8) & 0xFF) + ((h >> 16) & 0xFF) + (h >> 24) - 510.0f) / 147.0f;
    const int64_t grp = i / 128, pos = i % 128;
    switch (grp % 97) {
      case 1: if (pos == 77) v = __int_as_float(0x7FC00000); break;
      case 2: if (pos == 3) v = -__int_as_float(0x7F800000); break;
      case 3: v = 1.5f; break;
      case 4: v = pos == 9 ? -0.0f : 0.0f; break;
      case 5: v = __int_as_float(h & 0x807FFFFF); break;
      case 6: v *= 3.0e38f; break;
      case 7: v = pos == 127 ? 0.0f : fabsf(v) + 1.0f; break;
      default: break;
    }
    x[i] = v;
  }
}

template <typename T>
__global__ void convert(const float* x, T* y, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x)
    y[i] = from_f32<T>(x[i]);
}

// ---- memory probes -------------------------------------------------------------------------

__global__ void copy2x(const float4* __restrict__ x, float4* __restrict__ y, int64_t n4) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n4;
       i += int64_t{gridDim.x} * blockDim.x) {
    float4 v = x[i];
    y[i] = make_float4(2 * v.x, 2 * v.y, 2 * v.z, 2 * v.w);
  }
}

__global__ void read_only(const uint4* __restrict__ x, int64_t n16, uint32_t* sink) {
  uint32_t acc = 0;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n16;
       i += int64_t{gridDim.x} * blockDim.x) {
    const uint4 v = __ldg(x + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x12345678u) sink[0] = acc;  // keeps the loads
}

// The quantize kernel's loads and stores (QuantLayout, one wave, prefetch) with the arithmetic
// replaced by a xor: what its access pattern costs by itself.
template <typename T, int G, int BITS, int LANES>
__global__ void __launch_bounds__(kQuantThreads)
    pattern_kernel(const T* __restrict__ x, int64_t groups, uint8_t* __restrict__ packed,
                   uint16_t* __restrict__ params) {
  using L = fast::QuantLayout<T, G, LANES>;
  constexpr int kVec = L::kVec, kLanes = L::kLanes, kLoads = L::kLoads, kGpw = L::kGroupsPerWarp;
  constexpr int kPieceBytes = kVec * BITS / 8, kCodeBytes = G * BITS / 8;
  const int lane = static_cast<int>(threadIdx.x) % kWarp, j = lane % kLanes;
  const int64_t first = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x / kWarp;
  for (int64_t w = first; w * kGpw < groups; w += stride) {
    const int64_t grp = w * kGpw + lane / kLanes;
    uint4 raw[kLoads];
    load_group<L>(x, grp, groups, j, raw);
    if (grp >= groups) continue;
    if (j == 0) *reinterpret_cast<uint32_t*>(params + 2 * grp) = raw[0].x;
    uint8_t* dst = packed + grp * kCodeBytes + j * kPieceBytes;
#pragma unroll
    for (int k = 0; k < kLoads; ++k) {
      uint32_t codes[kVec];
#pragma unroll
      for (int t = 0; t < kVec; ++t) codes[t] = (raw[k].x >> t) & ((1u << BITS) - 1u);
      fast::store_piece<kVec, BITS>(dst + k * kLanes * kPieceBytes, codes, raw[k].y | 1u);
    }
  }
}

// ---- timing --------------------------------------------------------------------------------

template <typename F>
std::pair<double, double> time_us(F&& launch) {
  for (int i = 0; i < 3; ++i) launch();
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  std::vector<double> t;
  for (int i = 0; i < kTimed; ++i) {
    CK(cudaEventRecord(a));
    launch();
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(1000.0 * ms);
  }
  CK(cudaGetLastError());
  std::sort(t.begin(), t.end());
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return {t[t.size() / 2], t[0]};
}

double g_copy_us = 0;  // the fp32 copy of n elements, for "x_copy"

void report(const std::string& name, const char* dtype, int bits, double bytes,
            std::pair<double, double> us, const char* same = nullptr, int regs = -1) {
  std::printf("{\"name\": \"%s\", \"dtype\": \"%s\", \"bits\": %d, \"bytes\": %.0f, "
              "\"median_us\": %.2f, \"min_us\": %.2f, \"gbps\": %.1f, \"x_copy\": %.3f",
              name.c_str(), dtype, bits, bytes, us.first, us.second, bytes / us.first / 1e3,
              g_copy_us > 0 ? us.first / g_copy_us : 1.0);
  if (same) std::printf(", \"same\": %s", same);
  if (regs >= 0) std::printf(", \"registers\": %d", regs);
  std::printf("}\n");
  std::fflush(stdout);
}

template <auto kKernel>
int registers() {
  cudaFuncAttributes a{};
  CK(cudaFuncGetAttributes(&a, kKernel));
  return a.numRegs;
}

template <auto kKernel>
int resident_blocks(int threads) {
  int n = 0;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kKernel, threads, 0));
  return std::max(1, n);
}

struct Buffers {
  int64_t n = 0;
  void* x = nullptr;  // n values of the dtype under test
  uint8_t* packed = nullptr;
  uint16_t* params = nullptr;
  uint8_t* ref_packed = nullptr;
  uint16_t* ref_params = nullptr;
  size_t packed_bytes = 0, params_bytes = 0;
};

bool same_as_ref(const Buffers& b) {
  std::vector<uint8_t> p(b.packed_bytes), r(b.packed_bytes);
  std::vector<uint8_t> q(b.params_bytes), s(b.params_bytes);
  CK(cudaMemcpy(p.data(), b.packed, b.packed_bytes, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(r.data(), b.ref_packed, b.packed_bytes, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(q.data(), b.params, b.params_bytes, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(s.data(), b.ref_params, b.params_bytes, cudaMemcpyDeviceToHost));
  return p == r && q == s;
}

// One quantize variant: LANES lanes a group, PREFETCH, KEY_STATS, THREADS a block (the
// kernel's launch bound is kQuantThreads, so THREADS <= kQuantThreads), grid = `waves` waves of
// resident blocks, or (waves == 0) enough blocks for one tile a warp.
template <typename T, int G, int BITS, int POLICY, int LANES, bool PREFETCH, bool KEYS>
void variant(const char* dtype, Buffers& b, int threads, int waves, double bytes) {
  constexpr auto kernel = quantize_fast_kernel<T, G, BITS, POLICY, LANES, PREFETCH, KEYS>;
  using L = fast::QuantLayout<T, G, LANES>;
  const int64_t groups = b.n / G;
  const int64_t warps = (groups + L::kGroupsPerWarp - 1) / L::kGroupsPerWarp;
  const int64_t full = (warps * kWarp + threads - 1) / threads;
  const int64_t wave = int64_t{sm_count()} * resident_blocks<kernel>(threads);
  const int grid = static_cast<int>(waves == 0 ? full : std::min<int64_t>(full, waves * wave));
  CK(cudaMemset(b.packed, 0xAB, b.packed_bytes));
  CK(cudaMemset(b.params, 0xAB, b.params_bytes));
  auto us = time_us([&] {
    kernel<<<grid, threads, 0>>>(static_cast<const T*>(b.x), groups, b.packed, b.params);
  });
  const std::string name = std::string("quantize ") + (KEYS ? "keys" : "minmax") + " L" +
                           std::to_string(LANES) + " loads" + std::to_string(L::kLoads) +
                           (PREFETCH ? " prefetch" : "") + " t" + std::to_string(threads) +
                           (waves == 0 ? std::string(" full-grid")
                                       : " waves" + std::to_string(waves));
  report(name, dtype, BITS, bytes, us, same_as_ref(b) ? "true" : "false", registers<kernel>());
}

// The generic kernel (one warp a group, min_f / max_f, run-time format): the reference every
// fast kernel's bytes are compared with.
template <typename T>
void generic_quantize(const void* x, int64_t groups, int g, int bits, int policy, uint8_t* packed,
                      uint16_t* params) {
  quantize_kernel<T, 4><<<grid_for(groups), kQuantThreads>>>(static_cast<const T*>(x), groups, g,
                                                             bits, policy, packed, params, true);
}

template <typename T, int BITS>
void quantize_suite(const char* dtype, int64_t n, const float* x32) {
  constexpr int G = 128;
  Buffers b;
  b.n = n;
  b.packed_bytes = static_cast<size_t>(n) * BITS / 8;
  b.params_bytes = static_cast<size_t>(n / G) * 4;
  CK(cudaMalloc(&b.x, n * sizeof(T)));
  CK(cudaMalloc(&b.packed, b.packed_bytes));
  CK(cudaMalloc(&b.params, b.params_bytes));
  CK(cudaMalloc(&b.ref_packed, b.packed_bytes));
  CK(cudaMalloc(&b.ref_params, b.params_bytes));
  convert<T><<<1024, 256>>>(x32, static_cast<T*>(b.x), n);
  const double bytes = n * double(sizeof(T)) + b.packed_bytes + b.params_bytes;
  const int64_t groups = n / G;

  // Every policy: production (the custom call's launcher) against the generic kernel.
  for (int policy : {kPolicySym, kPolicyAsymNaive, kPolicyAsym}) {
    const char* pname =
        policy == kPolicySym ? "sym" : policy == kPolicyAsym ? "asym" : "asym_naive";
    CK(cudaMemset(b.ref_params, 0xAB, b.params_bytes));  // sym writes half of the buffer
    report(std::string("quantize generic ") + pname, dtype, BITS, bytes, time_us([&] {
             generic_quantize<T>(b.x, groups, G, BITS, policy, b.ref_packed, b.ref_params);
           }));
    CK(cudaMemset(b.packed, 0xAB, b.packed_bytes));
    CK(cudaMemset(b.params, 0xAB, b.params_bytes));
    auto us = time_us([&] {
      launch_quantize<T>(0, b.x, groups, G, BITS, policy, b.packed, b.params);
    });
    report(std::string("quantize production ") + pname, dtype, BITS, bytes, us,
           same_as_ref(b) ? "true" : "false",
           registers<quantize_fast_kernel<T, G, BITS, kPolicyAsym>>());
  }
  // (the reference now holds asym's bytes)
  constexpr int kL = fast::default_lanes<T, G>();
  constexpr auto pk = pattern_kernel<T, G, BITS, kL>;
  const int pgrid = sm_count() * resident_blocks<pk>(kQuantThreads);
  report("pattern (loads + stores, no arithmetic)", dtype, BITS, bytes, time_us([&] {
           pk<<<pgrid, kQuantThreads>>>(static_cast<const T*>(b.x), groups, b.packed, b.params);
         }));

  constexpr int k2 = fast::lanes_for_loads<T, G, 2>(), k8 = fast::lanes_for_loads<T, G, 8>();
  variant<T, G, BITS, kPolicyAsym, k2, true, true>(dtype, b, 256, 1, bytes);  // the old kernel
  variant<T, G, BITS, kPolicyAsym, kL, false, true>(dtype, b, 256, 1, bytes);
  variant<T, G, BITS, kPolicyAsym, k2, true, false>(dtype, b, 256, 1, bytes);
  variant<T, G, BITS, kPolicyAsym, kL, false, false>(dtype, b, 256, 1, bytes);  // production
  variant<T, G, BITS, kPolicyAsym, kL, false, false>(dtype, b, 256, 2, bytes);
  variant<T, G, BITS, kPolicyAsym, kL, false, false>(dtype, b, 256, 0, bytes);
  variant<T, G, BITS, kPolicyAsym, kL, true, false>(dtype, b, 256, 1, bytes);
  variant<T, G, BITS, kPolicyAsym, k8, false, false>(dtype, b, 256, 1, bytes);

  if constexpr (std::is_same_v<T, float>) {
    // Dequantize of the asym reference into an fp32 buffer (the copy of its output is g_copy).
    float* y = nullptr;
    CK(cudaMalloc(&y, n * sizeof(float)));
    report("dequantize production", "float32", BITS,
           double(b.packed_bytes) + b.params_bytes + 4.0 * n,
           time_us([&] {
             launch_dequantize(0, b.ref_packed, b.ref_params, groups, G, BITS, kPolicyAsym, y);
           }));
    CK(cudaFree(y));
  }
  CK(cudaFree(b.x));
  CK(cudaFree(b.packed));
  CK(cudaFree(b.params));
  CK(cudaFree(b.ref_packed));
  CK(cudaFree(b.ref_params));
}

// min.NaN / max.NaN on signed zeros and NaN, both operand orders: the facts fast::range_add
// relies on (IEEE 754-2019: -0 < +0, NaN propagates).
__global__ void zero_sign_probe(uint32_t* out) {
  const float pz = 0.0f, nz = -0.0f, one = 1.0f, nan = __int_as_float(0x7FC00000);
  const float in[4][2] = {{pz, nz}, {nz, pz}, {one, nan}, {nan, one}};
  for (int i = 0; i < 4; ++i) {
    out[2 * i] = __float_as_uint(fast::min_nan(in[i][0], in[i][1]));
    out[2 * i + 1] = __float_as_uint(fast::max_nan(in[i][0], in[i][1]));
  }
  // Packed halves: a = (+0, -0), b = (-0, +0) (low, high); IEEE 754-2019 gives min = (-0, -0),
  // max = (+0, +0) for both bf16x2 and f16x2.
  const uint32_t a = 0x80000000u, b = 0x00008000u;
  uint32_t r;
  asm("min.NaN.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  out[8] = r;
  asm("max.NaN.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  out[9] = r;
  asm("min.NaN.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  out[10] = r;
  asm("max.NaN.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  out[11] = r;
}

void zero_sign_report() {
  uint32_t* d = nullptr;
  uint32_t h[12];
  CK(cudaMalloc(&d, sizeof(h)));
  zero_sign_probe<<<1, 1>>>(d);
  CK(cudaMemcpy(h, d, sizeof(h), cudaMemcpyDeviceToHost));
  CK(cudaFree(d));
  const bool ok = h[0] == 0x80000000u && h[1] == 0u && h[2] == 0x80000000u && h[3] == 0u &&
                  (h[4] & 0x7FFFFFFFu) > 0x7F800000u && (h[5] & 0x7FFFFFFFu) > 0x7F800000u &&
                  (h[6] & 0x7FFFFFFFu) > 0x7F800000u && (h[7] & 0x7FFFFFFFu) > 0x7F800000u &&
                  h[8] == 0x80008000u && h[9] == 0u && h[10] == 0x80008000u && h[11] == 0u;
  std::printf("{\"name\": \"min.NaN/max.NaN probe\", \"min(+0,-0)\": \"%08x\", \"max(+0,-0)\": "
              "\"%08x\", \"min(-0,+0)\": \"%08x\", \"max(-0,+0)\": \"%08x\", \"min(1,nan)\": "
              "\"%08x\", \"max(nan,1)\": \"%08x\", \"bf16x2 min/max\": \"%08x %08x\", "
              "\"f16x2 min/max\": \"%08x %08x\", \"ieee2019\": %s}\n",
              h[0], h[1], h[2], h[3], h[4], h[7], h[8], h[9], h[10], h[11], ok ? "true" : "false");
}

}  // namespace
}  // namespace cuda
}  // namespace echo

int main(int argc, char** argv) {
  using namespace echo::cuda;
  const int64_t mib = argc > 1 ? std::atoll(argv[1]) : 256;
  const int64_t n = mib * (1 << 20) / 4 / 128 * 128;  // fp32 values of `mib` MiB, whole groups
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("{\"device\": \"%s\", \"sms\": %d, \"values\": %lld, \"timed_launches\": %d}\n",
              prop.name, prop.multiProcessorCount, static_cast<long long>(n), kTimed);
  float *x = nullptr, *y = nullptr;
  uint32_t* sink = nullptr;
  CK(cudaMalloc(&x, n * 4));
  CK(cudaMalloc(&y, n * 4));
  CK(cudaMalloc(&sink, 4));
  zero_sign_report();
  fill<<<1024, 256>>>(x, n);
  CK(cudaDeviceSynchronize());
  const int grid = sm_count() * 8;
  auto copy_us = time_us([&] {
    copy2x<<<grid, 256>>>(reinterpret_cast<const float4*>(x), reinterpret_cast<float4*>(y), n / 4);
  });
  g_copy_us = copy_us.first;
  report("copy (y = 2x, float4)", "float32", 32, 8.0 * n, copy_us);
  report("read only", "float32", 32, 4.0 * n, time_us([&] {
           read_only<<<grid, 256>>>(reinterpret_cast<const uint4*>(x), n / 4, sink);
         }));
  quantize_suite<float, 4>("float32", n, x);
  quantize_suite<float, 8>("float32", n, x);
  quantize_suite<__nv_bfloat16, 4>("bfloat16", n, x);
  CK(cudaFree(x));
  CK(cudaFree(y));
  return 0;
}
