// A MoE checkpoint: config.json + safetensors, with selective loading by layer and expert.
//
// Tensor names (docs/DESIGN.md "Checkpoints"):
//   K3: [language_model.]model.layers.{L}.block_sparse_moe.{gate.weight,
//   gate.e_score_correction_bias,
//       routed_expert_down_proj.weight, routed_expert_norm.weight, routed_expert_up_proj.weight,
//       shared_experts.{gate,up,down}_proj.weight, experts.{e}.{w1,w3,w2}.{weight |
//       weight_packed,weight_scale}}
//   K2: model.layers.{L}.mlp.{gate.weight, gate.e_score_correction_bias,
//       experts.{e}.{gate,up,down}_proj.{weight[, weight_scale_inv]},
//       shared_experts.{gate,up,down}_proj...}
// Loaded weights are views into the memory-mapped files; they stay valid while the
// Checkpoint lives.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/weights.h"
#include "model/config.h"
#include "model/safetensors.h"

namespace moe {

// What the gateway holds for one layer: everything but the routed experts.
struct GatewayLayerWeights {
  int layer = 0;
  WeightMatrix router;             // bf16 [E, H]
  std::vector<float> router_bias;  // fp32 [E] (e_score_correction_bias; zeros when absent)
  bool has_latent = false;
  WeightMatrix latent_down;  // [Lat, H]   (K3)
  WeightMatrix latent_up;    // [H, Lat]   (K3)
  bool has_latent_norm = false;
  WeightVector latent_norm;  // bf16 [Lat] (K3)
  bool has_shared = false;
  MlpWeights shared;  // [S, H], [S, H], [H, S]
  int64_t TotalBytes() const;
};

// A contiguous or explicit set of routed experts of one layer (what a rank holds).
struct ExpertShardWeights {
  int layer = 0;
  std::vector<int> expert_ids;      // global expert ids, ascending
  std::vector<MlpWeights> experts;  // same order
  int64_t TotalBytes() const;
};

// How Checkpoint::LoadExperts loads.
struct ExpertLoadOptions {
  // Ask the kernel to read the experts' pages now instead of at first use.
  bool prefetch = false;
  // Refuse NaN/Inf in the experts' weights and scales (INVALID_ARGUMENT naming the tensor and
  // the element). Reads every byte of bf16 and FP8 experts (6-7 GB/s on one core here); of
  // MXFP4 experts only the E8M0 scales (1/17 of their bytes): E2M1 codes are all finite. The
  // gateway's tensors are always checked.
  bool check_values = true;
  // With check_values: called after each tensor is checked with the bytes checked so far and
  // the bytes of every tensor this call checks (progress of a long load).
  std::function<void(int64_t done, int64_t total)> on_checked;
};

class Checkpoint {
 public:
  // Reads config.json and the safetensors headers/index; no tensor data.
  static absl::StatusOr<std::unique_ptr<Checkpoint>> Open(const std::string& dir);

  const MoeConfig& config() const { return config_; }
  const std::string& dir() const { return dir_; }
  const SafetensorsCheckpoint& tensors() const { return *tensors_; }

  // MoE layers present in the files (those config().IsMoeLayer), ascending.
  const std::vector<int>& layers() const { return layers_; }
  bool HasLayer(int layer) const;

  // Loads (maps and validates, NaN/Inf included) the gateway's tensors of `layer`. NotFound
  // for an absent layer.
  absl::StatusOr<GatewayLayerWeights> LoadGatewayLayer(int layer) const;
  // Loads the given routed experts of `layer`; errors name the missing/malformed tensor.
  absl::StatusOr<ExpertShardWeights> LoadExperts(int layer, const std::vector<int>& expert_ids,
                                                 const ExpertLoadOptions& options = {}) const;

 private:
  Checkpoint() = default;
  std::string dir_;
  MoeConfig config_;
  std::unique_ptr<SafetensorsCheckpoint> tensors_;
  // The MoE block's tensor-name prefix of `layer`, e.g.
  // "language_model.model.layers.3.block_sparse_moe.".
  std::string LayerPrefix(int layer) const;
  absl::Status CheckLayer(int layer) const;

  std::vector<int> layers_;
  std::string prefix_head_;  // e.g. "language_model.model.layers."
  std::string prefix_tail_;  // e.g. ".block_sparse_moe."
};

}  // namespace moe
