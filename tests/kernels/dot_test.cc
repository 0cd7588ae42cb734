// The batched dot kernels: portable kernel vs an fp64 reference, and every vector kernel
// bit for bit against the portable one (the canonical order is part of the contract).
#include <cmath>
#include <tuple>

#include "gtest/gtest.h"
#include "kernels/cpu/canonical.h"
#include "kernels/cpu/dot.h"
#include "tests/kernels/test_weights.h"

namespace moe::cpu {
namespace {

using moe::testing::AbsDot;
using moe::testing::RandomActivations;
using moe::testing::RandomWeight;
using moe::testing::ReferenceLinear;

struct Problem {
  std::vector<uint8_t> packed;
  int64_t stride;
};

Problem Pack(const std::vector<float>& x, int64_t m, int64_t k, WeightFormat f, Precision p) {
  Problem out;
  out.stride = PaddedK(k);
  const size_t elem = p == Precision::kBF16 ? 2 : 4;
  out.packed.resize(m * out.stride * elem);
  for (int64_t i = 0; i < m; ++i)
    PackActivationRow(x.data() + i * k, k, f, p, out.packed.data() + i * out.stride * elem);
  return out;
}

std::vector<float> RunDot(const DotKernels& kernels, const Problem& pr, int64_t m,
                          const WeightMatrix& w, Precision p, const int32_t* rows = nullptr) {
  DotOperands op;
  op.x = pr.packed.data();
  op.x_stride = pr.stride;
  op.x_rows = rows;
  op.m = m;
  op.w = &w;
  op.precision = p;
  std::vector<float> y(m * w.rows, NAN);
  DotScratch scratch;
  // Two calls over a split of the rows, as threads would make them.
  const int64_t split = w.rows / 2;
  kernels.dot_rows(op, 0, split, y.data(), w.rows, &scratch);
  kernels.dot_rows(op, split, w.rows, y.data() + split, w.rows, &scratch);
  return y;
}

class DotTest : public ::testing::TestWithParam<std::tuple<WeightFormat, Precision>> {};

TEST_P(DotTest, PortableMatchesFp64ReferenceAndVectorKernelsMatchBitForBit) {
  const auto [format, precision] = GetParam();
  const DotKernels* vector_kernels = Avx512DotKernels();
  __builtin_cpu_init();
  const bool have_avx512 =
      __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vbmi");
  int checked = 0;
  for (int64_t k : {32, 64, 96, 200, 320, 1000, 3584, 4500}) {  // 3584, 4500: K-sliced paths
    if (format == WeightFormat::kMXFP4 && k % 32 != 0) continue;
    for (int64_t n : {1, 6, 7, 13}) {  // every tail of 2- and 4-row tilings
      for (int64_t m : {1, 2, 3, 4, 5, 6, 9}) {
        const uint32_t seed = static_cast<uint32_t>(k * 131 + n * 17 + m);
        RandomWeight w(format, n, k, seed);
        const auto x = RandomActivations(m, k, seed + 1, precision == Precision::kBF16);
        const Problem pr = Pack(x, m, k, format, precision);
        const auto y = RunDot(PortableDotKernels(), pr, m, w.view, precision);
        const auto ref = ReferenceLinear(x, m, w);
        for (int64_t i = 0; i < m; ++i)
          for (int64_t j = 0; j < n; ++j) {
            // fp32 accumulation over ceil(k/16) sequential adds per lane plus the tree.
            const double bound =
                (static_cast<double>(k) / 16 + 8) * std::ldexp(1.0, -24) * AbsDot(x, i, w, j);
            ASSERT_NEAR(y[i * n + j], ref[i * n + j], bound)
                << "k=" << k << " n=" << n << " m=" << m;
          }
        if (have_avx512 && vector_kernels != nullptr) {
          const auto v = RunDot(*vector_kernels, pr, m, w.view, precision);
          for (size_t e = 0; e < y.size(); ++e)
            ASSERT_EQ(std::memcmp(&v[e], &y[e], 4), 0)
                << "k=" << k << " n=" << n << " m=" << m << " e=" << e << ": " << v[e] << " vs "
                << y[e];
        }
        ++checked;
      }
    }
  }
  EXPECT_GT(checked, 40);
  if (!have_avx512)
    GTEST_SKIP() << "AVX-512 BF16 not available: only the portable kernel was checked";
}

INSTANTIATE_TEST_SUITE_P(AllFormats, DotTest,
                         ::testing::Combine(::testing::Values(WeightFormat::kBF16,
                                                              WeightFormat::kMXFP4,
                                                              WeightFormat::kFP8Block128),
                                            ::testing::Values(Precision::kBF16, Precision::kFP32)));

// Every FP8 E4M3 code decodes to its exact value in every kernel path: one-hot operand rows
// pick single weights (row 0 holds all 254 finite codes), for m = 1 (the in-register path) and
// m = 254 (the decode-to-scratch tiles); a NaN code makes its row NaN in both.
TEST(Fp8DecodeTest, EveryCodeExactInEveryPath) {
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx512bf16") || !__builtin_cpu_supports("avx512vbmi"))
    GTEST_SKIP() << "AVX-512 BF16 not available";
  std::vector<uint8_t> codes;
  for (int c = 0; c < 256; ++c)
    if ((c & 0x7F) != 0x7F) codes.push_back(static_cast<uint8_t>(c));
  const int64_t k = static_cast<int64_t>(codes.size());  // 254: a partial last 128-block
  std::vector<uint8_t> data(2 * k, 0x38);                // row 1: 1.0 everywhere but one NaN
  std::copy(codes.begin(), codes.end(), data.begin());
  data[k + 100] = 0xFF;
  const std::vector<float> scales(2 * ((k + 127) / 128), 1.0f);
  WeightMatrix w;
  w.format = WeightFormat::kFP8Block128;
  w.rows = 2;
  w.cols = k;
  w.data = data.data();
  w.scales = scales.data();
  std::vector<float> one_hot(k * k, 0.0f);
  for (int64_t i = 0; i < k; ++i) one_hot[i * k + i] = 1.0f;
  const Problem pr = Pack(one_hot, k, k, w.format, Precision::kBF16);
  for (const int64_t m : {int64_t{1}, k}) {
    std::vector<float> y;
    if (m == 1) {
      for (int64_t i = 0; i < k; ++i) {
        const int32_t row = static_cast<int32_t>(i);
        const auto yi = RunDot(*Avx512DotKernels(), pr, 1, w, Precision::kBF16, &row);
        y.insert(y.end(), yi.begin(), yi.end());
      }
    } else {
      y = RunDot(*Avx512DotKernels(), pr, m, w, Precision::kBF16);
    }
    for (int64_t i = 0; i < k; ++i) {
      const float expected = Fp8E4m3ToFloat(codes[i]);
      ASSERT_EQ(y[i * 2], expected) << "m=" << m << " code 0x" << std::hex << int{codes[i]};
      ASSERT_TRUE(std::isnan(y[i * 2 + 1])) << "m=" << m << " row " << i;
    }
  }
}

// Row indirection (x_rows) gives the same results as a gathered copy.
TEST(DotIndirectionTest, RowListEqualsGatheredRows) {
  const int64_t k = 320, n = 7, m = 6;
  RandomWeight w(WeightFormat::kMXFP4, n, k, 5);
  const auto x = RandomActivations(m, k, 6);
  const Problem pr = Pack(x, m, k, WeightFormat::kMXFP4, Precision::kBF16);
  const int32_t rows[3] = {4, 0, 4};
  const auto all = RunDot(BestDotKernels(), pr, m, w.view, Precision::kBF16);
  const auto picked = RunDot(BestDotKernels(), pr, 3, w.view, Precision::kBF16, rows);
  for (int i = 0; i < 3; ++i)
    for (int j = 0; j < n; ++j) EXPECT_EQ(picked[i * n + j], all[rows[i] * n + j]);
}

}  // namespace
}  // namespace moe::cpu
