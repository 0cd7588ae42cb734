#include "server/metrics/rank_metrics.h"

#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "server/metrics/conventions.h"
#include "server/metrics/exposer.h"

namespace moe {

RankMetrics::RankMetrics() : registry_(std::make_shared<prometheus::Registry>()) {
  using prometheus::BuildCounter;
  using prometheus::BuildGauge;
  using prometheus::BuildHistogram;
  steps_ = &BuildCounter()
                .Name("moe_rank_steps_total")
                .Help("Steps this rank computed, by layer")
                .Register(*registry_);
  rows_ = &BuildCounter()
               .Name("moe_rank_received_tokens_total")
               .Help("Token rows this rank received, by layer")
               .Register(*registry_);
  compute_seconds_ = &BuildHistogram()
                          .Name("moe_rank_compute_duration_seconds")
                          .Help("Grouped expert computation time per step, by layer")
                          .Register(*registry_);
  active_experts_ = &BuildGauge()
                         .Name("moe_rank_step_active_experts")
                         .Help("Distinct local experts used in the layer's last step")
                         .Register(*registry_);
  weight_bytes_ = &BuildGauge()
                       .Name("moe_rank_weight_bytes")
                       .Help("Routed-expert weight bytes resident")
                       .Register(*registry_);
  // One name per direction, the same on the gateway and on the ranks.
  received_bytes_ = &BuildCounter()
                         .Name("moe_transport_gateway_to_rank_bytes_total")
                         .Help("Bytes of expert-input rows this rank received from the gateway")
                         .Register(*registry_);
  sent_bytes_ = &BuildCounter()
                     .Name("moe_transport_rank_to_gateway_bytes_total")
                     .Help("Bytes of partial sums this rank sent to the gateway")
                     .Register(*registry_);
  build_info_ = &BuildGauge()
                     .Name("moe_build_info")
                     .Help("The build and backend of this process (value 1)")
                     .Register(*registry_);
  load_progress_ = &BuildGauge()
                        .Name("moe_load_progress_ratio")
                        .Help(
                            "Fraction of the rank's expert bytes mapped and prefaulted by the "
                            "load in progress (1 once loaded)")
                        .Register(*registry_);
  rank_id_ = &BuildGauge()
                  .Name("moe_rank_id")
                  .Help("This process's rank id (-1 before registering)")
                  .Register(*registry_);
  // Until the rank registers it has no id: these four are unlabeled, then move to rank="R".
  AddRankSeries({});
  rank_id_series_->Set(-1);
}

// The server first: a probe in progress reads the registration.
RankMetrics::~RankMetrics() { server_.reset(); }

void RankMetrics::SetBuildInfo(const std::string& backend) {
  build_info_->Add(BuildInfoLabels(backend)).Set(1);
}

absl::Status RankMetrics::Serve(const std::string& address) {
  ASSIGN_OR_RETURN(server_, MetricsServer::Start(registry_, address, 1));
  port_ = server_->port();
  // Ready once registered with a gateway (and loaded: registration follows the load).
  server_->SetReadiness([this]() -> std::string {
    std::lock_guard<std::mutex> lock(mu_);
    return rank_label_.empty() ? "not registered with a gateway yet" : "";
  });
  return absl::OkStatus();
}

void RankMetrics::AddRankSeries(const prometheus::Labels& labels) {
  rank_id_series_ = &rank_id_->Add(labels);
  load_progress_series_ = &load_progress_->Add(labels);
  load_progress_series_->Set(load_ratio_);
  weight_bytes_series_ = &weight_bytes_->Add(labels);
  received_bytes_series_ = &received_bytes_->Add(labels);
  sent_bytes_series_ = &sent_bytes_->Add(labels);
}

void RankMetrics::OnRegistered(int rank, int64_t weight_bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  const std::string label = std::to_string(rank);
  if (label != rank_label_) {
    // A new identity (first registration, or registered again as another id): the series
    // move to its label; the transport counters start again from zero under it.
    rank_id_->Remove(rank_id_series_);
    load_progress_->Remove(load_progress_series_);
    weight_bytes_->Remove(weight_bytes_series_);
    received_bytes_->Remove(received_bytes_series_);
    sent_bytes_->Remove(sent_bytes_series_);
    rank_label_ = label;
    AddRankSeries({{"rank", rank_label_}});
  }
  rank_id_series_->Set(rank);
  weight_bytes_series_->Set(static_cast<double>(weight_bytes));
}

void RankMetrics::OnLoadProgress(double ratio) {
  std::lock_guard<std::mutex> lock(mu_);
  load_ratio_ = ratio;
  load_progress_series_->Set(ratio);
}

void RankMetrics::OnRankStep(const RankStepReport& r) {
  static const prometheus::Histogram::BucketBoundaries kBuckets = {
      1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2,
      5e-2, 0.1,    0.25, 0.5,  1.0,    2.5,  5.0,  10.0};
  std::lock_guard<std::mutex> lock(mu_);  // the label can change only between steps
  const prometheus::Labels layer = {{"layer", std::to_string(r.layer)}, {"rank", rank_label_}};
  steps_->Add(layer).Increment();
  rows_->Add(layer).Increment(static_cast<double>(r.rows));
  compute_seconds_->Add(layer, kBuckets).Observe(absl::ToDoubleSeconds(r.compute));
  active_experts_->Add(layer).Set(r.active_experts);
  received_bytes_series_->Increment(static_cast<double>(r.bytes_received));
  sent_bytes_series_->Increment(static_cast<double>(r.bytes_sent));
}

}  // namespace moe
