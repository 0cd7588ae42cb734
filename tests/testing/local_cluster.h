// Gateways and N ranks as real processes on loopback, for integration tests (one gateway unless
// ClusterOptions::gateways says more: then every rank serves all of them).
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
  std::vector<std::string> gateway_args;  // extra flags (every gateway)
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
  int gateways = 1;
  // The rank binary: moe-rank, or moe-rank-faults for rank_args with fault injection.
  std::string rank_binary = "moe-rank";
};

class LocalCluster {
 public:
  explicit LocalCluster(const ClusterOptions& options);
  ~LocalCluster();

  // Starts everything and waits until every gateway reports SERVING.
  absl::Status Start(absl::Duration timeout = absl::Seconds(60));
  // Gateway 0's, unless another is named.
  int port(int gateway = 0) const { return gateways_[gateway].port; }
  int control_port(int gateway = 0) const { return gateways_[gateway].control_port; }
  std::string target(int gateway = 0) const;
  std::string control_target(int gateway = 0) const;
  // Every gateway's public address, comma separated (what a failover client takes).
  std::string targets() const;
  const std::string& token_file() const { return token_file_; }
  const std::string& dir() const { return log_dir_; }  // removed with the cluster
  moe::v1::MoeService::Stub& stub() { return *stub_; }
  ChildProcess& gateway(int i = 0) { return *gateways_[i].process; }
  // Kills gateway i if it still runs and starts it again on the same ports.
  void RestartGateway(int i);
  ChildProcess& rank(int i) { return *ranks_[i]; }
  // Kills rank process i if it still runs and starts it again with the same flags (a rank
  // that comes back); its log goes on in a new file.
  void RestartRank(int i);
  // grpc.health.v1 status of gateway 0: true when SERVING.
  bool Serving();
  // /metrics ports (options.metrics): a gateway's, and rank i's.
  int gateway_metrics_port(int gateway = 0) const { return gateways_[gateway].metrics_port; }
  int rank_metrics_port(int i) const { return rank_metrics_ports_[i]; }
  std::string Logs() const;

 private:
  struct Gateway {
    std::unique_ptr<ChildProcess> process;
    std::vector<std::string> argv;
    int port = 0, control_port = 0, metrics_port = 0;
    int starts = 0;
  };
  // Starts gateways_[i] (ports from its argv) and reads its ports from its log.
  absl::Status StartGateway(int i, absl::Duration timeout);

  ClusterOptions options_;
  std::string log_dir_;
  std::vector<Gateway> gateways_;
  std::vector<std::unique_ptr<ChildProcess>> ranks_;
  std::vector<std::vector<std::string>> rank_argv_;
  // Their logs stay in Logs().
  std::vector<std::unique_ptr<ChildProcess>> exited_ranks_, exited_gateways_;
  std::string token_file_;
  std::vector<int> rank_metrics_ports_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<moe::v1::MoeService::Stub> stub_;
};

}  // namespace moe::testing
