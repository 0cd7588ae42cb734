// Serving a prometheus-cpp registry on /metrics (one place for the exposer's exceptions and its
// shutdown).
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "prometheus/exposer.h"
#include "prometheus/registry.h"

namespace moe {

// A running /metrics endpoint. Destruction returns within milliseconds: civetweb's listener
// thread polls with a 2 s quantum and checks its stop flag only between polls, so the
// destructor connects to the port while the exposer stops (which wakes the poll) instead of
// making every process exit wait for up to 2 s.
class MetricsServer {
 public:
  // Listens on `address` ("HOST:PORT", port 0 = any free one) and serves `registry` and the
  // process_* metrics; `before_scrape`, if set, runs before each collection of the registry
  // (gauges computed from time windows).
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(
      const std::shared_ptr<prometheus::Registry>& registry, const std::string& address,
      int threads, std::function<void()> before_scrape = nullptr);
  ~MetricsServer();
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  int port() const { return port_; }

  // Workers at least, and how long a connection may take to send its request. civetweb runs a
  // thread per connection: fewer idle connections than workers cost nothing, N of them delay a
  // scrape by at most ceil(N / workers) request timeouts.
  static constexpr int kMinThreads = 8;
  static constexpr absl::Duration kRequestTimeout = absl::Seconds(2);

 private:
  MetricsServer(std::unique_ptr<prometheus::Exposer> exposer, std::string wake_host, int port);

  std::unique_ptr<prometheus::Exposer> exposer_;
  std::shared_ptr<prometheus::Collectable> process_;  // process_* (the exposer holds it weakly)
  std::shared_ptr<prometheus::Collectable> refreshed_;  // the registry behind before_scrape
  const std::string wake_host_;  // where the destructor connects: the bound address, or loopback
  const int port_;
};

}  // namespace moe
