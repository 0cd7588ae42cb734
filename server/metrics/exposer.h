// The HTTP endpoint of every process: a prometheus-cpp registry on /metrics, and the probes
// /healthz (200 while the process answers) and /readyz (200 when its owner says ready, else 503
// with the reason), on civetweb (one place for its exceptions and its shutdown).
#pragma once

#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "prometheus/registry.h"

namespace moe {

class CivetListener;

// A running endpoint; destruction returns within milliseconds (CivetListener).
class MetricsServer {
 public:
  // Listens on `address` ("HOST:PORT", port 0 = any free one) and serves `registry` and the
  // process_* metrics; `before_scrape`, if set, runs before each collection of the registry
  // (gauges computed from time windows). /readyz says ready until SetReadiness.
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(
      const std::shared_ptr<prometheus::Registry>& registry, const std::string& address,
      int threads, std::function<void()> before_scrape = nullptr);
  ~MetricsServer();
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  int port() const;
  // What /readyz asks: "" when ready, else why not. Returns only when no probe is still running
  // the previous function (so an owner can clear it, nullptr, before it goes away).
  void SetReadiness(std::function<std::string()> not_ready);

  // Workers at least, and how long a connection may take to send its request. civetweb runs a
  // thread per connection: fewer idle connections than workers cost nothing, N of them delay a
  // scrape by at most ceil(N / workers) request timeouts.
  static constexpr int kMinThreads = 8;
  static constexpr absl::Duration kRequestTimeout = absl::Seconds(2);

 private:
  class MetricsHandler;
  class HealthHandler;
  MetricsServer();

  std::unique_ptr<MetricsHandler> metrics_;
  std::unique_ptr<HealthHandler> healthz_, readyz_;
  std::mutex readiness_mu_;
  std::function<std::string()> not_ready_;   // guarded by readiness_mu_
  std::unique_ptr<CivetListener> listener_;  // last: stopped before the handlers go
};

}  // namespace moe
