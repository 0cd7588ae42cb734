// A gateway and N ranks as real processes on loopback, for integration tests.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "moe/v1/moe.grpc.pb.h"
#include "security/credentials.h"
#include "tests/testing/child_process.h"

namespace moe::testing {

struct ClusterOptions {
  std::string checkpoint;
  int ranks = 2;
  std::vector<std::string> gateway_args;  // extra flags
  std::vector<std::string> rank_args;     // extra flags for every rank
  int threads = 1;                        // per process (tests share 2 cores)
  bool metrics = false;                   // serve /metrics on free ports (see metrics_port())
  // Ranks authenticate with a cluster token written for the run (token_file()), unless
  // insecure_cluster (then --insecure-cluster) or the test passes its own credentials.
  bool insecure_cluster = false;
  bool cluster_token = true;
  TlsFiles client_tls;  // the test's own channel (stub(), Serving()) to the public port
  // Ranks register again when their exchange ends (the default of moe-rank) instead of exiting
  // (--exit-on-disconnect, which most tests want: a lost rank stays lost).
  bool ranks_reconnect = false;
};

class LocalCluster {
 public:
  explicit LocalCluster(const ClusterOptions& options);
  ~LocalCluster();

  // Starts everything and waits until the gateway reports SERVING.
  absl::Status Start(absl::Duration timeout = absl::Seconds(60));
  int port() const { return port_; }
  int control_port() const { return control_port_; }
  std::string target() const;
  std::string control_target() const;
  const std::string& token_file() const { return token_file_; }
  const std::string& dir() const { return log_dir_; }  // removed with the cluster
  moe::v1::MoeService::Stub& stub() { return *stub_; }
  ChildProcess& gateway() { return *gateway_; }
  ChildProcess& rank(int i) { return *ranks_[i]; }
  // Kills rank process i if it still runs and starts it again with the same flags (a rank
  // that comes back); its log goes on in a new file.
  void RestartRank(int i);
  // grpc.health.v1 status of the gateway: true when SERVING.
  bool Serving();
  // /metrics ports (options.metrics): the gateway's, and rank i's.
  int gateway_metrics_port() const { return gateway_metrics_port_; }
  int rank_metrics_port(int i) const { return rank_metrics_ports_[i]; }
  std::string Logs() const;

 private:
  ClusterOptions options_;
  std::string log_dir_;
  std::unique_ptr<ChildProcess> gateway_;
  std::vector<std::unique_ptr<ChildProcess>> ranks_;
  std::vector<std::vector<std::string>> rank_argv_;
  std::vector<std::unique_ptr<ChildProcess>> exited_ranks_;  // their logs stay in Logs()
  int port_ = 0;
  int control_port_ = 0;
  std::string token_file_;
  int gateway_metrics_port_ = 0;
  std::vector<int> rank_metrics_ports_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<moe::v1::MoeService::Stub> stub_;
};

}  // namespace moe::testing
