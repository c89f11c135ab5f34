// The generic stages of the fused all-reduce: one warp per group, g, bits and policy at run
// time, so they serve every format (any g; with the rotation, any power-of-two g up to
// kMaxRotatedGroup); the fast stages (p2p_fast.cuh) serve the common ones. The arithmetic is
// echo_common.h's, in the same order of rounded operations. Included by p2p_cuda.cu.
#ifndef ECHO_JAX_FFI_P2P_GENERIC_CUH_
#define ECHO_JAX_FFI_P2P_GENERIC_CUH_

#include "p2p_layout.cuh"

namespace echo {
namespace cuda {
namespace {

// push: quantize group `grp` of segment `seg` into owner seg's push slot for this rank.
template <typename T, int VEC, bool COMP>
__device__ void push_group(const KernelArgs& a, int seg, int64_t grp, int64_t local, int lane) {
  const int cb = a.g * a.bits / 8;
  const int chunks = a.g / VEC;
  const int64_t e0 = seg * a.seg_groups * a.g + grp * a.g;
  GroupStats st = empty_stats();
  float cache[kCacheChunks][VEC];  // one pass over x (and m1, m2) when the group fits
  for (int c = lane, i = 0; c < chunks; c += kWarp, ++i) {
    float v[VEC];
    load_contrib<T, VEC, COMP>(a, e0 + c * VEC, v);
    stats_add_vec(st, v, VEC);
    if (i < kCacheChunks) {
#pragma unroll
      for (int k = 0; k < VEC; ++k) cache[i][k] = v[k];
    }
  }
  warp_stats(st);
  const QuantParams p = make_params(st, a.bits, a.policy);
  uint8_t* slot = a.ws[seg] + push_slot(a.me, a.slot_bytes);
  uint8_t* codes = slot + local * cb;
  if (lane == 0) {
    uint16_t* prm = reinterpret_cast<uint16_t*>(slot + a.params_offset) + local * num_params(a.policy);
    prm[0] = p.s16;
    if (a.policy != kPolicySym) prm[1] = p.z16;
  }
  for (int c = lane, i = 0; c < chunks; c += kWarp, ++i) {
    float v[VEC];
    if (i < kCacheChunks) {
#pragma unroll
      for (int k = 0; k < VEC; ++k) v[k] = cache[i][k];
    } else {
      load_contrib<T, VEC, COMP>(a, e0 + c * VEC, v);  // large groups: a second (cached) read
    }
    encode_chunk<VEC>(v, p, a.bits, a.policy, codes + c * VEC * a.bits / 8);
  }
}

// One value chunk of the owner's fp32 sum, in rank order with its own contribution in place.
template <typename T, int VEC, bool COMP>
__device__ __forceinline__ void sum_chunk(const KernelArgs& a, int64_t e, int64_t local, int c,
                                          float* acc) {
  const int cb = a.g * a.bits / 8;
  const int np = num_params(a.policy);
  for (int r = 0; r < a.P; ++r) {
    float v[VEC];
    if (r == a.me) {
      load_contrib<T, VEC, COMP>(a, e, v);
    } else {
      const uint8_t* slot = a.ws[a.me] + push_slot(r, a.slot_bytes);
      const DequantParams d = load_dequant_params(
          reinterpret_cast<const uint16_t*>(slot + a.params_offset) + local * np, a.bits, a.policy);
      decode_chunk<VEC>(slot + local * cb + c * VEC * a.bits / 8, d, a.bits, v);
    }
#pragma unroll
    for (int k = 0; k < VEC; ++k) acc[k] = r == 0 ? v[k] : add_rn(acc[k], v[k]);
  }
}

// reduce + gather of one group of the own segment.
template <typename T, int VEC, bool COMP, bool UPDATE = COMP>
__device__ void reduce_group(const KernelArgs& a, int64_t grp, int64_t local, int lane) {
  const int cb = a.g * a.bits / 8;
  const int np = num_params(a.policy);
  const int chunks = a.g / VEC;
  const int64_t e0 = a.me * a.seg_groups * a.g + grp * a.g;
  float cache[kCacheChunks][VEC];
  GroupStats st = empty_stats();
  for (int c = lane, i = 0; c < chunks; c += kWarp, ++i) {
    float acc[VEC];
    sum_chunk<T, VEC, COMP>(a, e0 + c * VEC, local, c, acc);
    stats_add_vec(st, acc, VEC);
    if (i < kCacheChunks) {
#pragma unroll
      for (int k = 0; k < VEC; ++k) cache[i][k] = acc[k];
    }
  }
  warp_stats(st);
  const QuantParams p = make_params(st, a.bits, a.policy);
  if (lane < a.P) {  // the parameters go to every rank's gather slot for this owner
    uint16_t* prm = reinterpret_cast<uint16_t*>(a.ws[lane] + gather_slot(a.me, a.P, a.slot_bytes) +
                                                a.params_offset) + local * np;
    prm[0] = p.s16;
    if (a.policy != kPolicySym) prm[1] = p.z16;
  }
  uint16_t prm_local[2] = {p.s16, p.z16};
  const DequantParams d = dequant_params(prm_local, a.bits, a.policy);
  for (int c = lane, i = 0; c < chunks; c += kWarp, ++i) {
    float acc[VEC];
    if (i < kCacheChunks) {
#pragma unroll
      for (int k = 0; k < VEC; ++k) acc[k] = cache[i][k];
    } else {
      sum_chunk<T, VEC, COMP>(a, e0 + c * VEC, local, c, acc);
    }
    uint8_t codes[VEC];
    float y[VEC];
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      codes[k] = encode_value(acc[k], p, a.bits, a.policy);
      y[k] = decode_value(codes[k], d);  // the owner decodes the same code its peers receive
    }
    const int64_t byte = local * cb + c * VEC * a.bits / 8;
    for (int r = 0; r < a.P; ++r)
      store_codes<VEC>(a.ws[r] + gather_slot(a.me, a.P, a.slot_bytes) + byte, a.bits, codes);
    store_output<T, VEC, COMP, UPDATE>(a, e0 + c * VEC, y);
  }
}

// tail: dequantize one group of owner seg's reduced code.
template <typename T, int VEC, bool COMP, bool UPDATE = COMP>
__device__ void tail_group(const KernelArgs& a, int seg, int64_t grp, int64_t local, int lane) {
  const int cb = a.g * a.bits / 8;
  const int np = num_params(a.policy);
  const int chunks = a.g / VEC;
  const int64_t e0 = seg * a.seg_groups * a.g + grp * a.g;
  const uint8_t* slot = a.ws[a.me] + gather_slot(seg, a.P, a.slot_bytes);
  const DequantParams d = load_dequant_params(
      reinterpret_cast<const uint16_t*>(slot + a.params_offset) + local * np, a.bits, a.policy);
  for (int c = lane; c < chunks; c += kWarp) {
    float y[VEC];
    decode_chunk<VEC>(slot + local * cb + c * VEC * a.bits / 8, d, a.bits, y);
    store_output<T, VEC, COMP, UPDATE>(a, e0 + c * VEC, y);
  }
}

// The generic stages over a tile: one warp per group, g / bits / policy at run time (any g).
// UPDATE as in FastStages (false: the applied call).
template <typename T, int VEC, bool COMP, bool UPDATE = COMP>
struct GenericStages {
  static constexpr int kMinBlocks = 1;  // __launch_bounds__' second argument
  static constexpr int kBlockThreads = kThreads;  // its first
  static constexpr bool kSmemSpills = false;
  __device__ static void setup() {}
  __device__ static void push(const KernelArgs& a, int seg, int64_t first, int count,
                              int64_t local0, int warp, int warps, int lane) {
    for (int q = warp; q < count; q += warps) push_group<T, VEC, COMP>(a, seg, first + q, local0 + q, lane);
  }
  __device__ static void reduce(const KernelArgs& a, int64_t first, int count, int64_t local0,
                                int warp, int warps, int lane) {
    for (int q = warp; q < count; q += warps) reduce_group<T, VEC, COMP, UPDATE>(a, first + q, local0 + q, lane);
  }
  __device__ static void tail(const KernelArgs& a, int seg, int64_t first, int count,
                              int64_t local0, int warp, int warps, int lane) {
    for (int q = warp; q < count; q += warps) tail_group<T, VEC, COMP, UPDATE>(a, seg, first + q, local0 + q, lane);
  }
};

// The generic stages with the Hadamard rotation (any power-of-two g <= kMaxRotatedGroup): a warp
// stages its group in shared memory, rotates it there (echo_common.h's stages, lane-strided
// pairs, __syncwarp between stages) and quantizes from there; sums and outputs likewise. The
// fallback of the fast stages (g outside their instances, rows not 16-byte aligned), so plain.
constexpr int kMaxRotatedGroup = 1024;

template <typename T, bool COMP, bool UPDATE = COMP>
struct RotatedGenericStages {
  static constexpr int VEC = 2;  // g >= 2 and even: two values a chunk (one byte of 4-bit codes)
  static constexpr int kMinBlocks = 1;
  static constexpr int kBlockThreads = kThreads;  // group_buffer: a buffer a warp
  static constexpr bool kSmemSpills = false;

  __device__ static void setup() {}

  __device__ static float* group_buffer(int warp) {
    __shared__ float buf[kThreads / kWarp][kMaxRotatedGroup];  // 32 KiB a block
    return buf[warp];
  }

  // In place on the warp's buffer b[0, g): forward (v * s, stages, * f) or inverse (stages,
  // * s f). Reads and writes of a stage by other lanes are ordered by __syncwarp.
  __device__ static void rotate(float* b, int g, int lane, float f, bool inverse) {
    __syncwarp();  // b was written by the lanes of other chunks
    if (!inverse) {
      for (int i = lane; i < g; i += kWarp)
        b[i] = mul_rn(b[i], hadamard_sign_negative(i) ? -1.0f : 1.0f);
    }
    __syncwarp();
    for (int h = 1; h < g; h *= 2) {
      for (int p = lane; p < g / 2; p += kWarp) {
        const int i = (p / h) * 2 * h + p % h;
        const float x0 = b[i], x1 = b[i + h];
        b[i] = add_rn(x0, x1);
        b[i + h] = sub_rn(x0, x1);
      }
      __syncwarp();
    }
    for (int i = lane; i < g; i += kWarp)
      b[i] = mul_rn(b[i], inverse && hadamard_sign_negative(i) ? -f : f);
    __syncwarp();
  }

  // The quantization parameters of the (rotated) group in b.
  __device__ static QuantParams quantize_buffer(const KernelArgs& a, const float* b, int lane) {
    GroupStats st = empty_stats();
    for (int c = lane; c < a.g / VEC; c += kWarp) stats_add_vec(st, b + c * VEC, VEC);
    warp_stats(st);
    return make_params(st, a.bits, a.policy);
  }

  __device__ static void push(const KernelArgs& a, int seg, int64_t first, int count,
                              int64_t local0, int warp, int warps, int lane) {
    const int cb = a.g * a.bits / 8;
    float* b = group_buffer(warp);
    uint8_t* slot = a.ws[seg] + push_slot(a.me, a.slot_bytes);
    for (int q = warp; q < count; q += warps) {
      const int64_t local = local0 + q;
      const int64_t e0 = (seg * a.seg_groups + first + q) * a.g;
      for (int c = lane; c < a.g / VEC; c += kWarp)
        load_contrib<T, VEC, COMP>(a, e0 + c * VEC, b + c * VEC);
      rotate(b, a.g, lane, a.rot_scale, false);
      const QuantParams p = quantize_buffer(a, b, lane);
      if (lane == 0) {
        uint16_t* prm =
            reinterpret_cast<uint16_t*>(slot + a.params_offset) + local * num_params(a.policy);
        prm[0] = p.s16;
        if (a.policy != kPolicySym) prm[1] = p.z16;
      }
      for (int c = lane; c < a.g / VEC; c += kWarp)
        encode_chunk<VEC>(b + c * VEC, p, a.bits, a.policy,
                          slot + local * cb + c * VEC * a.bits / 8);
      __syncwarp();  // b is reused by the next group
    }
  }

  __device__ static void reduce(const KernelArgs& a, int64_t first, int count, int64_t local0,
                                int warp, int warps, int lane) {
    const int cb = a.g * a.bits / 8;
    const int np = num_params(a.policy);
    float* b = group_buffer(warp);
    for (int q = warp; q < count; q += warps) {
      const int64_t local = local0 + q;
      const int64_t e0 = (a.me * a.seg_groups + first + q) * a.g;
      for (int c = lane; c < a.g / VEC; c += kWarp)
        load_contrib<T, VEC, COMP>(a, e0 + c * VEC, b + c * VEC);
      rotate(b, a.g, lane, a.rot_scale, false);  // the own contribution, rotated like the peers'
      for (int c = lane; c < a.g / VEC; c += kWarp) {  // sum in rank order, own value in place
        float acc[VEC];
        for (int r = 0; r < a.P; ++r) {
          float v[VEC];
          if (r == a.me) {
            v[0] = b[c * VEC];
            v[1] = b[c * VEC + 1];
          } else {
            const uint8_t* slot = a.ws[a.me] + push_slot(r, a.slot_bytes);
            const DequantParams d = load_dequant_params(
                reinterpret_cast<const uint16_t*>(slot + a.params_offset) + local * np, a.bits,
                a.policy);
            decode_chunk<VEC>(slot + local * cb + c * VEC * a.bits / 8, d, a.bits, v);
          }
#pragma unroll
          for (int k = 0; k < VEC; ++k) acc[k] = r == 0 ? v[k] : add_rn(acc[k], v[k]);
        }
        b[c * VEC] = acc[0];
        b[c * VEC + 1] = acc[1];
      }
      __syncwarp();
      const QuantParams p = quantize_buffer(a, b, lane);
      if (lane < a.P) {  // the parameters go to every rank's gather slot for this owner
        uint8_t* gather = a.ws[lane] + gather_slot(a.me, a.P, a.slot_bytes);
        uint16_t* prm = reinterpret_cast<uint16_t*>(gather + a.params_offset) + local * np;
        prm[0] = p.s16;
        if (a.policy != kPolicySym) prm[1] = p.z16;
      }
      uint16_t prm_local[2] = {p.s16, p.z16};
      const DequantParams d = dequant_params(prm_local, a.bits, a.policy);
      for (int c = lane; c < a.g / VEC; c += kWarp) {
        uint8_t codes[VEC];
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          codes[k] = encode_value(b[c * VEC + k], p, a.bits, a.policy);
          b[c * VEC + k] = decode_value(codes[k], d);  // the code every rank decodes
        }
        for (int r = 0; r < a.P; ++r)
          store_codes<VEC>(a.ws[r] + gather_slot(a.me, a.P, a.slot_bytes) + local * cb +
                               c * VEC * a.bits / 8, a.bits, codes);
      }
      rotate(b, a.g, lane, a.rot_scale, true);
      for (int c = lane; c < a.g / VEC; c += kWarp)
        store_output<T, VEC, COMP, UPDATE>(a, e0 + c * VEC, b + c * VEC);
      __syncwarp();
    }
  }

  __device__ static void tail(const KernelArgs& a, int seg, int64_t first, int count,
                              int64_t local0, int warp, int warps, int lane) {
    const int cb = a.g * a.bits / 8;
    const int np = num_params(a.policy);
    float* b = group_buffer(warp);
    const uint8_t* slot = a.ws[a.me] + gather_slot(seg, a.P, a.slot_bytes);
    for (int q = warp; q < count; q += warps) {
      const int64_t local = local0 + q;
      const int64_t e0 = (seg * a.seg_groups + first + q) * a.g;
      const DequantParams d = load_dequant_params(
          reinterpret_cast<const uint16_t*>(slot + a.params_offset) + local * np, a.bits,
          a.policy);
      for (int c = lane; c < a.g / VEC; c += kWarp)
        decode_chunk<VEC>(slot + local * cb + c * VEC * a.bits / 8, d, a.bits, b + c * VEC);
      rotate(b, a.g, lane, a.rot_scale, true);
      for (int c = lane; c < a.g / VEC; c += kWarp)
        store_output<T, VEC, COMP, UPDATE>(a, e0 + c * VEC, b + c * VEC);
      __syncwarp();
    }
  }
};

}  // namespace
}  // namespace cuda
}  // namespace echo

#endif  // ECHO_JAX_FFI_P2P_GENERIC_CUH_
