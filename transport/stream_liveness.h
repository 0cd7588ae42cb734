// Liveness of one Exchange stream, on either side: a heartbeat out every `heartbeat`, and a
// watchdog that gives up on a peer that has been silent for `peer_timeout`.
//
// NOTES: a hung peer (SIGSTOP, a wedged host) keeps its TCP connection open, so a broken stream
// alone never reveals it. The heartbeat and the watchdog run on threads of their own: a Write to
// a peer that stopped reading can block (flow control) for as long as the peer is stuck, and the
// watchdog must still fire then (its callback cancels the stream, which unblocks the Write).
#pragma once

#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>

#include "absl/time/time.h"

namespace moe {

struct LivenessOptions {
  absl::Duration heartbeat = absl::Milliseconds(500);      // one out this often
  absl::Duration peer_timeout = absl::Milliseconds(3000);  // give up after this much silence
};

class StreamLiveness {
 public:
  // `send_heartbeat` writes one heartbeat if it can without waiting (it returns at once when
  // another write holds the stream: that write is proof of life too); `on_silent` runs once,
  // on the watchdog thread, when nothing was heard from the peer for `peer_timeout`. Both may
  // run until the destructor returns.
  StreamLiveness(const LivenessOptions& options, std::function<void()> send_heartbeat,
                 std::function<void()> on_silent);
  ~StreamLiveness();  // stops both threads (never calls on_silent afterwards)
  StreamLiveness(const StreamLiveness&) = delete;
  StreamLiveness& operator=(const StreamLiveness&) = delete;

  void Heard();         // a message arrived from the peer
  bool silent() const;  // on_silent has fired

 private:
  void HeartbeatLoop();
  void WatchdogLoop();

  const LivenessOptions options_;
  const std::function<void()> send_heartbeat_;
  const std::function<void()> on_silent_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  absl::Time last_heard_;
  bool stop_ = false;
  bool silent_ = false;
  std::thread heartbeat_thread_, watchdog_thread_;
};

}  // namespace moe
