#include "model/synthetic.h"

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/numerics.h"
#include "gtest/gtest.h"
#include "model/checkpoint.h"
#include "model/safetensors.h"
#include "tests/testing/model_files.h"
#include "tests/testing/temp_dir.h"

namespace moe {
namespace {

namespace fs = std::filesystem;

// A path for a checkpoint the test writes (the directory itself does not exist yet).
std::string FreshDir(const std::string& name) {
  const std::string dir = testing::FreshTestDir("synthetic_test_" + name);
  fs::remove_all(dir);
  return dir;
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

float Decode(const WeightMatrix& m, int64_t r, int64_t c) {
  const auto* data = static_cast<const uint8_t*>(m.data);
  switch (m.format) {
    case WeightFormat::kBF16: {
      uint16_t bits;
      std::memcpy(&bits, data + 2 * (r * m.cols + c), 2);
      return Bf16BitsToFloat(bits);
    }
    case WeightFormat::kMXFP4:
      return Mxfp4Element(data + r * (m.cols / 2),
                          static_cast<const uint8_t*>(m.scales) + r * (m.cols / 32), c);
    case WeightFormat::kFP8Block128: {
      float scale;
      std::memcpy(&scale,
                  static_cast<const uint8_t*>(m.scales) +
                      4 * ((r / 128) * ((m.cols + 127) / 128) + c / 128),
                  4);
      return Fp8E4m3ToFloat(data[r * m.cols + c]) * scale;
    }
  }
  return NAN;
}

struct Stats {
  double mean = 0, rms = 0, stddev = 0;
  int64_t zeros = 0, n = 0;
};

Stats MatrixStats(const WeightMatrix& m) {
  Stats s;
  double sum = 0, sum_sq = 0;
  for (int64_t r = 0; r < m.rows; ++r)
    for (int64_t c = 0; c < m.cols; ++c) {
      const double v = Decode(m, r, c);
      sum += v;
      sum_sq += v * v;
      s.zeros += v == 0;
    }
  s.n = m.rows * m.cols;
  s.mean = sum / s.n;
  s.rms = std::sqrt(sum_sq / s.n);
  s.stddev = std::sqrt(std::max(0.0, sum_sq / s.n - s.mean * s.mean));
  return s;
}

// Weight RMS close to 1/sqrt(in): outputs of order 1 for inputs of order 1.
void ExpectInputScaled(const WeightMatrix& m, const std::string& what) {
  const Stats s = MatrixStats(m);
  const double want = 1.0 / std::sqrt(static_cast<double>(m.cols));
  EXPECT_GT(s.rms, 0.8 * want) << what;
  EXPECT_LT(s.rms, 1.25 * want) << what;
  EXPECT_LT(std::fabs(s.mean), 0.1 * want) << what;
  EXPECT_LT(s.zeros, s.n / 4) << what;
}

TEST(SyntheticPresetTest, ExactValues) {
  auto mini = SyntheticPreset("k3-mini");
  ASSERT_TRUE(mini.ok()) << mini.status();
  EXPECT_EQ(mini->family, ModelFamily::kKimiK3);
  EXPECT_EQ(mini->model_type, "kimi_k3");
  EXPECT_EQ(mini->hidden_size, 640);
  EXPECT_EQ(mini->latent_size, 320);
  EXPECT_EQ(mini->expert_hidden_size, 256);
  EXPECT_EQ(mini->routing.num_experts, 64);
  EXPECT_EQ(mini->routing.top_k, 2);
  EXPECT_EQ(mini->num_shared_experts, 2);
  EXPECT_TRUE(mini->latent_norm);
  EXPECT_TRUE(mini->routing.renormalize);
  EXPECT_EQ(mini->routing.routed_scaling_factor, 1.0f);
  EXPECT_EQ(mini->rms_norm_eps, 1e-5f);
  EXPECT_EQ(mini->activation.kind, Activation::kSiTU);
  EXPECT_EQ(mini->activation.situ_beta, 4.0f);
  EXPECT_EQ(mini->activation.situ_linear_beta, 25.0f);
  EXPECT_EQ(mini->first_k_dense_replace, 1);
  EXPECT_EQ(mini->MoeLayerIndices(), (std::vector<int>{1, 2}));
  EXPECT_EQ(mini->expert_format, WeightFormat::kBF16);
  EXPECT_EQ(mini->dense_format, WeightFormat::kBF16);
  EXPECT_TRUE(mini->Validate().ok());

  auto k3 = SyntheticPreset("kimi-k3");
  ASSERT_TRUE(k3.ok()) << k3.status();
  EXPECT_EQ(k3->hidden_size, 7168);
  EXPECT_EQ(k3->latent_size, 3584);
  EXPECT_EQ(k3->expert_hidden_size, 3072);
  EXPECT_EQ(k3->routing.num_experts, 896);
  EXPECT_EQ(k3->routing.top_k, 16);
  EXPECT_EQ(k3->num_shared_experts, 2);
  EXPECT_EQ(k3->expert_format, WeightFormat::kMXFP4);
  EXPECT_EQ(k3->dense_format, WeightFormat::kBF16);
  EXPECT_EQ(k3->MoeLayerIndices(), (std::vector<int>{1}));
  EXPECT_TRUE(k3->Validate().ok());

  auto k2 = SyntheticPreset("kimi-k2");
  ASSERT_TRUE(k2.ok()) << k2.status();
  EXPECT_EQ(k2->family, ModelFamily::kKimiK2);
  EXPECT_EQ(k2->model_type, "kimi_k2");
  EXPECT_EQ(k2->hidden_size, 7168);
  EXPECT_EQ(k2->latent_size, 0);
  EXPECT_EQ(k2->expert_hidden_size, 2048);
  EXPECT_EQ(k2->routing.num_experts, 384);
  EXPECT_EQ(k2->routing.top_k, 8);
  EXPECT_EQ(k2->num_shared_experts, 1);
  EXPECT_EQ(k2->routing.routed_scaling_factor, 2.827f);
  EXPECT_EQ(k2->routing.n_group, 1);
  EXPECT_EQ(k2->routing.topk_group, 1);
  EXPECT_EQ(k2->activation.kind, Activation::kSiLU);
  EXPECT_EQ(k2->rms_norm_eps, 1e-6f);
  EXPECT_EQ(k2->expert_format, WeightFormat::kFP8Block128);
  EXPECT_EQ(k2->dense_format, WeightFormat::kFP8Block128);
  EXPECT_EQ(k2->MoeLayerIndices(), (std::vector<int>{1}));
  EXPECT_TRUE(k2->Validate().ok());

  auto unknown = SyntheticPreset("kimi-k9");
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_CONTAINS(unknown.status().message(), "k3-mini");
}

TEST(SyntheticCheckpointTest, K3MiniLoadsWithRealisticValues) {
  const std::string dir = FreshDir("k3_mini");
  auto config = SyntheticPreset("k3-mini");
  ASSERT_TRUE(config.ok());
  SyntheticSummary summary;
  ASSERT_TRUE(WriteSyntheticCheckpoint(dir, *config, {}, &summary).ok());
  EXPECT_EQ(summary.layers, (std::vector<int>{1, 2}));
  EXPECT_EQ(summary.num_experts, 64);
  EXPECT_EQ(summary.files.size(), 3u);  // config, one shard, index
  EXPECT_TRUE(fs::exists(dir + "/model-00001-of-00001.safetensors"));
  EXPECT_GT(summary.file_bytes, summary.tensor_bytes);

  auto ckpt = Checkpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_EQ((*ckpt)->config(), *config);
  EXPECT_EQ((*ckpt)->layers(), (std::vector<int>{1, 2}));
  EXPECT_TRUE((*ckpt)->tensors().Contains(
      "language_model.model.layers.2.block_sparse_moe.experts.63.w2.weight"));

  auto gw = (*ckpt)->LoadGatewayLayer(2);
  ASSERT_TRUE(gw.ok()) << gw.status();
  ExpectInputScaled(gw->router, "router");
  ExpectInputScaled(gw->latent_down, "latent_down");
  ExpectInputScaled(gw->latent_up, "latent_up");
  ExpectInputScaled(gw->shared.gate, "shared.gate");
  ExpectInputScaled(gw->shared.up, "shared.up");
  ExpectInputScaled(gw->shared.down, "shared.down");
  EXPECT_EQ(gw->shared.gate.rows, 512);

  double norm_sum = 0, norm_sq = 0;
  for (int64_t i = 0; i < gw->latent_norm.size; ++i) {
    const double v = Bf16BitsToFloat(gw->latent_norm.data[i]);
    norm_sum += v;
    norm_sq += (v - 1) * (v - 1);
  }
  EXPECT_NEAR(norm_sum / 320, 1.0, 0.01);
  EXPECT_NEAR(std::sqrt(norm_sq / 320), 0.05, 0.01);

  double bias_sq = 0;
  std::set<float> distinct;
  for (float b : gw->router_bias) {
    bias_sq += b * b;
    distinct.insert(b);
  }
  EXPECT_NEAR(std::sqrt(bias_sq / 64), 0.02, 0.008);
  EXPECT_GT(distinct.size(), 60u);

  std::vector<int> all(64);
  for (int e = 0; e < 64; ++e) all[e] = e;
  auto experts = (*ckpt)->LoadExperts(1, all);
  ASSERT_TRUE(experts.ok()) << experts.status();
  for (int e : {0, 17, 63}) {
    ExpectInputScaled(experts->experts[e].gate, absl::StrCat("expert ", e, " w1"));
    ExpectInputScaled(experts->experts[e].up, absl::StrCat("expert ", e, " w3"));
    ExpectInputScaled(experts->experts[e].down, absl::StrCat("expert ", e, " w2"));
  }
  // Different experts hold different values.
  EXPECT_NE(std::memcmp(experts->experts[0].gate.data, experts->experts[1].gate.data, 1024), 0);
  EXPECT_NE(std::memcmp(experts->experts[0].gate.data, experts->experts[0].up.data, 1024), 0);
}

MoeConfig SmallK3(WeightFormat experts) {
  MoeConfig c = *SyntheticPreset("k3-mini");
  c.hidden_size = 256;
  c.latent_size = 96;
  c.expert_hidden_size = 160;
  c.routing.num_experts = 8;
  c.expert_format = experts;
  SetNumMoeLayers(1, &c);
  return c;
}

// Every tensor's bytes, by name.
std::map<std::string, std::string> AllTensorBytes(const std::string& dir) {
  std::map<std::string, std::string> out;
  auto ckpt = SafetensorsCheckpoint::Open(dir);
  EXPECT_TRUE(ckpt.ok()) << ckpt.status();
  if (!ckpt.ok()) return out;
  for (const std::string& name : (*ckpt)->TensorNames()) {
    auto t = (*ckpt)->Find(name);
    EXPECT_TRUE(t.ok()) << t.status();
    auto bytes = t->file->Data(*t->info);
    out[name] = std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  }
  return out;
}

TEST(SyntheticCheckpointTest, Deterministic) {
  const MoeConfig config = SmallK3(WeightFormat::kMXFP4);
  SyntheticOptions options;
  options.seed = 7;
  const std::string a = FreshDir("det_a"), b = FreshDir("det_b");
  ASSERT_TRUE(WriteSyntheticCheckpoint(a, config, options).ok());
  ASSERT_TRUE(WriteSyntheticCheckpoint(b, config, options).ok());
  for (const char* file :
       {"config.json", "model-00001-of-00001.safetensors", "model.safetensors.index.json"})
    EXPECT_TRUE(ReadAll(a + "/" + file) == ReadAll(b + "/" + file)) << file;

  // Values depend only on (seed, name): not on the thread count or the sharding.
  SyntheticOptions other = options;
  other.num_threads = 1;
  other.max_shard_bytes = 300000;
  const std::string c = FreshDir("det_c");
  ASSERT_TRUE(WriteSyntheticCheckpoint(c, config, other).ok());
  int shards = 0;
  for (const auto& entry : fs::directory_iterator(c))
    shards += entry.path().extension() == ".safetensors";
  EXPECT_GT(shards, 1);
  const auto tensors_a = AllTensorBytes(a);
  EXPECT_EQ(tensors_a.size(), 1u * (2 + 3 + 3 + 8 * 6));
  EXPECT_TRUE(tensors_a == AllTensorBytes(c));

  // Another seed changes every tensor.
  SyntheticOptions reseeded = options;
  reseeded.seed = 8;
  const std::string d = FreshDir("det_d");
  ASSERT_TRUE(WriteSyntheticCheckpoint(d, config, reseeded).ok());
  const auto tensors_d = AllTensorBytes(d);
  ASSERT_EQ(tensors_d.size(), tensors_a.size());
  for (const auto& [name, bytes] : tensors_a) EXPECT_NE(bytes, tensors_d.at(name)) << name;
}

TEST(SyntheticCheckpointTest, ShardsKeepExpertsTogether) {
  const MoeConfig config = SmallK3(WeightFormat::kBF16);
  SyntheticOptions options;
  options.max_shard_bytes = 400000;  // an expert is 3 * 160 * 96 * 2 = 92160 bytes
  const std::string dir = FreshDir("shards");
  SyntheticSummary summary;
  ASSERT_TRUE(WriteSyntheticCheckpoint(dir, config, options, &summary).ok());

  auto ckpt = SafetensorsCheckpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  std::set<std::string> shard_paths;
  int64_t total = 0;
  for (const std::string& name : (*ckpt)->TensorNames()) {
    auto t = (*ckpt)->Find(name);
    ASSERT_TRUE(t.ok());
    shard_paths.insert(t->file->path());
    total += t->info->size_bytes;
  }
  const int n = static_cast<int>(shard_paths.size());
  EXPECT_GT(n, 2);
  EXPECT_EQ(summary.files.size(), static_cast<size_t>(n + 2));
  for (int s = 1; s <= n; ++s)
    EXPECT_TRUE(shard_paths.count(absl::StrFormat("%s/model-%05d-of-%05d.safetensors", dir, s, n)));
  EXPECT_EQ(total, summary.tensor_bytes);
  EXPECT_CONTAINS(ReadAll(dir + "/model.safetensors.index.json"),
                  absl::StrCat("\"total_size\": ", total));

  // Every shard within the limit (no single unit is larger here); each expert in one shard.
  for (const std::string& path : shard_paths) {
    auto file = SafetensorsFile::Open(path);
    ASSERT_TRUE(file.ok());
    uint64_t bytes = 0;
    for (const auto& [name, info] : (*file)->tensors()) bytes += info.size_bytes;
    EXPECT_LE(bytes, 400000u) << path;
  }
  const std::string p = "language_model.model.layers.1.block_sparse_moe.experts.";
  for (int e = 0; e < 8; ++e) {
    const std::string w1 = (*ckpt)->Find(absl::StrCat(p, e, ".w1.weight"))->file->path();
    EXPECT_EQ((*ckpt)->Find(absl::StrCat(p, e, ".w3.weight"))->file->path(), w1);
    EXPECT_EQ((*ckpt)->Find(absl::StrCat(p, e, ".w2.weight"))->file->path(), w1);
  }
  auto loaded = Checkpoint::Open(dir);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_TRUE((*loaded)->LoadExperts(1, {0, 7}).ok());
  EXPECT_TRUE((*loaded)->LoadGatewayLayer(1).ok());
}

TEST(SyntheticCheckpointTest, Mxfp4Scale) {
  const MoeConfig config = SmallK3(WeightFormat::kMXFP4);
  const std::string dir = FreshDir("mxfp4");
  ASSERT_TRUE(WriteSyntheticCheckpoint(dir, config, {}).ok());
  auto ckpt = Checkpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  auto experts = (*ckpt)->LoadExperts(1, {0, 5});
  ASSERT_TRUE(experts.ok()) << experts.status();
  for (const MlpWeights& e : experts->experts) {
    ASSERT_EQ(e.gate.format, WeightFormat::kMXFP4);
    ExpectInputScaled(e.gate, "w1");  // in = latent 96
    ExpectInputScaled(e.up, "w3");
    ExpectInputScaled(e.down, "w2");  // in = 160
    // Two neighbouring E8M0 exponents, as a real quantizer would produce.
    std::set<uint8_t> exponents(static_cast<const uint8_t*>(e.down.scales),
                                static_cast<const uint8_t*>(e.down.scales) + e.down.ScaleBytes());
    EXPECT_EQ(exponents.size(), 2u);
  }
  auto gw = (*ckpt)->LoadGatewayLayer(1);
  ASSERT_TRUE(gw.ok()) << gw.status();
  EXPECT_EQ(gw->latent_down.format, WeightFormat::kBF16);
}

TEST(SyntheticCheckpointTest, Fp8ScaleWithEdgeBlocks) {
  MoeConfig config = *SyntheticPreset("kimi-k2");
  config.hidden_size = 200;
  config.expert_hidden_size = 328;
  config.routing.num_experts = 4;
  config.routing.top_k = 2;
  const std::string dir = FreshDir("fp8");
  ASSERT_TRUE(WriteSyntheticCheckpoint(dir, config, {}).ok());
  auto ckpt = Checkpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  auto scale = (*ckpt)->tensors().FindChecked(
      "model.layers.1.mlp.experts.3.down_proj.weight_scale_inv", DType::kF32, {2, 3});
  ASSERT_TRUE(scale.ok()) << scale.status();
  std::vector<float> s(6);
  std::memcpy(s.data(), scale->file->Data(*scale->info).data(), 24);
  for (float v : s) {
    EXPECT_GE(v, 0.75f / std::sqrt(328.0f));
    EXPECT_LE(v, 1.25f / std::sqrt(328.0f));
  }
  auto experts = (*ckpt)->LoadExperts(1, {3});
  ASSERT_TRUE(experts.ok()) << experts.status();
  const MlpWeights& e = experts->experts[0];
  ASSERT_EQ(e.gate.format, WeightFormat::kFP8Block128);
  ExpectInputScaled(e.gate, "gate_proj");  // 328 x 200
  ExpectInputScaled(e.up, "up_proj");
  ExpectInputScaled(e.down, "down_proj");  // 200 x 328
  auto gw = (*ckpt)->LoadGatewayLayer(1);
  ASSERT_TRUE(gw.ok()) << gw.status();
  EXPECT_EQ(gw->router.format, WeightFormat::kBF16);
  EXPECT_EQ(gw->shared.down.format, WeightFormat::kFP8Block128);
  ExpectInputScaled(gw->shared.down, "shared down_proj");
  ExpectInputScaled(gw->router, "router");
}

TEST(SyntheticCheckpointTest, RouterSkewAndPlainPrefix) {
  MoeConfig config = SmallK3(WeightFormat::kBF16);
  config.routing.num_experts = 40;
  SyntheticOptions options;
  options.router_skew = 1.0f;
  options.language_model_prefix = false;
  options.num_moe_layers = 2;
  const std::string dir = FreshDir("skew");
  ASSERT_TRUE(WriteSyntheticCheckpoint(dir, config, options).ok());
  auto ckpt = Checkpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_EQ((*ckpt)->layers(), (std::vector<int>{1, 2}));
  EXPECT_EQ((*ckpt)->config().num_hidden_layers, 3);
  EXPECT_TRUE((*ckpt)->tensors().Contains("model.layers.2.block_sparse_moe.gate.weight"));
  auto gw = (*ckpt)->LoadGatewayLayer(2);
  ASSERT_TRUE(gw.ok()) << gw.status();
  for (int e = 0; e < 40; ++e) {
    if (e < 4)
      EXPECT_NEAR(gw->router_bias[e], 1.0f, 0.1f) << e;
    else
      EXPECT_NEAR(gw->router_bias[e], 0.0f, 0.1f) << e;
  }
}

TEST(SyntheticCheckpointTest, InvalidRequests) {
  MoeConfig config = SmallK3(WeightFormat::kBF16);
  config.routing.top_k = 9;
  EXPECT_EQ(WriteSyntheticCheckpoint(FreshDir("bad_topk"), config, {}).code(),
            absl::StatusCode::kInvalidArgument);

  SyntheticOptions options;
  options.max_shard_bytes = 0;
  EXPECT_EQ(
      WriteSyntheticCheckpoint(FreshDir("bad_shard"), SmallK3(WeightFormat::kBF16), options).code(),
      absl::StatusCode::kInvalidArgument);

  MoeConfig odd = SmallK3(WeightFormat::kMXFP4);
  odd.latent_size = 100;  // MXFP4 needs multiples of 32
  EXPECT_EQ(WriteSyntheticCheckpoint(FreshDir("bad_mxfp4"), odd, {}).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(SyntheticCheckpointTest, DiskSpaceIsCheckedFirst) {
  MoeConfig huge = *SyntheticPreset("kimi-k3");
  huge.expert_format = WeightFormat::kBF16;
  huge.expert_hidden_size = 3072 * 256;  // ~15 TB of experts
  const std::string dir = FreshDir("huge");
  const absl::Status s = WriteSyntheticCheckpoint(dir, huge, {});
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_CONTAINS(s.message(), "not enough disk space");
  EXPECT_FALSE(fs::exists(dir));
}

}  // namespace
}  // namespace moe
