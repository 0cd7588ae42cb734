#include "server/metrics/gateway_metrics.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "server/metrics/conventions.h"
#include "server/metrics/exposer.h"

namespace moe {
namespace {

const prometheus::Histogram::BucketBoundaries& LatencyBuckets() {
  static const prometheus::Histogram::BucketBoundaries b = {1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3,
                                                            1e-2, 2.5e-2, 5e-2, 0.1,  0.25,   0.5,
                                                            1.0,  2.5,    5.0,  10.0, 30.0};
  return b;
}

const prometheus::Histogram::BucketBoundaries& TokenBuckets() {
  static const prometheus::Histogram::BucketBoundaries b = {1,   2,   4,   8,    16,   32,   64,
                                                            128, 256, 512, 1024, 2048, 4096, 8192};
  return b;
}

double MeanOverMax(const std::vector<int64_t>& v) {
  if (v.empty()) return 1.0;
  const int64_t max = *std::max_element(v.begin(), v.end());
  if (max == 0) return 1.0;
  double sum = 0;
  for (int64_t x : v) sum += static_cast<double>(x);
  return sum / static_cast<double>(v.size()) / static_cast<double>(max);
}

}  // namespace

GatewayMetrics::GatewayMetrics(const MoeConfig& config, const std::vector<int>& layers,
                               const ExpertPlacement& placement, const MetricsOptions& options)
    : config_(config),
      options_(options),
      served_layers_(layers.begin(), layers.end()),
      registry_(std::make_shared<prometheus::Registry>()) {
  // Every family is a name and a help text in this registry.
  auto counter = [this](const char* name, const char* help) {
    return &prometheus::BuildCounter().Name(name).Help(help).Register(*registry_);
  };
  auto gauge = [this](const char* name, const char* help) {
    return &prometheus::BuildGauge().Name(name).Help(help).Register(*registry_);
  };
  auto histogram = [this](const char* name, const char* help) {
    return &prometheus::BuildHistogram().Name(name).Help(help).Register(*registry_);
  };
  requests_ = counter("moe_requests_total",
                      "Forward requests by layer and gRPC status code name (OK, UNAVAILABLE, ...)");
  request_seconds_ = histogram("moe_request_duration_seconds",
                               "Forward request latency inside the gateway, by layer");
  stage_seconds_ =
      histogram("moe_forward_stage_duration_seconds",
                "Time per forward stage: queue (per request), route, dispatch, expert_compute "
                "(ranks and exchange, overlapping the shared experts), finish, total (per step)");
  step_tokens_ = histogram("moe_step_tokens", "Tokens per step, by layer");
  steps_ = counter("moe_steps_total", "Steps run, by layer and result");
  rank_tokens_ =
      counter("moe_rank_tokens_total",
              "Token rows dispatched to each rank (a token counts once per rank), by layer");
  rank_active_experts_ = gauge("moe_rank_active_experts",
                               "Distinct local experts a rank used in the layer's last step");
  balancedness_ = gauge("moe_load_balancedness",
                        "Mean over max of tokens per rank over the window (--balance-window-s; 1 = "
                        "balanced, also when the window is empty), by layer");
  expert_balancedness_ = gauge("moe_expert_balancedness",
                               "Mean over max of tokens per expert over the window, by layer");
  window_tokens_ = gauge("moe_load_window_tokens",
                         "Tokens in the balancedness window, by layer (alerts need enough)");
  expert_tokens_ = counter("moe_expert_tokens_total",
                           "Token assignments per expert (opt-in: --per-expert-metrics)");
  rank_up_ = gauge("moe_rank_up", "1 while the rank's exchange is connected");
  rank_weight_bytes_ =
      gauge("moe_rank_weight_bytes",
            "Routed-expert weight bytes resident on each rank (all served layers)");
  // One name per direction, the same on the gateway and on the ranks.
  sent_bytes_ = counter("moe_transport_gateway_to_rank_bytes_total",
                        "Bytes the gateway put on the wire to each rank (rows, framing)");
  received_bytes_ = counter("moe_transport_rank_to_gateway_bytes_total",
                            "Bytes the gateway took off the wire from each rank (partial sums)");
  dropped_results_ = counter("moe_transport_dropped_results_total",
                             "Results a rank sent for steps the gateway did not await (given up "
                             "on, or never sent to it): dropped, never kept");
  auth_failures_ = counter("moe_auth_failures_total",
                           "Calls refused for a missing or wrong credential, by plane (control: "
                           "ranks, api: callers, admin: MoeDiagnostics)");
  for (const char* plane : {"control", "api", "admin"}) auth_failures_->Add({{"plane", plane}});
  experts_unavailable_ = &gauge("moe_experts_unavailable",
                                "Experts without a replica on a live rank (not ready while > 0)")
                              ->Add({});
  experts_unavailable_->Set(config.routing.num_experts);  // no rank has registered yet
  failovers_ = counter("moe_failovers_total",
                       "Steps sent again to live replicas after a rank went down, by layer");
  redispatched_rows_ =
      counter("moe_redispatched_rows_total",
              "Token rows of lost ranks re-dispatched to other replicas, by layer");
  placement_generation_ =
      &gauge("moe_placement_generation", "Expert placement in use: 1 at start, +1 per live change")
           ->Add({});
  expert_replicas_ =
      gauge("moe_expert_replicas", "Ranks hosting each routed expert in the placement in use");
  placement_changes_ =
      counter("moe_placement_changes_total", "Live re-placements (ApplyPlacement), by result");
  for (const char* result : {"ok", "failed"}) placement_changes_->Add({{"result", result}});
  placement_change_seconds_ =
      &histogram("moe_placement_change_duration_seconds",
                 "Live re-placement: from the request to the release of the old experts")
           ->Add({}, prometheus::Histogram::BucketBoundaries{0.01, 0.1, 1, 10, 60, 300, 1800});
  SetPlacement(1, placement);
  requests_in_flight_ =
      &gauge("moe_requests_in_flight", "Forward requests accepted and not yet answered")->Add({});
  queued_tokens_ =
      &gauge("moe_queue_tokens", "Tokens of accepted requests waiting for a step, all layers")
           ->Add({});
  stream_buffer_bytes_ = &gauge("moe_stream_buffer_bytes",
                                "Responses held for slow ForwardStream readers, all streams "
                                "(queued, and reserved for requests being computed)")
                              ->Add({});
  build_info_ = gauge("moe_build_info", "The build and backend of this process (value 1)");
  info_ = gauge("moe_model_info", "The served model (value 1)");
  info_
      ->Add({{"family", ModelFamilyName(config.family)},
             {"model_type", config.model_type},
             {"experts", L(config.routing.num_experts)},
             {"top_k", L(config.routing.top_k)},
             {"expert_format", WeightFormatName(config.expert_format)}})
      .Set(1);
  // Create the series up front so dashboards and alerts see zeros, not absences.
  for (int r = 0; r < placement.num_ranks(); ++r) {
    rank_up_->Add({{"rank", L(r)}}).Set(0);
    sent_bytes_->Add({{"rank", L(r)}});
    received_bytes_->Add({{"rank", L(r)}});
    dropped_results_->Add({{"rank", L(r)}});
  }
  for (int layer : layers) {
    windows_[layer];
    balancedness_->Add({{"layer", L(layer)}}).Set(1);
    expert_balancedness_->Add({{"layer", L(layer)}}).Set(1);
    window_tokens_->Add({{"layer", L(layer)}}).Set(0);
    for (int r = 0; r < placement.num_ranks(); ++r)
      rank_tokens_->Add({{"rank", L(r)}, {"layer", L(layer)}});
  }
}

// The server first: a scrape in progress reads the windows.
GatewayMetrics::~GatewayMetrics() { server_.reset(); }

absl::Status GatewayMetrics::Serve(const std::string& address) {
  ASSIGN_OR_RETURN(server_,
                   MetricsServer::Start(registry_, address, 2, [this] { RefreshWindows(); }));
  port_ = server_->port();
  return absl::OkStatus();
}

void GatewayMetrics::SetScoreSink(
    std::function<void(int, const std::vector<float>&, int64_t)> sink) {
  std::lock_guard<std::mutex> lock(mu_);
  score_sink_ = std::move(sink);
}

bool GatewayMetrics::WantsRouterScores() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<bool>(score_sink_);
}

void GatewayMetrics::OnRequest(int layer, int grpc_code, absl::Duration latency,
                               absl::Duration queue) {
  // The layer comes from the client: only served layers become label values, so no caller can
  // mint new series.
  if (served_layers_.count(layer) == 0) {
    requests_->Add({{"layer", "invalid"}, {"code", GrpcCodeName(grpc_code)}}).Increment();
    return;
  }
  requests_->Add({{"layer", L(layer)}, {"code", GrpcCodeName(grpc_code)}}).Increment();
  {
    std::lock_guard<std::mutex> lock(mu_);
    InferenceStats& stats = inference_[layer];
    if (grpc_code == 0) {
      ++stats.success_count;
      stats.success_time += latency;
      stats.queue_time += queue;
    } else {
      ++stats.fail_count;
      stats.fail_time += latency;
    }
    stats.last_request = absl::Now();
  }
  if (grpc_code == 0) {
    request_seconds_->Add({{"layer", L(layer)}}, LatencyBuckets())
        .Observe(absl::ToDoubleSeconds(latency));
    stage_seconds_->Add({{"layer", L(layer)}, {"stage", "queue"}}, LatencyBuckets())
        .Observe(absl::ToDoubleSeconds(queue));
  }
}

void GatewayMetrics::OnRankState(int rank, bool up) {
  rank_up_->Add({{"rank", L(rank)}}).Set(up ? 1 : 0);
}

void GatewayMetrics::SetRequestsInFlight(int64_t requests) {
  requests_in_flight_->Set(static_cast<double>(requests));
}

void GatewayMetrics::SetQueuedTokens(int64_t tokens) {
  queued_tokens_->Set(static_cast<double>(tokens));
}

void GatewayMetrics::SetStreamBufferBytes(int64_t bytes) {
  stream_buffer_bytes_->Set(static_cast<double>(bytes));
}

void GatewayMetrics::SetBuildInfo(const std::string& backend) {
  build_info_->Add(BuildInfoLabels(backend)).Set(1);
}

void GatewayMetrics::SetPlacement(uint64_t generation, const ExpertPlacement& placement) {
  placement_generation_->Set(static_cast<double>(generation));
  for (int e = 0; e < placement.num_experts; ++e)
    expert_replicas_->Add({{"expert", L(e)}})
        .Set(static_cast<double>(placement.replicas[e].size()));
}

void GatewayMetrics::OnPlacementChange(bool ok, absl::Duration took) {
  placement_changes_->Add({{"result", ok ? "ok" : "failed"}}).Increment();
  if (ok) placement_change_seconds_->Observe(absl::ToDoubleSeconds(took));
}

void GatewayMetrics::SetRankWeightBytes(int rank, int64_t bytes) {
  rank_weight_bytes_->Add({{"rank", L(rank)}}).Set(static_cast<double>(bytes));
}

void GatewayMetrics::SetExpertsUnavailable(int experts) { experts_unavailable_->Set(experts); }

void GatewayMetrics::OnAuthFailure(const std::string& plane) {
  auth_failures_->Add({{"plane", plane}}).Increment();
}

void GatewayMetrics::OnDroppedResult(int rank) {
  dropped_results_->Add({{"rank", L(rank)}}).Increment();
}

void GatewayMetrics::OnStep(const StepStats& s) {
  const std::string layer = L(s.layer);
  if (s.failovers > 0) {
    failovers_->Add({{"layer", layer}}).Increment(s.failovers);
    redispatched_rows_->Add({{"layer", layer}}).Increment(static_cast<double>(s.redispatched_rows));
  }
  steps_->Add({{"layer", layer}, {"result", s.ok ? "ok" : "error"}}).Increment();
  if (!s.ok) return;
  auto stage = [&](const char* name, absl::Duration d) {
    stage_seconds_->Add({{"layer", layer}, {"stage", name}}, LatencyBuckets())
        .Observe(absl::ToDoubleSeconds(d));
  };
  stage("route", s.route);
  stage("dispatch", s.dispatch);
  stage("expert_compute", s.expert_compute);
  stage("finish", s.finish);
  stage("total", s.total);
  step_tokens_->Add({{"layer", layer}}, TokenBuckets()).Observe(static_cast<double>(s.tokens));
  const int R = static_cast<int>(s.rank_rows.size());
  for (int r = 0; r < R; ++r) {
    const std::string rank = L(r);
    if (s.rank_rows[r] > 0)
      rank_tokens_->Add({{"rank", rank}, {"layer", layer}}).Increment(s.rank_rows[r]);
    rank_active_experts_->Add({{"rank", rank}, {"layer", layer}}).Set(s.rank_active_experts[r]);
    if (s.rank_bytes_sent[r] > 0)
      sent_bytes_->Add({{"rank", rank}}).Increment(s.rank_bytes_sent[r]);
    if (s.rank_bytes_received[r] > 0)
      received_bytes_->Add({{"rank", rank}}).Increment(s.rank_bytes_received[r]);
  }
  std::vector<int64_t> experts(config_.routing.num_experts, 0);
  if (s.routing != nullptr)
    for (int32_t e : s.routing->ids) experts[e]++;
  if (options_.per_expert) {
    for (int e = 0; e < config_.routing.num_experts; ++e)
      if (experts[e] > 0)
        expert_tokens_->Add({{"layer", layer}, {"expert", L(e)}}).Increment(experts[e]);
  }

  std::function<void(int, const std::vector<float>&, int64_t)> sink;
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++inference_[s.layer].steps;
    LayerWindow& w = windows_[s.layer];
    if (w.rank_sum.empty()) w.rank_sum.assign(R, 0);
    if (w.expert_sum.empty()) w.expert_sum.assign(experts.size(), 0);
    w.step_times.push_back(absl::Now());
    w.rank_steps.push_back(s.rank_rows);
    w.expert_steps.push_back(experts);
    w.step_tokens.push_back(s.tokens);
    for (int r = 0; r < R; ++r) w.rank_sum[r] += s.rank_rows[r];
    for (size_t e = 0; e < experts.size(); ++e) w.expert_sum[e] += experts[e];
    w.token_sum += s.tokens;
    Expire(w, w.step_times.back());
    SetWindowGauges(s.layer, w);
    sink = score_sink_;
  }
  if (sink && s.router_scores != nullptr) sink(s.layer, *s.router_scores, s.tokens);
}

void GatewayMetrics::Expire(LayerWindow& w, absl::Time now) const {
  const absl::Time oldest = now - options_.window;
  while (!w.step_times.empty() && (static_cast<int>(w.step_times.size()) > options_.window_steps ||
                                   w.step_times.front() < oldest)) {
    for (size_t r = 0; r < w.rank_sum.size(); ++r) w.rank_sum[r] -= w.rank_steps.front()[r];
    for (size_t e = 0; e < w.expert_sum.size(); ++e) w.expert_sum[e] -= w.expert_steps.front()[e];
    w.token_sum -= w.step_tokens.front();
    w.step_times.pop_front();
    w.rank_steps.pop_front();
    w.expert_steps.pop_front();
    w.step_tokens.pop_front();
  }
}

void GatewayMetrics::SetWindowGauges(int layer, const LayerWindow& w) {
  balancedness_->Add({{"layer", L(layer)}}).Set(MeanOverMax(w.rank_sum));
  expert_balancedness_->Add({{"layer", L(layer)}}).Set(MeanOverMax(w.expert_sum));
  window_tokens_->Add({{"layer", L(layer)}}).Set(static_cast<double>(w.token_sum));
}

void GatewayMetrics::RefreshWindows() {
  std::lock_guard<std::mutex> lock(mu_);
  const absl::Time now = absl::Now();
  for (auto& [layer, w] : windows_) {
    Expire(w, now);
    SetWindowGauges(layer, w);
  }
}

InferenceStats GatewayMetrics::Inference(int layer) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = inference_.find(layer);
  return it == inference_.end() ? InferenceStats() : it->second;
}

LayerLoad GatewayMetrics::Load(int layer) const {
  std::lock_guard<std::mutex> lock(mu_);
  LayerLoad out;
  auto it = windows_.find(layer);
  if (it == windows_.end()) return out;
  LayerWindow& w = it->second;
  Expire(w, absl::Now());
  out.steps = static_cast<int64_t>(w.rank_steps.size());
  out.tokens = w.token_sum;
  out.rank_tokens = w.rank_sum;
  out.expert_tokens = w.expert_sum;
  out.rank_balancedness = MeanOverMax(w.rank_sum);
  out.expert_balancedness = MeanOverMax(w.expert_sum);
  return out;
}

}  // namespace moe
