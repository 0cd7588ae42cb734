// Load-balance diagnostics of the gateway: Quantile Balancing over a sliding window of live
// router scores per layer, placement advice (DeepSeek EPLB) from the observed expert load,
// and the audited router-bias override.
//
// The score windows cost layers x window x experts x 4 bytes (K3, 92 layers, 1024 tokens:
// 338 MB); --qb-window-tokens 0 turns Quantile Balancing off.
#pragma once

#include <atomic>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/step_engine.h"
#include "model/load_balance.h"
#include "moe/v1/moe.pb.h"
#include "prometheus/gauge.h"
#include "server/metrics/gateway_metrics.h"

namespace moe {

struct BalanceOptions {
  int64_t window_tokens = 1024;                // router-score window per layer (0 = off)
  absl::Duration refresh = absl::Seconds(10);  // how often the QB gauges are recomputed
  bool allow_bias_override = false;            // SetRouterBias permitted
  bool per_expert = false;                     // per-expert QB bias gauges
};

class BalanceDiagnostics {
 public:
  static constexpr size_t kMaxOverrideHistory = 64;  // newest SetRouterBias records kept
  static constexpr size_t kMaxSourceBytes = 256;     // of a caller's `source` text
  BalanceDiagnostics(StepEngine* engine, GatewayMetrics* metrics, const BalanceOptions& options);
  ~BalanceDiagnostics();

  absl::StatusOr<moe::v1::LoadBalanceReport> Report(int layer);
  // EPLB advice from `layer`'s window of expert loads, or (layer < 0) from all served layers'
  // summed: one placement serves every layer.
  absl::StatusOr<moe::v1::PlacementAdvice> Advice(int layer, int redundant_experts);
  // PERMISSION_DENIED unless allowed; empty bias restores the checkpoint's.
  absl::StatusOr<moe::v1::BiasOverride> SetRouterBias(int layer, std::vector<float> bias,
                                                      const std::string& source);
  std::vector<moe::v1::BiasOverride> overrides() const;

  // Recomputes the QB gauges of every layer now (also done every `refresh`).
  void Refresh();

 private:
  void AddScores(int layer, const std::vector<float>& scores, int64_t tokens);
  absl::StatusOr<QuantileBalanceResult> ComputeQuantileBalance(int layer);

  StepEngine* engine_;
  GatewayMetrics* metrics_;
  BalanceOptions options_;
  std::map<int, std::vector<float>> checkpoint_bias_;

  mutable std::mutex mu_;  // windows and overrides
  std::map<int, std::unique_ptr<RouterScoreWindow>> windows_;
  std::vector<moe::v1::BiasOverride> overrides_;

  prometheus::Family<prometheus::Gauge>* qb_predicted_;
  prometheus::Family<prometheus::Gauge>* qb_observed_;
  prometheus::Family<prometheus::Gauge>* qb_bias_;
  prometheus::Family<prometheus::Gauge>* qb_window_;

  std::mutex refresh_mu_;
  std::condition_variable refresh_cv_;
  bool stop_ = false;
  std::thread refresher_;
};

}  // namespace moe
