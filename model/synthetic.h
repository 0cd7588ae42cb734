// Synthetic MoE checkpoints in exactly the on-disk formats of docs/DESIGN.md "Checkpoints".
//
// No real Kimi checkpoint can be downloaded here, so demos, tests and benchmarks run on
// generated ones: config.json (MoeConfigToJson), shards `model-0000i-of-0000N.safetensors`
// and `model.safetensors.index.json`, with the real tensor names, dtypes and shapes.
//
// Values are deterministic: each tensor depends only on (seed, tensor name), never on the
// thread count or the sharding. Their scale is realistic: for inputs x ~ N(0, 1) every linear
// output is of order 1 (weight RMS ~ 1/sqrt(in_features), the router too, so sigmoid scores are
// not saturated); norm weights ~ 1 + N(0, 0.05^2); the router bias ~ N(0, 0.02^2), plus
// `router_skew` on the first ~10% of experts when asked (a skewed router for load-balance
// tests). MXFP4: uniform random E2M1 codes with per-32 E8M0 scales; FP8: quantized normal
// samples with fp32 block-128 scale_inv ~ (1/sqrt(in)) * U(0.75, 1.25).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "model/config.h"

namespace moe {

// Built-in configurations:
//   "k3-mini": scaled K3 (hidden 640, latent 320, 64 experts of 256, top-2, 2 shared), all
//              bf16, 2 MoE layers (1, 2).
//   "kimi-k3": Kimi K3 (hidden 7168, latent 3584, 896 experts of 3072, top-16, 2 shared),
//              routed experts MXFP4, 1 MoE layer (1).
//   "kimi-k2": Kimi K2 (hidden 7168, 384 experts of 2048, top-8, 1 shared, scaling 2.827),
//              FP8 block-128 experts and shared experts, 1 MoE layer (1).
// MoE layers start at first_k_dense_replace = 1; num_hidden_layers = 1 + MoE layers.
absl::StatusOr<MoeConfig> SyntheticPreset(absl::string_view name);
std::vector<std::string> SyntheticPresetNames();

// Makes `config` have `num_moe_layers` MoE layers first_k_dense_replace .. +n-1 (freq 1).
void SetNumMoeLayers(int num_moe_layers, MoeConfig* config);

struct SyntheticOptions {
  // MoE layers to write; 0 keeps the config's own (num_hidden_layers - first_k_dense_replace
  // for the presets). When > 0 the written config.json says so too.
  int num_moe_layers = 0;
  uint64_t seed = 0;
  // A new shard starts when the next tensor (or expert: one expert's tensors stay together)
  // would take the current one past this size.
  int64_t max_shard_bytes = int64_t{4} << 30;
  // Progress bar on stderr (bytes written / total, MB/s, ETA).
  bool progress = false;
  // Added to the router bias of the first ceil(10%) of experts.
  float router_skew = 0.0f;
  // K3 only: name tensors `language_model.model.layers.*` (as the released checkpoint) or,
  // when false, `model.layers.*`.
  bool language_model_prefix = true;
  // Generator threads (the calling thread writes).
  int num_threads = 2;
};

// What WriteSyntheticCheckpoint wrote.
struct SyntheticSummary {
  std::vector<int> layers;         // MoE layer indices
  int num_experts = 0;             // routed experts per layer
  int64_t tensor_bytes = 0;        // index.json's total_size
  int64_t file_bytes = 0;          // all files written, headers and config included
  std::vector<std::string> files;  // paths, config.json and index included
  double seconds = 0;
};

// Writes a checkpoint for `config` into `dir` (created if needed; files of the same names
// are replaced). Fails up front with ResourceExhausted when the file system lacks space.
absl::Status WriteSyntheticCheckpoint(const std::string& dir, const MoeConfig& config,
                                      const SyntheticOptions& options,
                                      SyntheticSummary* summary = nullptr);

}  // namespace moe
