// Quantile Balancing (model/load_balance) against the independent torch transcription of the
// seed's QuantileBalancer.update (tests/reference/qb_reference.py), on recorded random router
// scores: ties, k = 1, k = E - 1, a window size where torch's fp32 quantile rank rounds up, a
// group-limited router, and a skewed router.
//
// Exactness:
//   quantile (before centering): exactly equal. Both sides compute s + b, the (k+1)-th largest
//     biased score and cutoff - s with the same fp32 operations on the same fp32 inputs, and the
//     "higher" quantile picks one of those samples (same index: torch's fp32 rank), so there is
//     no rounding in which they could differ.
//   bias, centered with the fp64 mean (bias_f64mean): exactly equal. The fp64 sum of E fp32
//     values is exact here (no summation-order effect), the mean is rounded once to fp32, and
//     the subtraction is one fp32 operation on both sides.
//   bias, centered as the seed does (fp32 torch mean): within 1e-6. torch's fp32 sum order
//     depends on its SIMD dispatch, so the mean may differ by an ulp; the maximum difference is
//     printed.
//   counts: exactly equal (observed with the input bias; predicted with the bitwise-equal
//     fp64-mean bias): integer results of identical comparisons, ties to the lower index.
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/npy.h"
#include "gtest/gtest.h"
#include "model/load_balance.h"

namespace moe {
namespace {

std::string Dir() {
  const char* tmp = std::getenv("TMPDIR");
  return absl::StrCat(tmp ? tmp : "/tmp", "/moe_load_balance_reference_", getpid());
}

struct Case {
  std::string name;
  int tokens, experts, top_k;
  int n_group = 1, topk_group = 1;
  enum Scores { kSigmoid, kGrid } scores = kSigmoid;  // kGrid: multiples of 1/8 (many ties)
  float favoured_bias = 0.0f;                         // on the first 10% of experts
};
void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

class LoadBalanceReferenceTest : public ::testing::TestWithParam<Case> {
 protected:
  static void SetUpTestSuite() { std::filesystem::create_directories(Dir()); }
  static void TearDownTestSuite() { std::filesystem::remove_all(Dir()); }
};

std::vector<int64_t> Int64s(const NpyArray& a) { return {a.ints.begin(), a.ints.end()}; }

TEST_P(LoadBalanceReferenceTest, MatchesTorchTranscriptionOfTheSeed) {
  const Case& c = GetParam();
  const int N = c.tokens, E = c.experts;
  std::mt19937 rng(N * 131 + E * 7 + c.top_k);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> scores(static_cast<size_t>(N) * E), bias(E);
  for (float& s : scores) {
    if (c.scores == Case::kGrid)
      s = static_cast<float>(rng() % 9) / 8.0f;
    else
      s = 1.0f / (1.0f + std::exp(-normal(rng)));
  }
  for (int e = 0; e < E; ++e) {
    if (c.scores == Case::kGrid)
      bias[e] = static_cast<float>(static_cast<int>(rng() % 3) - 1) / 8.0f;
    else
      bias[e] = 0.02f * normal(rng);
    if (e < E / 10) bias[e] += c.favoured_bias;
  }

  RoutingParams routing;
  routing.num_experts = E;
  routing.top_k = c.top_k;
  routing.n_group = c.n_group;
  routing.topk_group = c.topk_group;
  auto result = QuantileBalance(scores, bias, routing);
  ASSERT_TRUE(result.ok()) << result.status();

  const std::string tag = absl::StrCat(Dir(), "/", c.name);
  ASSERT_TRUE(WriteNpyFloat32(tag + "_scores.npy", {N, E}, scores.data()).ok());
  ASSERT_TRUE(WriteNpyFloat32(tag + "_bias.npy", {E}, bias.data()).ok());
  const std::string cmd = absl::StrCat(
      "/usr/bin/python3 ", MOE_SOURCE_DIR, "/tests/reference/qb_reference.py --scores ", tag,
      "_scores.npy --bias ", tag, "_bias.npy --top-k ", c.top_k, " --n-group ", c.n_group,
      " --topk-group ", c.topk_group, " --out-dir ", tag, "_out");
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  auto read = [&](const std::string& name) {
    auto a = ReadNpy(absl::StrCat(tag, "_out/", name, ".npy"));
    EXPECT_TRUE(a.ok()) << a.status();
    return a.ok() ? *a : NpyArray{};
  };
  const NpyArray quantile = read("quantile"), bias_seed = read("bias"),
                 bias_f64 = read("bias_f64mean"), observed = read("observed"),
                 predicted_f64 = read("predicted_f64mean");
  ASSERT_EQ(quantile.data.size(), static_cast<size_t>(E));
  ASSERT_EQ(bias_seed.data.size(), static_cast<size_t>(E));
  ASSERT_EQ(bias_f64.data.size(), static_cast<size_t>(E));

  double max_seed_diff = 0;
  for (int e = 0; e < E; ++e) {
    // == on floats: equal values, whatever the sign of a zero.
    EXPECT_EQ(result->quantile[e], quantile.data[e]) << "expert " << e;
    EXPECT_EQ(result->bias[e], bias_f64.data[e]) << "expert " << e;
    const double d = std::abs(static_cast<double>(result->bias[e]) - bias_seed.data[e]);
    EXPECT_LE(d, 1e-6) << "expert " << e;
    max_seed_diff = std::max(max_seed_diff, d);
  }
  EXPECT_EQ(result->observed_counts, Int64s(observed));
  EXPECT_EQ(result->predicted_counts, Int64s(predicted_f64));
  std::printf(
      "  %s: N=%d E=%d k=%d: quantiles and biases exact; |bias - seed-centered bias| <= %.2g; "
      "balancedness observed %.4f, predicted %.4f\n",
      c.name.c_str(), N, E, c.top_k, max_seed_diff, result->observed_balancedness,
      result->predicted_balancedness);
  RecordProperty("observed_balancedness", absl::StrCat(result->observed_balancedness));
  RecordProperty("predicted_balancedness", absl::StrCat(result->predicted_balancedness));
  if (c.favoured_bias > 0) {
    EXPECT_GT(result->predicted_balancedness, result->observed_balancedness + 0.3);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, LoadBalanceReferenceTest,
    ::testing::Values(Case{"k3_mini", 1000, 64, 2}, Case{"ties", 300, 16, 4, 1, 1, Case::kGrid},
                      Case{"ties_k1", 257, 8, 1, 1, 1, Case::kGrid}, Case{"k1", 500, 32, 1},
                      Case{"k_e_minus_1", 257, 8, 7},
                      Case{"ties_k_e_minus_1", 100, 8, 7, 1, 1, Case::kGrid},
                      Case{"one_token", 1, 16, 3},
                      // 0.3 * 50 = 15 but torch's fp32 rank is 15.000001: index 16.
                      Case{"fp32_rank", 51, 10, 3}, Case{"grouped", 400, 64, 6, 8, 3},
                      Case{"skewed", 4096, 64, 2, 1, 1, Case::kSigmoid, 0.3f}),
    [](const ::testing::TestParamInfo<Case>& param_info) { return param_info.param.name; });

}  // namespace
}  // namespace moe
