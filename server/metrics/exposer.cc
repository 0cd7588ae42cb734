#include "server/metrics/exposer.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "CivetServer.h"
#include "prometheus/text_serializer.h"
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

void Respond(mg_connection* conn, int code, const char* reason, const char* content_type,
             const std::string& body) {
  mg_printf(conn,
            "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\n"
            "Connection: close\r\n\r\n",
            code, reason, content_type, body.size());
  mg_write(conn, body.data(), body.size());
}

}  // namespace

// GET /metrics: the registry (after `before_scrape`) and the process_* families, as text.
class MetricsServer::MetricsHandler final : public CivetHandler {
 public:
  MetricsHandler(std::shared_ptr<prometheus::Registry> registry,
                 std::function<void()> before_scrape)
      : registry_(std::move(registry)),
        before_scrape_(std::move(before_scrape)),
        process_(ProcessCollector()) {}
  bool handleGet(CivetServer*, mg_connection* conn) override {
    if (before_scrape_) before_scrape_();
    std::vector<prometheus::MetricFamily> families = registry_->Collect();
    for (auto& family : process_->Collect()) families.push_back(std::move(family));
    Respond(conn, 200, "OK", "text/plain; version=0.0.4; charset=utf-8",
            prometheus::TextSerializer().Serialize(families));
    return true;
  }

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  std::function<void()> before_scrape_;
  std::shared_ptr<prometheus::Collectable> process_;
};

// GET /healthz (the process answers) and /readyz (the owner's readiness).
class MetricsServer::HealthHandler final : public CivetHandler {
 public:
  HealthHandler(MetricsServer* server, bool readiness) : server_(server), readiness_(readiness) {}
  bool handleGet(CivetServer*, mg_connection* conn) override {
    if (!readiness_) {
      Respond(conn, 200, "OK", "text/plain; charset=utf-8", "ok\n");
      return true;
    }
    std::string not_ready;
    {
      std::lock_guard<std::mutex> lock(server_->readiness_mu_);
      not_ready = server_->not_ready_ ? server_->not_ready_() : std::string();
    }
    if (not_ready.empty())
      Respond(conn, 200, "OK", "text/plain; charset=utf-8", "ready\n");
    else
      Respond(conn, 503, "Service Unavailable", "text/plain; charset=utf-8",
              absl::StrCat("not ready: ", not_ready, "\n"));
    return true;
  }

 private:
  MetricsServer* server_;
  bool readiness_;
};

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(
    const std::shared_ptr<prometheus::Registry>& registry, const std::string& address,
    int threads, std::function<void()> before_scrape) {
  // civetweb gives each connection a worker thread until its request is read; with its
  // default 30 s request timeout a few half-open connections (or a slow scanner) would hold
  // every worker and stall scrapes and liveness probes. A scrape's request arrives at once.
  const std::vector<std::string> options = {
      "listening_ports",    address,
      "num_threads",        std::to_string(std::max(threads, kMinThreads)),
      "request_timeout_ms", std::to_string(absl::ToInt64Milliseconds(kRequestTimeout))};
  std::unique_ptr<CivetServer> civet;
  try {
    civet = std::make_unique<CivetServer>(options);
  } catch (const std::exception& e) {  // civetweb reports bind failures by throwing
    return absl::UnavailableError(
        absl::StrCat("cannot serve metrics on ", address, ": ", e.what()));
  }
  const std::vector<int> ports = civet->getListeningPorts();
  const int port = ports.empty() ? 0 : ports.front();
  auto server = std::unique_ptr<MetricsServer>(new MetricsServer(WakeHost(address), port));
  server->metrics_ = std::make_unique<MetricsHandler>(registry, std::move(before_scrape));
  server->healthz_ = std::make_unique<HealthHandler>(server.get(), /*readiness=*/false);
  server->readyz_ = std::make_unique<HealthHandler>(server.get(), /*readiness=*/true);
  // Exact paths ("$"): civetweb matches handler URIs as prefixes otherwise.
  civet->addHandler("/metrics$", server->metrics_.get());
  civet->addHandler("/healthz$", server->healthz_.get());
  civet->addHandler("/readyz$", server->readyz_.get());
  server->civet_ = std::move(civet);
  return server;
}

MetricsServer::MetricsServer(std::string wake_host, int port)
    : wake_host_(std::move(wake_host)), port_(port) {}

void MetricsServer::SetReadiness(std::function<std::string()> not_ready) {
  std::lock_guard<std::mutex> lock(readiness_mu_);
  not_ready_ = std::move(not_ready);
}

MetricsServer::~MetricsServer() {
  std::atomic<bool> stopped{false};
  std::thread waker([this, &stopped] {
    while (!stopped.load()) {
      Poke(wake_host_, port_);
      absl::SleepFor(absl::Milliseconds(20));
    }
  });
  civet_.reset();
  stopped = true;
  waker.join();
}

}  // namespace moe
