// CpuBackend ops against plain fp64 loops, on random data and awkward sizes.
#include "kernels/cpu/cpu_backend.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>

#include "gtest/gtest.h"
#include "tests/kernels/test_weights.h"
#include "tests/kernels/tier_checks.h"
#include "tests/kernels/tier_testing.h"

namespace moe {
namespace {

using testing::RandomActivations;
using testing::RandomWeight;
using testing::ReferenceLinear;

MatrixView View(std::vector<float>& v, int64_t rows, int64_t cols) {
  return MatrixView(v.data(), rows, cols, cols);
}
ConstMatrixView CView(const std::vector<float>& v, int64_t rows, int64_t cols) {
  return ConstMatrixView(v.data(), rows, cols, cols);
}

class CpuBackendTest : public ::testing::Test {
 protected:
  CpuBackend backend_{CpuBackendOptions{2, ""}};
  CpuBackend portable_{CpuBackendOptions{2, "portable"}};
};

TEST_F(CpuBackendTest, LinearRoundsTheExactProductToBf16) {
  for (WeightFormat f : {WeightFormat::kBF16, WeightFormat::kMXFP4, WeightFormat::kFP8Block128}) {
    for (int64_t m : {1, 3, 257}) {
      const int64_t k = 320, n = 67;
      RandomWeight w(f, n, k, static_cast<uint32_t>(m));
      auto x = RandomActivations(m, k, 99);
      std::vector<float> y(m * n);
      ASSERT_TRUE(backend_.Linear(CView(x, m, k), w.view, View(y, m, n), Precision::kBF16).ok());
      const auto ref = ReferenceLinear(x, m, w);
      int exact = 0;
      for (int64_t i = 0; i < m * n; ++i) {
        ASSERT_EQ(y[i], RoundToBf16(y[i]));  // the output is a bf16 value
        // Within half a bf16 ulp plus the fp32 accumulation error of the exact value.
        const double ulp = std::ldexp(1.0, std::ilogb(ref[i]) - 7);
        ASSERT_LE(std::fabs(y[i] - ref[i]), 0.5 * ulp + 1e-5 * std::fabs(ref[i]) + 1e-6) << i;
        exact += y[i] == static_cast<float>(RoundToBf16(static_cast<float>(ref[i])));
      }
      EXPECT_GT(exact, 0.99 * m * n) << "format " << WeightFormatName(f) << " m=" << m;
    }
  }
}

// Every tier the host runs, and the batch a row is in, leave Linear's bits alone.
TEST_F(CpuBackendTest, ResultsDoNotDependOnTheBatchOrTheKernelTier) {
  const int64_t k = 3584, n = 40, m = 37;
  for (WeightFormat f : {WeightFormat::kBF16, WeightFormat::kMXFP4, WeightFormat::kFP8Block128}) {
    RandomWeight w(f, n, k, 7);
    auto x = RandomActivations(m, k, 8);
    std::vector<float> portable(m * n);
    ASSERT_TRUE(
        portable_.Linear(CView(x, m, k), w.view, View(portable, m, n), Precision::kBF16).ok());
    int tiers = 0;
    for (const cpu::CpuTier* tier : testing::VectorTiers()) {
      if (!tier->host_supports()) continue;
      ++tiers;
      CpuBackend backend(CpuBackendOptions{2, tier->name});
      std::vector<float> batch(m * n), single(n);
      ASSERT_TRUE(backend.Linear(CView(x, m, k), w.view, View(batch, m, n), Precision::kBF16).ok());
      EXPECT_EQ(batch, portable) << WeightFormatName(f) << " " << tier->name;
      for (int64_t i : {0L, 5L, 36L}) {
        ASSERT_TRUE(backend
                        .Linear(ConstMatrixView(x.data() + i * k, 1, k, k), w.view,
                                View(single, 1, n), Precision::kBF16)
                        .ok());
        for (int64_t j = 0; j < n; ++j)
          ASSERT_EQ(single[j], batch[i * n + j])
              << WeightFormatName(f) << " " << tier->name << " row " << i;
      }
    }
    if (tiers == 0) GTEST_SKIP() << "this host runs no vector tier: only the portable kernels";
  }
}

// Plain router: sigmoid, biased top-k with index tie-break, renormalize, scale.
void ReferenceSelect(const std::vector<float>& logits, int64_t T, const std::vector<float>& bias,
                     const RoutingParams& rp, std::vector<int32_t>* ids,
                     std::vector<float>* weights) {
  const int E = rp.num_experts;
  for (int64_t t = 0; t < T; ++t) {
    std::vector<double> s(E), b(E);
    for (int e = 0; e < E; ++e) {
      s[e] = 1.0 / (1.0 + std::exp(-static_cast<double>(logits[t * E + e])));
      b[e] = static_cast<float>(static_cast<float>(s[e]) + bias[e]);
    }
    if (rp.n_group > 1) {
      const int size = E / rp.n_group;
      std::vector<std::pair<double, int>> groups;
      for (int g = 0; g < rp.n_group; ++g) {
        std::vector<double> v(b.begin() + g * size, b.begin() + (g + 1) * size);
        std::sort(v.rbegin(), v.rend());
        groups.push_back({-(v[0] + v[1]), g});
      }
      std::sort(groups.begin(), groups.end());
      std::vector<bool> keep(rp.n_group);
      for (int i = 0; i < rp.topk_group; ++i) keep[groups[i].second] = true;
      for (int e = 0; e < E; ++e)
        if (!keep[e / size]) b[e] = -1e30;
    }
    std::vector<int> order(E);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int c) { return b[a] > b[c]; });
    double sum = 0;
    for (int j = 0; j < rp.top_k; ++j) sum += static_cast<float>(s[order[j]]);
    for (int j = 0; j < rp.top_k; ++j) {
      ids->push_back(order[j]);
      double w = static_cast<float>(s[order[j]]);
      if (rp.renormalize && rp.top_k > 1) w /= sum + 1e-20;
      weights->push_back(static_cast<float>(w * rp.routed_scaling_factor));
    }
  }
}

TEST_F(CpuBackendTest, SelectExpertsMatchesReferenceIncludingTiesAndGroups) {
  struct Case {
    int E, k, n_group, topk_group;
    bool renorm;
    float scale;
  };
  for (const Case& c : {Case{64, 2, 1, 1, true, 1.0f}, Case{16, 1, 1, 1, true, 1.0f},
                        Case{16, 16, 1, 1, true, 1.0f}, Case{40, 8, 1, 1, true, 2.827f},
                        Case{64, 8, 8, 4, true, 2.5f}, Case{10, 3, 1, 1, false, 1.0f}}) {
    const int64_t T = 257;
    std::mt19937 rng(c.E * 7 + c.k);
    std::normal_distribution<float> normal(0, 1);
    std::vector<float> logits(T * c.E), bias(c.E);
    for (auto& v : logits) v = normal(rng);
    for (auto& v : bias) v = 0.02f * normal(rng);
    // Exact ties: a few tokens whose logits repeat one value (tie broken by lower index).
    for (int64_t t = 0; t < 5; ++t)
      for (int e = 0; e < c.E; ++e) logits[t * c.E + e] = 0.25f;
    std::vector<float> zero_bias(c.E, 0.0f);
    RoutingParams rp{c.E, c.k, c.renorm, c.scale, c.n_group, c.topk_group};
    for (int tie_case = 0; tie_case < 2; ++tie_case) {
      const std::vector<float>& b = tie_case ? zero_bias : bias;
      std::vector<int32_t> ids(T * c.k), want_ids;
      std::vector<float> w(T * c.k), want_w;
      ASSERT_TRUE(
          backend_.SelectExperts(CView(logits, T, c.E), b.data(), rp, ids.data(), w.data()).ok());
      ReferenceSelect(logits, T, b, rp, &want_ids, &want_w);
      int mismatched = 0;
      for (int64_t i = 0; i < T * c.k; ++i) mismatched += ids[i] != want_ids[i];
      EXPECT_LE(mismatched, 2) << "E=" << c.E << " k=" << c.k;  // only near-ties may differ
      if (tie_case) {
        for (int j = 0; j < c.k; ++j) EXPECT_EQ(ids[j], j) << "ties go to the lower index";
      }
      for (int64_t i = 0; i < T * c.k; ++i)
        if (ids[i] == want_ids[i]) {
          EXPECT_NEAR(w[i], want_w[i], 2e-6 * std::fabs(want_w[i]) + 1e-7);
        }
    }
  }
}

// Plain fp64 grouped experts with the contract's roundings.
std::vector<double> ReferenceExperts(const std::vector<float>& x, int64_t in,
                                     const ExpertAssignments& asg,
                                     const std::vector<RandomWeight*>& gate,
                                     const std::vector<RandomWeight*>& up,
                                     const std::vector<RandomWeight*>& down,
                                     const ActivationParams& act, Precision p, int64_t M) {
  const int64_t hidden = gate[0]->view.rows;
  std::vector<double> y(M * in, 0.0);
  for (int e = 0; e < asg.num_experts(); ++e)
    for (int32_t i = asg.offsets[e]; i < asg.offsets[e + 1]; ++i) {
      const int32_t r = asg.rows[i];
      std::vector<float> a(hidden);
      for (int64_t h = 0; h < hidden; ++h) {
        double g = 0, u = 0;
        for (int64_t c = 0; c < in; ++c) {
          g += x[r * in + c] * gate[e]->Value(h, c);
          u += x[r * in + c] * up[e]->Value(h, c);
        }
        a[h] = RoundTo(p, GluActivate(act, RoundTo(p, static_cast<float>(g)),
                                      RoundTo(p, static_cast<float>(u))));
      }
      for (int64_t c = 0; c < in; ++c) {
        double o = 0;
        for (int64_t h = 0; h < hidden; ++h) o += a[h] * down[e]->Value(c, h);
        y[r * in + c] += static_cast<double>(RoundTo(p, static_cast<float>(o))) * asg.gates[i];
      }
    }
  return y;
}

TEST_F(CpuBackendTest, ExpertMlpMatchesReference) {
  const int64_t in = 96, hidden = 64;
  const int E = 5;
  for (WeightFormat f : {WeightFormat::kBF16, WeightFormat::kMXFP4, WeightFormat::kFP8Block128})
    for (Precision p : {Precision::kBF16, Precision::kFP32})
      for (int64_t M : {1, 3, 40}) {
        std::vector<std::unique_ptr<RandomWeight>> owned;
        std::vector<RandomWeight*> g, u, d;
        std::vector<MlpWeights> experts;
        for (int e = 0; e < E; ++e) {
          owned.push_back(std::make_unique<RandomWeight>(f, hidden, in, 100 + e));
          g.push_back(owned.back().get());
          owned.push_back(std::make_unique<RandomWeight>(f, hidden, in, 200 + e));
          u.push_back(owned.back().get());
          owned.push_back(std::make_unique<RandomWeight>(f, in, hidden, 300 + e));
          d.push_back(owned.back().get());
          experts.push_back({g.back()->view, u.back()->view, d.back()->view});
        }
        // Rows choose 0..3 experts; expert 2 gets nobody.
        std::mt19937 rng(static_cast<uint32_t>(M));
        ExpertAssignments asg;
        asg.offsets.assign(E + 1, 0);
        std::vector<std::vector<std::pair<int32_t, float>>> per_expert(E);
        for (int64_t r = 0; r < M; ++r)
          for (int e : {0, 1, 3, 4})
            if (rng() % 2)
              per_expert[e].push_back({static_cast<int32_t>(r), 0.1f + (rng() % 100) / 100.0f});
        for (int e = 0; e < E; ++e) {
          for (auto& [r, gate] : per_expert[e]) {
            asg.rows.push_back(r);
            asg.gates.push_back(gate);
          }
          asg.offsets[e + 1] = static_cast<int32_t>(asg.rows.size());
        }
        auto x = RandomActivations(M, in, 11, p == Precision::kBF16);
        std::vector<double> y(M * in, -1.0);
        ActivationParams act{Activation::kSiTU, 4.0f, 25.0f};
        ASSERT_TRUE(
            backend_
                .ExpertMlp(CView(x, M, in), asg, experts, act, PartialView(y.data(), M, in, in), p)
                .ok());
        const auto ref = ReferenceExperts(x, in, asg, g, u, d, act, p, M);
        double num = 0, den = 0;
        for (size_t i = 0; i < y.size(); ++i) {
          num += (y[i] - ref[i]) * (y[i] - ref[i]);
          den += ref[i] * ref[i];
        }
        // fp32: accumulation-order differences only. bf16: occasional one-ulp rounding flips
        // of intermediate values (2^-8 relative on a few elements).
        const double tol = p == Precision::kFP32 ? 1e-6 : 5e-3;
        EXPECT_LE(std::sqrt(num / den), tol) << WeightFormatName(f) << " M=" << M;
        // Rows without experts are exactly zero.
        std::vector<bool> used(M);
        for (int32_t r : asg.rows) used[r] = true;
        for (int64_t r = 0; r < M; ++r) {
          if (used[r]) continue;
          for (int64_t c = 0; c < in; ++c) ASSERT_EQ(y[r * in + c], 0.0);
        }
      }
}

// The whole grouped-expert op, every format and precision: every tier's kernels (dot, GLU,
// packing) give the portable kernels' bits, so results never depend on the CPU; a tier with a
// one-ulp bug in any of the three does not.
// bf16_rows: the input in bf16 storage (a bf16 step's rows as a rank receives them).
std::vector<double> RunExpertMlp(CpuBackend& backend, WeightFormat f, Precision p,
                                 bool bf16_rows = false) {
  const int64_t in = 320, hidden = 200;  // hidden not a multiple of 64: partial units
  const int64_t h = f == WeightFormat::kMXFP4 ? 256 : hidden;  // MXFP4 needs multiples of 32
  std::vector<std::unique_ptr<RandomWeight>> owned;
  std::vector<MlpWeights> experts;
  for (int e = 0; e < 3; ++e) {
    owned.push_back(std::make_unique<RandomWeight>(f, h, in, 10 + e));
    owned.push_back(std::make_unique<RandomWeight>(f, h, in, 20 + e));
    owned.push_back(std::make_unique<RandomWeight>(f, in, h, 30 + e));
    experts.push_back({owned[3 * e]->view, owned[3 * e + 1]->view, owned[3 * e + 2]->view});
  }
  const int64_t M = 37;
  ExpertAssignments asg;
  asg.offsets = {0};
  for (int e = 0; e < 3; ++e) {
    for (int64_t r = e; r < M; r += 2) {
      asg.rows.push_back(static_cast<int32_t>(r));
      asg.gates.push_back(0.25f + 0.01f * static_cast<float>(r));
    }
    asg.offsets.push_back(static_cast<int32_t>(asg.rows.size()));
  }
  auto x = RandomActivations(M, in, 5, p == Precision::kBF16);
  const ActivationRows x_bf16 = ActivationRows::FromFloats(Precision::kBF16, x.data(), M, in);
  const ActivationView x_view =
      bf16_rows ? ActivationView(x_bf16) : ActivationView(CView(x, M, in));
  std::vector<double> y(M * in);
  ActivationParams act{Activation::kSiTU, 4.0f, 25.0f};
  EXPECT_TRUE(
      backend.ExpertMlp(x_view, asg, experts, act, PartialView(y.data(), M, in, in), p).ok());
  return y;
}

TEST_F(CpuBackendTest, ExpertMlpIsBitIdenticalAcrossKernelTiers) {
  int tiers = 0;
  for (const cpu::CpuTier* tier : testing::VectorTiers()) {
    if (!tier->host_supports()) continue;
    ++tiers;
    CpuBackend backend(CpuBackendOptions{2, tier->name});
    for (WeightFormat f : {WeightFormat::kBF16, WeightFormat::kMXFP4, WeightFormat::kFP8Block128})
      for (Precision p : {Precision::kBF16, Precision::kFP32})
        EXPECT_EQ(RunExpertMlp(backend, f, p), RunExpertMlp(portable_, f, p))
            << tier->name << " " << WeightFormatName(f) << " " << PrecisionName(p);
  }
  if (tiers == 0) GTEST_SKIP() << "this host runs no vector tier: only the portable kernels";
}

// A bf16 step's rows arrive in bf16 storage and go into the GEMMs without an fp32 copy: the same
// bits as the same values in fp32 storage, on every tier and format.
TEST_F(CpuBackendTest, ExpertMlpFromBf16RowsMatchesFp32Rows) {
  for (const cpu::CpuTier& tier : cpu::CpuTiers()) {
    if (!tier.host_supports()) continue;
    CpuBackend backend(CpuBackendOptions{2, tier.name});
    for (WeightFormat f : {WeightFormat::kBF16, WeightFormat::kMXFP4, WeightFormat::kFP8Block128}) {
      const std::vector<double> from_fp32 = RunExpertMlp(backend, f, Precision::kBF16);
      EXPECT_EQ(RunExpertMlp(backend, f, Precision::kBF16, /*bf16_rows=*/true), from_fp32)
          << tier.name << " " << WeightFormatName(f);
      EXPECT_LT(std::count(from_fp32.begin(), from_fp32.end(), 0.0),
                static_cast<std::ptrdiff_t>(from_fp32.size()) / 2);
    }
  }
}

// An fp32 ulp in a dot product or an activation shows in fp32 mode (bf16 mode mostly rounds it
// away, which is why the kernel tests compare the unrounded outputs); a bf16 ulp in a packed
// operand shows in bf16 mode.
TEST_F(CpuBackendTest, ExpertMlpCheckCatchesEachCorruptedKernel) {
  for (auto [what, p] : {std::pair{testing::Corruption::kDot, Precision::kFP32},
                         std::pair{testing::Corruption::kGlu, Precision::kFP32},
                         std::pair{testing::Corruption::kPack, Precision::kBF16}}) {
    const cpu::DotKernels corrupted = testing::Corrupted(*cpu::PortableDotKernels(), what);
    CpuBackend backend(CpuBackendOptions{2, ""}, &corrupted);
    EXPECT_NE(RunExpertMlp(backend, WeightFormat::kMXFP4, p),
              RunExpertMlp(portable_, WeightFormat::kMXFP4, p))
        << static_cast<int>(what);
  }
}

TEST_F(CpuBackendTest, RmsNormAndRoundingOps) {
  const int64_t T = 3, D = 320;
  auto x = RandomActivations(T, D, 3);
  std::vector<uint16_t> wbits(D);
  std::mt19937 rng(4);
  for (auto& b : wbits)
    b = FloatToBf16Bits(1.0f + 0.05f * (static_cast<float>(rng() % 200) / 100.0f - 1.0f));
  WeightVector wv{wbits.data(), D};
  std::vector<float> y(T * D);
  ASSERT_TRUE(backend_.RmsNorm(CView(x, T, D), wv, 1e-5f, View(y, T, D), Precision::kFP32).ok());
  for (int64_t t = 0; t < T; ++t) {
    double ss = 0;
    for (int64_t c = 0; c < D; ++c) ss += x[t * D + c] * x[t * D + c];
    const double inv = 1.0 / std::sqrt(ss / D + 1e-5);
    for (int64_t c = 0; c < D; ++c)
      ASSERT_NEAR(y[t * D + c], x[t * D + c] * inv * Bf16BitsToFloat(wbits[c]), 1e-6);
  }
  // RoundPartials: one rounding from fp64 (no double rounding through fp32).
  const double d = 1.0 + std::ldexp(1.0, -8) + std::ldexp(1.0, -30);  // just above a bf16 tie
  std::vector<double> part = {d, -d, 3.0};
  std::vector<float> out(3);
  ASSERT_TRUE(
      backend_
          .RoundPartials(ConstPartialView(part.data(), 1, 3, 3), View(out, 1, 3), Precision::kBF16)
          .ok());
  EXPECT_EQ(out[0], 1.0f + std::ldexp(1.0f, -7));
  EXPECT_EQ(out[1], -(1.0f + std::ldexp(1.0f, -7)));
  EXPECT_EQ(out[2], 3.0f);
  // Gather and scatter-add.
  std::vector<float> g(2 * D);
  const std::vector<int32_t> rows = {2, 0};
  ASSERT_TRUE(backend_.GatherRows(CView(x, T, D), rows, View(g, 2, D)).ok());
  EXPECT_EQ(g[0], x[2 * D]);
  EXPECT_EQ(g[D + 5], x[5]);
  EXPECT_FALSE(backend_.GatherRows(CView(x, T, D), std::vector<int32_t>{0, 7}, View(g, 2, D)).ok());
}

// The nearest bf16 to finite v, ties to the even mantissa, found by comparing the two bf16
// neighbours in fp64 (not by the bit trick the backends use).
uint16_t NearestBf16(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  const uint32_t down = u & 0xffff0000u, up = down + 0x10000u;  // toward zero, away from zero
  float fd, fu;
  std::memcpy(&fd, &down, 4);
  std::memcpy(&fu, &up, 4);
  const double ed = std::fabs(static_cast<double>(v) - fd),
               eu = std::fabs(fu - static_cast<double>(v));
  if (ed != eu) return static_cast<uint16_t>((ed < eu ? down : up) >> 16);
  return static_cast<uint16_t>(((down >> 16) & 1) == 0 ? down >> 16 : up >> 16);
}

TEST_F(CpuBackendTest, GatherRowsIntoBf16RoundsToNearestEven) {
  const int64_t T = 5, D = 37;  // odd width: no vector-multiple rows
  auto x = RandomActivations(T, D, 9);
  x[3] = 1.0f + std::ldexp(1.0f, -8);            // a tie: stays 1
  x[4] = 1.0f + 3 * std::ldexp(1.0f, -8);        // a tie: rounds up to the even 1 + 2^-6
  x[5] = -(1.0f + std::ldexp(1.0f, -8) * 1.5f);  // above a tie (magnitude): away from zero
  x[6] = RoundToBf16(x[6]);                      // a bf16 value: exact
  const std::vector<int32_t> rows = {4, 0, 0, 2};
  const int64_t stride = D + 3;
  std::vector<uint16_t> out(rows.size() * stride, 0xabcd);
  ASSERT_TRUE(backend_
                  .GatherRows(CView(x, T, D), rows,
                              MutableActivationView(out.data(), Precision::kBF16, 4, D, stride))
                  .ok());
  for (size_t i = 0; i < rows.size(); ++i)
    for (int64_t c = 0; c < stride; ++c)
      ASSERT_EQ(out[i * stride + c], c < D ? NearestBf16(x[rows[i] * D + c]) : 0xabcd)
          << "row " << i << " col " << c;
  EXPECT_EQ(out[stride + 3], 0x3f80);
  EXPECT_EQ(out[stride + 4], 0x3f82);
  EXPECT_EQ(Bf16BitsToFloat(out[stride + 6]), x[6]);
}

TEST_F(CpuBackendTest, ShapeMismatchesAreErrorsNotCrashes) {
  RandomWeight w(WeightFormat::kBF16, 8, 64, 1);
  auto x = RandomActivations(2, 32, 2);
  std::vector<float> y(16);
  EXPECT_EQ(backend_.Linear(CView(x, 2, 32), w.view, View(y, 2, 8), Precision::kBF16).code(),
            absl::StatusCode::kInvalidArgument);
  RandomWeight bad(WeightFormat::kMXFP4, 4, 64, 3);
  bad.scale_bytes[0] = 255;
  EXPECT_FALSE(backend_.PrepareWeight(bad.view).ok());
}

}  // namespace
}  // namespace moe
