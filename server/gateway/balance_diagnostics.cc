#include "server/gateway/balance_diagnostics.h"

#include <cstdio>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/log.h"
#include "core/status.h"

namespace moe {

BalanceDiagnostics::BalanceDiagnostics(StepEngine* engine, GatewayMetrics* metrics,
                                       const BalanceOptions& options)
    : engine_(engine), metrics_(metrics), options_(options) {
  auto& registry = *metrics_->registry();
  qb_predicted_ =
      &prometheus::BuildGauge()
           .Name("moe_qb_predicted_balancedness")
           .Help(
               "Expert balancedness (mean/max) the Quantile Balancing biases would give on the "
               "router-score window, by layer")
           .Register(registry);
  qb_observed_ =
      &prometheus::BuildGauge()
           .Name("moe_qb_observed_balancedness")
           .Help("Expert balancedness (mean/max) with the bias in use on the same window, by layer")
           .Register(registry);
  qb_bias_ =
      &prometheus::BuildGauge()
           .Name("moe_qb_bias")
           .Help("Selection bias Quantile Balancing would set (opt-in: --per-expert-metrics)")
           .Register(registry);
  qb_window_ = &prometheus::BuildGauge()
                    .Name("moe_qb_window_tokens")
                    .Help("Tokens in the Quantile Balancing router-score window, by layer")
                    .Register(registry);
  const int E = engine_->config().routing.num_experts;
  for (int layer : engine_->layers()) {
    checkpoint_bias_[layer] = engine_->RouterBias(layer);
    if (options_.window_tokens > 0)
      windows_[layer] = std::make_unique<RouterScoreWindow>(E, options_.window_tokens);
  }
  if (options_.window_tokens > 0) {
    metrics_->SetScoreSink([this](int layer, const std::vector<float>& scores, int64_t tokens) {
      AddScores(layer, scores, tokens);
    });
    refresher_ = std::thread([this] {
      std::unique_lock<std::mutex> lock(refresh_mu_);
      while (!refresh_cv_.wait_for(lock, absl::ToChronoMilliseconds(options_.refresh),
                                   [this] { return stop_; })) {
        lock.unlock();
        Refresh();
        lock.lock();
      }
    });
  }
}

BalanceDiagnostics::~BalanceDiagnostics() {
  metrics_->SetScoreSink(nullptr);
  {
    std::lock_guard<std::mutex> lock(refresh_mu_);
    stop_ = true;
  }
  refresh_cv_.notify_all();
  if (refresher_.joinable()) refresher_.join();
}

void BalanceDiagnostics::AddScores(int layer, const std::vector<float>& scores, int64_t tokens) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = windows_.find(layer);
  if (it != windows_.end())
    (void)it->second->Add(absl::MakeConstSpan(scores.data(), tokens * it->second->num_experts()));
}

absl::StatusOr<QuantileBalanceResult> BalanceDiagnostics::ComputeQuantileBalance(int layer) {
  std::vector<float> scores;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = windows_.find(layer);
    if (it == windows_.end())
      return absl::FailedPreconditionError("Quantile Balancing is off (--qb-window-tokens 0)");
    if (it->second->size() == 0)
      return absl::FailedPreconditionError(absl::StrCat("layer ", layer, " has no traffic yet"));
    scores = it->second->Snapshot();
  }
  return QuantileBalance(scores, engine_->RouterBias(layer), engine_->config().routing);
}

void BalanceDiagnostics::Refresh() {
  for (int layer : engine_->layers()) {
    auto qb = ComputeQuantileBalance(layer);
    if (!qb.ok()) continue;
    const prometheus::Labels labels = {{"layer", std::to_string(layer)}};
    qb_predicted_->Add(labels).Set(qb->predicted_balancedness);
    qb_observed_->Add(labels).Set(qb->observed_balancedness);
    qb_window_->Add(labels).Set(static_cast<double>(qb->tokens));
    if (options_.per_expert)
      for (size_t e = 0; e < qb->bias.size(); ++e)
        qb_bias_->Add({{"layer", std::to_string(layer)}, {"expert", std::to_string(e)}})
            .Set(qb->bias[e]);
  }
}

absl::StatusOr<moe::v1::LoadBalanceReport> BalanceDiagnostics::Report(int layer) {
  if (!engine_->Serves(layer))
    return absl::NotFoundError(absl::StrCat("layer ", layer, " is not served"));
  const LayerLoad load = metrics_->Load(layer);
  moe::v1::LoadBalanceReport report;
  report.set_layer(layer);
  report.set_window_steps(load.steps);
  report.set_window_tokens(load.tokens);
  report.mutable_rank_tokens()->Add(load.rank_tokens.begin(), load.rank_tokens.end());
  report.mutable_expert_tokens()->Add(load.expert_tokens.begin(), load.expert_tokens.end());
  report.set_rank_balancedness(load.rank_balancedness);
  report.set_expert_balancedness(load.expert_balancedness);
  const std::vector<float> bias = engine_->RouterBias(layer);
  report.mutable_current_bias()->Add(bias.begin(), bias.end());
  auto qb = ComputeQuantileBalance(layer);
  if (qb.ok()) {
    auto* q = report.mutable_quantile_balancing();
    q->mutable_bias()->Add(qb->bias.begin(), qb->bias.end());
    q->mutable_observed_counts()->Add(qb->observed_counts.begin(), qb->observed_counts.end());
    q->mutable_predicted_counts()->Add(qb->predicted_counts.begin(), qb->predicted_counts.end());
    q->set_observed_balancedness(qb->observed_balancedness);
    q->set_predicted_balancedness(qb->predicted_balancedness);
    q->set_tokens(qb->tokens);
  } else if (!absl::IsFailedPrecondition(qb.status())) {
    return qb.status();
  }
  return report;
}

absl::StatusOr<moe::v1::PlacementAdvice> BalanceDiagnostics::Advice(int layer,
                                                                    int redundant_experts) {
  if (layer >= 0 && !engine_->Serves(layer))
    return absl::NotFoundError(absl::StrCat("layer ", layer, " is not served"));
  if (redundant_experts < 0) return absl::InvalidArgumentError("redundant_experts must be >= 0");
  // One placement serves every layer: with layer < 0 the window loads of all are summed.
  std::vector<double> expert_load(engine_->config().routing.num_experts, 0.0);
  int64_t tokens = 0;
  for (int l : layer >= 0 ? std::vector<int>{layer} : engine_->layers()) {
    const LayerLoad load = metrics_->Load(l);
    tokens += load.tokens;
    for (size_t e = 0; e < expert_load.size() && e < load.expert_tokens.size(); ++e)
      expert_load[e] += static_cast<double>(load.expert_tokens[e]);
  }
  if (tokens == 0)
    return absl::FailedPreconditionError(
        layer >= 0 ? absl::StrCat("layer ", layer, " has no traffic yet") : "no traffic yet");
  const auto in_use = engine_->placement();
  const ExpertPlacement& current = in_use->placement;
  const int slots = engine_->config().routing.num_experts + redundant_experts;
  if (slots % current.num_ranks() != 0)
    return absl::InvalidArgumentError(
        absl::StrCat(slots, " expert slots (experts + redundant) do not divide evenly over ",
                     current.num_ranks(), " ranks"));
  ASSIGN_OR_RETURN(PlacementAdvice advice,
                   AdvisePlacement(expert_load, current.num_ranks(), slots, current));
  moe::v1::PlacementAdvice out;
  out.set_layer(layer);
  out.set_placement(PlacementFileText(advice));
  out.mutable_predicted_rank_load()->Add(advice.predicted_rank_load.begin(),
                                         advice.predicted_rank_load.end());
  out.set_predicted_balancedness(advice.predicted_balancedness);
  out.set_current_balancedness(advice.current_balancedness);
  return out;
}

absl::StatusOr<moe::v1::BiasOverride> BalanceDiagnostics::SetRouterBias(int layer,
                                                                        std::vector<float> bias,
                                                                        const std::string& source) {
  if (!options_.allow_bias_override)
    return absl::PermissionDeniedError(
        "router bias overrides are disabled (start moe-gateway with --allow-bias-override)");
  if (!engine_->Serves(layer))
    return absl::NotFoundError(absl::StrCat("layer ", layer, " is not served"));
  const bool restore = bias.empty();
  if (restore) bias = checkpoint_bias_[layer];
  for (float b : bias)
    if (!std::isfinite(b)) return absl::InvalidArgumentError("bias contains NaN or Inf");
  RETURN_IF_ERROR(engine_->SetRouterBias(layer, bias));
  // `source` is the caller's text: bounded, and escaped before it reaches the log (no forged
  // lines, no terminal control codes).
  const std::string said = absl::CHexEscape(source.substr(0, kMaxSourceBytes));
  moe::v1::BiasOverride record;
  record.set_layer(layer);
  record.set_source(restore ? absl::StrCat("restored checkpoint bias (", said, ")") : said);
  record.set_installed_at(absl::FormatTime(absl::RFC3339_sec, absl::Now(), absl::UTCTimeZone()));
  LogLine("moe-gateway: router bias of layer %d %s by '%s' at %s", layer,
          restore ? "restored" : "overridden", said.c_str(), record.installed_at().c_str());
  std::lock_guard<std::mutex> lock(mu_);
  overrides_.push_back(record);
  // Model info lists the history: the newest entries only, so it stays a small message.
  if (overrides_.size() > kMaxOverrideHistory)
    overrides_.erase(overrides_.begin(), overrides_.end() - kMaxOverrideHistory);
  // A new bias changes the routing: old windows no longer describe it.
  auto it = windows_.find(layer);
  if (it != windows_.end()) it->second->Clear();
  return record;
}

std::vector<moe::v1::BiasOverride> BalanceDiagnostics::overrides() const {
  std::lock_guard<std::mutex> lock(mu_);
  return overrides_;
}

}  // namespace moe
