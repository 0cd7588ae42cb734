// --auto-rebalance: applies the EPLB placement advice by itself when the ranks' load stays
// unbalanced. Every `interval` it reads the worst rank balancedness over the served layers'
// windows; after `checks` readings in a row below `threshold` it asks for the advice (all
// layers' loads summed, `redundant` extra replicas) and applies it live when it predicts at least
// `min_gain` more balancedness, at most once per `min_gap`. Every decision is logged; skipped
// ones at most once per `min_gap`.
#pragma once

#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "moe/v1/moe.pb.h"

namespace moe {

struct AutoRebalanceOptions {
  bool enabled = false;
  double threshold = 0.7;  // rank balancedness (mean / max) below which to act
  int redundant = -1;      // extra replicas; -1: the fewest >= ranks that divide evenly
  absl::Duration interval = absl::Seconds(60);
  int checks = 3;  // readings in a row below the threshold
  absl::Duration min_gap = absl::Minutes(10);
  double min_gain = 0.05;
};

class AutoRebalancer {
 public:
  struct Hooks {
    std::function<double()> balancedness;  // worst over the layers with traffic (1: none)
    std::function<absl::StatusOr<moe::v1::PlacementAdvice>(int redundant)> advise;
    std::function<absl::Status(const std::string& placement)> apply;
  };
  AutoRebalancer(const AutoRebalanceOptions& options, Hooks hooks);
  ~AutoRebalancer();

  // One reading (the thread calls it every interval; tests call it directly, with an interval
  // that keeps the thread away). Returns whether a placement was applied.
  bool Check();

 private:
  void Log(const std::string& message);

  const AutoRebalanceOptions options_;
  const Hooks hooks_;
  int low_readings_ = 0;
  absl::Time last_change_ = absl::InfinitePast();
  absl::Time last_skip_log_ = absl::InfinitePast();
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;  // guarded by mu_
  std::thread thread_;
};

}  // namespace moe
