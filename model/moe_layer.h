// The MoE layer's math (docs/DESIGN.md "Numerics"), written once against kernels/backend.h.
//
//   GatewayLayer: router + top-k, latent down-projection, shared experts, and after the
//                 combine: rounding, latent RMSNorm, up-projection, + shared.
//   ExpertShard:  the routed experts a rank hosts; one fp64 partial sum per received row.
// The step that joins them (route, dispatch, combine) is engine/step_engine.h, in the gateway
// and in process alike (engine/local_layer.h).
#pragma once

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kernels/backend.h"
#include "kernels/workspace.h"
#include "model/checkpoint.h"
#include "model/config.h"
#include "model/dispatch.h"

namespace moe {

class GatewayLayer {
 public:
  // Prepares the weights on the backend (uploads on GPU; in place on CPU).
  static absl::StatusOr<std::unique_ptr<GatewayLayer>> Create(const MoeConfig& config,
                                                              const GatewayLayerWeights& weights,
                                                              Backend* backend);

  int layer() const { return layer_; }
  const MoeConfig& config() const { return config_; }
  // Replaces the router's selection bias (Quantile Balancing overrides); size must be E.
  absl::Status SetRouterBias(std::vector<float> bias);
  const std::vector<float>& router_bias() const { return bias_; }

  // Router and expert input. x: [T, H] in the precision (bf16 values in bf16 mode).
  // routing: host ids/weights; expert_input: [T, expert_input_size] (latent for K3, x for K2).
  absl::Status Route(ConstMatrixView x, Precision p, Routing* routing, MatrixView expert_input,
                     std::vector<float>* router_scores = nullptr);
  // shared: [T, H] (left untouched when the layer has no shared experts).
  absl::Status SharedExperts(ConstMatrixView x, Precision p, MatrixView shared);
  // combined: fp64 sums [T, expert_input_size]; out: [T, H].
  absl::Status Finish(ConstPartialView combined, ConstMatrixView shared, Precision p,
                      MatrixView out);

 private:
  GatewayLayer(const MoeConfig& config, Backend* backend)
      : config_(config), backend_(backend), workspace_(backend) {}
  MoeConfig config_;
  Backend* backend_;
  int layer_ = 0;
  WeightMatrix router_;
  std::vector<float> bias_;
  WeightMatrix latent_down_, latent_up_;
  WeightVector latent_norm_;
  bool has_shared_ = false;
  MlpWeights shared_;
  Workspace workspace_;
  std::unique_ptr<DeviceBuffer> device_bias_;  // the bias in backend memory (device backends)
};

class ExpertShard {
 public:
  static absl::StatusOr<std::unique_ptr<ExpertShard>> Create(const MoeConfig& config,
                                                             const ExpertShardWeights& weights,
                                                             Backend* backend);

  int layer() const { return layer_; }
  const std::vector<int>& expert_ids() const { return expert_ids_; }
  int64_t weight_bytes() const { return weight_bytes_; }

  // x: [M, expert_input_size] received rows (bf16 or fp32 storage); rows: each row's local
  // experts and gates. partial: [M, expert_input_size] fp64 sums over the row's experts.
  absl::Status Compute(ActivationView x, const RowAssignments& rows, Precision p,
                       PartialView partial);

 private:
  ExpertShard(const MoeConfig& config, Backend* backend) : config_(config), backend_(backend) {}
  MoeConfig config_;
  Backend* backend_;
  int layer_ = 0;
  std::vector<int> expert_ids_;
  std::vector<MlpWeights> experts_;
  int64_t weight_bytes_ = 0;
};

}  // namespace moe
