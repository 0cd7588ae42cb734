// Prometheus metrics of an expert rank (served on its own /metrics endpoint).
#pragma once

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "prometheus/counter.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "server/metrics/exposer.h"
#include "server/rank/rank_worker.h"

namespace moe {

class RankMetrics final : public RankStepObserver {
 public:
  RankMetrics();
  ~RankMetrics() override;
  absl::Status Serve(const std::string& address);
  int port() const { return port_; }

  void OnRegistered(int rank, int64_t weight_bytes) override;
  // moe_build_info{version, commit, backend, kernels} = 1.
  void SetBuildInfo(const std::string& backend);
  void OnRankStep(const RankStepReport& report) override;

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<MetricsServer> server_;
  int port_ = 0;
  prometheus::Family<prometheus::Counter>* steps_;
  prometheus::Family<prometheus::Counter>* rows_;
  prometheus::Family<prometheus::Histogram>* compute_seconds_;
  prometheus::Family<prometheus::Gauge>* active_experts_;
  prometheus::Family<prometheus::Gauge>* weight_bytes_;
  prometheus::Family<prometheus::Counter>* received_bytes_;
  prometheus::Family<prometheus::Counter>* sent_bytes_;
  prometheus::Family<prometheus::Gauge>* rank_id_;
  prometheus::Family<prometheus::Gauge>* build_info_;
};

}  // namespace moe
