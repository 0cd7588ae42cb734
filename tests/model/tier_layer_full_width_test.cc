// The full-width Kimi K3 layout (7168 / 3584 / 3072, 32 MXFP4 experts, top-16) on every CPU
// kernel tier the host runs, bit for bit against the portable kernels (tier_layer_testing.h).
// 1, 3 and 17 tokens: the portable run at 257 would take minutes, and 17 tokens x top-16 of 32
// experts already puts ~8 rows on each expert, past every in-register path. Label `layer`: the
// release build only (minutes under the sanitizers).
#include "tests/model/tier_layer_testing.h"

namespace moe {
namespace {

INSTANTIATE_TEST_SUITE_P(FullWidthK3, TierLayerTest,
                         ::testing::Combine(::testing::Values("k3-mxfp4-full-width"),
                                            ::testing::Values(1, 3, 17),
                                            ::testing::Values(Precision::kBF16, Precision::kFP32)),
                         CaseName);

}  // namespace
}  // namespace moe
