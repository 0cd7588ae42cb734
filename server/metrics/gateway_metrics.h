// Prometheus metrics of the gateway: one object owns the registry and builds every family
// once (Triton style); the engine reports steps to it as a StepObserver.
//
// Names follow Prometheus conventions: `moe_` prefix, base units (seconds, bytes), counters
// end in `_total`. Per-expert series (E x layers of them: 896 x 92 for Kimi K3) are opt-in.
#pragma once

#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "engine/step_engine.h"
#include "model/dispatch.h"
#include "prometheus/counter.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "server/metrics/exposer.h"

namespace moe {

struct MetricsOptions {
  bool per_expert = false;  // moe_expert_tokens_total{layer, expert} and per-expert QB biases
  // The balancedness gauges and the load reports cover the steps of the last `window`, at most
  // `window_steps` of them: a window of time, so it empties when traffic stops instead of
  // freezing on the last busy minute.
  absl::Duration window = absl::Seconds(60);
  int window_steps = 1024;
};

// Token counts of one layer over the sliding window.
struct LayerLoad {
  int64_t steps = 0;
  int64_t tokens = 0;
  std::vector<int64_t> rank_tokens;    // token rows received per rank
  std::vector<int64_t> expert_tokens;  // token assignments per expert
  double rank_balancedness = 1.0;      // mean / max over ranks
  double expert_balancedness = 1.0;    // mean / max over experts
};

// A layer's requests since the start, as Triton's statistics extension reports them.
struct InferenceStats {
  int64_t success_count = 0, fail_count = 0;
  absl::Duration success_time, fail_time;  // end to end, summed
  absl::Duration queue_time;               // of the successful ones, until their first step
  int64_t steps = 0;                       // executions (several requests share one)
  absl::Time last_request = absl::UnixEpoch();
};

class GatewayMetrics final : public StepObserver {
 public:
  GatewayMetrics(const MoeConfig& config, const std::vector<int>& layers,
                 const ExpertPlacement& placement, const MetricsOptions& options);
  ~GatewayMetrics() override;

  // Serves /metrics on `address` ("0.0.0.0:9400"); port 0 picks a free one (see port()).
  absl::Status Serve(const std::string& address);
  int port() const { return port_; }
  // What the endpoint's /readyz asks (MetricsServer::SetReadiness); after Serve.
  void SetReadiness(std::function<std::string()> not_ready) {
    if (server_ != nullptr) server_->SetReadiness(std::move(not_ready));
  }
  std::shared_ptr<prometheus::Registry> registry() const { return registry_; }

  void OnStep(const StepStats& stats) override;
  bool WantsRouterScores() const override;
  void OnRequest(int layer, int grpc_code, absl::Duration latency, absl::Duration queue);
  void OnRankState(int rank, bool up);
  void SetRankWeightBytes(int rank, int64_t bytes);
  void SetExpertsUnavailable(int experts);
  void SetRequestsInFlight(int64_t requests);
  void SetQueuedTokens(int64_t tokens);
  void SetStreamBufferBytes(int64_t bytes);
  // moe_build_info{version, commit, backend, kernels} = 1, for the gateway's backend.
  void SetBuildInfo(const std::string& backend);
  // The placement serving now: its generation and each expert's replica count.
  void SetPlacement(uint64_t generation, const ExpertPlacement& placement);
  // A live re-placement ended (took: request to release, when it succeeded).
  void OnPlacementChange(bool ok, absl::Duration took);
  // A call refused by AccessControl; plane: "control", "api" or "admin".
  void OnAuthFailure(const std::string& plane);
  // A rank's result for a step the gateway no longer awaits (or never sent it), dropped.
  void OnDroppedResult(int rank);

  LayerLoad Load(int layer) const;
  // Zeros for a layer that is not served.
  InferenceStats Inference(int layer) const;

  // Optional consumer of every step's router scores (Quantile Balancing windows).
  void SetScoreSink(
      std::function<void(int layer, const std::vector<float>& scores, int64_t tokens)> sink);

 private:
  struct LayerWindow {
    std::deque<absl::Time> step_times;
    std::deque<std::vector<int64_t>> rank_steps;    // per step, per rank
    std::deque<std::vector<int64_t>> expert_steps;  // per step, per expert
    std::deque<int64_t> step_tokens;
    std::vector<int64_t> rank_sum, expert_sum;
    int64_t token_sum = 0;
  };
  // Drops the steps that left the window (mu_ held).
  void Expire(LayerWindow& w, absl::Time now) const;
  // Ages every layer's window and sets its gauges (before each scrape).
  void RefreshWindows();
  void SetWindowGauges(int layer, const LayerWindow& w);
  static std::string L(int v) { return std::to_string(v); }

  MoeConfig config_;
  MetricsOptions options_;
  const std::set<int> served_layers_;
  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<MetricsServer> server_;
  int port_ = 0;

  prometheus::Family<prometheus::Counter>* requests_;
  prometheus::Family<prometheus::Histogram>* stage_seconds_;
  prometheus::Family<prometheus::Histogram>* request_seconds_;
  prometheus::Family<prometheus::Histogram>* step_tokens_;
  prometheus::Family<prometheus::Counter>* steps_;
  prometheus::Family<prometheus::Counter>* rank_tokens_;
  prometheus::Family<prometheus::Gauge>* rank_active_experts_;
  prometheus::Family<prometheus::Gauge>* balancedness_;
  prometheus::Family<prometheus::Gauge>* expert_balancedness_;
  prometheus::Family<prometheus::Gauge>* window_tokens_;
  prometheus::Family<prometheus::Counter>* expert_tokens_;
  prometheus::Family<prometheus::Gauge>* rank_up_;
  prometheus::Family<prometheus::Gauge>* rank_weight_bytes_;
  prometheus::Family<prometheus::Counter>* sent_bytes_;
  prometheus::Family<prometheus::Counter>* received_bytes_;
  prometheus::Family<prometheus::Counter>* auth_failures_;
  prometheus::Family<prometheus::Counter>* dropped_results_;
  prometheus::Gauge* experts_unavailable_;
  prometheus::Family<prometheus::Counter>* failovers_;
  prometheus::Family<prometheus::Counter>* redispatched_rows_;
  prometheus::Family<prometheus::Gauge>* info_;
  prometheus::Gauge* placement_generation_;
  prometheus::Gauge* requests_in_flight_;
  prometheus::Gauge* queued_tokens_;
  prometheus::Gauge* stream_buffer_bytes_;
  prometheus::Family<prometheus::Gauge>* build_info_;
  prometheus::Family<prometheus::Gauge>* expert_replicas_;
  prometheus::Family<prometheus::Counter>* placement_changes_;
  prometheus::Histogram* placement_change_seconds_;

  mutable std::mutex mu_;
  mutable std::map<int, LayerWindow> windows_;  // aged on read too
  std::map<int, InferenceStats> inference_;     // served layers only
  std::function<void(int, const std::vector<float>&, int64_t)> score_sink_;
};

}  // namespace moe
