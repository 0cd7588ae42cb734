// A TCP relay on loopback that records what clients send: what a recording proxy on a rank's
// network path would see, for tests that replay it.
#pragma once

#include <atomic>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/time.h"

namespace moe::testing {

class RecordingRelay {
 public:
  // Listens on 127.0.0.1 (a free port) and forwards each connection to 127.0.0.1:target_port.
  explicit RecordingRelay(int target_port);
  ~RecordingRelay();  // closes every connection
  RecordingRelay(const RecordingRelay&) = delete;
  RecordingRelay& operator=(const RecordingRelay&) = delete;

  int port() const { return port_; }
  // The client-to-server bytes of each connection so far, in the order they were accepted.
  std::vector<std::string> client_bytes() const;

 private:
  void AcceptLoop();
  void Relay(int client, size_t index);

  const int target_port_;
  int listener_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  mutable std::mutex mu_;
  std::vector<std::string> recorded_;  // guarded by mu_
  std::vector<int> sockets_;           // guarded by mu_: shut down on destruction
  std::vector<std::thread> threads_;   // guarded by mu_
  std::thread acceptor_;
};

// Connects to 127.0.0.1:port, sends `bytes`, and returns what the server sent back within
// `listen_for` (or until it closed the connection).
std::string Replay(int port, const std::string& bytes, absl::Duration listen_for);

}  // namespace moe::testing
