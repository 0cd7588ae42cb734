// Who may call what on the gateway. Three planes, each with its own secret:
//   control (RankControl, its own port): ranks, by mTLS client certificate and/or the cluster
//       token; a gateway refuses to start with neither unless told the network is trusted;
//   api (MoeService): callers, by the API token when one is set;
//   admin (MoeDiagnostics): operators, by the admin token when one is set (else the API's).
// Health is always open: probes carry no secrets. Refusals are counted and logged (at most
// one line a second, so a scanner cannot flood the log).
#pragma once

#include <atomic>
#include <mutex>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"

namespace moe {

class GatewayMetrics;

struct AccessOptions {
  std::string cluster_token;  // "" = no token check on the control plane
  bool control_mtls = false;  // the control port requires CA-signed client certificates
  bool insecure_cluster = false;
  std::string api_token;
  std::string admin_token;
};

class AccessControl {
 public:
  AccessControl(AccessOptions options, GatewayMetrics* metrics)
      : options_(std::move(options)), metrics_(metrics) {}

  // FAILED_PRECONDITION when ranks would join unauthenticated without --insecure-cluster.
  static absl::Status CheckConfiguration(const AccessOptions& options);

  grpc::Status Rank(const grpc::ServerContext& context, absl::string_view method);
  grpc::Status Caller(const grpc::ServerContext& context, absl::string_view method);
  // PERMISSION_DENIED (the caller may be a legitimate API user, just not an operator).
  grpc::Status Admin(const grpc::ServerContext& context, absl::string_view method);

  int64_t refusals() const { return refusals_.load(); }

 private:
  grpc::Status Refuse(const grpc::ServerContext& context, absl::string_view plane,
                      absl::string_view method, grpc::Status status);

  const AccessOptions options_;
  GatewayMetrics* const metrics_;
  std::atomic<int64_t> refusals_{0};
  std::mutex log_mu_;
  absl::Time last_log_ = absl::InfinitePast();  // guarded by log_mu_
  int64_t unlogged_ = 0;                        // guarded by log_mu_
};

}  // namespace moe
