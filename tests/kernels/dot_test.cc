// The batched dot kernels: the portable kernel against an fp64 reference, and every vector tier
// bit for bit against the portable one (the canonical order is part of the contract), per
// format, precision and kernel path (up to 4-6 operand rows take the in-register paths, more
// the scratch tiles; widths that are not multiples of 128 the padded tails); every FP8 code and
// every MXFP4 code and scale edge exactly; and a corrupted tier, to show the checks can fail.
#include <cmath>
#include <tuple>

#include "gtest/gtest.h"
#include "kernels/cpu/canonical.h"
#include "kernels/cpu/dot.h"
#include "tests/kernels/test_weights.h"
#include "tests/kernels/tier_checks.h"
#include "tests/kernels/tier_testing.h"

namespace moe::cpu {
namespace {

using moe::testing::AbsDot;
using moe::testing::DotMatchesPortable;
using moe::testing::PackedRows;
using moe::testing::PackRows;
using moe::testing::RandomActivations;
using moe::testing::RandomWeight;
using moe::testing::ReferenceLinear;
using moe::testing::RunDot;
using moe::testing::SameBits;

const int64_t kWidths[] = {32, 64, 96, 200, 320, 1000, 3584, 4500};  // 3584, 4500: K-sliced paths
// Every tail of 2-, 4- and 8-row tilings; 37 crosses the fused paths' 16-row slice groups twice.
const int64_t kWeightRows[] = {1, 6, 7, 13, 37};
// 1-8: one fused sweep (every tile shape and chunk order); 9, 13, 16: two; 17, 31: scratch tiles.
const int64_t kOperandRows[] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 16, 17, 31};

class PortableDotTest : public ::testing::TestWithParam<std::tuple<WeightFormat, Precision>> {};

TEST_P(PortableDotTest, MatchesFp64Reference) {
  const auto [format, precision] = GetParam();
  int checked = 0;
  for (int64_t k : kWidths) {
    if (format == WeightFormat::kMXFP4 && k % 32 != 0) continue;
    for (int64_t n : kWeightRows)
      for (int64_t m : {1, 5, 9}) {
        const uint32_t seed = static_cast<uint32_t>(k * 131 + n * 17 + m);
        RandomWeight w(format, n, k, seed);
        const auto x = RandomActivations(m, k, seed + 1, precision == Precision::kBF16);
        const auto y = RunDot(*PortableDotKernels(), PackRows(x, m, k, format, precision), m,
                              w.view, precision);
        const auto ref = ReferenceLinear(x, m, w);
        for (int64_t i = 0; i < m; ++i)
          for (int64_t j = 0; j < n; ++j) {
            // fp32 accumulation over ceil(k/16) sequential adds per lane plus the tree.
            const double bound =
                (static_cast<double>(k) / 16 + 8) * std::ldexp(1.0, -24) * AbsDot(x, i, w, j);
            ASSERT_NEAR(y[i * n + j], ref[i * n + j], bound)
                << "k=" << k << " n=" << n << " m=" << m;
          }
        ++checked;
      }
  }
  EXPECT_GT(checked, 40);
}

INSTANTIATE_TEST_SUITE_P(AllFormats, PortableDotTest,
                         ::testing::Combine(::testing::Values(WeightFormat::kBF16,
                                                              WeightFormat::kMXFP4,
                                                              WeightFormat::kFP8Block128),
                                            ::testing::Values(Precision::kBF16, Precision::kFP32)));

class TierDotTest
    : public ::testing::TestWithParam<std::tuple<const CpuTier*, WeightFormat, Precision>> {};

TEST_P(TierDotTest, BitIdenticalToPortable) {
  const auto [tier, format, precision] = GetParam();
  MOE_SKIP_UNLESS_HOST_RUNS(tier);
  for (int64_t k : kWidths) {
    if (format == WeightFormat::kMXFP4 && k % 32 != 0) continue;
    for (int64_t n : kWeightRows)
      for (int64_t m : kOperandRows)
        ASSERT_TRUE(DotMatchesPortable(*tier->kernels(), format, precision, k, n, m));
  }
}

std::string TierFormatName(
    const ::testing::TestParamInfo<std::tuple<const CpuTier*, WeightFormat, Precision>>& info) {
  return moe::testing::TierTestName(std::get<0>(info.param)) + "_" +
         WeightFormatName(std::get<1>(info.param)) + "_" +
         moe::PrecisionName(std::get<2>(info.param));
}

INSTANTIATE_TEST_SUITE_P(AllTiers, TierDotTest,
                         ::testing::Combine(::testing::ValuesIn(moe::testing::VectorTiers()),
                                            ::testing::Values(WeightFormat::kBF16,
                                                              WeightFormat::kMXFP4,
                                                              WeightFormat::kFP8Block128),
                                            ::testing::Values(Precision::kBF16, Precision::kFP32)),
                         TierFormatName);

// Single weights picked by one-hot operand rows, through every kernel path: operand rows per call
// 1, 2, 4 (in-register decode, each chunk order), 6 (MXFP4 half passes), 8 (FP8's largest fused
// shape), 12 (two fused sweeps) and all at once (decode to scratch). Returns y[operand][weight row]
// in full.
std::vector<float> OneHotProducts(const DotKernels& kernels, const WeightMatrix& w, Precision p,
                                  int64_t rows_per_call) {
  const int64_t k = w.cols;
  std::vector<float> one_hot(k * k, 0.0f);
  for (int64_t i = 0; i < k; ++i) one_hot[i * k + i] = 1.0f;
  const PackedRows packed = PackRows(one_hot, k, k, w.format, p);
  if (rows_per_call >= k) return RunDot(kernels, packed, k, w, p);
  std::vector<float> y;
  std::vector<int32_t> rows(rows_per_call);
  for (int64_t i0 = 0; i0 < k; i0 += rows_per_call) {
    const int64_t m = std::min(rows_per_call, k - i0);
    for (int64_t i = 0; i < m; ++i) rows[i] = static_cast<int32_t>(i0 + i);
    const auto yi = RunDot(kernels, packed, m, w, p, rows.data());
    y.insert(y.end(), yi.begin(), yi.end());
  }
  return y;
}

class TierCodeTest : public ::testing::TestWithParam<const CpuTier*> {};

// Every FP8 E4M3 code decodes to its exact value in every path and precision: row 0 holds all
// 254 finite codes (a partial last 128-block); row 1 is 1.0 everywhere but one NaN code, which
// makes its outputs NaN.
TEST_P(TierCodeTest, EveryFp8CodeExactInEveryPath) {
  const CpuTier* tier = GetParam();
  MOE_SKIP_UNLESS_HOST_RUNS(tier);
  std::vector<uint8_t> codes;
  for (int c = 0; c < 256; ++c)
    if ((c & 0x7F) != 0x7F) codes.push_back(static_cast<uint8_t>(c));
  const int64_t k = static_cast<int64_t>(codes.size());
  std::vector<uint8_t> data(2 * k, 0x38);
  std::copy(codes.begin(), codes.end(), data.begin());
  data[k + 100] = 0xFF;
  const std::vector<float> scales(2 * ((k + 127) / 128), 1.0f);
  WeightMatrix w;
  w.format = WeightFormat::kFP8Block128;
  w.rows = 2;
  w.cols = k;
  w.data = data.data();
  w.scales = scales.data();
  for (Precision p : {Precision::kBF16, Precision::kFP32})
    for (int64_t per_call : {int64_t{1}, int64_t{4}, int64_t{8}, k}) {
      const auto y = OneHotProducts(*tier->kernels(), w, p, per_call);
      const auto portable = OneHotProducts(*PortableDotKernels(), w, p, per_call);
      for (int64_t i = 0; i < k; ++i) {
        ASSERT_EQ(y[i * 2], Fp8E4m3ToFloat(codes[i]))
            << moe::PrecisionName(p) << " " << per_call << " rows per call, code 0x" << std::hex
            << int{codes[i]};
        ASSERT_TRUE(SameBits(y[i * 2], portable[i * 2]));
        ASSERT_TRUE(std::isnan(y[i * 2 + 1])) << "per call " << per_call << " row " << i;
      }
    }
}

// A NaN code early in a wide FP8 row poisons that row whatever the path: the fused paths cut K
// into slices for more than one operand row and learn of the NaN in the first slice, long before
// the row's last one. The rows beside it keep the portable bits.
TEST_P(TierCodeTest, Fp8NanCodeInAnEarlySliceMakesItsRowNaN) {
  const CpuTier* tier = GetParam();
  MOE_SKIP_UNLESS_HOST_RUNS(tier);
  const int64_t k = 3000, n = 3;
  RandomWeight w(WeightFormat::kFP8Block128, n, k, 7);
  w.data[1 * k + 5] = 0xFF;
  for (Precision p : {Precision::kBF16, Precision::kFP32})
    for (int64_t m = 1; m <= 9; ++m) {
      const auto x = RandomActivations(m, k, static_cast<uint32_t>(m), p == Precision::kBF16);
      const PackedRows packed = PackRows(x, m, k, w.view.format, p);
      const auto want = RunDot(*PortableDotKernels(), packed, m, w.view, p);
      const auto got = RunDot(*tier->kernels(), packed, m, w.view, p);
      for (int64_t i = 0; i < m; ++i) {
        EXPECT_TRUE(std::isnan(got[i * n + 1])) << moe::PrecisionName(p) << " m=" << m;
        EXPECT_TRUE(SameBits(got[i * n], want[i * n]) && SameBits(got[i * n + 2], want[i * n + 2]))
            << moe::PrecisionName(p) << " m=" << m << " operand row " << i;
      }
    }
}

// Operand elements at the top of the bf16 range keep the portable bits in every path: the
// fused FP8 path multiplies its operand rows by 256 (its weights then decode as value * 2^-8),
// which is exact below 2^120 and would overflow from there (those calls take the scratch path).
TEST_P(TierCodeTest, Fp8HugeOperandsKeepThePortableBits) {
  const CpuTier* tier = GetParam();
  MOE_SKIP_UNLESS_HOST_RUNS(tier);
  const int64_t k = 640, n = 5;
  RandomWeight w(WeightFormat::kFP8Block128, n, k, 11);
  const float kHuge[] = {std::ldexp(1.5f, 119),          // bf16 exponent field 246: x * 256 finite
                         std::ldexp(1.0f, 120),          // 247: x * 256 would overflow
                         std::ldexp(1.5f, 126),          // 253
                         std::ldexp(255.0f / 128, 127),  // 254: the largest finite bf16
                         INFINITY,
                         -NAN};
  for (int64_t m = 1; m <= 9; ++m)
    for (const float huge : kHuge) {
      auto x = RandomActivations(m, k, static_cast<uint32_t>(m + 100), true);
      x[(m - 1) * k + 300] = -huge;  // the last operand row only: the others keep their bits
      const PackedRows packed = PackRows(x, m, k, w.view.format, Precision::kBF16);
      const auto want = RunDot(*PortableDotKernels(), packed, m, w.view, Precision::kBF16);
      const auto got = RunDot(*tier->kernels(), packed, m, w.view, Precision::kBF16);
      for (size_t e = 0; e < want.size(); ++e)
        ASSERT_TRUE(SameBits(got[e], want[e]))
            << "m=" << m << " x=" << -huge << " y[" << e / n << "][" << e % n << "] = " << got[e]
            << ", portable " << want[e];
    }
}

// Every E2M1 code under the edge E8M0 scales the CPU backend accepts ([2, 252]) and around 127,
// exact in every path and precision, for a whole 128-group and a partial one (96 columns).
TEST_P(TierCodeTest, EveryMxfp4CodeAndScaleEdgeExactInEveryPath) {
  const CpuTier* tier = GetParam();
  MOE_SKIP_UNLESS_HOST_RUNS(tier);
  const uint8_t kScales[] = {2, 3, 126, 127, 128, 251, 252};
  const int64_t rows = 7;
  for (int64_t k : {128, 96}) {
    std::vector<uint8_t> packed(rows * k / 2), scale_bytes(rows * k / 32);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t e = 0; e < k; e += 2)  // element e holds nibble (e + r) % 16
        packed[r * k / 2 + e / 2] =
            static_cast<uint8_t>(((e + r) % 16) | (((e + 1 + r) % 16) << 4));
      for (int64_t b = 0; b < k / 32; ++b) scale_bytes[r * k / 32 + b] = kScales[(r + b) % 7];
    }
    WeightMatrix w;
    w.format = WeightFormat::kMXFP4;
    w.rows = rows;
    w.cols = k;
    w.data = packed.data();
    w.scales = scale_bytes.data();
    for (Precision p : {Precision::kBF16, Precision::kFP32})
      for (int64_t per_call : {int64_t{1}, int64_t{2}, int64_t{4}, int64_t{6}, int64_t{12}, k}) {
        const auto y = OneHotProducts(*tier->kernels(), w, p, per_call);
        const auto portable = OneHotProducts(*PortableDotKernels(), w, p, per_call);
        for (int64_t e = 0; e < k; ++e)
          for (int64_t r = 0; r < rows; ++r) {
            const float expected = E2m1ToFloat(static_cast<uint8_t>((e + r) % 16)) *
                                   std::ldexp(1.0f, scale_bytes[r * k / 32 + e / 32] - 127);
            ASSERT_EQ(y[e * rows + r], expected)
                << "k=" << k << " " << moe::PrecisionName(p) << " " << per_call
                << " rows per call, element " << e << " row " << r;
            ASSERT_TRUE(SameBits(y[e * rows + r], portable[e * rows + r]));
          }
      }
  }
}

// Row indirection (x_rows) gives the same results as a gathered copy.
TEST_P(TierCodeTest, RowListEqualsGatheredRows) {
  const CpuTier* tier = GetParam();
  MOE_SKIP_UNLESS_HOST_RUNS(tier);
  for (WeightFormat f : {WeightFormat::kBF16, WeightFormat::kMXFP4, WeightFormat::kFP8Block128}) {
    const int64_t k = 384, n = 7, m = 9;
    RandomWeight w(f, n, k, 5);
    const auto x = RandomActivations(m, k, 6);
    const PackedRows pr = PackRows(x, m, k, f, Precision::kBF16);
    const int32_t rows[7] = {4, 0, 4, 8, 1, 2, 7};
    const auto all = RunDot(*tier->kernels(), pr, m, w.view, Precision::kBF16);
    for (int64_t count : {1, 3, 7}) {
      const auto picked = RunDot(*tier->kernels(), pr, count, w.view, Precision::kBF16, rows);
      for (int i = 0; i < count; ++i)
        for (int j = 0; j < n; ++j)
          ASSERT_TRUE(SameBits(picked[i * n + j], all[rows[i] * n + j]))
              << WeightFormatName(f) << " " << count << " rows";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllTiers, TierCodeTest, ::testing::ValuesIn(moe::testing::VectorTiers()),
                         moe::testing::TierParamName);

// The bit-for-bit check fails on a tier with a one-ulp bug in one output of its wide calls.
TEST(TierCheckTest, DotCheckCatchesACorruptedKernel) {
  const DotKernels corrupted =
      moe::testing::Corrupted(*PortableDotKernels(), moe::testing::Corruption::kDot);
  EXPECT_TRUE(DotMatchesPortable(corrupted, WeightFormat::kMXFP4, Precision::kBF16, 320, 7, 4));
  EXPECT_FALSE(DotMatchesPortable(corrupted, WeightFormat::kMXFP4, Precision::kBF16, 320, 7, 5));
  EXPECT_FALSE(
      DotMatchesPortable(corrupted, WeightFormat::kFP8Block128, Precision::kFP32, 200, 1, 9));
}

}  // namespace
}  // namespace moe::cpu
