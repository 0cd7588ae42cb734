#include "server/metrics/exposer.h"

#include <algorithm>
#include <mutex>
#include <string>
#include <vector>

#include "CivetServer.h"
#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "prometheus/text_serializer.h"
#include "server/http/civet_listener.h"
#include "server/metrics/conventions.h"

namespace moe {

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
    RespondHttp(conn, 200, "text/plain; version=0.0.4; charset=utf-8",
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
      RespondHttp(conn, 200, "text/plain; charset=utf-8", "ok\n");
      return true;
    }
    std::string not_ready;
    {
      std::lock_guard<std::mutex> lock(server_->readiness_mu_);
      not_ready = server_->not_ready_ ? server_->not_ready_() : std::string();
    }
    if (not_ready.empty())
      RespondHttp(conn, 200, "text/plain; charset=utf-8", "ready\n");
    else
      RespondHttp(conn, 503, "text/plain; charset=utf-8",
                  absl::StrCat("not ready: ", not_ready, "\n"));
    return true;
  }

 private:
  MetricsServer* server_;
  bool readiness_;
};

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(
    const std::shared_ptr<prometheus::Registry>& registry, const std::string& address, int threads,
    std::function<void()> before_scrape) {
  // civetweb gives each connection a worker thread until its request is read; with its
  // default 30 s request timeout a few half-open connections (or a slow scanner) would hold
  // every worker and stall scrapes and liveness probes. A scrape's request arrives at once.
  const std::vector<std::string> options = {
      "listening_ports",    address,
      "num_threads",        std::to_string(std::max(threads, kMinThreads)),
      "request_timeout_ms", std::to_string(absl::ToInt64Milliseconds(kRequestTimeout))};
  ASSIGN_OR_RETURN(std::unique_ptr<CivetListener> listener,
                   CivetListener::Start(options, address, "metrics"));
  auto server = std::unique_ptr<MetricsServer>(new MetricsServer());
  server->metrics_ = std::make_unique<MetricsHandler>(registry, std::move(before_scrape));
  server->healthz_ = std::make_unique<HealthHandler>(server.get(), /*readiness=*/false);
  server->readyz_ = std::make_unique<HealthHandler>(server.get(), /*readiness=*/true);
  // Exact paths ("$"): civetweb matches handler URIs as prefixes otherwise.
  listener->server().addHandler("/metrics$", server->metrics_.get());
  listener->server().addHandler("/healthz$", server->healthz_.get());
  listener->server().addHandler("/readyz$", server->readyz_.get());
  server->listener_ = std::move(listener);
  return server;
}

MetricsServer::MetricsServer() = default;

void MetricsServer::SetReadiness(std::function<std::string()> not_ready) {
  std::lock_guard<std::mutex> lock(readiness_mu_);
  not_ready_ = std::move(not_ready);
}

MetricsServer::~MetricsServer() = default;

int MetricsServer::port() const { return listener_->port(); }

}  // namespace moe
