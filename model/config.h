// The MoE-layer configuration of a checkpoint, read from its Hugging Face config.json.
//
// Accepted config.json variants (docs/DESIGN.md "Checkpoints"):
//   Kimi K3:  model_type "kimi_k3" with the model fields nested in `text_config`, or
//             model_type "kimi_linear" with them at the top level.
//   Kimi K2:  model_type "kimi_k2" or "deepseek_v3" (DeepSeek-V3 field names), flat.
//   quantization_config (top level, or inside text_config): absent = everything bf16;
//   DeepSeek FP8 (quant_method "fp8", e4m3, 128x128 blocks) = experts and dense weights FP8;
//   compressed-tensors "mxfp4-pack-quantized" = routed experts MXFP4, the rest bf16.
// Fields the layer does not need (attention, vocabulary, rope, ...) are ignored.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/numerics.h"
#include "kernels/backend.h"
#include "kernels/weights.h"

namespace moe {

enum class ModelFamily {
  kKimiK3,  // latent MoE: model_type kimi_k3 (nested text_config) or kimi_linear (flat)
  kKimiK2,  // DeepSeek-V3 layout: model_type kimi_k2 or deepseek_v3
};

// "kimi_k3" or "kimi_k2".
const char* ModelFamilyName(ModelFamily f);

struct MoeConfig {
  ModelFamily family = ModelFamily::kKimiK3;
  // As written in config.json: kimi_k3 | kimi_linear (K3), kimi_k2 | deepseek_v3 (K2).
  // Empty means the family's default spelling (kimi_k3, kimi_k2) when written.
  std::string model_type;

  int64_t hidden_size = 0;         // H: the layer's input/output width
  int64_t latent_size = 0;         // K3 routed_expert_hidden_size; 0 for K2 (experts see H)
  int64_t expert_hidden_size = 0;  // moe_intermediate_size
  int num_shared_experts = 0;      // the shared MLP has num_shared_experts * expert_hidden_size
  int64_t shared_hidden_size() const { return expert_hidden_size * num_shared_experts; }
  // Width the routed experts work in: the latent for K3, the hidden size for K2.
  int64_t expert_input_size() const { return latent_size > 0 ? latent_size : hidden_size; }
  bool has_latent() const { return latent_size > 0; }

  // num_experts, top_k, renormalize, scaling, groups. K3: num_experts, num_experts_per_token,
  // moe_renormalize (default true), routed_scaling_factor (default 1), num_expert_group /
  // topk_group (default 1/1; 1/1 when use_grouped_topk is false). K2: n_routed_experts,
  // num_experts_per_tok, norm_topk_prob (default true), routed_scaling_factor, n_group /
  // topk_group (1/1 when topk_method is "greedy").
  RoutingParams routing;
  // latent_moe_use_norm (K3, default false); only meaningful with a latent, as in the
  // reference modeling code, so the parser keeps it false without one.
  bool latent_norm = false;
  float rms_norm_eps = 1e-6f;  // rms_norm_eps (default 1e-6)
  // hidden_act: "situ" (activation_situ_beta default 4, activation_situ_linear_beta default
  // 25) or "silu" / "swiglu" (default "silu").
  ActivationParams activation;

  int num_hidden_layers = 0;
  int first_k_dense_replace = 0;  // layers [0, first_k_dense_replace) are dense
  int moe_layer_freq = 1;         // layer L >= first_k_dense_replace is MoE if (L % freq) == 0

  // From quantization_config: the routed experts' format (bf16 when absent). The shared
  // experts and projections follow `dense_format` (FP8 models quantize those too). The pairs
  // config.json can express: bf16/bf16, fp8/fp8 (DeepSeek FP8), mxfp4/bf16 (compressed-tensors).
  WeightFormat expert_format = WeightFormat::kBF16;
  WeightFormat dense_format = WeightFormat::kBF16;

  // Whether layer L (the checkpoint's own numbering) is a MoE layer by the config:
  // L in [first_k_dense_replace, num_hidden_layers) with L % moe_layer_freq == 0.
  bool IsMoeLayer(int layer) const;
  // Every such L, ascending. As many as num_hidden_layers, which a config.json may set to 2^31:
  // for configs this program made; readers ask IsMoeLayer of the layers they find instead.
  std::vector<int> MoeLayerIndices() const;
  // Checks the config describes a servable layer: positive sizes, top_k <= num_experts, the
  // group limits, at least one MoE layer, a format pair config.json can express, MXFP4 widths
  // divisible by 32. InvalidArgument naming the config.json field of the family otherwise.
  absl::Status Validate() const;
};

// Field-by-field equality (ActivationParams' SiTU bounds count only for SiTU).
bool operator==(const MoeConfig& a, const MoeConfig& b);
inline bool operator!=(const MoeConfig& a, const MoeConfig& b) { return !(a == b); }

// Parses config.json text. Unsupported values give InvalidArgument naming the field,
// e.g. "config.json: scoring_func 'softmax' is not supported (only 'sigmoid')". The result
// passes Validate(). Never throws.
absl::StatusOr<MoeConfig> ParseMoeConfig(absl::string_view config_json);

// Serializes a config as a config.json the parser reads back to an equal MoeConfig (used by
// the synthetic checkpoint writer); `config` should pass Validate(). K3 is written as
// model_type kimi_k3 with a nested text_config (kimi_linear flat when config.model_type says
// so), K2 as kimi_k2 (or deepseek_v3) flat; quantization_config at the top level. Keys sorted
// and indented by 2, as Hugging Face writes them.
std::string MoeConfigToJson(const MoeConfig& config);

}  // namespace moe
