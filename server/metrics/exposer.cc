#include "server/metrics/exposer.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <exception>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "server/metrics/conventions.h"

namespace moe {
namespace {

// The host part of "HOST:PORT" / "[V6]:PORT", as a connectable address (wildcards -> loopback).
std::string WakeHost(const std::string& address) {
  std::string host = address.substr(0, address.rfind(':'));
  if (absl::StartsWith(host, "[") && absl::EndsWith(host, "]"))
    host = host.substr(1, host.size() - 2);
  if (host.empty() || host == "0.0.0.0") return "127.0.0.1";
  if (host == "::") return "::1";
  return host;
}

// One TCP connection attempt to host:port, closed at once (a numeric host; others are skipped).
void Poke(const std::string& host, int port) {
  sockaddr_storage storage{};
  socklen_t length = 0;
  auto* v4 = reinterpret_cast<sockaddr_in*>(&storage);
  auto* v6 = reinterpret_cast<sockaddr_in6*>(&storage);
  if (inet_pton(AF_INET, host.c_str(), &v4->sin_addr) == 1) {
    v4->sin_family = AF_INET;
    v4->sin_port = htons(static_cast<uint16_t>(port));
    length = sizeof *v4;
  } else if (inet_pton(AF_INET6, host.c_str(), &v6->sin6_addr) == 1) {
    v6->sin6_family = AF_INET6;
    v6->sin6_port = htons(static_cast<uint16_t>(port));
    length = sizeof *v6;
  } else {
    return;  // a host name: the exposer then stops at its own pace
  }
  const int fd = socket(storage.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return;
  (void)connect(fd, reinterpret_cast<sockaddr*>(&storage), length);
  close(fd);
}

// A registry whose owner updates some gauges right before each scrape.
class RefreshedRegistry final : public prometheus::Collectable {
 public:
  RefreshedRegistry(std::shared_ptr<prometheus::Registry> registry, std::function<void()> refresh)
      : registry_(std::move(registry)), refresh_(std::move(refresh)) {}
  std::vector<prometheus::MetricFamily> Collect() const override {
    refresh_();
    return registry_->Collect();
  }

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  std::function<void()> refresh_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(
    const std::shared_ptr<prometheus::Registry>& registry, const std::string& address,
    int threads, std::function<void()> before_scrape) {
  std::unique_ptr<prometheus::Exposer> exposer;
  // civetweb gives each connection a worker thread until its request is read; with its
  // default 30 s request timeout a few half-open connections (or a slow scanner) would hold
  // every worker and stall scrapes and liveness probes. A scrape's request arrives at once.
  const std::vector<std::string> options = {
      "listening_ports",    address,
      "num_threads",        std::to_string(std::max(threads, kMinThreads)),
      "request_timeout_ms", std::to_string(absl::ToInt64Milliseconds(kRequestTimeout))};
  try {
    exposer = std::make_unique<prometheus::Exposer>(options);
  } catch (const std::exception& e) {  // civetweb reports bind failures by throwing
    return absl::UnavailableError(
        absl::StrCat("cannot serve metrics on ", address, ": ", e.what()));
  }
  std::shared_ptr<prometheus::Collectable> refreshed;
  if (before_scrape) {
    refreshed = std::make_shared<RefreshedRegistry>(registry, std::move(before_scrape));
    exposer->RegisterCollectable(refreshed);
  } else {
    exposer->RegisterCollectable(registry);
  }
  auto process = ProcessCollector();
  exposer->RegisterCollectable(process);
  const auto ports = exposer->GetListeningPorts();
  const int port = ports.empty() ? 0 : ports.front();
  auto server = std::unique_ptr<MetricsServer>(
      new MetricsServer(std::move(exposer), WakeHost(address), port));
  server->process_ = std::move(process);
  server->refreshed_ = std::move(refreshed);
  return server;
}

MetricsServer::MetricsServer(std::unique_ptr<prometheus::Exposer> exposer, std::string wake_host,
                             int port)
    : exposer_(std::move(exposer)), wake_host_(std::move(wake_host)), port_(port) {}

MetricsServer::~MetricsServer() {
  std::atomic<bool> stopped{false};
  std::thread waker([this, &stopped] {
    while (!stopped.load()) {
      Poke(wake_host_, port_);
      absl::SleepFor(absl::Milliseconds(20));
    }
  });
  exposer_.reset();
  stopped = true;
  waker.join();
}

}  // namespace moe
