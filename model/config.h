// The MoE-layer configuration of a checkpoint, read from its Hugging Face config.json.
#pragma once

#include <string>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/status/statusor.h"
#include "core/numerics.h"
#include "kernels/backend.h"
#include "kernels/weights.h"

namespace moe {

enum class ModelFamily {
  kKimiK3,  // latent MoE: model_type kimi_k3 (nested text_config) or kimi_linear (flat)
  kKimiK2,  // DeepSeek-V3 layout: model_type kimi_k2 or deepseek_v3
};

const char* ModelFamilyName(ModelFamily f);

struct MoeConfig {
  ModelFamily family = ModelFamily::kKimiK3;
  std::string model_type;  // as written in config.json

  int64_t hidden_size = 0;         // H: the layer's input/output width
  int64_t latent_size = 0;         // K3 routed_expert_hidden_size; 0 for K2 (experts see H)
  int64_t expert_hidden_size = 0;  // moe_intermediate_size
  int num_shared_experts = 0;      // the shared MLP has num_shared_experts * expert_hidden_size
  int64_t shared_hidden_size() const { return expert_hidden_size * num_shared_experts; }
  // Width the routed experts work in: the latent for K3, the hidden size for K2.
  int64_t expert_input_size() const { return latent_size > 0 ? latent_size : hidden_size; }
  bool has_latent() const { return latent_size > 0; }

  RoutingParams routing;  // num_experts, top_k, renormalize, scaling, groups
  bool latent_norm = false;  // latent_moe_use_norm (K3)
  float rms_norm_eps = 1e-6f;
  ActivationParams activation;  // situ (K3) or silu (K2)

  int num_hidden_layers = 0;
  int first_k_dense_replace = 0;  // layers [0, first_k_dense_replace) are dense
  int moe_layer_freq = 1;         // layer L >= first_k_dense_replace is MoE if (L % freq) == 0

  // From quantization_config: the routed experts' format (bf16 when absent). The shared
  // experts and projections follow `dense_format` (FP8 models quantize those too).
  WeightFormat expert_format = WeightFormat::kBF16;
  WeightFormat dense_format = WeightFormat::kBF16;

  // Layer indices (the checkpoint's own numbering) that are MoE layers by the config.
  std::vector<int> MoeLayerIndices() const;
  // Checks the dimensions are consistent (e.g. MXFP4 needs widths divisible by 32).
  absl::Status Validate() const;
};

// Parses config.json text. Unsupported values give InvalidArgument naming the field,
// e.g. "config.json: scoring_func 'softmax' is not supported (only 'sigmoid')".
absl::StatusOr<MoeConfig> ParseMoeConfig(absl::string_view config_json);

// Serializes a config as a config.json the parser reads back (used by the synthetic
// checkpoint writer). K3 is written as model_type kimi_k3 with a nested text_config.
std::string MoeConfigToJson(const MoeConfig& config);

}  // namespace moe
