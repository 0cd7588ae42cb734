// The whole MoE layer (LocalMoeLayer) on the CUDA backend against the same layer on the CPU
// backend, on synthetic checkpoints: k3-mini (bf16 experts, SiTU, latent norm), k3-mini with
// MXFP4 experts, and a K2 FP8 layout with widths that are not multiples of 128 and
// group-limited routing; 1, 3 and 257 tokens; 1 and 3 in-process shards; bf16 and fp32.
//
// Tolerances (relative L2 over the tokens both backends route identically):
//   bf16 <= 1e-2: both round at the same points; they differ where fp32 summation order
//                 flips a bf16 rounding (as the CPU-vs-Python reference test allows).
//   fp32 <= 1e-4: no intermediate rounding, only summation order differs.
// A token whose expert choice differs (a near-tie: the router logits come from GEMMs with
// different fp32 summation orders) is excluded and counted; at most max(1, 2%) of the tokens.
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <random>

#include "absl/strings/str_cat.h"
#include "engine/local_layer.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "model/checkpoint.h"
#include "model/synthetic.h"
#include "tests/cuda/cuda_test_util.h"

namespace moe {
namespace {

MoeConfig MakeConfig(const std::string& name) {
  if (name == "k3-mini") return *SyntheticPreset("k3-mini");
  if (name == "k3-mini-mxfp4") {
    MoeConfig c = *SyntheticPreset("k3-mini");
    c.expert_format = WeightFormat::kMXFP4;
    return c;
  }
  // k2-fp8-odd: Kimi K2 layout, FP8 everywhere, partial scale blocks, group-limited routing.
  MoeConfig c = *SyntheticPreset("kimi-k2");
  c.hidden_size = 456;
  c.expert_hidden_size = 200;
  c.routing.num_experts = 24;
  c.routing.top_k = 8;
  c.routing.n_group = 4;
  c.routing.topk_group = 2;
  return c;
}

// Checkpoints are deterministic (seed), so they are written once and shared by the test
// processes ctest starts (one per case), under a file lock.
std::string CacheDir() {
  if (const char* dir = std::getenv("MOE_TEST_CACHE")) return dir;
  const char* tmp = std::getenv("TMPDIR");
  return absl::StrCat(tmp ? tmp : "/tmp", "/moe_cuda_layer_test_", getuid());
}

class CudaLayerTest
    : public ::testing::TestWithParam<std::tuple<std::string, int, int, Precision>> {
 protected:
  static std::string Checkpoint(const std::string& name) {
    const std::string dir = absl::StrCat(CacheDir(), "/", name, "-seed11");
    std::filesystem::create_directories(CacheDir());
    const int lock = open((dir + ".lock").c_str(), O_CREAT | O_RDWR, 0644);
    if (lock >= 0) flock(lock, LOCK_EX);
    if (!std::filesystem::exists(dir + "/.complete")) {
      SyntheticOptions options;
      options.seed = 11;
      options.num_moe_layers = 1;
      const absl::Status s = WriteSyntheticCheckpoint(dir, MakeConfig(name), options);
      EXPECT_TRUE(s.ok()) << s;
      if (s.ok()) std::fclose(std::fopen((dir + "/.complete").c_str(), "w"));
    }
    if (lock >= 0) close(lock);  // releases the lock
    return dir;
  }
};

TEST_P(CudaLayerTest, MatchesCpuBackend) {
  MOE_SKIP_WITHOUT_CUDA();
  const auto& [name, ranks, tokens, precision] = GetParam();
  auto checkpoint = Checkpoint::Open(Checkpoint(name));
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  const MoeConfig& config = (*checkpoint)->config();
  const int layer = (*checkpoint)->layers().front();
  const ExpertPlacement placement = ExpertPlacement::Contiguous(config.routing.num_experts, ranks);

  CpuBackend cpu(CpuBackendOptions{2, ""});
  auto gpu = CudaBackend::Create(CudaBackendOptions{});
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  auto cpu_layer = LocalMoeLayer::Load(**checkpoint, layer, placement, &cpu);
  ASSERT_TRUE(cpu_layer.ok()) << cpu_layer.status();
  auto gpu_layer = LocalMoeLayer::Load(**checkpoint, layer, placement, gpu->get());
  ASSERT_TRUE(gpu_layer.ok()) << gpu_layer.status();

  const int64_t H = config.hidden_size;
  std::mt19937 rng(static_cast<uint32_t>(tokens * 7 + ranks));
  std::normal_distribution<float> normal(0, 1);
  std::vector<float> x(tokens * H);
  for (auto& v : x) v = normal(rng);
  std::vector<float> want(tokens * H), got(tokens * H, std::nanf(""));
  Routing want_routing, got_routing;
  ASSERT_TRUE((*cpu_layer)->Forward(x.data(), tokens, precision, want.data(), &want_routing).ok());
  const absl::Status s =
      (*gpu_layer)->Forward(x.data(), tokens, precision, got.data(), &got_routing);
  ASSERT_TRUE(s.ok()) << s;

  const int k = config.routing.top_k;
  double num = 0, den = 0;
  int differ = 0;
  for (int64_t t = 0; t < tokens; ++t) {
    bool same_route = true;
    for (int j = 0; j < k; ++j)
      same_route = same_route && got_routing.ids[t * k + j] == want_routing.ids[t * k + j];
    for (int64_t c = 0; c < H; ++c) ASSERT_FALSE(std::isnan(got[t * H + c])) << t << ", " << c;
    if (!same_route) {
      ++differ;
      continue;
    }
    for (int64_t c = 0; c < H; ++c) {
      const double d = static_cast<double>(got[t * H + c]) - want[t * H + c];
      num += d * d;
      den += static_cast<double>(want[t * H + c]) * want[t * H + c];
    }
  }
  ASSERT_GT(den, 0.0);
  const double rel = std::sqrt(num / den);
  EXPECT_LE(rel, precision == Precision::kBF16 ? 1e-2 : 1e-4);
  EXPECT_LE(differ, std::max<int64_t>(1, tokens / 50)) << "routing differs beyond near-ties";
  std::printf("  %s ranks=%d tokens=%d %s: relative L2 %.3g, tokens routed differently %d\n",
              name.c_str(), ranks, tokens, precision == Precision::kBF16 ? "bf16" : "fp32", rel,
              differ);
}

std::string CaseName(
    const ::testing::TestParamInfo<std::tuple<std::string, int, int, Precision>>& info) {
  std::string name = absl::StrCat(std::get<0>(info.param), "_r", std::get<1>(info.param), "_t",
                                  std::get<2>(info.param),
                                  std::get<3>(info.param) == Precision::kBF16 ? "_bf16" : "_fp32");
  for (char& ch : name)
    if (ch == '-') ch = '_';
  return name;
}

INSTANTIATE_TEST_SUITE_P(AllModels, CudaLayerTest,
                         ::testing::Combine(::testing::Values("k3-mini", "k3-mini-mxfp4",
                                                              "k2-fp8-odd"),
                                            ::testing::Values(1, 3), ::testing::Values(1, 3, 257),
                                            ::testing::Values(Precision::kBF16, Precision::kFP32)),
                         CaseName);

}  // namespace
}  // namespace moe
