#include "server/gateway/auto_rebalancer.h"

#include <cstdio>

#include "absl/strings/str_format.h"
#include "core/log.h"

namespace moe {

AutoRebalancer::AutoRebalancer(const AutoRebalanceOptions& options, Hooks hooks)
    : options_(options), hooks_(std::move(hooks)) {
  thread_ = std::thread([this] {
    std::unique_lock<std::mutex> lock(mu_);
    while (!cv_.wait_for(lock, absl::ToChronoMilliseconds(options_.interval),
                         [this] { return stop_; })) {
      lock.unlock();
      Check();
      lock.lock();
    }
  });
}

AutoRebalancer::~AutoRebalancer() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    cv_.notify_all();
  }
  thread_.join();
}

void AutoRebalancer::Log(const std::string& message) {
  LogLine("moe-gateway: auto-rebalance: %s", message.c_str());
}

bool AutoRebalancer::Check() {
  const double balance = hooks_.balancedness();
  if (balance >= options_.threshold) {
    low_readings_ = 0;
    return false;
  }
  if (++low_readings_ < options_.checks) return false;
  const absl::Time now = absl::Now();
  if (now - last_change_ < options_.min_gap) return false;  // the window still holds old steps
  const bool log_skips = now - last_skip_log_ >= options_.min_gap;
  absl::StatusOr<moe::v1::PlacementAdvice> advice = hooks_.advise(options_.redundant);
  if (!advice.ok()) {
    if (log_skips) Log(absl::StrFormat("no advice: %s", advice.status().message()));
    last_skip_log_ = log_skips ? now : last_skip_log_;
    return false;
  }
  if (advice->predicted_balancedness() < advice->current_balancedness() + options_.min_gain) {
    if (log_skips)
      Log(absl::StrFormat(
          "rank balancedness %.3f below %.2f, but the advice predicts only %.3f (from %.3f): kept",
          balance, options_.threshold, advice->predicted_balancedness(),
          advice->current_balancedness()));
    last_skip_log_ = log_skips ? now : last_skip_log_;
    return false;
  }
  Log(absl::StrFormat(
      "rank balancedness %.3f below %.2f for %d readings; applying the EPLB advice (predicted "
      "%.3f)",
      balance, options_.threshold, low_readings_, advice->predicted_balancedness()));
  low_readings_ = 0;
  last_change_ = now;
  const absl::Status applied = hooks_.apply(advice->placement());
  if (!applied.ok()) {
    Log(absl::StrFormat("the change failed: %s", applied.message()));
    return false;
  }
  return true;
}

}  // namespace moe
