#include "model/checkpoint.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/numerics.h"
#include "gtest/gtest.h"
#include "tests/testing/model_files.h"
#include "tests/testing/temp_dir.h"

namespace moe {
namespace {

using testing::TestTensor;
using testing::WriteTestTensors;

namespace fs = std::filesystem;

std::string FreshDir(const std::string& name) {
  return testing::FreshTestDir("checkpoint_test_" + name);
}

// Values that identify their tensor (tag = its position in the checkpoint): no two tensors
// of a test checkpoint hold the same bytes, so a view pointing at the wrong one is caught.
std::vector<uint8_t> TaggedBytes(DType dtype, int64_t n, int tag, bool is_scale) {
  std::vector<uint8_t> out(n * DTypeSize(dtype));
  for (int64_t i = 0; i < n; ++i) {
    switch (dtype) {
      case DType::kBF16: {
        // Multiples of 1/8 in [-15.6, 15.6]: exact in bf16; the phase tag*3 mod 251 is unique.
        const float v = static_cast<float>((tag * 3 + i) % 251 - 125) / 8.0f;
        const uint16_t bits = FloatToBf16Bits(v);
        std::memcpy(&out[2 * i], &bits, 2);
        break;
      }
      case DType::kF32: {
        const float v = is_scale ? 0.5f + 0.25f * static_cast<float>((tag + i) % 5)
                                 : static_cast<float>(tag) + 0.001f * static_cast<float>(i);
        std::memcpy(&out[4 * i], &v, 4);
        break;
      }
      case DType::kU8:
        out[i] = is_scale ? static_cast<uint8_t>(120 + (tag + i) % 10)  // E8M0 2^-7 .. 2^2
                          : static_cast<uint8_t>((tag * 3 + i * 7 + 1) % 256);
        break;
      case DType::kF8E4M3:  // never 0x7f/0xff (NaN)
        out[i] = static_cast<uint8_t>((tag * 3 + i) % 0x77) | ((i >> 1) & 1 ? 0x80 : 0);
        break;
      default:
        break;
    }
  }
  return out;
}

MoeConfig TinyK3(WeightFormat experts = WeightFormat::kBF16) {
  MoeConfig c;
  c.family = ModelFamily::kKimiK3;
  c.model_type = "kimi_k3";
  c.hidden_size = 64;
  c.latent_size = 32;
  c.expert_hidden_size = experts == WeightFormat::kMXFP4 ? 64 : 32;
  c.num_shared_experts = 1;
  c.routing.num_experts = 4;
  c.routing.top_k = 2;
  c.latent_norm = true;
  c.rms_norm_eps = 1e-5f;
  c.activation.kind = Activation::kSiTU;
  c.first_k_dense_replace = 1;
  c.num_hidden_layers = 3;  // MoE layers 1, 2
  c.expert_format = experts;
  return c;
}

// K2 with widths that are not multiples of 128: FP8 edge blocks.
MoeConfig TinyK2Fp8() {
  MoeConfig c;
  c.family = ModelFamily::kKimiK2;
  c.model_type = "kimi_k2";
  c.hidden_size = 200;
  c.expert_hidden_size = 328;
  c.num_shared_experts = 1;
  c.routing.num_experts = 3;
  c.routing.top_k = 2;
  c.routing.routed_scaling_factor = 2.5f;
  c.activation.kind = Activation::kSiLU;
  c.first_k_dense_replace = 1;
  c.num_hidden_layers = 2;  // MoE layer 1
  c.expert_format = WeightFormat::kFP8Block128;
  c.dense_format = WeightFormat::kFP8Block128;
  return c;
}

// The tensors of a checkpoint for `config`, written independently of model/synthetic.cc.
class TestCheckpoint {
 public:
  TestCheckpoint(const MoeConfig& config, const std::string& k3_head = "language_model.")
      : config_(config) {
    const bool k3 = config.family == ModelFamily::kKimiK3;
    for (int layer : config.MoeLayerIndices()) {
      const std::string p = k3 ? absl::StrCat(k3_head, "model.layers.", layer, ".block_sparse_moe.")
                               : absl::StrCat("model.layers.", layer, ".mlp.");
      const int64_t e = config.routing.num_experts, h = config.hidden_size;
      Add(p + "gate.weight", DType::kBF16, {e, h});
      Add(p + "gate.e_score_correction_bias", DType::kF32, {e});
      if (config.has_latent()) {
        AddMatrix(p + "routed_expert_down_proj", config.dense_format, config.latent_size, h);
        Add(p + "routed_expert_norm.weight", DType::kBF16, {config.latent_size});
        AddMatrix(p + "routed_expert_up_proj", config.dense_format, h, config.latent_size);
      }
      const int64_t s = config.shared_hidden_size();
      AddMatrix(p + "shared_experts.gate_proj", config.dense_format, s, h);
      AddMatrix(p + "shared_experts.up_proj", config.dense_format, s, h);
      AddMatrix(p + "shared_experts.down_proj", config.dense_format, h, s);
      const int64_t in = config.expert_input_size(), hid = config.expert_hidden_size;
      for (int x = 0; x < e; ++x) {
        const std::string ep = absl::StrCat(p, "experts.", x, ".");
        AddMatrix(ep + (k3 ? "w1" : "gate_proj"), config.expert_format, hid, in);
        AddMatrix(ep + (k3 ? "w3" : "up_proj"), config.expert_format, hid, in);
        AddMatrix(ep + (k3 ? "w2" : "down_proj"), config.expert_format, in, hid);
      }
    }
  }

  void Add(const std::string& name, DType dtype, std::vector<int64_t> shape,
           bool is_scale = false) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    const int tag = static_cast<int>(tensors_.size());
    tensors_.push_back({name, dtype, shape, TaggedBytes(dtype, n, tag, is_scale)});
  }
  void AddMatrix(const std::string& base, WeightFormat format, int64_t rows, int64_t cols) {
    switch (format) {
      case WeightFormat::kBF16:
        Add(base + ".weight", DType::kBF16, {rows, cols});
        break;
      case WeightFormat::kMXFP4:
        Add(base + ".weight_packed", DType::kU8, {rows, cols / 2});
        Add(base + ".weight_scale", DType::kU8, {rows, cols / 32}, true);
        break;
      case WeightFormat::kFP8Block128:
        Add(base + ".weight", DType::kF8E4M3, {rows, cols});
        Add(base + ".weight_scale_inv", DType::kF32, {(rows + 127) / 128, (cols + 127) / 128},
            true);
        break;
    }
  }

  TestTensor& Get(const std::string& name) {
    for (TestTensor& t : tensors_)
      if (t.name == name) return t;
    ADD_FAILURE() << "no test tensor " << name;
    return tensors_[0];
  }
  void Remove(const std::string& name) {
    tensors_.erase(std::remove_if(tensors_.begin(), tensors_.end(),
                                  [&](const TestTensor& t) { return t.name == name; }),
                   tensors_.end());
  }

  // Writes config.json and the tensors: one `model.safetensors` without index, or
  // `num_shards` shards with an index.
  void Write(const std::string& dir, int num_shards, bool index = true) const {
    std::ofstream(dir + "/config.json") << MoeConfigToJson(config_);
    std::string index_json = "{\"metadata\": {\"total_size\": 0}, \"weight_map\": {";
    const size_t per_shard = (tensors_.size() + num_shards - 1) / num_shards;
    for (int s = 0; s < num_shards; ++s) {
      const std::string file =
          index ? absl::StrCat("model-0000", s + 1, "-of-0000", num_shards, ".safetensors")
                : "model.safetensors";
      const size_t begin = s * per_shard, end = std::min(tensors_.size(), begin + per_shard);
      for (size_t i = begin; i < end; ++i)
        absl::StrAppend(&index_json, i ? ", " : "", "\"", tensors_[i].name, "\": \"", file, "\"");
      const absl::Status written =
          WriteTestTensors(dir + "/" + file, {tensors_.begin() + begin, tensors_.begin() + end});
      ASSERT_TRUE(written.ok()) << written;
    }
    if (index) std::ofstream(dir + "/model.safetensors.index.json") << index_json << "}}";
  }

  const MoeConfig& config() const { return config_; }

 private:
  MoeConfig config_;
  std::vector<TestTensor> tensors_;
};

// Decodes W[r, c] from first principles (not with core/numerics' MXFP4 helpers).
float Decode(const WeightMatrix& m, int64_t r, int64_t c) {
  const auto* data = static_cast<const uint8_t*>(m.data);
  switch (m.format) {
    case WeightFormat::kBF16: {
      uint16_t bits;
      std::memcpy(&bits, data + 2 * (r * m.cols + c), 2);
      return Bf16BitsToFloat(bits);
    }
    case WeightFormat::kMXFP4: {
      static const float kMag[8] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};
      const uint8_t byte = data[r * (m.cols / 2) + c / 2];
      const uint8_t nibble = c % 2 ? byte >> 4 : byte & 0xf;
      const uint8_t e = static_cast<const uint8_t*>(m.scales)[r * (m.cols / 32) + c / 32];
      return (nibble & 8 ? -1.0f : 1.0f) * kMag[nibble & 7] * std::ldexp(1.0f, e - 127);
    }
    case WeightFormat::kFP8Block128: {
      float scale;
      const int64_t col_blocks = (m.cols + 127) / 128;
      std::memcpy(&scale,
                  static_cast<const uint8_t*>(m.scales) + 4 * ((r / 128) * col_blocks + c / 128),
                  4);
      return Fp8E4m3ToFloat(data[r * m.cols + c]) * scale;
    }
  }
  return NAN;
}

// The matrix the test wrote under `base`, as a view of the test's own bytes.
WeightMatrix Written(TestCheckpoint& ckpt, const std::string& base, WeightFormat format,
                     int64_t rows, int64_t cols) {
  WeightMatrix m;
  m.format = format;
  m.rows = rows;
  m.cols = cols;
  switch (format) {
    case WeightFormat::kBF16:
      m.data = ckpt.Get(base + ".weight").bytes.data();
      break;
    case WeightFormat::kMXFP4:
      m.data = ckpt.Get(base + ".weight_packed").bytes.data();
      m.scales = ckpt.Get(base + ".weight_scale").bytes.data();
      break;
    case WeightFormat::kFP8Block128:
      m.data = ckpt.Get(base + ".weight").bytes.data();
      m.scales = ckpt.Get(base + ".weight_scale_inv").bytes.data();
      break;
  }
  return m;
}

// Every element of `loaded` decodes to the value of the tensor written under `base`.
void ExpectMatrix(const WeightMatrix& loaded, TestCheckpoint& ckpt, const std::string& base,
                  WeightFormat format, int64_t rows, int64_t cols) {
  ASSERT_EQ(loaded.format, format) << base;
  ASSERT_EQ(loaded.rows, rows) << base;
  ASSERT_EQ(loaded.cols, cols) << base;
  ASSERT_TRUE(loaded.Validate().ok()) << base;
  const WeightMatrix written = Written(ckpt, base, format, rows, cols);
  int nonzero = 0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const float want = Decode(written, r, c);
      ASSERT_EQ(Decode(loaded, r, c), want) << base << "[" << r << ", " << c << "]";
      nonzero += want != 0;
    }
  EXPECT_GT(nonzero, rows * cols / 2) << base;
}

constexpr char kK3Prefix[] = "language_model.model.layers.";

TEST(CheckpointTest, K3ShardedSelectiveLoading) {
  const std::string dir = FreshDir("k3_sharded");
  TestCheckpoint written(TinyK3());
  written.Write(dir, 3);
  auto ckpt = Checkpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_EQ((*ckpt)->layers(), (std::vector<int>{1, 2}));
  EXPECT_TRUE((*ckpt)->HasLayer(2));
  EXPECT_FALSE((*ckpt)->HasLayer(0));
  EXPECT_EQ((*ckpt)->config(), written.config());

  const std::string p = absl::StrCat(kK3Prefix, 2, ".block_sparse_moe.");
  auto gw = (*ckpt)->LoadGatewayLayer(2);
  ASSERT_TRUE(gw.ok()) << gw.status();
  EXPECT_EQ(gw->layer, 2);
  ExpectMatrix(gw->router, written, p + "gate", WeightFormat::kBF16, 4, 64);
  const auto& bias_bytes = written.Get(p + "gate.e_score_correction_bias").bytes;
  std::vector<float> bias(4);
  std::memcpy(bias.data(), bias_bytes.data(), 16);
  EXPECT_EQ(gw->router_bias, bias);
  ASSERT_TRUE(gw->has_latent);
  ExpectMatrix(gw->latent_down, written, p + "routed_expert_down_proj", WeightFormat::kBF16, 32,
               64);
  ExpectMatrix(gw->latent_up, written, p + "routed_expert_up_proj", WeightFormat::kBF16, 64, 32);
  ASSERT_TRUE(gw->has_latent_norm);
  ASSERT_EQ(gw->latent_norm.size, 32);
  EXPECT_EQ(std::memcmp(gw->latent_norm.data,
                        written.Get(p + "routed_expert_norm.weight").bytes.data(), 64),
            0);
  ASSERT_TRUE(gw->has_shared);
  ExpectMatrix(gw->shared.gate, written, p + "shared_experts.gate_proj", WeightFormat::kBF16, 32,
               64);
  ExpectMatrix(gw->shared.up, written, p + "shared_experts.up_proj", WeightFormat::kBF16, 32, 64);
  ExpectMatrix(gw->shared.down, written, p + "shared_experts.down_proj", WeightFormat::kBF16, 64,
               32);
  EXPECT_EQ(gw->TotalBytes(), (4 * 64 + 32 * 64 * 2 + 32 * 64 * 3) * 2 + 4 * 4 + 32 * 2);

  // Experts in any order come back ascending; each view holds exactly its expert.
  ExpertLoadOptions prefetch;
  prefetch.prefetch = true;
  auto experts = (*ckpt)->LoadExperts(2, {3, 1}, prefetch);
  ASSERT_TRUE(experts.ok()) << experts.status();
  EXPECT_EQ(experts->layer, 2);
  EXPECT_EQ(experts->expert_ids, (std::vector<int>{1, 3}));
  ASSERT_EQ(experts->experts.size(), 2u);
  for (int i = 0; i < 2; ++i) {
    const std::string ep = absl::StrCat(p, "experts.", experts->expert_ids[i], ".");
    ExpectMatrix(experts->experts[i].gate, written, ep + "w1", WeightFormat::kBF16, 32, 32);
    ExpectMatrix(experts->experts[i].up, written, ep + "w3", WeightFormat::kBF16, 32, 32);
    ExpectMatrix(experts->experts[i].down, written, ep + "w2", WeightFormat::kBF16, 32, 32);
  }
  EXPECT_EQ(experts->TotalBytes(), 2 * 3 * 32 * 32 * 2);

  auto none = (*ckpt)->LoadExperts(1, {});
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->experts.empty());
}

TEST(CheckpointTest, K3WithoutLanguageModelPrefixSingleFile) {
  const std::string dir = FreshDir("k3_plain");
  TestCheckpoint written(TinyK3(), /*k3_head=*/"");
  written.Write(dir, 1, /*index=*/false);
  ASSERT_TRUE(fs::exists(dir + "/model.safetensors"));
  auto ckpt = Checkpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_EQ((*ckpt)->layers(), (std::vector<int>{1, 2}));
  auto experts = (*ckpt)->LoadExperts(1, {0, 2});
  ASSERT_TRUE(experts.ok()) << experts.status();
  ExpectMatrix(experts->experts[1].down, written, "model.layers.1.block_sparse_moe.experts.2.w2",
               WeightFormat::kBF16, 32, 32);
  auto gw = (*ckpt)->LoadGatewayLayer(1);
  ASSERT_TRUE(gw.ok()) << gw.status();
  ExpectMatrix(gw->router, written, "model.layers.1.block_sparse_moe.gate", WeightFormat::kBF16, 4,
               64);
}

TEST(CheckpointTest, K3Mxfp4Experts) {
  const std::string dir = FreshDir("k3_mxfp4");
  TestCheckpoint written(TinyK3(WeightFormat::kMXFP4));
  written.Write(dir, 2);
  auto ckpt = Checkpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_EQ((*ckpt)->config().expert_format, WeightFormat::kMXFP4);
  auto experts = (*ckpt)->LoadExperts(1, {0, 1, 2, 3});
  ASSERT_TRUE(experts.ok()) << experts.status();
  for (int e = 0; e < 4; ++e) {
    const std::string ep = absl::StrCat(kK3Prefix, "1.block_sparse_moe.experts.", e, ".");
    ExpectMatrix(experts->experts[e].gate, written, ep + "w1", WeightFormat::kMXFP4, 64, 32);
    ExpectMatrix(experts->experts[e].up, written, ep + "w3", WeightFormat::kMXFP4, 64, 32);
    ExpectMatrix(experts->experts[e].down, written, ep + "w2", WeightFormat::kMXFP4, 32, 64);
    // The shared numerics helper agrees with the first-principles decode.
    const WeightMatrix& w = experts->experts[e].down;
    EXPECT_EQ(Mxfp4Element(static_cast<const uint8_t*>(w.data) + 5 * 32,
                           static_cast<const uint8_t*>(w.scales) + 5 * 2, 37),
              Decode(w, 5, 37));
  }
  EXPECT_EQ(experts->TotalBytes(), 4 * 3 * (64 * 32 / 2 + 64 * 32 / 32));
  // Dense weights stay bf16.
  auto gw = (*ckpt)->LoadGatewayLayer(1);
  ASSERT_TRUE(gw.ok()) << gw.status();
  EXPECT_EQ(gw->shared.gate.format, WeightFormat::kBF16);
}

TEST(CheckpointTest, K2Fp8WithEdgeBlocks) {
  const std::string dir = FreshDir("k2_fp8");
  TestCheckpoint written(TinyK2Fp8());
  written.Write(dir, 2);
  auto ckpt = Checkpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_EQ((*ckpt)->layers(), (std::vector<int>{1}));
  auto experts = (*ckpt)->LoadExperts(1, {2});
  ASSERT_TRUE(experts.ok()) << experts.status();
  const std::string ep = "model.layers.1.mlp.experts.2.";
  ExpectMatrix(experts->experts[0].gate, written, ep + "gate_proj", WeightFormat::kFP8Block128, 328,
               200);
  ExpectMatrix(experts->experts[0].up, written, ep + "up_proj", WeightFormat::kFP8Block128, 328,
               200);
  ExpectMatrix(experts->experts[0].down, written, ep + "down_proj", WeightFormat::kFP8Block128, 200,
               328);
  EXPECT_EQ(experts->TotalBytes(), 3 * 328 * 200 + 4 * (3 * 2 + 3 * 2 + 2 * 3));

  auto gw = (*ckpt)->LoadGatewayLayer(1);
  ASSERT_TRUE(gw.ok()) << gw.status();
  EXPECT_FALSE(gw->has_latent);
  EXPECT_FALSE(gw->has_latent_norm);
  ExpectMatrix(gw->router, written, "model.layers.1.mlp.gate", WeightFormat::kBF16, 3, 200);
  ExpectMatrix(gw->shared.down, written, "model.layers.1.mlp.shared_experts.down_proj",
               WeightFormat::kFP8Block128, 200, 328);
}

TEST(CheckpointTest, AbsentLayerAndBadExpertIds) {
  const std::string dir = FreshDir("absent_layer");
  TestCheckpoint(TinyK3()).Write(dir, 1);
  auto ckpt = Checkpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  auto gw = (*ckpt)->LoadGatewayLayer(7);
  EXPECT_EQ(gw.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(gw.status().message(),
            absl::StrCat("layer 7 is not in checkpoint ", dir, " (MoE layers present: 1, 2)"));
  EXPECT_EQ((*ckpt)->LoadExperts(0, {0}).status().code(), absl::StatusCode::kNotFound);

  auto out_of_range = (*ckpt)->LoadExperts(1, {1, 4});
  EXPECT_EQ(out_of_range.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_CONTAINS(out_of_range.status().message(), "expert id 4 is out of range [0, 4)");
  EXPECT_EQ((*ckpt)->LoadExperts(1, {-1}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*ckpt)->LoadExperts(1, {2, 2}).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(CheckpointTest, LayersPresentAreTheOnesWithARouter) {
  const std::string dir = FreshDir("partial_layers");
  TestCheckpoint written(TinyK3());
  written.Remove(absl::StrCat(kK3Prefix, "1.block_sparse_moe.gate.weight"));
  written.Write(dir, 1);
  auto ckpt = Checkpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_EQ((*ckpt)->layers(), (std::vector<int>{2}));
}

// Found by tests/fuzz (config target): Open listed every layer the config names, so a
// config.json saying 2^31 - 1 layers made it allocate 8 GB and loop 2^31 times.
TEST(CheckpointTest, HugeLayerCountInConfigIsNotListed) {
  const std::string dir = FreshDir("huge_layer_count");
  TestCheckpoint(TinyK3()).Write(dir, 1);
  MoeConfig huge = TinyK3();
  huge.num_hidden_layers = 2147483647;
  std::ofstream(dir + "/config.json") << MoeConfigToJson(huge);
  auto ckpt = Checkpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_EQ((*ckpt)->layers(), (std::vector<int>{1, 2}));
}

// Each malformed checkpoint: (code, substrings of the message).
struct Broken {
  absl::StatusCode code;
  std::vector<std::string> message_parts;
  std::string dir = "";  // where the checkpoint was written
};

Broken LoadBroken(const std::string& name, const MoeConfig& config,
                  const std::function<void(TestCheckpoint&)>& mutate, bool gateway, int layer = 1) {
  const std::string dir = FreshDir(name);
  TestCheckpoint written(config);
  mutate(written);
  written.Write(dir, 1);
  auto ckpt = Checkpoint::Open(dir);
  if (!ckpt.ok()) return {ckpt.status().code(), {std::string(ckpt.status().message())}, dir};
  const absl::Status s = gateway ? (*ckpt)->LoadGatewayLayer(layer).status()
                                 : (*ckpt)->LoadExperts(layer, {0, 1}).status();
  return {s.code(), {std::string(s.message())}, dir};
}

void ExpectBroken(const Broken& b, absl::StatusCode code, const std::vector<std::string>& parts) {
  EXPECT_EQ(b.code, code) << b.message_parts[0];
  for (const std::string& part : parts) EXPECT_CONTAINS(b.message_parts[0], part);
}

const std::string kL1 = absl::StrCat(kK3Prefix, "1.block_sparse_moe.");
const std::string kShard = "model-00001-of-00001.safetensors";

TEST(CheckpointTest, WrongDtype) {
  auto b = LoadBroken(
      "wrong_dtype", TinyK3(),
      [](TestCheckpoint& c) {
        TestTensor& t = c.Get(kL1 + "gate.weight");
        t.dtype = DType::kF32;
        t.shape = {4, 32};  // same bytes, so the file itself is valid
      },
      true);
  ExpectBroken(b, absl::StatusCode::kInvalidArgument,
               {"tensor '" + kL1 + "gate.weight' in ", kShard, ": dtype F32, expected BF16"});

  auto e = LoadBroken(
      "wrong_expert_dtype", TinyK3(),
      [](TestCheckpoint& c) {
        TestTensor& t = c.Get(kL1 + "experts.1.w3.weight");
        t.dtype = DType::kF32;
        t.shape = {16, 32};
      },
      false);
  ExpectBroken(e, absl::StatusCode::kInvalidArgument,
               {"experts.1.w3.weight", kShard, "dtype F32, expected BF16 or F8_E4M3"});
}

TEST(CheckpointTest, WrongShape) {
  auto b = LoadBroken(
      "wrong_shape", TinyK3(),
      [](TestCheckpoint& c) {
        c.Get(kL1 + "experts.0.w2.weight").shape = {16, 64};
      },
      false);
  ExpectBroken(b, absl::StatusCode::kInvalidArgument,
               {"experts.0.w2.weight", kShard, "shape [16, 64], expected [32, 32]"});

  auto s = LoadBroken(
      "wrong_scale_shape", TinyK2Fp8(),
      [](TestCheckpoint& c) {
        c.Get("model.layers.1.mlp.experts.1.up_proj.weight_scale_inv").shape = {2, 3};
      },
      false);
  ExpectBroken(s, absl::StatusCode::kInvalidArgument,
               {"experts.1.up_proj.weight_scale_inv", "shape [2, 3], expected [3, 2]"});
}

TEST(CheckpointTest, MissingTensor) {
  auto b = LoadBroken(
      "missing_expert", TinyK3(), [](TestCheckpoint& c) { c.Remove(kL1 + "experts.1.w1.weight"); },
      false);
  ExpectBroken(b, absl::StatusCode::kNotFound, {"experts.1.w1.weight", "not found in checkpoint"});

  auto n = LoadBroken(
      "missing_norm", TinyK3(),
      [](TestCheckpoint& c) { c.Remove(kL1 + "routed_expert_norm.weight"); }, true);
  ExpectBroken(n, absl::StatusCode::kNotFound, {"routed_expert_norm.weight"});
}

TEST(CheckpointTest, MissingScaleTensor) {
  auto mx = LoadBroken(
      "missing_mxfp4_scale", TinyK3(WeightFormat::kMXFP4),
      [](TestCheckpoint& c) { c.Remove(kL1 + "experts.0.w3.weight_scale"); }, false);
  ExpectBroken(mx, absl::StatusCode::kNotFound,
               {"experts.0.w3.weight_scale'", "experts.0.w3.weight_packed", kShard});

  auto fp8 = LoadBroken(
      "missing_fp8_scale", TinyK2Fp8(),
      [](TestCheckpoint& c) {
        c.Remove("model.layers.1.mlp.shared_experts.down_proj.weight_scale_inv");
      },
      true);
  ExpectBroken(fp8, absl::StatusCode::kNotFound,
               {"shared_experts.down_proj.weight_scale_inv", kShard});
}

TEST(CheckpointTest, MissingShardOrConfig) {
  const std::string dir = FreshDir("missing_shard");
  TestCheckpoint(TinyK3()).Write(dir, 2);
  fs::remove(dir + "/model-00002-of-00002.safetensors");
  auto ckpt = Checkpoint::Open(dir);
  EXPECT_EQ(ckpt.status().code(), absl::StatusCode::kNotFound);
  EXPECT_CONTAINS(ckpt.status().message(), "model-00002-of-00002.safetensors");

  const std::string no_config = FreshDir("missing_config");
  TestCheckpoint(TinyK3()).Write(no_config, 1);
  fs::remove(no_config + "/config.json");
  auto c = Checkpoint::Open(no_config);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kNotFound);
  EXPECT_CONTAINS(c.status().message(), "config.json");

  // Tensors of the other family's layout: no MoE layer found.
  const std::string wrong_family = FreshDir("wrong_family");
  TestCheckpoint(TinyK3()).Write(wrong_family, 1);
  MoeConfig k2 = TinyK2Fp8();
  k2.num_hidden_layers = 3;
  std::ofstream(wrong_family + "/config.json") << MoeConfigToJson(k2);
  auto w = Checkpoint::Open(wrong_family);
  EXPECT_EQ(w.status().code(), absl::StatusCode::kNotFound);
  EXPECT_CONTAINS(w.status().message(), "model.layers.{L}.mlp.gate.weight");
}

TEST(CheckpointTest, RouterBiasAbsentOrBf16) {
  const std::string dir = FreshDir("bias_absent");
  TestCheckpoint absent(TinyK3());
  absent.Remove(kL1 + "gate.e_score_correction_bias");
  absent.Write(dir, 1);
  auto ckpt = Checkpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  auto gw = (*ckpt)->LoadGatewayLayer(1);
  ASSERT_TRUE(gw.ok()) << gw.status();
  EXPECT_EQ(gw->router_bias, std::vector<float>(4, 0.0f));

  const std::string dir2 = FreshDir("bias_bf16");
  TestCheckpoint bf16(TinyK3());
  TestTensor& bias = bf16.Get(kL1 + "gate.e_score_correction_bias");
  bias.dtype = DType::kBF16;
  bias.bytes = TaggedBytes(DType::kBF16, 4, 7, false);
  bf16.Write(dir2, 1);
  auto ckpt2 = Checkpoint::Open(dir2);
  ASSERT_TRUE(ckpt2.ok()) << ckpt2.status();
  auto gw2 = (*ckpt2)->LoadGatewayLayer(1);
  ASSERT_TRUE(gw2.ok()) << gw2.status();
  for (int e = 0; e < 4; ++e)
    EXPECT_EQ(gw2->router_bias[e], static_cast<float>((7 * 3 + e) % 251 - 125) / 8.0f);
}

// ---- NaN/Inf in the weights ------------------------------------------------------------------

// Overwrites element `index` of a test tensor with the stored bytes `code` (one element's worth).
void Poison(TestCheckpoint& c, const std::string& name, int64_t index, std::vector<uint8_t> code) {
  TestTensor& t = c.Get(name);
  ASSERT_LE((index + 1) * static_cast<int64_t>(code.size()), static_cast<int64_t>(t.bytes.size()))
      << name;
  std::memcpy(t.bytes.data() + index * code.size(), code.data(), code.size());
}

std::vector<uint8_t> F32Bytes(float v) {
  std::vector<uint8_t> b(4);
  std::memcpy(b.data(), &v, 4);
  return b;
}

const std::vector<uint8_t> kBf16NaN = {0xc0, 0x7f};       // 0x7fc0
const std::vector<uint8_t> kBf16MinusInf = {0x80, 0xff};  // 0xff80

// The message of a value check: "tensor '<name>' in <its shard>: <what>".
std::string BadValueMessage(const Broken& b, const std::string& tensor, const std::string& what) {
  return "tensor '" + tensor + "' in " + b.dir + "/" + kShard + ": " + what;
}

// Every gateway tensor is checked at load: the router, its bias, the latent projections and
// norm, the shared experts.
TEST(CheckpointTest, NaNOrInfInAGatewayTensorIsRefused) {
  struct Case {
    std::string tensor;
    int64_t element;
    std::vector<uint8_t> code;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {"gate.weight", 37, kBf16NaN, "NaN at element 37"},
      {"gate.e_score_correction_bias", 2, F32Bytes(INFINITY), "+Inf at element 2"},
      {"routed_expert_down_proj.weight", 1234, kBf16MinusInf, "-Inf at element 1234"},
      {"routed_expert_up_proj.weight", 2047, kBf16NaN, "NaN at element 2047"},
      {"routed_expert_norm.weight", 31, kBf16NaN, "NaN at element 31"},
      {"shared_experts.down_proj.weight", 1, kBf16NaN, "NaN at element 1"},
  };
  for (const Case& c : cases) {
    const Broken b = LoadBroken(
        "nan_gateway", TinyK3(),
        [&](TestCheckpoint& ckpt) { Poison(ckpt, kL1 + c.tensor, c.element, c.code); }, true);
    EXPECT_EQ(b.code, absl::StatusCode::kInvalidArgument) << c.tensor;
    EXPECT_EQ(b.message_parts[0], BadValueMessage(b, kL1 + c.tensor, c.expected));
  }
  // FP8 dense weights and their block scales (K2).
  const Broken fp8 = LoadBroken(
      "nan_gateway_fp8", TinyK2Fp8(),
      [](TestCheckpoint& ckpt) {
        Poison(ckpt, "model.layers.1.mlp.shared_experts.up_proj.weight_scale_inv", 5,
               F32Bytes(NAN));
      },
      true);
  EXPECT_EQ(fp8.code, absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(fp8.message_parts[0],
            BadValueMessage(fp8, "model.layers.1.mlp.shared_experts.up_proj.weight_scale_inv",
                            "NaN at element 5"));
}

// Routed experts in every format that can hold a NaN: bf16 values, FP8 values and block
// scales, MXFP4 E8M0 scales (E2M1 codes have none).
TEST(CheckpointTest, NaNInAnExpertTensorIsRefused) {
  const std::string k2 = "model.layers.1.mlp.experts.1.";
  struct Case {
    MoeConfig config;
    std::string tensor;
    int64_t element;
    std::vector<uint8_t> code;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {TinyK3(), kL1 + "experts.1.w2.weight", 1000, kBf16NaN, "NaN at element 1000"},
      {TinyK3(), kL1 + "experts.0.w1.weight", 0, kBf16MinusInf, "-Inf at element 0"},
      {TinyK2Fp8(), k2 + "down_proj.weight", 5000, {0x7f}, "NaN (E4M3 0x7f) at element 5000"},
      {TinyK2Fp8(), k2 + "gate_proj.weight", 65599, {0xff}, "NaN (E4M3 0xff) at element 65599"},
      {TinyK2Fp8(), k2 + "up_proj.weight_scale_inv", 3, F32Bytes(NAN), "NaN at element 3"},
      {TinyK3(WeightFormat::kMXFP4),
       kL1 + "experts.1.w3.weight_scale",
       17,
       {0xff},
       "NaN (E8M0 0xff) at element 17"},
  };
  for (const Case& c : cases) {
    const Broken b = LoadBroken(
        "nan_expert", c.config,
        [&](TestCheckpoint& ckpt) { Poison(ckpt, c.tensor, c.element, c.code); }, false);
    EXPECT_EQ(b.code, absl::StatusCode::kInvalidArgument) << c.tensor;
    EXPECT_EQ(b.message_parts[0], BadValueMessage(b, c.tensor, c.expected));
  }
}

TEST(CheckpointTest, ValueCheckOfExpertsCanBeTurnedOff) {
  const std::string dir = FreshDir("nan_unchecked");
  TestCheckpoint written(TinyK2Fp8());
  Poison(written, "model.layers.1.mlp.experts.0.up_proj.weight", 9, {0x7f});
  written.Write(dir, 1);
  auto ckpt = Checkpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_EQ((*ckpt)->LoadExperts(1, {0}).status().code(), absl::StatusCode::kInvalidArgument);
  ExpertLoadOptions unchecked;
  unchecked.check_values = false;
  EXPECT_TRUE((*ckpt)->LoadExperts(1, {0}, unchecked).ok());
  // The other experts and the gateway's tensors are clean.
  EXPECT_TRUE((*ckpt)->LoadExperts(1, {1, 2}).ok());
  EXPECT_TRUE((*ckpt)->LoadGatewayLayer(1).ok());
}

// MXFP4 packed bytes 0x7f / 0xff are finite E2M1 pairs (6 and -6 with 3 and -3): they load.
TEST(CheckpointTest, Mxfp4PackedCodesAreNeverNaN) {
  const std::string dir = FreshDir("mxfp4_all_codes");
  TestCheckpoint written(TinyK3(WeightFormat::kMXFP4));
  Poison(written, kL1 + "experts.2.w1.weight_packed", 3, {0xff});
  Poison(written, kL1 + "experts.2.w1.weight_packed", 4, {0x7f});
  written.Write(dir, 1);
  auto ckpt = Checkpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  auto experts = (*ckpt)->LoadExperts(1, {2});
  ASSERT_TRUE(experts.ok()) << experts.status();
  // Row 0, byte 3: columns 6 and 7 are both -6 x scale; byte 4: column 8 is -6, 9 is +6.
  const WeightMatrix& w1 = experts->experts[0].gate;
  EXPECT_LT(Decode(w1, 0, 6), 0.0f);
  EXPECT_EQ(Decode(w1, 0, 6), Decode(w1, 0, 7));
  EXPECT_EQ(Decode(w1, 0, 8), Decode(w1, 0, 6));
  EXPECT_EQ(Decode(w1, 0, 9), -Decode(w1, 0, 6));
}

TEST(CheckpointTest, ConcurrentLoadsShareLazilyOpenedShards) {
  const std::string dir = FreshDir("concurrent");
  TestCheckpoint written(TinyK3());
  written.Write(dir, 4);
  auto ckpt = Checkpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  std::vector<absl::StatusOr<ExpertShardWeights>> results(8, absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  ExpertLoadOptions prefetch;
  prefetch.prefetch = true;
  for (int i = 0; i < 8; ++i)
    threads.emplace_back([&, i] {
      results[i] = (*ckpt)->LoadExperts(1 + i % 2, {0, 1, 2, 3}, prefetch);
    });
  for (auto& t : threads) t.join();
  for (int i = 0; i < 8; ++i) {
    ASSERT_TRUE(results[i].ok()) << results[i].status();
    EXPECT_EQ(results[i]->experts[3].down.data, results[i % 2]->experts[3].down.data);
  }
  EXPECT_NE(results[0]->experts[0].gate.data, results[1]->experts[0].gate.data);
}

}  // namespace
}  // namespace moe
