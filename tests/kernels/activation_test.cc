// The vector GLU rows against the scalar definition (core/numerics.h), bit for bit.
#include <cstring>
#include <random>

#include "gtest/gtest.h"
#include "kernels/cpu/dot.h"

namespace moe::cpu {
namespace {

TEST(ActivationTest, VectorGluMatchesScalarBitForBit) {
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx512f"))
    GTEST_SKIP() << "no AVX-512: only the portable activation exists";
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> dist(-12.0f, 12.0f);
  for (int64_t n : {1, 15, 16, 17, 1000}) {
    std::vector<float> g(n), u(n);
    for (int64_t i = 0; i < n; ++i) {
      g[i] = dist(rng) * (i % 5 == 0 ? 0.02f : 1.0f) * (i % 11 == 0 ? 20.0f : 1.0f);
      u[i] = dist(rng) * (i % 3 == 0 ? 5.0f : 1.0f);
    }
    if (n > 4) {  // the tanh branch boundaries and the saturation point
      g[0] = 4 * 0.3f;
      u[1] = 25 * 0.3f;
      g[2] = 36.0f;
      u[3] = -225.0f;
    }
    for (Activation kind : {Activation::kSiTU, Activation::kSiLU})
      for (Precision p : {Precision::kBF16, Precision::kFP32}) {
        ActivationParams act{kind, 4.0f, 25.0f};
        std::vector<float> scalar(n), vector(n);
        PortableGluRow(g.data(), u.data(), n, act, p, scalar.data());
        Avx512GluRow()(g.data(), u.data(), n, act, p, vector.data());
        for (int64_t i = 0; i < n; ++i)
          ASSERT_EQ(std::memcmp(&scalar[i], &vector[i], 4), 0)
              << "n=" << n << " i=" << i << " g=" << g[i] << " u=" << u[i] << ": " << scalar[i]
              << " vs " << vector[i];
      }
  }
}

}  // namespace
}  // namespace moe::cpu
