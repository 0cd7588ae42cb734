// Progress of long work measured in bytes (loading a rank's experts, a gateway's layers,
// writing a checkpoint): on a terminal a bar redrawn in place, otherwise a plain line every few
// seconds so that logs of a rank mapping 200+ GB show rate and ETA, never `\r` frames.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>

#include "absl/strings/string_view.h"

namespace moe {

class Progress {
 public:
  // `label` starts every line ("moe-rank 3: loading"). `enabled` false: silent.
  Progress(std::string label, int64_t total_bytes, bool enabled = true);
  // Replaces the estimate of the total (it may be refined as the work goes).
  void SetTotal(int64_t total_bytes) { total_ = total_bytes; }
  // `bytes` more are done; `stage` names where the work is ("layer 3/60").
  void Add(int64_t bytes, absl::string_view stage = "");
  // The last line: total bytes, time taken, mean rate.
  void Finish();
  double ratio() const;
  int64_t done() const { return done_; }
  // Called with ratio() whenever a line is due (and at Finish): a metrics gauge.
  std::function<void(double)> on_ratio;

  // For tests: lines every `interval` (terminal or not).
  void set_interval(std::chrono::milliseconds interval) { interval_ = interval; }
  void set_terminal(bool terminal) { terminal_ = terminal; }

 private:
  void Print(bool final);

  std::string label_;
  int64_t total_;
  int64_t done_ = 0;
  bool enabled_;
  bool terminal_;
  std::string stage_;
  std::chrono::milliseconds interval_;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
  std::chrono::steady_clock::time_point last_ = start_;
};

// "1.23 GB", "45.6 MB", "789 kB".
std::string HumanBytes(double bytes);

}  // namespace moe
