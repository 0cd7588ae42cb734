#include "transport/stream_liveness.h"

#include <algorithm>

#include "absl/time/clock.h"

namespace moe {

StreamLiveness::StreamLiveness(const LivenessOptions& options, std::function<void()> send_heartbeat,
                               std::function<void()> on_silent)
    : options_(options),
      send_heartbeat_(std::move(send_heartbeat)),
      on_silent_(std::move(on_silent)),
      last_heard_(absl::Now()) {
  heartbeat_thread_ = std::thread([this] { HeartbeatLoop(); });
  watchdog_thread_ = std::thread([this] { WatchdogLoop(); });
}

StreamLiveness::~StreamLiveness() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  heartbeat_thread_.join();
  watchdog_thread_.join();
}

void StreamLiveness::Heard() {
  std::lock_guard<std::mutex> lock(mu_);
  last_heard_ = absl::Now();
}

bool StreamLiveness::silent() const {
  std::lock_guard<std::mutex> lock(mu_);
  return silent_;
}

void StreamLiveness::HeartbeatLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  absl::Time due = absl::Now();
  while (!stop_ && !silent_) {
    const absl::Time now = absl::Now();
    if (now < due) {
      cv_.wait_for(lock, absl::ToChronoNanoseconds(due - now));
      continue;
    }
    due = now + options_.heartbeat;
    lock.unlock();
    send_heartbeat_();
    lock.lock();
  }
}

void StreamLiveness::WatchdogLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    const absl::Time deadline = last_heard_ + options_.peer_timeout;
    const absl::Time now = absl::Now();
    if (now < deadline) {
      // Wake at least every 100 ms: absl::Now() is the clock that matters, not the cv's.
      cv_.wait_for(lock,
                   absl::ToChronoNanoseconds(std::min(deadline - now, absl::Milliseconds(100))));
      continue;
    }
    silent_ = true;
    lock.unlock();
    cv_.notify_all();  // the heartbeat loop stops too
    on_silent_();
    return;
  }
}

}  // namespace moe
