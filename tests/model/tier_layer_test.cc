// The whole MoE layer (LocalMoeLayer) on every CPU kernel tier the host runs, bit for bit
// against the portable kernels, for k3-mini and the FP8 K2 layout in bf16 and fp32 modes, with
// experts split over shards that do not divide them: no output may change by one bit on any host.
// Tiers the host lacks are named in the output and counted as not checked; a corrupted kernel
// table shows the comparison can fail. 1, 3 and 257 tokens (257 puts tens of rows on every
// expert: the scratch tiles).
#include "tests/model/tier_layer_testing.h"

namespace moe {
namespace {

INSTANTIATE_TEST_SUITE_P(SmallModels, TierLayerTest,
                         ::testing::Combine(::testing::Values("k3-mini", "k2-fp8-odd"),
                                            ::testing::Values(1, 3, 257),
                                            ::testing::Values(Precision::kBF16, Precision::kFP32)),
                         CaseName);
// The comparison catches a one-ulp bug in the dot kernel of the operands' wide calls.
TEST(TierLayerCheckTest, CatchesACorruptedKernel) {
  CpuBackend portable(CpuBackendOptions{2, "portable"});
  const cpu::DotKernels corrupted =
      testing::Corrupted(*cpu::PortableDotKernels(), testing::Corruption::kDot);
  CpuBackend backend(CpuBackendOptions{2, ""}, &corrupted);
  EXPECT_FALSE(SameBits(RunLayer("k3-mini", 257, Precision::kFP32, &backend).y,
                        RunLayer("k3-mini", 257, Precision::kFP32, &portable).y));
}

}  // namespace
}  // namespace moe
