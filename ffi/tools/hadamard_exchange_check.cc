// Host check of the half-exchange rotation of ffi/quant_fast.cuh (hadamard_exchange_rotate /
// _unrotate, the CUDA kernels' ECHO_P2P_ROT_EXCHANGE): the device functions themselves run on
// 32 host threads, one a lane of a warp, with __shfl_xor_sync emulated through a barrier, and
// their results, stored where ExchangePlans says (rotated_lane / rotated_piece / output_lane),
// must equal echo_common.h's hadamard_rotate_group / hadamard_unrotate_group (the reference's
// stage order) bit for bit (NaN as NaN). Every layout the all-reduce's rotated instances can
// have is checked: fp32 and 16-bit values (4 / 8 a piece), g = 32 .. 256, two and four pieces a
// lane. The register-butterfly rotation (hadamard_rotate) runs through the same harness first, as
// a check of the harness.
// Build and run (any host with threads):
//   g++ -O2 -ffp-contract=off -std=c++17 -pthread -Iffi ffi/tools/hadamard_exchange_check.cc \
//       -o hadamard_exchange_check
//   ./hadamard_exchange_check [group sets a layout, default 40]   # "mismatches: 0", exit 0
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

namespace emu {
constexpr int kWarp = 32;
thread_local int lane = 0;
float slot[kWarp];
std::atomic<int> arrived{0};
std::atomic<int> phase{0};

// A sense-reversing barrier of the 32 lane threads (yields: the host may have few cores).
void barrier() {
  const int my = phase.load();
  if (arrived.fetch_add(1) == kWarp - 1) {
    arrived.store(0);
    phase.store(my + 1);
  } else {
    while (phase.load() == my) std::this_thread::yield();
  }
}

float shfl_xor(float v, int o) {
  slot[lane] = v;
  barrier();
  const float r = slot[lane ^ o];
  barrier();
  return r;
}
}  // namespace emu

#define __device__
#define __forceinline__ inline
#define __shfl_xor_sync(mask, v, o) emu::shfl_xor((v), (o))
inline float __uint_as_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t __float_as_uint(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
#include "quant_fast.cuh"

namespace {

bool same(float a, float b) {
  return (a != a && b != b) || __float_as_uint(a) == __float_as_uint(b);
}

// Group set q's values: random normals of several scales, and groups of zeros of both signs,
// infinities, a NaN, fp32 subnormals and huge values mixed in.
void fill(std::vector<float>& x, int g, int q, std::mt19937& rng) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const float scale = std::ldexp(1.0f, static_cast<int>(rng() % 40) - 20);
  for (int i = 0; i < g; ++i) x[i] = nd(rng) * scale;
  switch (q % 6) {
    case 1:  // zeros of both signs, the rest cancelling pairs
      for (int i = 0; i < g; ++i) x[i] = (i % 3 == 0) ? (i % 2 ? -0.0f : 0.0f) : x[i & ~1];
      break;
    case 2: x[rng() % g] = INFINITY; x[rng() % g] = -INFINITY; break;
    case 3: x[rng() % g] = NAN; break;
    case 4: for (int i = 0; i < g; i += 3) x[i] = std::ldexp(1.0f, -140) * (i % 2 ? -1 : 1); break;
    case 5: for (int i = 0; i < g; i += 5) x[i] = 3.0e38f * (i % 2 ? -1 : 1); break;
    default: break;
  }
}

// One layout: kGpw groups a warp, each lane's slots loaded and stored where the plans say.
template <class L, bool kExchange>
long check_layout(int sets, const char* name) {
  constexpr int G = L::kLanes * L::kVec * L::kLoads;
  constexpr int kGpw = L::kGroupsPerWarp;
  const float f = echo::hadamard_scale(G);
  using X = echo::fast::ExchangePlans<L>;
  std::vector<float> x(kGpw * G), r(kGpw * G), y(kGpw * G), want_r(kGpw * G), want_y(kGpw * G);
  std::atomic<long> bad{0};
  std::mt19937 rng(G * 131 + L::kVec * 7 + L::kLoads);
  for (int set = 0; set < sets; ++set) {
    for (int q = 0; q < kGpw; ++q) {
      std::vector<float> g(G);
      fill(g, G, set * kGpw + q, rng);
      std::copy(g.begin(), g.end(), x.begin() + q * G);
      echo::hadamard_rotate_group(g.data(), G, f);
      std::copy(g.begin(), g.end(), want_r.begin() + q * G);
      echo::hadamard_unrotate_group(g.data(), G, f);
      std::copy(g.begin(), g.end(), want_y.begin() + q * G);
    }
    std::vector<std::thread> lanes;
    for (int ln = 0; ln < emu::kWarp; ++ln) {
      lanes.emplace_back([&, ln] {
        emu::lane = ln;
        const int q = ln / L::kLanes, j = ln % L::kLanes;
        float v[L::kLoads][L::kVec];
        // forward: input layout -> rotated layout
        for (int m = 0; m < L::kLoads; ++m)
          for (int t = 0; t < L::kVec; ++t) {
            const int piece = kExchange ? X::input_piece(j, m) : m;
            v[m][t] = x[q * G + L::index(j, piece, t)];
          }
        if constexpr (kExchange) {
          echo::fast::hadamard_exchange_rotate<L>(v, j, echo::fast::exchange_sign_mask<L>(j, true),
                                                  f);
        } else {
          echo::fast::hadamard_rotate<L, true>(v, j, echo::fast::hadamard_sign_mask<L>(j), f);
        }
        for (int m = 0; m < L::kLoads; ++m)
          for (int t = 0; t < L::kVec; ++t) {
            const int i = kExchange ? L::index(X::rotated_lane(j), X::rotated_piece(j, m), t)
                                    : L::index(j, m, t);
            r[q * G + i] = v[m][t];
          }
        emu::barrier();  // r complete before any lane reads it back
        // inverse: the reference's rotated values, loaded as the rotated layout -> output layout
        for (int m = 0; m < L::kLoads; ++m)
          for (int t = 0; t < L::kVec; ++t) {
            const int i = kExchange ? L::index(X::rotated_lane(j), X::rotated_piece(j, m), t)
                                    : L::index(j, m, t);
            v[m][t] = want_r[q * G + i];
          }
        if constexpr (kExchange) {
          echo::fast::hadamard_exchange_unrotate<L>(
              v, j, echo::fast::exchange_sign_mask<L>(j, false), f);
        } else {
          echo::fast::hadamard_unrotate<L, true>(v, j, echo::fast::hadamard_sign_mask<L>(j), f);
        }
        for (int m = 0; m < L::kLoads; ++m)
          for (int t = 0; t < L::kVec; ++t) {
            const int lane_out = kExchange ? X::output_lane(j) : j;
            y[q * G + L::index(lane_out, m, t)] = v[m][t];
          }
      });
    }
    for (auto& th : lanes) th.join();
    for (int i = 0; i < kGpw * G; ++i) {
      if (!same(r[i], want_r[i]) || !same(y[i], want_y[i])) {
        if (bad < 5)
          std::printf("%s set %d value %d: rotated %a want %a, unrotated %a want %a\n", name, set,
                      i, r[i], want_r[i], y[i], want_y[i]);
        ++bad;
      }
    }
  }
  std::printf("%-44s g=%3d lanes=%2d pieces=%d: %ld mismatches\n", name, G, L::kLanes, L::kLoads,
              bad.load());
  return bad;
}

template <int VEC, int G, int LOADS>
long check_both(int sets, const char* type) {
  // QuantLayout takes the value type for its piece width only: 4-byte or 2-byte stand-ins.
  using T = std::conditional_t<VEC == 4, float, uint16_t>;
  using L = echo::fast::QuantLayout<T, G, echo::fast::lanes_for_loads<T, G, LOADS>()>;
  char name[64];
  std::snprintf(name, sizeof(name), "%s butterflies", type);
  long bad = check_layout<L, false>(sets, name);
  std::snprintf(name, sizeof(name), "%s half exchanges", type);
  return bad + check_layout<L, true>(sets, name);
}

}  // namespace

int main(int argc, char** argv) {
  const int sets = argc > 1 ? std::atoi(argv[1]) : 40;
  long bad = 0;
  bad += check_both<4, 32, 2>(sets, "fp32");
  bad += check_both<4, 64, 2>(sets, "fp32");
  bad += check_both<4, 128, 2>(sets, "fp32");
  bad += check_both<4, 256, 2>(sets, "fp32");
  bad += check_both<4, 128, 4>(sets, "fp32");
  bad += check_both<4, 256, 4>(sets, "fp32");
  bad += check_both<8, 32, 2>(sets, "16-bit");
  bad += check_both<8, 64, 2>(sets, "16-bit");
  bad += check_both<8, 128, 2>(sets, "16-bit");
  bad += check_both<8, 256, 2>(sets, "16-bit");
  bad += check_both<8, 128, 4>(sets, "16-bit");
  bad += check_both<8, 64, 4>(sets, "16-bit");
  std::printf("mismatches: %ld\n", bad);
  return bad == 0 ? 0 : 1;
}
