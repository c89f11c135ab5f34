// Exhaustive host check of the conversion-free code arithmetic of ffi/quant_fast.cuh:
//   * round_code<BITS>(v, lo, hi, kRoundMagic + off) == clamp(cvt.rni.s32.f32(v), lo, hi) + off
//     for every non-NaN fp32 v (2^32 - 2^24 inputs) and the four encoders of the fast kernels
//     (4 / 8 bits, asym [0, 2^b - 1] and sym [-qmax, qmax] + qmax + 1); a finite group never
//     encodes a NaN (quant_fast.cuh), and a non-finite group's codes are masked to 0;
//   * code_to_f32(c) == (float)c for every code c < 256.
// The cvt form is emulated as the device defines it: round to nearest even, saturating.
// Besides the bit patterns, every half-integer in [-600, 600] and its two fp32 neighbours (the
// ties and the values next to them) are checked on every run.
// Build and run (any x86-64 or arm64 host, about two minutes a core for all patterns):
//   g++ -O2 -ffp-contract=off -std=c++17 -Iffi ffi/tools/round_code_check.cc -o round_code_check
//   ./round_code_check          # every pattern; prints "mismatches: 0" and exits 0
//   ./round_code_check 65537    # every 65537th pattern (tests/echo_jax/test_round_code_check.py)
#include <cmath>
#include <cstdio>
#include <cstdlib>

// The header's device-only helpers (the rotation's shuffles) compile on the host as no-ops.
#define __device__
#define __forceinline__ inline
#define __shfl_xor_sync(mask, v, o) (v)
#include "quant_fast.cuh"

namespace {

using echo::f32_bits;
using echo::f32_from_bits;

int32_t cvt_rni_s32(float v) {  // cvt.rni.s32.f32: ties to even, saturating (no NaN here)
  if (v >= 2147483648.0f) return 0x7FFFFFFF;
  if (v <= -2147483648.0f) return static_cast<int32_t>(0x80000000u);
  return static_cast<int32_t>(std::nearbyint(v));
}

template <int BITS>
bool same_code(float v, int lo, int hi, int off, long& bad) {
  if (v != v) return true;
  int32_t q = cvt_rni_s32(v);
  q = q < lo ? lo : q > hi ? hi : q;
  const uint32_t want = static_cast<uint32_t>(q + off);
  const uint32_t got = echo::fast::round_code<BITS>(v, static_cast<float>(lo),
                                                    static_cast<float>(hi),
                                                    echo::fast::kRoundMagic + off);
  if (want == got) return true;
  if (bad < 5)
    std::printf("bits %d [%d, %d] + %d: v = %a: want %u, got %u\n", BITS, lo, hi, off, v, want,
                got);
  ++bad;
  return false;
}

template <int BITS>
long check_encoder(int lo, int hi, int off, uint64_t stride) {
  long bad = 0;
  for (uint64_t u = 0; u < (uint64_t{1} << 32); u += stride)
    same_code<BITS>(f32_from_bits(static_cast<uint32_t>(u)), lo, hi, off, bad);
  for (int k = -1200; k <= 1200; ++k) {  // v = k / 2: every tie, and the values beside it
    const float v = 0.5f * static_cast<float>(k);
    same_code<BITS>(v, lo, hi, off, bad);
    same_code<BITS>(std::nextafter(v, -1e30f), lo, hi, off, bad);
    same_code<BITS>(std::nextafter(v, 1e30f), lo, hi, off, bad);
  }
  return bad;
}

}  // namespace

int main(int argc, char** argv) {
  const uint64_t stride = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 1;
  if (stride == 0) {
    std::printf("stride must be a positive integer, got %s\n", argv[1]);
    return 2;
  }
  long bad = check_encoder<4>(0, 15, 0, stride) + check_encoder<4>(-7, 7, 8, stride) +
             check_encoder<8>(0, 255, 0, stride) + check_encoder<8>(-127, 127, 128, stride);
  for (uint32_t c = 0; c < 256; ++c) {
    if (f32_bits(echo::fast::code_to_f32(c)) != f32_bits(static_cast<float>(c))) {
      std::printf("code %u: %a\n", c, echo::fast::code_to_f32(c));
      ++bad;
    }
  }
  std::printf("mismatches: %ld\n", bad);
  return bad != 0;
}
