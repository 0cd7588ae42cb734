// ActivationRows: host rows in their real dtype (bf16 bits or fp32).
#include "core/activations.h"

#include <cmath>
#include <limits>

#include "gtest/gtest.h"

namespace moe {
namespace {

TEST(ActivationRowsTest, Bf16RowsRoundToNearestEvenAndReadBackExactly) {
  // 1 + 2^-8 is halfway between two bf16 values: ties go to the even one (1.0); 1 + 3 * 2^-8 is
  // halfway too and goes up (to 1 + 2^-6); 3.140625 is a bf16 value and stays.
  const float x[] = {1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-8f, 3.140625f, -0.3f, 1e-3f, -65504.0f};
  const ActivationRows rows = ActivationRows::FromFloats(Precision::kBF16, x, 2, 3);
  EXPECT_EQ(rows.bytes(), 12u);
  EXPECT_EQ(rows.Value(0), 1.0f);
  EXPECT_EQ(rows.Value(1), 1.0f + 0x1p-6f);
  EXPECT_EQ(rows.Value(2), 3.140625f);
  for (int i = 0; i < 6; ++i) {
    EXPECT_EQ(rows.Value(i), Bf16BitsToFloat(FloatToBf16Bits(x[i]))) << i;
    EXPECT_LE(std::fabs(rows.Value(i) - x[i]), std::fabs(x[i]) * 0x1p-8f) << i;  // half an ulp
  }
  const std::vector<float> back = rows.ToFloats();
  const ActivationRows again = ActivationRows::FromFloats(Precision::kBF16, back.data(), 2, 3);
  EXPECT_TRUE(again == rows);  // bf16 values survive fp32 and back unchanged
}

TEST(ActivationRowsTest, Fp32RowsAreKeptBitForBit) {
  const float x[] = {1.0f + 0x1p-20f, -0.3f, 0x1p-100f, 7.0f};
  const ActivationRows rows = ActivationRows::FromFloats(Precision::kFP32, x, 1, 4);
  EXPECT_EQ(rows.bytes(), 16u);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(rows.Value(i), x[i]);
}

TEST(ActivationRowsTest, CopyZeroAndNonFiniteWorkOnWholeRows) {
  for (Precision p : {Precision::kBF16, Precision::kFP32}) {
    std::vector<float> x(4 * 5);
    for (size_t i = 0; i < x.size(); ++i) x[i] = 0.5f * static_cast<float>(i) - 3.25f;
    const ActivationRows src = ActivationRows::FromFloats(p, x.data(), 4, 5);
    ActivationRows dst(p, 3, 5);
    dst.CopyRows(1, src, 2, 2);  // rows 2, 3 of src into rows 1, 2
    for (int c = 0; c < 5; ++c) {
      EXPECT_EQ(dst.Value(c), 0.0f);
      EXPECT_EQ(dst.Value(5 + c), src.Value(10 + c));
      EXPECT_EQ(dst.Value(10 + c), src.Value(15 + c));
    }
    EXPECT_EQ(dst.FirstNonFinite(), -1);
    dst.ZeroRows(2, 1);
    for (int c = 0; c < 5; ++c) EXPECT_EQ(dst.Value(10 + c), 0.0f);
    dst.CopyRows(0, src, 0, 0);  // empty copies and zeroings are no-ops
    dst.ZeroRows(3, 0);

    x[13] = std::numeric_limits<float>::infinity();
    EXPECT_EQ(ActivationRows::FromFloats(p, x.data(), 4, 5).FirstNonFinite(), 13);
    x[7] = std::nanf("");
    EXPECT_EQ(ActivationRows::FromFloats(p, x.data(), 4, 5).FirstNonFinite(), 7);
  }
  // A finite fp32 value beyond bf16's range rounds to Inf, and is seen as such.
  const float big[] = {3.4e38f};
  EXPECT_EQ(ActivationRows::FromFloats(Precision::kBF16, big, 1, 1).FirstNonFinite(), 0);
  EXPECT_TRUE(ActivationRows::FromFloats(Precision::kBF16, nullptr, 0, 7).empty());
}

}  // namespace
}  // namespace moe
