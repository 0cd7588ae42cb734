#include "tests/testing/local_cluster.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <fstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"

namespace moe::testing {
namespace {
std::atomic<int> g_cluster_counter{0};
}

LocalCluster::LocalCluster(const ClusterOptions& options) : options_(options) {
  log_dir_ =
      absl::StrCat(::testing::TempDir(), "/moe_cluster_", getpid(), "_", g_cluster_counter++);
  std::filesystem::create_directories(log_dir_);
}

LocalCluster::~LocalCluster() {
  for (auto& r : ranks_) r->Signal(SIGKILL);
  for (auto& g : gateways_)
    if (g.process) g.process->Signal(SIGKILL);
  ranks_.clear();
  gateways_.clear();
  std::filesystem::remove_all(log_dir_);
}

std::string LocalCluster::target(int gateway) const {
  return absl::StrCat("127.0.0.1:", port(gateway));
}
std::string LocalCluster::control_target(int gateway) const {
  return absl::StrCat("127.0.0.1:", control_port(gateway));
}
std::string LocalCluster::targets() const {
  std::string out;
  for (size_t i = 0; i < gateways_.size(); ++i)
    absl::StrAppend(&out, i == 0 ? "" : ",", target(static_cast<int>(i)));
  return out;
}

absl::Status LocalCluster::StartGateway(int i, absl::Duration timeout) {
  Gateway& g = gateways_[i];
  g.process = std::make_unique<ChildProcess>(
      g.argv, absl::StrCat(log_dir_, "/gateway", i == 0 ? "" : absl::StrCat(i),
                           g.starts == 0 ? "" : absl::StrCat(".", g.starts), ".log"));
  ++g.starts;
  const std::string line = g.process->WaitForLog("waiting for", timeout);
  if (line.empty())
    return absl::DeadlineExceededError(absl::StrCat("gateway did not start:\n", Logs()));
  // "moe-gateway: serving DIR on 127.0.0.1:PORT, ..."
  const size_t colon = line.find("127.0.0.1:");
  if (colon == std::string::npos ||
      !absl::SimpleAtoi(line.substr(colon + 10, line.find(',', colon) - colon - 10), &g.port))
    return absl::InternalError(absl::StrCat("cannot parse the gateway port from: ", line));
  // "moe-gateway: control plane on 127.0.0.1:PORT (...)", logged before the line above.
  const std::string control = g.process->WaitForLog("control plane on", timeout);
  const size_t control_at = control.find("127.0.0.1:");
  if (control_at == std::string::npos ||
      !absl::SimpleAtoi(
          control.substr(control_at + 10, control.find(' ', control_at) - control_at - 10),
          &g.control_port))
    return absl::InternalError(absl::StrCat("cannot parse the control port from: ", control));
  if (options_.metrics) {
    const std::string m = g.process->WaitForLog("metrics on", timeout);
    const size_t at = m.rfind(':');
    const size_t slash = m.find('/', at);
    if (at == std::string::npos ||
        !absl::SimpleAtoi(m.substr(at + 1, slash - at - 1), &g.metrics_port))
      return absl::InternalError(
          absl::StrCat("cannot parse a metrics port from: '", m, "'\n", Logs()));
  }
  // Later starts take the same ports (a restarted gateway is found where it was).
  for (size_t a = 0; a + 1 < g.argv.size(); ++a) {
    if (g.argv[a] == "--port") g.argv[a + 1] = absl::StrCat(g.port);
    if (g.argv[a] == "--control-port") g.argv[a + 1] = absl::StrCat(g.control_port);
    if (g.argv[a] == "--metrics-port") g.argv[a + 1] = absl::StrCat(g.metrics_port);
  }
  return absl::OkStatus();
}

void LocalCluster::RestartGateway(int i) {
  Gateway& g = gateways_[i];
  g.process->Signal(SIGKILL);
  g.process->Wait(absl::Seconds(10));
  exited_gateways_.push_back(std::move(g.process));
  ASSERT_TRUE(StartGateway(i, absl::Seconds(30)).ok()) << Logs();
}

absl::Status LocalCluster::Start(absl::Duration timeout) {
  std::vector<std::string> argv = {BinaryPath("moe-gateway"),
                                   "--checkpoint",
                                   options_.checkpoint,
                                   "--ranks",
                                   absl::StrCat(options_.ranks),
                                   "--port",
                                   "0",
                                   "--host",
                                   "127.0.0.1",
                                   "--threads",
                                   absl::StrCat(options_.threads)};
  if (options_.metrics)
    argv.insert(argv.end(), {"--metrics-port", "0", "--metrics-host", "127.0.0.1"});
  std::vector<std::string> auth;
  if (options_.insecure_cluster) argv.push_back("--insecure-cluster");
  if (options_.cluster_token) {
    token_file_ = log_dir_ + "/cluster-token";
    std::ofstream(token_file_) << absl::StrCat("test-token-", getpid(), "-", g_cluster_counter++)
                               << "\n";
    auth = {"--cluster-token-file", token_file_};
    argv.insert(argv.end(), auth.begin(), auth.end());
  }
  argv.insert(argv.end(), {"--control-port", "0"});
  argv.insert(argv.end(), options_.gateway_args.begin(), options_.gateway_args.end());
  gateways_.resize(std::max(options_.gateways, 1));
  std::string control_targets;
  for (size_t i = 0; i < gateways_.size(); ++i) {
    gateways_[i].argv = argv;
    if (absl::Status s = StartGateway(static_cast<int>(i), timeout); !s.ok()) return s;
    absl::StrAppend(&control_targets, i == 0 ? "" : ",", control_target(static_cast<int>(i)));
  }
  auto metrics_port = [&](const ChildProcess& p, int* port) -> absl::Status {
    const std::string m = p.WaitForLog("metrics on", timeout);
    const size_t at = m.rfind(':');
    const size_t slash = m.find('/', at);
    if (at == std::string::npos || !absl::SimpleAtoi(m.substr(at + 1, slash - at - 1), port))
      return absl::InternalError(
          absl::StrCat("cannot parse a metrics port from: '", m, "'\n", Logs()));
    return absl::OkStatus();
  };
  for (int r = 0; r < options_.ranks; ++r) {
    std::vector<std::string> rank_argv = {BinaryPath(options_.rank_binary),
                                          "--gateway",
                                          control_targets,
                                          "--rank",
                                          absl::StrCat(r),
                                          "--threads",
                                          absl::StrCat(options_.threads)};
    if (!options_.ranks_reconnect) rank_argv.push_back("--exit-on-disconnect");
    if (options_.metrics)
      rank_argv.insert(rank_argv.end(), {"--metrics-port", "0", "--metrics-host", "127.0.0.1"});
    rank_argv.insert(rank_argv.end(), auth.begin(), auth.end());
    rank_argv.insert(rank_argv.end(), options_.rank_args.begin(), options_.rank_args.end());
    ranks_.push_back(
        std::make_unique<ChildProcess>(rank_argv, absl::StrCat(log_dir_, "/rank", r, ".log")));
    rank_argv_.push_back(rank_argv);
  }
  if (options_.metrics) {
    rank_metrics_ports_.assign(options_.ranks, 0);
    for (int r = 0; r < options_.ranks; ++r)
      if (absl::Status s = metrics_port(*ranks_[r], &rank_metrics_ports_[r]); !s.ok()) return s;
  }
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(1 << 30);
  args.SetMaxSendMessageSize(1 << 30);
  AddTlsChannelArgs(options_.client_tls, &args);
  auto credentials = ChannelCredentials(options_.client_tls);
  if (!credentials.ok()) return credentials.status();
  channel_ = grpc::CreateCustomChannel(target(), *credentials, args);
  stub_ = moe::v1::MoeService::NewStub(channel_);
  const absl::Time end = absl::Now() + timeout;
  for (const Gateway& g : gateways_) {
    auto health = grpc::health::v1::Health::NewStub(
        g.port == port()
            ? channel_
            : grpc::CreateCustomChannel(absl::StrCat("127.0.0.1:", g.port), *credentials, args));
    for (;;) {
      grpc::ClientContext context;
      context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
      grpc::health::v1::HealthCheckResponse response;
      const grpc::Status s =
          health->Check(&context, grpc::health::v1::HealthCheckRequest(), &response);
      if (s.ok() && response.status() == grpc::health::v1::HealthCheckResponse::SERVING) break;
      if (absl::Now() > end)
        return absl::DeadlineExceededError(absl::StrCat("cluster not ready:\n", Logs()));
      if (!g.process->running())
        return absl::InternalError(absl::StrCat("gateway exited:\n", Logs()));
      absl::SleepFor(absl::Milliseconds(50));
    }
    // With redundant experts a gateway serves before every rank is up: a test starts with all.
    const std::string all_up =
        absl::StrCat("ready (", options_.ranks, options_.ranks == 1 ? " rank)" : " ranks)");
    if (g.process->WaitForLog(all_up, std::max(end - absl::Now(), absl::Seconds(1))).empty())
      return absl::DeadlineExceededError(absl::StrCat("not every rank came up:\n", Logs()));
  }
  return absl::OkStatus();
}

bool LocalCluster::Serving() {
  auto health = grpc::health::v1::Health::NewStub(channel_);
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
  grpc::health::v1::HealthCheckRequest request;
  grpc::health::v1::HealthCheckResponse response;
  const grpc::Status s = health->Check(&context, request, &response);
  return s.ok() && response.status() == grpc::health::v1::HealthCheckResponse::SERVING;
}

void LocalCluster::RestartRank(int i) {
  ranks_[i]->Signal(SIGKILL);
  ranks_[i]->Wait(absl::Seconds(10));
  exited_ranks_.push_back(std::move(ranks_[i]));
  ranks_[i] = std::make_unique<ChildProcess>(
      rank_argv_[i], absl::StrCat(log_dir_, "/rank", i, ".", exited_ranks_.size(), ".log"));
}

std::string LocalCluster::Logs() const {
  std::string out;
  for (const auto& exited : exited_gateways_)
    absl::StrAppend(&out, "--- an exited gateway process\n", exited->Log());
  for (size_t g = 0; g < gateways_.size(); ++g)
    if (gateways_[g].process)
      absl::StrAppend(&out, "--- gateway ", g, "\n", gateways_[g].process->Log());
  for (const auto& exited : exited_ranks_)
    absl::StrAppend(&out, "--- an exited rank process\n", exited->Log());
  for (size_t r = 0; r < ranks_.size(); ++r)
    absl::StrAppend(&out, "--- rank ", r, "\n", ranks_[r]->Log());
  return out;
}

}  // namespace moe::testing
