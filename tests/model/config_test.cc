#include "model/config.h"

#include <algorithm>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "gtest/gtest.h"

namespace moe {
namespace {

using Json = nlohmann::json;

// ---- realistic config.json files ---------------------------------------------------------

// Kimi K3: multimodal wrapper, model fields in text_config, compressed-tensors MXFP4 experts.
constexpr char kKimiK3Config[] = R"json({
  "architectures": ["KimiK3ForConditionalGeneration"],
  "auto_map": {
    "AutoConfig": "configuration_kimi_k3.KimiK3Config",
    "AutoModel": "modeling_kimi_k3.KimiK3ForConditionalGeneration"
  },
  "ignore_index": -100,
  "media_placeholder_token_id": 163605,
  "model_type": "kimi_k3",
  "pad_token_id": 163839,
  "quantization_config": {
    "config_groups": {
      "group_0": {
        "input_activations": null,
        "output_activations": null,
        "targets": ["Linear"],
        "weights": {
          "actorder": null,
          "block_structure": null,
          "dynamic": false,
          "group_size": 32,
          "num_bits": 4,
          "observer": "minmax",
          "observer_kwargs": {},
          "strategy": "group",
          "symmetric": true,
          "type": "float"
        }
      }
    },
    "format": "mxfp4-pack-quantized",
    "global_compression_ratio": null,
    "ignore": [
      "lm_head",
      "re:.*vision_tower.*",
      "re:.*multi_modal_projector.*",
      "re:.*self_attn.*",
      "re:.*mlp\\.(gate|up|down)_proj$",
      "re:.*gate$",
      "re:.*shared_experts.*",
      "re:.*routed_expert_(down|up)_proj$"
    ],
    "kv_cache_scheme": null,
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
    "sparsity_config": {},
    "transform_config": {},
    "version": "0.12.2"
  },
  "text_config": {
    "activation_situ_beta": 4.0,
    "activation_situ_linear_beta": 25.0,
    "bos_token_id": 163584,
    "eos_token_id": 163585,
    "first_k_dense_replace": 1,
    "head_dim": 128,
    "hidden_act": "situ",
    "hidden_size": 7168,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "latent_moe_use_norm": true,
    "linear_attn_config": {"head_dim": 128, "num_heads": 64, "short_conv_kernel_size": 4},
    "mla_use_nope": true,
    "model_type": "kimi_linear",
    "moe_intermediate_size": 3072,
    "moe_layer_freq": 1,
    "moe_renormalize": true,
    "moe_router_activation_func": "sigmoid",
    "num_attention_heads": 64,
    "num_expert_group": 1,
    "num_experts": 896,
    "num_experts_per_token": 16,
    "num_hidden_layers": 93,
    "num_key_value_heads": 64,
    "num_nextn_predict_layers": 0,
    "num_shared_experts": 2,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-05,
    "rope_scaling": null,
    "rope_theta": 50000.0,
    "routed_expert_hidden_size": 3584,
    "routed_scaling_factor": 1.0,
    "tie_word_embeddings": false,
    "topk_group": 1,
    "use_cache": true,
    "use_grouped_topk": true,
    "v_head_dim": 128,
    "vocab_size": 163840
  },
  "torch_dtype": "bfloat16",
  "transformers_version": "4.57.1",
  "vision_config": {"hidden_size": 1152, "model_type": "moonvit", "patch_size": 14}
})json";

// Kimi Linear layout (flat, model_type kimi_linear), as Kimi-Linear-48B-A3B writes it.
constexpr char kKimiLinearConfig[] = R"json({
  "architectures": ["KimiLinearForCausalLM"],
  "bos_token_id": 1,
  "dtype": "bfloat16",
  "eos_token_id": 163586,
  "first_k_dense_replace": 1,
  "head_dim": 72,
  "hidden_act": "silu",
  "hidden_size": 2304,
  "intermediate_size": 9216,
  "kv_lora_rank": 512,
  "linear_attn_config": {"full_attn_layers": [4, 8, 12], "head_dim": 128, "num_heads": 32},
  "model_type": "kimi_linear",
  "moe_intermediate_size": 1024,
  "moe_layer_freq": 1,
  "moe_renormalize": true,
  "moe_router_activation_func": "sigmoid",
  "num_attention_heads": 32,
  "num_expert_group": 1,
  "num_experts": 256,
  "num_experts_per_token": 8,
  "num_hidden_layers": 27,
  "num_key_value_heads": 32,
  "num_nextn_predict_layers": 0,
  "num_shared_experts": 1,
  "pad_token_id": 163839,
  "q_lora_rank": null,
  "rms_norm_eps": 1e-05,
  "rope_scaling": null,
  "routed_scaling_factor": 2.446,
  "tie_word_embeddings": false,
  "topk_group": 1,
  "use_grouped_topk": true,
  "vocab_size": 163840
})json";

// moonshotai/Kimi-K2-Instruct config.json.
constexpr char kKimiK2Config[] = R"json({
  "architectures": ["DeepseekV3ForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "auto_map": {
    "AutoConfig": "configuration_deepseek.DeepseekV3Config",
    "AutoModel": "modeling_deepseek.DeepseekV3Model",
    "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"
  },
  "aux_loss_alpha": 0.001,
  "bos_token_id": 163584,
  "eos_token_id": 163585,
  "first_k_dense_replace": 1,
  "hidden_act": "silu",
  "hidden_size": 7168,
  "initializer_range": 0.02,
  "intermediate_size": 18432,
  "kv_lora_rank": 512,
  "max_position_embeddings": 131072,
  "model_type": "kimi_k2",
  "moe_intermediate_size": 2048,
  "moe_layer_freq": 1,
  "n_group": 1,
  "n_routed_experts": 384,
  "n_shared_experts": 1,
  "norm_topk_prob": true,
  "num_attention_heads": 64,
  "num_experts_per_tok": 8,
  "num_hidden_layers": 61,
  "num_key_value_heads": 64,
  "num_nextn_predict_layers": 0,
  "pretraining_tp": 1,
  "q_lora_rank": 1536,
  "qk_nope_head_dim": 128,
  "qk_rope_head_dim": 64,
  "quantization_config": {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128]
  },
  "rms_norm_eps": 1e-06,
  "rope_scaling": {
    "beta_fast": 1.0,
    "beta_slow": 1.0,
    "factor": 32.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 4096,
    "type": "yarn"
  },
  "rope_theta": 50000.0,
  "routed_scaling_factor": 2.827,
  "scoring_func": "sigmoid",
  "seq_aux": true,
  "tie_word_embeddings": false,
  "topk_group": 1,
  "topk_method": "noaux_tc",
  "torch_dtype": "bfloat16",
  "transformers_version": "4.48.3",
  "use_cache": true,
  "v_head_dim": 128,
  "vocab_size": 163840
})json";

// deepseek-ai/DeepSeek-V3 config.json (MoE fields): group-limited routing.
constexpr char kDeepSeekV3Config[] = R"json({
  "architectures": ["DeepseekV3ForCausalLM"],
  "ep_size": 1,
  "first_k_dense_replace": 3,
  "hidden_act": "silu",
  "hidden_size": 7168,
  "model_type": "deepseek_v3",
  "moe_intermediate_size": 2048,
  "moe_layer_freq": 1,
  "n_group": 8,
  "n_routed_experts": 256,
  "n_shared_experts": 1,
  "norm_topk_prob": true,
  "num_experts_per_tok": 8,
  "num_hidden_layers": 61,
  "quantization_config": {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128]
  },
  "rms_norm_eps": 1e-06,
  "routed_scaling_factor": 2.5,
  "scoring_func": "sigmoid",
  "topk_group": 4,
  "topk_method": "noaux_tc"
})json";

Json K3() { return Json::parse(kKimiK3Config); }
Json KimiLinear() { return Json::parse(kKimiLinearConfig); }
Json K2() { return Json::parse(kKimiK2Config); }
Json DeepSeekV3() { return Json::parse(kDeepSeekV3Config); }

std::vector<int> Range(int begin, int end) {
  std::vector<int> v;
  for (int i = begin; i < end; ++i) v.push_back(i);
  return v;
}

// The scaled K3 of the demos (seed 002): 64 experts, top-2, latent 320 of 640.
MoeConfig K3Mini() {
  MoeConfig c;
  c.family = ModelFamily::kKimiK3;
  c.model_type = "kimi_k3";
  c.hidden_size = 640;
  c.latent_size = 320;
  c.expert_hidden_size = 256;
  c.num_shared_experts = 2;
  c.routing.num_experts = 64;
  c.routing.top_k = 2;
  c.routing.renormalize = true;
  c.routing.routed_scaling_factor = 1.0f;
  c.latent_norm = true;
  c.rms_norm_eps = 1e-5f;
  c.activation.kind = Activation::kSiTU;
  c.num_hidden_layers = 8;
  c.first_k_dense_replace = 1;
  c.expert_format = WeightFormat::kMXFP4;
  c.dense_format = WeightFormat::kBF16;
  return c;
}

// Parses `config` and checks it fails with InvalidArgument naming `field`.
testing::AssertionResult RejectedNaming(const std::string& config, const std::string& field) {
  const absl::StatusOr<MoeConfig> parsed = ParseMoeConfig(config);
  if (parsed.ok())
    return testing::AssertionFailure() << "parsed; expected an error naming " << field;
  const absl::Status& s = parsed.status();
  if (s.code() != absl::StatusCode::kInvalidArgument) {
    return testing::AssertionFailure() << "wrong code: " << s;
  }
  if (!absl::StartsWith(s.message(), "config.json: ")) {
    return testing::AssertionFailure() << "message does not start with config.json: " << s;
  }
  if (!absl::StrContains(s.message(), field)) {
    return testing::AssertionFailure() << "message does not name " << field << ": " << s;
  }
  return testing::AssertionSuccess() << s;
}

testing::AssertionResult RejectedNaming(const Json& config, const std::string& field) {
  return RejectedNaming(config.dump(2), field);
}

std::string MessageOf(const Json& config) {
  const absl::StatusOr<MoeConfig> parsed = ParseMoeConfig(config.dump());
  return parsed.ok() ? "OK" : std::string(parsed.status().message());
}

// ---- the real layouts --------------------------------------------------------------------

TEST(ParseMoeConfigTest, KimiK3NestedTextConfigMxfp4) {
  const absl::StatusOr<MoeConfig> c = ParseMoeConfig(kKimiK3Config);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->family, ModelFamily::kKimiK3);
  EXPECT_EQ(c->model_type, "kimi_k3");
  EXPECT_EQ(c->hidden_size, 7168);
  EXPECT_EQ(c->latent_size, 3584);
  EXPECT_TRUE(c->has_latent());
  EXPECT_EQ(c->expert_input_size(), 3584);
  EXPECT_EQ(c->expert_hidden_size, 3072);
  EXPECT_EQ(c->num_shared_experts, 2);
  EXPECT_EQ(c->shared_hidden_size(), 6144);
  EXPECT_EQ(c->routing.num_experts, 896);
  EXPECT_EQ(c->routing.top_k, 16);
  EXPECT_TRUE(c->routing.renormalize);
  EXPECT_EQ(c->routing.routed_scaling_factor, 1.0f);
  EXPECT_EQ(c->routing.n_group, 1);
  EXPECT_EQ(c->routing.topk_group, 1);
  EXPECT_TRUE(c->latent_norm);
  EXPECT_EQ(c->rms_norm_eps, 1e-5f);
  EXPECT_EQ(c->activation.kind, Activation::kSiTU);
  EXPECT_EQ(c->activation.situ_beta, 4.0f);
  EXPECT_EQ(c->activation.situ_linear_beta, 25.0f);
  EXPECT_EQ(c->num_hidden_layers, 93);
  EXPECT_EQ(c->first_k_dense_replace, 1);
  EXPECT_EQ(c->moe_layer_freq, 1);
  EXPECT_EQ(c->expert_format, WeightFormat::kMXFP4);
  EXPECT_EQ(c->dense_format, WeightFormat::kBF16);
  EXPECT_EQ(c->MoeLayerIndices(), Range(1, 93));  // layers 1..92
  EXPECT_TRUE(c->Validate().ok());
}

TEST(ParseMoeConfigTest, KimiLinearFlat) {
  const absl::StatusOr<MoeConfig> c = ParseMoeConfig(kKimiLinearConfig);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->family, ModelFamily::kKimiK3);
  EXPECT_EQ(c->model_type, "kimi_linear");
  EXPECT_EQ(c->hidden_size, 2304);
  EXPECT_EQ(c->latent_size, 0);  // no routed_expert_hidden_size: experts see the hidden size
  EXPECT_FALSE(c->has_latent());
  EXPECT_EQ(c->expert_input_size(), 2304);
  EXPECT_FALSE(c->latent_norm);
  EXPECT_EQ(c->expert_hidden_size, 1024);
  EXPECT_EQ(c->num_shared_experts, 1);
  EXPECT_EQ(c->routing.num_experts, 256);
  EXPECT_EQ(c->routing.top_k, 8);
  EXPECT_EQ(c->routing.routed_scaling_factor, 2.446f);
  EXPECT_EQ(c->activation.kind, Activation::kSiLU);
  EXPECT_EQ(c->rms_norm_eps, 1e-5f);
  EXPECT_EQ(c->expert_format, WeightFormat::kBF16);
  EXPECT_EQ(c->dense_format, WeightFormat::kBF16);
  EXPECT_EQ(c->MoeLayerIndices(), Range(1, 27));
}

TEST(ParseMoeConfigTest, KimiK2Fp8) {
  const absl::StatusOr<MoeConfig> c = ParseMoeConfig(kKimiK2Config);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->family, ModelFamily::kKimiK2);
  EXPECT_EQ(c->model_type, "kimi_k2");
  EXPECT_EQ(c->hidden_size, 7168);
  EXPECT_EQ(c->latent_size, 0);
  EXPECT_EQ(c->expert_input_size(), 7168);
  EXPECT_EQ(c->expert_hidden_size, 2048);
  EXPECT_EQ(c->num_shared_experts, 1);
  EXPECT_EQ(c->shared_hidden_size(), 2048);
  EXPECT_EQ(c->routing.num_experts, 384);
  EXPECT_EQ(c->routing.top_k, 8);
  EXPECT_TRUE(c->routing.renormalize);
  EXPECT_EQ(c->routing.routed_scaling_factor, 2.827f);
  EXPECT_EQ(c->routing.n_group, 1);
  EXPECT_EQ(c->routing.topk_group, 1);
  EXPECT_FALSE(c->latent_norm);
  EXPECT_EQ(c->rms_norm_eps, 1e-6f);
  EXPECT_EQ(c->activation.kind, Activation::kSiLU);
  EXPECT_EQ(c->num_hidden_layers, 61);
  EXPECT_EQ(c->expert_format, WeightFormat::kFP8Block128);
  EXPECT_EQ(c->dense_format, WeightFormat::kFP8Block128);
  EXPECT_EQ(c->MoeLayerIndices(), Range(1, 61));  // layers 1..60
}

TEST(ParseMoeConfigTest, DeepSeekV3GroupLimitedRouting) {
  const absl::StatusOr<MoeConfig> c = ParseMoeConfig(kDeepSeekV3Config);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->family, ModelFamily::kKimiK2);
  EXPECT_EQ(c->model_type, "deepseek_v3");
  EXPECT_EQ(c->routing.num_experts, 256);
  EXPECT_EQ(c->routing.top_k, 8);
  EXPECT_EQ(c->routing.n_group, 8);
  EXPECT_EQ(c->routing.topk_group, 4);
  EXPECT_EQ(c->routing.routed_scaling_factor, 2.5f);
  EXPECT_EQ(c->MoeLayerIndices(), Range(3, 61));
}

TEST(ParseMoeConfigTest, QuantizationConfigInsideTextConfig) {
  Json j = K3();
  j["text_config"]["quantization_config"] = j["quantization_config"];
  j.erase("quantization_config");
  const absl::StatusOr<MoeConfig> c = ParseMoeConfig(j.dump());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->expert_format, WeightFormat::kMXFP4);
  EXPECT_EQ(c->dense_format, WeightFormat::kBF16);

  // Errors there are named by their nested path.
  j["text_config"]["quantization_config"]["quant_method"] = "gptq";
  EXPECT_TRUE(RejectedNaming(j, "text_config.quantization_config.quant_method 'gptq'"));
}

TEST(ParseMoeConfigTest, Fp8InsideTextConfig) {
  Json j = K3();
  j.erase("quantization_config");
  j["text_config"]["quantization_config"] = K2()["quantization_config"];
  const absl::StatusOr<MoeConfig> c = ParseMoeConfig(j.dump());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->expert_format, WeightFormat::kFP8Block128);
  EXPECT_EQ(c->dense_format, WeightFormat::kFP8Block128);
}

TEST(ParseMoeConfigTest, GroupFormatOverridesTopLevel) {
  Json j = K3();
  Json& q = j["quantization_config"];
  q["format"] = "mixed-precision";
  q["config_groups"]["group_0"]["format"] = "mxfp4-pack-quantized";
  ASSERT_EQ(MessageOf(j), "OK");
  q.erase("format");
  ASSERT_EQ(MessageOf(j), "OK");
}

TEST(ParseMoeConfigTest, DefaultsOfAMinimalKimiLinearConfig) {
  const Json j = {
      {"model_type", "kimi_linear"}, {"hidden_size", 256},          {"num_experts", 8},
      {"num_experts_per_token", 2},  {"moe_intermediate_size", 64}, {"num_hidden_layers", 2}};
  const absl::StatusOr<MoeConfig> c = ParseMoeConfig(j.dump());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->num_shared_experts, 0);
  EXPECT_TRUE(c->routing.renormalize);
  EXPECT_EQ(c->routing.routed_scaling_factor, 1.0f);
  EXPECT_EQ(c->routing.n_group, 1);
  EXPECT_EQ(c->routing.topk_group, 1);
  EXPECT_FALSE(c->latent_norm);
  EXPECT_EQ(c->rms_norm_eps, 1e-6f);
  EXPECT_EQ(c->activation.kind, Activation::kSiLU);
  EXPECT_EQ(c->first_k_dense_replace, 0);
  EXPECT_EQ(c->moe_layer_freq, 1);
  EXPECT_EQ(c->MoeLayerIndices(), Range(0, 2));
  EXPECT_EQ(c->expert_format, WeightFormat::kBF16);
}

TEST(ParseMoeConfigTest, SituDefaultsAndOverrides) {
  Json j = K3();
  j["text_config"].erase("activation_situ_beta");
  j["text_config"]["activation_situ_linear_beta"] = 12.5;
  const absl::StatusOr<MoeConfig> c = ParseMoeConfig(j.dump());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->activation.situ_beta, 4.0f);
  EXPECT_EQ(c->activation.situ_linear_beta, 12.5f);

  j["text_config"]["hidden_act"] = "swiglu";
  const absl::StatusOr<MoeConfig> silu = ParseMoeConfig(j.dump());
  ASSERT_TRUE(silu.ok()) << silu.status();
  EXPECT_EQ(silu->activation.kind, Activation::kSiLU);
}

TEST(ParseMoeConfigTest, NullOrZeroSharedExpertsMeansNone) {
  Json j = K3();
  j["text_config"]["num_shared_experts"] = nullptr;
  absl::StatusOr<MoeConfig> c = ParseMoeConfig(j.dump());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->num_shared_experts, 0);
  j["text_config"]["num_shared_experts"] = 0;
  c = ParseMoeConfig(j.dump());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->num_shared_experts, 0);
}

TEST(ParseMoeConfigTest, NullLatentMeansNoLatentAndNoNorm) {
  Json j = K3();
  j["text_config"]["routed_expert_hidden_size"] = nullptr;
  j.erase("quantization_config");
  const absl::StatusOr<MoeConfig> c = ParseMoeConfig(j.dump());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->latent_size, 0);
  EXPECT_EQ(c->expert_input_size(), 7168);
  EXPECT_FALSE(c->latent_norm);  // the reference builds the norm only for a latent
}

TEST(ParseMoeConfigTest, UseGroupedTopkFalseDisablesGroups) {
  Json j = KimiLinear();
  j["num_expert_group"] = 8;
  j["topk_group"] = 4;
  absl::StatusOr<MoeConfig> c = ParseMoeConfig(j.dump());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->routing.n_group, 8);
  EXPECT_EQ(c->routing.topk_group, 4);
  j["use_grouped_topk"] = false;
  c = ParseMoeConfig(j.dump());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->routing.n_group, 1);
  EXPECT_EQ(c->routing.topk_group, 1);
}

TEST(ParseMoeConfigTest, GreedyTopkMethodHasNoGroupLimit) {
  Json j = DeepSeekV3();
  j["topk_method"] = "greedy";
  const absl::StatusOr<MoeConfig> c = ParseMoeConfig(j.dump());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->routing.n_group, 1);
  EXPECT_EQ(c->routing.topk_group, 1);
}

TEST(ParseMoeConfigTest, NormTopkProbFalse) {
  Json j = K2();
  j["norm_topk_prob"] = false;
  const absl::StatusOr<MoeConfig> c = ParseMoeConfig(j.dump());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FALSE(c->routing.renormalize);
}

TEST(ParseMoeConfigTest, BfloatK2WithoutQuantizationConfig) {
  Json j = K2();
  j.erase("quantization_config");
  const absl::StatusOr<MoeConfig> c = ParseMoeConfig(j.dump());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->expert_format, WeightFormat::kBF16);
  EXPECT_EQ(c->dense_format, WeightFormat::kBF16);
}

TEST(ParseMoeConfigTest, MoeLayerFreq) {
  Json j = K2();
  j["moe_layer_freq"] = 2;
  j["first_k_dense_replace"] = 3;
  j["num_hidden_layers"] = 10;
  const absl::StatusOr<MoeConfig> c = ParseMoeConfig(j.dump());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->MoeLayerIndices(), (std::vector<int>{4, 6, 8}));
}

// ---- round trip --------------------------------------------------------------------------

void ExpectRoundTrip(const MoeConfig& config) {
  ASSERT_TRUE(config.Validate().ok()) << config.Validate();
  const std::string text = MoeConfigToJson(config);
  const absl::StatusOr<MoeConfig> back = ParseMoeConfig(text);
  ASSERT_TRUE(back.ok()) << back.status() << "\n" << text;
  EXPECT_TRUE(*back == config) << text;
  // And writing it again gives the same text.
  EXPECT_EQ(MoeConfigToJson(*back), text);
}

TEST(MoeConfigToJsonTest, RoundTripsKimiK3) {
  const absl::StatusOr<MoeConfig> c = ParseMoeConfig(kKimiK3Config);
  ASSERT_TRUE(c.ok()) << c.status();
  ExpectRoundTrip(*c);
}

TEST(MoeConfigToJsonTest, RoundTripsKimiK2) {
  const absl::StatusOr<MoeConfig> c = ParseMoeConfig(kKimiK2Config);
  ASSERT_TRUE(c.ok()) << c.status();
  ExpectRoundTrip(*c);
}

TEST(MoeConfigToJsonTest, RoundTripsK3Mini) { ExpectRoundTrip(K3Mini()); }

TEST(MoeConfigToJsonTest, RoundTripsVariants) {
  for (const char* text : {kKimiLinearConfig, kDeepSeekV3Config}) {
    const absl::StatusOr<MoeConfig> c = ParseMoeConfig(text);
    ASSERT_TRUE(c.ok()) << c.status();
    ExpectRoundTrip(*c);
  }
  MoeConfig c = K3Mini();
  c.expert_format = c.dense_format = WeightFormat::kBF16;
  c.num_shared_experts = 0;
  c.routing.renormalize = false;
  c.routing.routed_scaling_factor = 2.827f;
  c.routing.n_group = 8;
  c.routing.topk_group = 2;
  c.activation.situ_beta = 3.5f;
  c.activation.situ_linear_beta = 20.0f;
  c.moe_layer_freq = 3;
  c.rms_norm_eps = 1e-6f;
  ExpectRoundTrip(c);
  c.expert_format = c.dense_format = WeightFormat::kFP8Block128;
  ExpectRoundTrip(c);
  c.latent_size = 0;
  c.latent_norm = false;
  ExpectRoundTrip(c);
}

TEST(MoeConfigToJsonTest, EmptyModelTypeWritesTheFamilyDefault) {
  MoeConfig c = K3Mini();
  c.model_type.clear();
  absl::StatusOr<MoeConfig> back = ParseMoeConfig(MoeConfigToJson(c));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->model_type, "kimi_k3");

  c.family = ModelFamily::kKimiK2;
  c.latent_size = 0;
  c.latent_norm = false;
  c.activation = ActivationParams();
  c.expert_format = c.dense_format = WeightFormat::kFP8Block128;
  back = ParseMoeConfig(MoeConfigToJson(c));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->model_type, "kimi_k2");
  EXPECT_EQ(back->family, ModelFamily::kKimiK2);
}

TEST(MoeConfigToJsonTest, KimiK3Layout) {
  const absl::StatusOr<MoeConfig> c = ParseMoeConfig(kKimiK3Config);
  ASSERT_TRUE(c.ok()) << c.status();
  const std::string text = MoeConfigToJson(*c);
  EXPECT_TRUE(
      absl::StartsWith(text, "{\n  \"architectures\": [\n    \"KimiK3ForConditionalGeneration\""))
      << text;
  EXPECT_TRUE(absl::StrContains(text, "\"rms_norm_eps\": 1e-05")) << text;
  EXPECT_TRUE(absl::StrContains(text, "\"activation_situ_beta\": 4.0")) << text;
  const Json j = Json::parse(text);
  EXPECT_EQ(j["model_type"], "kimi_k3");
  EXPECT_EQ(j["architectures"], Json::array({"KimiK3ForConditionalGeneration"}));
  ASSERT_TRUE(j["text_config"].is_object());
  EXPECT_EQ(j["text_config"]["routed_expert_hidden_size"], 3584);
  EXPECT_EQ(j["text_config"]["num_experts"], 896);
  EXPECT_EQ(j["text_config"]["hidden_act"], "situ");
  EXPECT_FALSE(j["text_config"].contains("quantization_config"));

  const Json& q = j["quantization_config"];
  EXPECT_EQ(q["quant_method"], "compressed-tensors");
  EXPECT_EQ(q["format"], "mxfp4-pack-quantized");
  const Json& g = q["config_groups"]["group_0"];
  EXPECT_EQ(g["targets"], Json::array({"Linear"}));
  EXPECT_EQ(g["weights"]["num_bits"], 4);
  EXPECT_EQ(g["weights"]["type"], "float");
  EXPECT_EQ(g["weights"]["group_size"], 32);
  EXPECT_EQ(g["weights"]["strategy"], "group");
  EXPECT_EQ(g["weights"]["symmetric"], true);
  const Json& ignore = q["ignore"];
  for (const char* pattern :
       {"lm_head", "re:.*gate$", "re:.*shared_experts.*", "re:.*routed_expert_(down|up)_proj$"}) {
    EXPECT_NE(std::find(ignore.begin(), ignore.end(), Json(pattern)), ignore.end()) << pattern;
  }
}

TEST(MoeConfigToJsonTest, KimiK2Layout) {
  const absl::StatusOr<MoeConfig> c = ParseMoeConfig(kKimiK2Config);
  ASSERT_TRUE(c.ok()) << c.status();
  const std::string text = MoeConfigToJson(*c);
  EXPECT_TRUE(absl::StrContains(text, "\"routed_scaling_factor\": 2.827")) << text;
  const Json j = Json::parse(text);
  EXPECT_EQ(j["model_type"], "kimi_k2");
  EXPECT_EQ(j["architectures"], Json::array({"DeepseekV3ForCausalLM"}));
  EXPECT_FALSE(j.contains("text_config"));
  EXPECT_EQ(j["n_routed_experts"], 384);
  EXPECT_EQ(j["num_experts_per_tok"], 8);
  EXPECT_EQ(j["topk_method"], "noaux_tc");
  EXPECT_EQ(j["scoring_func"], "sigmoid");
  EXPECT_EQ(j["quantization_config"], K2()["quantization_config"]);
}

TEST(MoeConfigToJsonTest, BfloatWritesNoQuantizationConfig) {
  MoeConfig c = K3Mini();
  c.expert_format = c.dense_format = WeightFormat::kBF16;
  EXPECT_FALSE(Json::parse(MoeConfigToJson(c)).contains("quantization_config"));
}

// ---- malformed configs: each names its field ---------------------------------------------

TEST(ParseMoeConfigErrorTest, NotJson) {
  EXPECT_TRUE(RejectedNaming(std::string("{\"model_type\": "), "not valid JSON"));
  EXPECT_TRUE(RejectedNaming(std::string(""), "not valid JSON"));
  EXPECT_TRUE(
      RejectedNaming(std::string("{\"model_type\": \"kimi_k2\"} trailing"), "not valid JSON"));
}

TEST(ParseMoeConfigErrorTest, TopLevelNotAnObject) {
  EXPECT_TRUE(RejectedNaming(std::string("[1, 2]"), "top level must be an object"));
}

TEST(ParseMoeConfigErrorTest, ModelType) {
  Json j = K2();
  j.erase("model_type");
  EXPECT_TRUE(RejectedNaming(j, "model_type is required"));
  j["model_type"] = 3;
  EXPECT_TRUE(RejectedNaming(j, "model_type must be a string"));
  j["model_type"] = "llama";
  EXPECT_TRUE(RejectedNaming(j, "model_type 'llama' is not supported"));
}

TEST(ParseMoeConfigErrorTest, KimiK3WithoutTextConfig) {
  Json j = K3();
  j.erase("text_config");
  EXPECT_TRUE(RejectedNaming(j, "text_config is required"));
  j["text_config"] = "flat";
  EXPECT_TRUE(RejectedNaming(j, "text_config must be an object"));
}

TEST(ParseMoeConfigErrorTest, MissingRequiredFields) {
  for (const char* field : {"hidden_size", "num_experts", "num_experts_per_token",
                            "moe_intermediate_size", "num_hidden_layers"}) {
    Json j = K3();
    j["text_config"].erase(field);
    EXPECT_TRUE(RejectedNaming(j, std::string("text_config.") + field + " is required"));
  }
  for (const char* field : {"hidden_size", "n_routed_experts", "num_experts_per_tok",
                            "moe_intermediate_size", "num_hidden_layers"}) {
    Json j = K2();
    j[field] = nullptr;  // null is as good as absent
    EXPECT_TRUE(RejectedNaming(j, std::string(field) + " is required"));
  }
}

TEST(ParseMoeConfigErrorTest, WrongTypes) {
  Json j = K3();
  j["text_config"]["hidden_size"] = "7168";
  EXPECT_TRUE(RejectedNaming(j, "text_config.hidden_size must be an integer, not string"));
  j = K3();
  j["text_config"]["num_shared_experts"] = 2.5;
  EXPECT_TRUE(RejectedNaming(j, "text_config.num_shared_experts must be an integer"));
  j = K3();
  j["text_config"]["moe_renormalize"] = "yes";
  EXPECT_TRUE(RejectedNaming(j, "text_config.moe_renormalize must be true or false"));
  j = K3();
  j["text_config"]["rms_norm_eps"] = "1e-5";
  EXPECT_TRUE(RejectedNaming(j, "text_config.rms_norm_eps must be a number"));
  j = K3();
  j["text_config"]["hidden_act"] = Json::array({"situ"});
  EXPECT_TRUE(RejectedNaming(j, "text_config.hidden_act must be a string"));
  j = K2();
  j["quantization_config"] = "fp8";
  EXPECT_TRUE(RejectedNaming(j, "quantization_config must be an object"));
}

TEST(ParseMoeConfigErrorTest, OutOfRangeIntegers) {
  Json j = K2();
  j["hidden_size"] = 1099511627776;  // 2^40
  EXPECT_TRUE(RejectedNaming(j, "hidden_size (1099511627776) is out of range"));
  j["hidden_size"] = -1099511627776;
  EXPECT_TRUE(RejectedNaming(j, "hidden_size (-1099511627776) is out of range"));
  EXPECT_TRUE(RejectedNaming(std::string(kKimiK2Config)
                                 .replace(std::string(kKimiK2Config).find("\"hidden_size\": 7168"),
                                          19, "\"hidden_size\": 18446744073709551615"),
                             "hidden_size (18446744073709551615) is out of range"));
  j = K2();
  j["routed_scaling_factor"] = 1e300;
  EXPECT_TRUE(RejectedNaming(j, "routed_scaling_factor"));
}

TEST(ParseMoeConfigErrorTest, NonPositiveSizes) {
  struct Case {
    Json base;
    const char* field;  // a JSON pointer
    Json value;
    const char* message;
  };
  const std::vector<Case> cases = {
      {K3(), "/text_config/hidden_size", 0, "text_config.hidden_size (0) must be positive"},
      {K3(), "/text_config/moe_intermediate_size", -3072,
       "text_config.moe_intermediate_size (-3072) must be positive"},
      {K3(), "/text_config/routed_expert_hidden_size", 0,
       "text_config.routed_expert_hidden_size (0) must be positive"},
      {K3(), "/text_config/num_experts", 0, "text_config.num_experts (0) must be positive"},
      {K2(), "/num_experts_per_tok", 0, "num_experts_per_tok (0) must be positive"},
      {K2(), "/n_shared_experts", -1, "n_shared_experts (-1) must not be negative"},
      {K2(), "/num_hidden_layers", 0, "num_hidden_layers (0) must be positive"},
      {K2(), "/moe_layer_freq", 0, "moe_layer_freq (0) must be positive"},
      {K2(), "/first_k_dense_replace", -1, "first_k_dense_replace (-1) must not be negative"},
      {K2(), "/rms_norm_eps", 0, "rms_norm_eps (0) must be a positive finite number"},
      {K2(), "/routed_scaling_factor", -2.5,
       "routed_scaling_factor (-2.5) must be a positive finite number"},
      {K3(), "/text_config/activation_situ_beta", 0.0,
       "text_config.activation_situ_beta (0) must be a positive"},
  };
  for (const Case& c : cases) {
    Json j = c.base;
    j[Json::json_pointer(c.field)] = c.value;
    EXPECT_TRUE(RejectedNaming(j, c.message)) << c.field;
  }
}

// Fields that are valid alone but not together.
TEST(ParseMoeConfigErrorTest, InconsistentFields) {
  struct Case {
    Json base;
    std::vector<std::pair<const char*, Json>> edits;  // JSON pointer, value
    const char* message;
  };
  const std::vector<Case> cases = {
      {K3(),
       {{"/text_config/num_experts", 16}, {"/text_config/num_experts_per_token", 20}},
       "config.json: text_config.num_experts_per_token (20) exceeds num_experts (16)"},
      {K2(),
       {{"/num_experts_per_tok", 385}},
       "num_experts_per_tok (385) exceeds n_routed_experts (384)"},
      {DeepSeekV3(), {{"/n_group", 7}}, "n_routed_experts (256) is not divisible by n_group (7)"},
      {KimiLinear(),
       {{"/num_expert_group", 3}},
       "num_experts (256) is not divisible by num_expert_group (3)"},
      {DeepSeekV3(), {{"/topk_group", 9}}, "topk_group (9) exceeds n_group (8)"},
      {DeepSeekV3(), {{"/topk_group", 0}}, "topk_group (0) must be positive"},
      {DeepSeekV3(), {{"/n_group", 0}}, "n_group (0) must be positive"},
      {DeepSeekV3(),  // 32 experts selectable
       {{"/topk_group", 1}, {"/num_experts_per_tok", 33}},
       "num_experts_per_tok (33) exceeds the 32 experts in topk_group"},
  };
  for (const Case& c : cases) {
    Json j = c.base;
    for (const auto& [field, value] : c.edits) j[Json::json_pointer(field)] = value;
    EXPECT_TRUE(RejectedNaming(j, c.message)) << c.message;
  }
}

TEST(ParseMoeConfigErrorTest, ScoringFunction) {
  Json j = K2();
  j["scoring_func"] = "softmax";
  EXPECT_EQ(MessageOf(j), "config.json: scoring_func 'softmax' is not supported (only 'sigmoid')");
  j = K3();
  j["text_config"]["moe_router_activation_func"] = "softmax";
  EXPECT_TRUE(RejectedNaming(j, "text_config.moe_router_activation_func 'softmax'"));
  j = K3();
  j["text_config"]["scoring_func"] = "softmax";
  EXPECT_TRUE(RejectedNaming(j, "text_config.scoring_func 'softmax'"));
}

TEST(ParseMoeConfigErrorTest, TopkMethod) {
  Json j = K2();
  j["topk_method"] = "group_limited_greedy";
  EXPECT_TRUE(RejectedNaming(j, "topk_method 'group_limited_greedy' is not supported"));
}

TEST(ParseMoeConfigErrorTest, UseGroupedTopkType) {
  Json j = KimiLinear();
  j["use_grouped_topk"] = 1;
  EXPECT_TRUE(RejectedNaming(j, "use_grouped_topk must be true or false"));
}

TEST(ParseMoeConfigErrorTest, HiddenAct) {
  Json j = K3();
  j["text_config"]["hidden_act"] = "gelu";
  EXPECT_TRUE(RejectedNaming(j, "text_config.hidden_act 'gelu' is not supported"));
  j = K2();
  j["hidden_act"] = "relu";
  EXPECT_TRUE(RejectedNaming(j, "hidden_act 'relu' is not supported"));
}

TEST(ParseMoeConfigErrorTest, NoMoeLayer) {
  Json j = K2();
  j["first_k_dense_replace"] = 61;
  EXPECT_TRUE(RejectedNaming(j, "first_k_dense_replace (61)"));
  j["first_k_dense_replace"] = 3;
  j["moe_layer_freq"] = 4;
  j["num_hidden_layers"] = 4;  // layer 3 is not a multiple of 4
  EXPECT_TRUE(RejectedNaming(j, "moe_layer_freq (4)"));
  j["num_hidden_layers"] = 5;
  const absl::StatusOr<MoeConfig> c = ParseMoeConfig(j.dump());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->MoeLayerIndices(), std::vector<int>{4});
}

TEST(ParseMoeConfigErrorTest, HugeLayerCountDoesNotAllocate) {
  Json j = K2();
  j["num_hidden_layers"] = 2147483647;
  EXPECT_EQ(MessageOf(j), "OK");  // validated arithmetically, without listing the layers
}

// The error message quotes a wrongly typed value (dumped, recursively): nesting is bounded
// while parsing, so a million '[' cannot overflow the stack.
TEST(ParseMoeConfigErrorTest, DeeplyNestedValueIsRefused) {
  const int depth = 1000000;
  Json j = K2();
  j["hidden_size"] = "PLACEHOLDER";  // "must be an integer, not array [[[[..." before the fix
  std::string text = j.dump();
  text.replace(text.find(R"("PLACEHOLDER")"), 13,
               std::string(depth, '[') + std::string(depth, ']'));
  const absl::StatusOr<MoeConfig> c = ParseMoeConfig(text);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c.status().message(), "config.json: not valid JSON: nested deeper than 64 levels");
}

TEST(ParseMoeConfigErrorTest, UnsupportedQuantMethod) {
  Json j = K2();
  j["quantization_config"] = {{"quant_method", "awq"}, {"bits", 4}};
  EXPECT_EQ(MessageOf(j),
            "config.json: quantization_config.quant_method 'awq' is not supported (fp8, "
            "compressed-tensors mxfp4-pack-quantized)");
  j["quantization_config"] = {{"bits", 4}};
  EXPECT_TRUE(RejectedNaming(j, "quantization_config.quant_method is required"));
}

TEST(ParseMoeConfigErrorTest, Fp8Variants) {
  Json j = K2();
  j["quantization_config"]["weight_block_size"] = {64, 64};
  EXPECT_TRUE(RejectedNaming(j, "quantization_config.weight_block_size [64,64] is not supported"));
  j["quantization_config"]["weight_block_size"] = {128};
  EXPECT_TRUE(RejectedNaming(j, "quantization_config.weight_block_size [128]"));
  j["quantization_config"]["weight_block_size"] = "128x128";
  EXPECT_TRUE(RejectedNaming(j, "quantization_config.weight_block_size"));
  j["quantization_config"].erase("weight_block_size");
  EXPECT_TRUE(RejectedNaming(j, "quantization_config.weight_block_size is required"));
  j = K2();
  j["quantization_config"]["fmt"] = "e5m2";
  EXPECT_TRUE(RejectedNaming(j, "quantization_config.fmt 'e5m2' is not supported"));
  j = K2();
  j["quantization_config"]["activation_scheme"] = "static";
  EXPECT_TRUE(RejectedNaming(j, "quantization_config.activation_scheme 'static' is not supported"));
}

TEST(ParseMoeConfigErrorTest, CompressedTensorsVariants) {
  // Kimi K2 Thinking's int4 format.
  Json j = K3();
  j["quantization_config"]["format"] = "pack-quantized";
  EXPECT_TRUE(RejectedNaming(j, "quantization_config.format 'pack-quantized' is not supported"));
  j = K3();
  j["quantization_config"]["config_groups"]["group_0"]["format"] = "nvfp4-pack-quantized";
  EXPECT_TRUE(
      RejectedNaming(j, "quantization_config.config_groups.group_0.format 'nvfp4-pack-quantized'"));
  j = K3();
  j["quantization_config"].erase("format");
  EXPECT_TRUE(RejectedNaming(j, "quantization_config.format is required"));
  j = K3();
  j["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = 8;
  EXPECT_TRUE(RejectedNaming(
      j, "quantization_config.config_groups.group_0.weights.num_bits (8) must be 4"));
  j = K3();
  j["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 16;
  EXPECT_TRUE(RejectedNaming(
      j, "quantization_config.config_groups.group_0.weights.group_size (16) must be 32"));
  j = K3();
  j["quantization_config"]["config_groups"]["group_0"]["weights"].erase("group_size");
  EXPECT_EQ(MessageOf(j), "OK");  // group_size is optional
  j = K3();
  j["quantization_config"]["config_groups"]["group_0"].erase("weights");
  EXPECT_TRUE(RejectedNaming(j, "quantization_config.config_groups.group_0.weights is required"));
  j = K3();
  j["quantization_config"].erase("config_groups");
  EXPECT_TRUE(RejectedNaming(j, "quantization_config.config_groups is required"));
  j = K3();
  j["quantization_config"]["config_groups"] = Json::object();
  EXPECT_TRUE(RejectedNaming(j, "quantization_config.config_groups is empty"));
  j = K3();
  j["quantization_config"]["config_groups"]["group_0"]["input_activations"] = {
      {"num_bits", 4}, {"type", "float"}, {"dynamic", true}};
  EXPECT_TRUE(RejectedNaming(j, "quantization_config.config_groups.group_0.input_activations"));
  j = K3();
  j["quantization_config"]["ignore"] = "lm_head";
  EXPECT_TRUE(RejectedNaming(j, "quantization_config.ignore must be an array"));
}

TEST(ParseMoeConfigErrorTest, Mxfp4WidthsDivisibleBy32) {
  Json j = K3();
  j["text_config"]["routed_expert_hidden_size"] = 3580;
  EXPECT_TRUE(
      RejectedNaming(j, "text_config.routed_expert_hidden_size (3580) is not divisible by 32"));
  j = K3();
  j["text_config"]["moe_intermediate_size"] = 3000;
  EXPECT_TRUE(RejectedNaming(j, "text_config.moe_intermediate_size (3000) is not divisible by 32"));
  // K2 experts read the hidden width.
  j = K2();
  j["hidden_size"] = 7000;
  j["quantization_config"] = K3()["quantization_config"];
  EXPECT_TRUE(RejectedNaming(j, "hidden_size (7000) is not divisible by 32"));
  // Without a latent a K3 expert reads the hidden width too.
  j = K3();
  j["text_config"]["routed_expert_hidden_size"] = nullptr;
  j["text_config"]["hidden_size"] = 7000;
  EXPECT_TRUE(RejectedNaming(j, "text_config.hidden_size (7000) is not divisible by 32"));
  // ... and bf16 experts have no such constraint.
  j.erase("quantization_config");
  EXPECT_EQ(MessageOf(j), "OK");
}

// Every prefix of a real config and every field replaced by every JSON type: an error or a
// config, never an exception or a crash.
TEST(ParseMoeConfigErrorTest, NeverThrowsOnMangledInput) {
  const std::string text = kKimiK3Config;
  for (size_t n = 0; n < text.size(); n += 7) {
    const absl::StatusOr<MoeConfig> c = ParseMoeConfig(absl::string_view(text).substr(0, n));
    EXPECT_FALSE(c.ok());
  }
  const std::vector<Json> values = {
      nullptr, true, -1, 0, 3.5, 1e40, "x", Json::array(), Json::object(), Json::array({128, 128})};
  for (const Json& base : {K3(), K2()}) {
    const bool nested = base.contains("text_config");
    const Json& fields = nested ? base.at("text_config") : base;
    for (const auto& item : fields.items()) {
      for (const Json& v : values) {
        Json j = base;
        (nested ? j["text_config"] : j)[item.key()] = v;
        const absl::StatusOr<MoeConfig> c = ParseMoeConfig(j.dump());
        if (!c.ok()) {
          EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << c.status();
        }
      }
    }
  }
  EXPECT_FALSE(ParseMoeConfig("{\"model_type\": \"kimi_k2\", \"hidden_size\": \"\xff\"}").ok());
}

// ---- Validate on configs built in code ---------------------------------------------------

TEST(MoeConfigValidateTest, AcceptsPresets) {
  EXPECT_TRUE(K3Mini().Validate().ok()) << K3Mini().Validate();
}

TEST(MoeConfigValidateTest, RejectsFormatPairsConfigJsonCannotExpress) {
  MoeConfig c = K3Mini();
  c.expert_format = WeightFormat::kFP8Block128;
  c.dense_format = WeightFormat::kBF16;
  const absl::Status s = c.Validate();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), "quantization_config")) << s;
}

TEST(MoeConfigValidateTest, RejectsLatentForKimiK2) {
  MoeConfig c = K3Mini();
  c.family = ModelFamily::kKimiK2;
  c.model_type = "kimi_k2";
  const absl::Status s = c.Validate();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), "routed_expert_hidden_size")) << s;
}

TEST(MoeConfigValidateTest, RejectsNormWithoutLatent) {
  MoeConfig c = K3Mini();
  c.latent_size = 0;
  const absl::Status s = c.Validate();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), "latent_moe_use_norm")) << s;
}

TEST(MoeConfigValidateTest, RejectsModelTypeOfTheOtherFamily) {
  MoeConfig c = K3Mini();
  c.model_type = "deepseek_v3";
  const absl::Status s = c.Validate();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), "model_type 'deepseek_v3'")) << s;
}

TEST(MoeConfigValidateTest, NamesFieldsLikeConfigJson) {
  MoeConfig c = K3Mini();
  c.routing.top_k = 65;
  EXPECT_EQ(c.Validate().message(),
            "MoeConfig: text_config.num_experts_per_token (65) exceeds num_experts (64)");
}

TEST(ModelFamilyNameTest, Names) {
  EXPECT_STREQ(ModelFamilyName(ModelFamily::kKimiK3), "kimi_k3");
  EXPECT_STREQ(ModelFamilyName(ModelFamily::kKimiK2), "kimi_k2");
}

}  // namespace
}  // namespace moe
