// /metrics under idle connections: half-open sockets (connected, never sending a request) must
// not stall scrapes, and the server must close them instead of holding a worker for 30 s.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "prometheus/counter.h"
#include "server/metrics/exposer.h"

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

// One GET /metrics; the whole response, "" when none came within 10 s.
std::string Scrape(int port) {
  const int fd = Connect(port, absl::Seconds(10));
  const std::string request = "GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
  EXPECT_EQ(send(fd, request.data(), request.size(), MSG_NOSIGNAL),
            static_cast<ssize_t>(request.size()));
  std::string response;
  char buffer[4096];
  for (ssize_t n; (n = recv(fd, buffer, sizeof buffer, 0)) > 0;) response.append(buffer, n);
  close(fd);
  return response;
}

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

}  // namespace
}  // namespace moe
