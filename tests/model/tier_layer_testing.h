// The whole-layer tier comparison shared by tier_layer_test.cc (k3-mini, the FP8 K2 layout)
// and tier_layer_full_width_test.cc (the full-width K3 layout): every CPU kernel tier the host
// runs against the portable kernels, bit for bit.
#pragma once

#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "engine/local_layer.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "model/checkpoint.h"
#include "tests/kernels/tier_checks.h"
#include "tests/kernels/tier_testing.h"
#include "tests/testing/test_checkpoints.h"

namespace moe {

struct LayerRun {
  std::vector<float> y;
  std::vector<int32_t> ids;
};

inline LayerRun RunLayer(const std::string& model, int64_t tokens, Precision p,
                         CpuBackend* backend) {
  auto checkpoint = Checkpoint::Open(testing::TestCheckpoint(model));
  EXPECT_TRUE(checkpoint.ok()) << checkpoint.status();
  const MoeConfig& config = (*checkpoint)->config();
  const int layer = (*checkpoint)->layers().front();
  std::mt19937 rng(static_cast<uint32_t>(tokens * 7 + static_cast<int>(p)));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(tokens * config.hidden_size);
  for (float& v : x) v = normal(rng);
  auto local = LocalMoeLayer::Load(
      **checkpoint, layer, ExpertPlacement::Contiguous(config.routing.num_experts, 3), backend);
  EXPECT_TRUE(local.ok()) << local.status();
  LayerRun run;
  run.y.resize(x.size());
  Routing routing;
  EXPECT_TRUE((*local)->Forward(x.data(), tokens, p, run.y.data(), &routing).ok());
  run.ids = routing.ids;
  return run;
}

inline bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

class TierLayerTest : public ::testing::TestWithParam<std::tuple<std::string, int64_t, Precision>> {
};

TEST_P(TierLayerTest, EveryTierGivesThePortableBits) {
  const auto& [model, tokens, precision] = GetParam();
  CpuBackend portable(CpuBackendOptions{2, "portable"});
  const LayerRun want = RunLayer(model, tokens, precision, &portable);
  std::string checked, lacking;
  for (const cpu::CpuTier* tier : testing::VectorTiers()) {
    if (!tier->host_supports()) {
      lacking += std::string(" ") + tier->name;
      continue;
    }
    CpuBackend backend(CpuBackendOptions{2, tier->name});
    const LayerRun got = RunLayer(model, tokens, precision, &backend);
    EXPECT_EQ(got.ids, want.ids) << tier->name;
    EXPECT_TRUE(SameBits(got.y, want.y)) << tier->name << " differs from the portable kernels";
    checked += std::string(" ") + tier->name;
  }
  std::printf("  %s, %lld tokens, %s: bit-identical on%s%s%s\n", model.c_str(),
              static_cast<long long>(tokens), PrecisionName(precision), checked.c_str(),
              lacking.empty() ? "" : "; not on this host:", lacking.c_str());
  if (checked.empty()) GTEST_SKIP() << "this host runs no vector tier (lacks" << lacking << ")";
}

inline std::string CaseName(
    const ::testing::TestParamInfo<std::tuple<std::string, int64_t, Precision>>& info) {
  std::string name = std::get<0>(info.param) + "_" + std::to_string(std::get<1>(info.param)) + "_" +
                     PrecisionName(std::get<2>(info.param));
  for (char& c : name)
    if (c == '-') c = '_';
  return name;
}

}  // namespace moe
