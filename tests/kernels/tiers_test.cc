// Choosing a kernel tier: by name, by MOE_CPU_KERNELS, and what is refused.
#include "kernels/cpu/tiers.h"

#include <cstdlib>
#include <string>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"

namespace moe::cpu {
namespace {

TEST(TiersTest, PortableIsLastAndAlwaysRuns) {
  const auto tiers = CpuTiers();
  ASSERT_FALSE(tiers.empty());
  EXPECT_EQ(std::string(tiers.back().name), "portable");
  EXPECT_TRUE(tiers.back().host_supports());
  auto portable = SelectCpuTier("portable");
  ASSERT_TRUE(portable.ok()) << portable.status();
  EXPECT_EQ((*portable)->kernels(), PortableDotKernels());
}

TEST(TiersTest, BestIsTheFirstTierTheHostRuns) {
  auto best = SelectCpuTier("best");
  ASSERT_TRUE(best.ok()) << best.status();
  for (const CpuTier& tier : CpuTiers()) {
    if (!tier.host_supports()) continue;
    EXPECT_EQ(*best, &tier);
    break;
  }
  auto empty = SelectCpuTier("");
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(*empty, *best);
}

TEST(TiersTest, EachTierIsSelectableExactlyWhenTheHostRunsIt) {
  for (const CpuTier& tier : CpuTiers()) {
    auto selected = SelectCpuTier(tier.name);
    if (tier.host_supports()) {
      ASSERT_TRUE(selected.ok()) << selected.status();
      EXPECT_EQ(*selected, &tier);
      EXPECT_EQ(std::string(tier.kernels()->name), tier.name);
    } else {
      EXPECT_EQ(selected.status().code(), absl::StatusCode::kFailedPrecondition) << tier.name;
      EXPECT_NE(selected.status().message().find(tier.features), std::string::npos)
          << selected.status();
    }
  }
}

TEST(TiersTest, UnknownNamesAreRefusedWithTheKnownOnes) {
  auto bad = SelectCpuTier("avx9000");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("avx9000"), std::string::npos);
  EXPECT_NE(bad.status().message().find("portable"), std::string::npos);
}

TEST(TiersTest, EnvironmentChoosesTheDefaultTier) {
  ASSERT_EQ(setenv("MOE_CPU_KERNELS", "portable", 1), 0);
  auto tier = DefaultCpuTier();
  ASSERT_TRUE(tier.ok());
  EXPECT_EQ(std::string((*tier)->name), "portable");
  auto backend = CpuBackend::Create(CpuBackendOptions{1, ""});
  ASSERT_TRUE(backend.ok());
  EXPECT_EQ(std::string((*backend)->kernels().name), "portable");

  ASSERT_EQ(setenv("MOE_CPU_KERNELS", "nonsense", 1), 0);
  EXPECT_EQ(DefaultCpuTier().status().code(), absl::StatusCode::kInvalidArgument);
  auto refused = CpuBackend::Create(CpuBackendOptions{1, ""});
  EXPECT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("MOE_CPU_KERNELS"), std::string::npos);
  // An explicit tier wins over the environment.
  EXPECT_TRUE(CpuBackend::Create(CpuBackendOptions{1, "portable"}).ok());
  ASSERT_EQ(unsetenv("MOE_CPU_KERNELS"), 0);
}

}  // namespace
}  // namespace moe::cpu
