// /metrics under idle connections: half-open sockets (connected, never sending a request) must
// not stall scrapes, and the server must close them instead of holding a worker for 30 s. And the
// gateway's load-balance window: a window of time, emptied on scrape once traffic stops.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "model/synthetic.h"
#include "prometheus/counter.h"
#include "server/metrics/exposer.h"
#include "server/metrics/gateway_metrics.h"

namespace moe {
namespace {

int Connect(int port, absl::Duration receive_timeout) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof address), 0);
  timeval tv{};
  tv.tv_sec = absl::ToInt64Seconds(receive_timeout);
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  return fd;
}

// One GET of `path`; the whole response, "" when none came within 10 s.
std::string Get(int port, const std::string& path) {
  const int fd = Connect(port, absl::Seconds(10));
  const std::string request = "GET " + path + " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
  EXPECT_EQ(send(fd, request.data(), request.size(), MSG_NOSIGNAL),
            static_cast<ssize_t>(request.size()));
  std::string response;
  char buffer[4096];
  for (ssize_t n; (n = recv(fd, buffer, sizeof buffer, 0)) > 0;) response.append(buffer, n);
  close(fd);
  return response;
}

std::string Scrape(int port) { return Get(port, "/metrics"); }

class MetricsServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    registry_ = std::make_shared<prometheus::Registry>();
    prometheus::BuildCounter()
        .Name("moe_test_total")
        .Help("test")
        .Register(*registry_)
        .Add({})
        .Increment(3);
    // One thread requested, as a rank asks for: the server keeps kMinThreads workers anyway.
    auto server = MetricsServer::Start(registry_, "127.0.0.1:0", 1);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
  }

  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<MetricsServer> server_;
};

// A scrape with `idle` half-open connections open; returns how long it took.
absl::Duration ScrapeBeside(int port, int idle) {
  std::vector<int> sockets;
  for (int i = 0; i < idle; ++i) sockets.push_back(Connect(port, absl::Seconds(10)));
  absl::SleepFor(absl::Milliseconds(100));  // accepted and handed to workers
  const absl::Time t0 = absl::Now();
  const std::string response = Scrape(port);
  const absl::Duration waited = absl::Now() - t0;
  EXPECT_NE(response.find("200 OK"), std::string::npos) << response;
  EXPECT_NE(response.find("moe_test_total 3"), std::string::npos) << response;
  for (int fd : sockets) close(fd);
  return waited;
}

TEST_F(MetricsServerTest, FewerHalfOpenConnectionsThanWorkersCostNothing) {
  // The case: one or two idle sockets stalled a rank's /metrics for ~30 s.
  EXPECT_LT(ScrapeBeside(server_->port(), MetricsServer::kMinThreads - 1), absl::Seconds(1));
}

TEST_F(MetricsServerTest, MoreHalfOpenConnectionsDelayAScrapeByTheirTimeoutsOnly) {
  // Twice as many as workers: two rounds of request timeouts at most, not 30 s each.
  const absl::Duration waited = ScrapeBeside(server_->port(), 2 * MetricsServer::kMinThreads);
  EXPECT_LT(waited, 2 * MetricsServer::kRequestTimeout + absl::Seconds(1.5)) << waited;
}

TEST_F(MetricsServerTest, TheServerClosesAConnectionThatSendsNoRequest) {
  const int fd = Connect(server_->port(), absl::Seconds(10));
  const absl::Time t0 = absl::Now();
  char byte;
  const ssize_t n = recv(fd, &byte, 1, 0);  // blocks until the server gives up on us
  const absl::Duration waited = absl::Now() - t0;
  close(fd);
  EXPECT_LE(n, 0) << "closed, nothing sent";
  EXPECT_LT(waited, MetricsServer::kRequestTimeout + absl::Seconds(1.5)) << waited;
  EXPECT_GT(waited, MetricsServer::kRequestTimeout / 2) << "not closed before its timeout";
}

TEST_F(MetricsServerTest, ProbesAnswerBesideTheMetrics) {
  const std::string health = Get(server_->port(), "/healthz");
  EXPECT_NE(health.find("HTTP/1.0 200"), std::string::npos) << health;
  std::string ready = Get(server_->port(), "/readyz");
  EXPECT_NE(ready.find("HTTP/1.0 200"), std::string::npos) << "ready until told otherwise";

  server_->SetReadiness([] { return std::string("2 of 4 ranks up"); });
  ready = Get(server_->port(), "/readyz");
  EXPECT_NE(ready.find("HTTP/1.0 503"), std::string::npos) << ready;
  EXPECT_NE(ready.find("not ready: 2 of 4 ranks up"), std::string::npos) << ready;
  EXPECT_NE(Get(server_->port(), "/healthz").find("HTTP/1.0 200"), std::string::npos)
      << "alive while not ready";
  server_->SetReadiness([] { return std::string(); });
  EXPECT_NE(Get(server_->port(), "/readyz").find("HTTP/1.0 200"), std::string::npos);

  const std::string metrics = Scrape(server_->port());
  EXPECT_NE(metrics.find("moe_test_total 3"), std::string::npos) << metrics;
  EXPECT_NE(metrics.find("process_resident_memory_bytes"), std::string::npos);
  // Exact paths only.
  EXPECT_EQ(Get(server_->port(), "/readyz/x").find("HTTP/1.0 200"), std::string::npos);
  EXPECT_EQ(Get(server_->port(), "/metricsx").find("HTTP/1.0 200"), std::string::npos);
}

// The value of `series` (full name and labels) in a scrape; -1 when it is missing.
double Sample(const std::string& scrape, const std::string& series) {
  const std::string line_start = "\n" + series + " ";
  const size_t at = scrape.find(line_start);
  return at == std::string::npos ? -1 : std::stod(scrape.substr(at + line_start.size()));
}

TEST(GatewayMetricsWindowTest, TheBalanceWindowEmptiesWhenTrafficStops) {
  auto config = SyntheticPreset("k3-mini");
  ASSERT_TRUE(config.ok());
  MetricsOptions options;
  options.window = absl::Milliseconds(400);
  GatewayMetrics metrics(*config, {1}, ExpertPlacement::Contiguous(config->routing.num_experts, 4),
                         options);
  ASSERT_TRUE(metrics.Serve("127.0.0.1:0").ok());
  StepStats step;
  step.layer = 1;
  step.tokens = 40;
  step.rank_rows = {40, 10, 10, 20};  // skewed: mean 20 over max 40
  step.rank_active_experts = {1, 1, 1, 1};
  step.rank_bytes_sent = step.rank_bytes_received = {0, 0, 0, 0};
  metrics.OnStep(step);
  metrics.OnStep(step);
  EXPECT_EQ(metrics.Load(1).steps, 2);
  EXPECT_EQ(metrics.Load(1).tokens, 80);
  EXPECT_DOUBLE_EQ(metrics.Load(1).rank_balancedness, 0.5);
  const std::string busy = Scrape(metrics.port());
  EXPECT_EQ(Sample(busy, "moe_load_window_tokens{layer=\"1\"}"), 80) << busy;
  EXPECT_DOUBLE_EQ(Sample(busy, "moe_load_balancedness{layer=\"1\"}"), 0.5);

  // No step since: a scrape after the window sees it empty (balanced, no tokens), not the last
  // busy window frozen; the load report agrees.
  absl::SleepFor(absl::Milliseconds(500));
  const std::string idle = Scrape(metrics.port());
  EXPECT_EQ(Sample(idle, "moe_load_window_tokens{layer=\"1\"}"), 0) << idle;
  EXPECT_DOUBLE_EQ(Sample(idle, "moe_load_balancedness{layer=\"1\"}"), 1.0);
  EXPECT_EQ(metrics.Load(1).steps, 0);
  EXPECT_EQ(metrics.Load(1).tokens, 0);

  // The step cap still bounds the window's memory.
  options.window = absl::Hours(1);
  options.window_steps = 3;
  GatewayMetrics capped(*config, {1}, ExpertPlacement::Contiguous(config->routing.num_experts, 4),
                        options);
  for (int i = 0; i < 5; ++i) capped.OnStep(step);
  EXPECT_EQ(capped.Load(1).steps, 3);
}

}  // namespace
}  // namespace moe
