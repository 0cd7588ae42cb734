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
  if (gateway_) gateway_->Signal(SIGKILL);
  ranks_.clear();
  gateway_.reset();
  std::filesystem::remove_all(log_dir_);
}

std::string LocalCluster::target() const { return absl::StrCat("127.0.0.1:", port_); }
std::string LocalCluster::control_target() const {
  return absl::StrCat("127.0.0.1:", control_port_);
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
  argv.insert(argv.end(), options_.gateway_args.begin(), options_.gateway_args.end());
  gateway_ = std::make_unique<ChildProcess>(argv, log_dir_ + "/gateway.log");
  const std::string line = gateway_->WaitForLog("waiting for", timeout);
  if (line.empty())
    return absl::DeadlineExceededError(absl::StrCat("gateway did not start:\n", Logs()));
  // "moe-gateway: serving DIR on 127.0.0.1:PORT, ..."
  const size_t colon = line.find("127.0.0.1:");
  if (colon == std::string::npos ||
      !absl::SimpleAtoi(line.substr(colon + 10, line.find(',', colon) - colon - 10), &port_))
    return absl::InternalError(absl::StrCat("cannot parse the gateway port from: ", line));
  // "moe-gateway: control plane on 127.0.0.1:PORT (...)", logged before the line above.
  const std::string control = gateway_->WaitForLog("control plane on", timeout);
  const size_t control_at = control.find("127.0.0.1:");
  if (control_at == std::string::npos ||
      !absl::SimpleAtoi(
          control.substr(control_at + 10, control.find(' ', control_at) - control_at - 10),
          &control_port_))
    return absl::InternalError(absl::StrCat("cannot parse the control port from: ", control));
  auto metrics_port = [&](const ChildProcess& p, int* port) -> absl::Status {
    const std::string m = p.WaitForLog("metrics on", timeout);
    const size_t at = m.rfind(':');
    const size_t slash = m.find('/', at);
    if (at == std::string::npos || !absl::SimpleAtoi(m.substr(at + 1, slash - at - 1), port))
      return absl::InternalError(
          absl::StrCat("cannot parse a metrics port from: '", m, "'\n", Logs()));
    return absl::OkStatus();
  };
  if (options_.metrics) {
    if (absl::Status s = metrics_port(*gateway_, &gateway_metrics_port_); !s.ok()) return s;
  }
  for (int r = 0; r < options_.ranks; ++r) {
    std::vector<std::string> rank_argv = {BinaryPath("moe-rank"),
                                          "--gateway",
                                          control_target(),
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
  while (!Serving()) {
    if (absl::Now() > end)
      return absl::DeadlineExceededError(absl::StrCat("cluster not ready:\n", Logs()));
    if (!gateway_->running()) return absl::InternalError(absl::StrCat("gateway exited:\n", Logs()));
    absl::SleepFor(absl::Milliseconds(50));
  }
  // With redundant experts the gateway serves before every rank is up: a test starts with all.
  const std::string all_up = absl::StrCat("ready (", options_.ranks, " ranks)");
  if (gateway_->WaitForLog(all_up, std::max(end - absl::Now(), absl::Seconds(1))).empty())
    return absl::DeadlineExceededError(absl::StrCat("not every rank came up:\n", Logs()));
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
  if (gateway_) absl::StrAppend(&out, "--- gateway\n", gateway_->Log());
  for (const auto& exited : exited_ranks_)
    absl::StrAppend(&out, "--- an exited rank process\n", exited->Log());
  for (size_t r = 0; r < ranks_.size(); ++r)
    absl::StrAppend(&out, "--- rank ", r, "\n", ranks_[r]->Log());
  return out;
}

}  // namespace moe::testing
