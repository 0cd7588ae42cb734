// Every vector tier's GLU row and activation packing against the portable definitions
// (core/numerics.h's GluActivate, canonical.h's PackActivationRow), bit for bit, on widths
// around every vector length; and corrupted ones, to show the checks can fail.
#include "gtest/gtest.h"
#include "kernels/cpu/dot.h"
#include "tests/kernels/tier_checks.h"
#include "tests/kernels/tier_testing.h"

namespace moe::cpu {
namespace {

using moe::testing::GluMatchesPortable;
using moe::testing::PackMatchesPortable;

const ActivationParams kActivations[] = {{Activation::kSiTU, 4.0f, 25.0f},
                                         {Activation::kSiLU, 4.0f, 25.0f}};

class TierActivationTest : public ::testing::TestWithParam<const CpuTier*> {};

TEST_P(TierActivationTest, GluMatchesScalarBitForBit) {
  const CpuTier* tier = GetParam();
  MOE_SKIP_UNLESS_HOST_RUNS(tier);
  for (int64_t n : {1, 7, 8, 9, 15, 16, 17, 1000})
    for (const ActivationParams& act : kActivations)
      for (Precision p : {Precision::kBF16, Precision::kFP32})
        ASSERT_TRUE(GluMatchesPortable(tier->kernels()->glu_row, n, act, p));
}

TEST_P(TierActivationTest, PackingMatchesPortableBitForBit) {
  const CpuTier* tier = GetParam();
  MOE_SKIP_UNLESS_HOST_RUNS(tier);
  for (WeightFormat f : {WeightFormat::kBF16, WeightFormat::kMXFP4, WeightFormat::kFP8Block128})
    for (Precision p : {Precision::kBF16, Precision::kFP32})
      for (int64_t k : {1, 31, 32, 64, 100, 128, 129, 320, 456, 1000, 3584})
        ASSERT_TRUE(PackMatchesPortable(tier->kernels()->pack_row, f, p, k));
}

INSTANTIATE_TEST_SUITE_P(AllTiers, TierActivationTest,
                         ::testing::ValuesIn(moe::testing::VectorTiers()),
                         moe::testing::TierParamName);

TEST(TierCheckTest, GluAndPackChecksCatchCorruptedKernels) {
  const DotKernels glu =
      moe::testing::Corrupted(*PortableDotKernels(), moe::testing::Corruption::kGlu);
  EXPECT_FALSE(GluMatchesPortable(glu.glu_row, 17, kActivations[0], Precision::kFP32));
  EXPECT_FALSE(GluMatchesPortable(glu.glu_row, 1000, kActivations[1], Precision::kBF16));
  const DotKernels pack =
      moe::testing::Corrupted(*PortableDotKernels(), moe::testing::Corruption::kPack);
  EXPECT_FALSE(PackMatchesPortable(pack.pack_row, WeightFormat::kMXFP4, Precision::kBF16, 320));
  EXPECT_FALSE(
      PackMatchesPortable(pack.pack_row, WeightFormat::kFP8Block128, Precision::kBF16, 129));
  EXPECT_TRUE(PackMatchesPortable(pack.pack_row, WeightFormat::kBF16, Precision::kFP32, 129));
}

}  // namespace
}  // namespace moe::cpu
