// Prometheus metrics of an expert rank (served on its own /metrics endpoint). Every moe_* series
// carries the rank's id as `rank` once it has registered (so a plain static scrape of several
// ranks keeps them apart); process_* and moe_build_info describe the process.
#pragma once

#include <memory>
#include <mutex>
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
  void OnLoadProgress(double ratio) override;

 private:
  void AddRankSeries(const prometheus::Labels& labels);

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
  prometheus::Family<prometheus::Gauge>* load_progress_;
  std::mutex mu_;
  double load_ratio_ = 0;   // guarded by mu_
  std::string rank_label_;  // "" until registered; guarded by mu_
  // The series labelled by the rank alone (guarded by mu_ when they move).
  prometheus::Gauge* rank_id_series_ = nullptr;
  prometheus::Gauge* load_progress_series_ = nullptr;
  prometheus::Gauge* weight_bytes_series_ = nullptr;
  prometheus::Counter* received_bytes_series_ = nullptr;
  prometheus::Counter* sent_bytes_series_ = nullptr;
};

}  // namespace moe
