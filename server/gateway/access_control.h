// Who may call what on the gateway. Three planes, each with its own secret:
//   control (RankControl, its own port): ranks, by mTLS client certificate naming the rank
//       identity and/or proof of the cluster token (security/rank_handshake.h, never the token
//       itself); a gateway refuses to start with neither unless told the network is trusted;
//   api (MoeService, the Open Inference Protocol over gRPC and HTTP): callers, by the API token
//       when one is set;
//   admin (MoeDiagnostics): operators, by the admin token when one is set (else the API's).
// Health is always open: probes carry no secrets. Every check reads only the call's metadata and
// its TLS peer, before any message (server/read_after_admission.h). Refusals are counted
// and logged (at most one line a second, so a scanner cannot flood the log).
#pragma once

#include <atomic>
#include <mutex>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "security/rank_handshake.h"
#include "server/control/cluster_control.h"

namespace moe {

class GatewayMetrics;

// The URI SAN scripts/make-certs.sh gives rank certificates only.
inline constexpr char kDefaultRankIdentity[] = "spiffe://moe-serve/rank";

struct AccessOptions {
  std::string cluster_token;  // "" = no token proof asked of ranks
  bool control_mtls = false;  // the control port requires CA-signed client certificates
  // Under mTLS, the URI SAN a client certificate must carry on the control port: other
  // certificates of the same CA (callers', the gateway's) are refused.
  std::string rank_identity = kDefaultRankIdentity;
  bool insecure_cluster = false;
  std::string api_token;
  std::string admin_token;
};

class AccessControl final : public RankAdmission {
 public:
  explicit AccessControl(AccessOptions options)
      : options_(std::move(options)), handshake_(options_.cluster_token) {}
  // Where refusals are counted; set before any call.
  void SetMetrics(GatewayMetrics* metrics) { metrics_ = metrics; }

  // FAILED_PRECONDITION when ranks would join unauthenticated without --insecure-cluster.
  static absl::Status CheckConfiguration(const AccessOptions& options);

  // The control port, every call: under mTLS the peer's certificate names the rank identity.
  grpc::Status RankPeer(const grpc::ServerContext& context, absl::string_view method) override;
  // RankControl/Register: RankPeer, then the registration proof in the metadata; the requested
  // rank (metadata moe-rank-id, covered by the proof) into `requested_rank`.
  grpc::Status RankRegistration(const grpc::ServerContext& context, int* requested_rank) override;
  // RankControl/Exchange: RankPeer, then the session in the metadata, claimed (single use); the
  // rank (metadata moe-rank-id) into `rank`, the session into `session`.
  grpc::Status RankExchange(const grpc::ServerContext& context, int* rank,
                            std::string* session) override;
  RankHandshake& handshake() override { return handshake_; }
  grpc::Status Caller(const grpc::ServerContext& context, absl::string_view method);
  // The same for the REST API: its Authorization header, and the peer for the log.
  absl::Status HttpCaller(absl::string_view authorization, absl::string_view peer,
                          absl::string_view method);
  // PERMISSION_DENIED (the caller may be a legitimate API user, just not an operator).
  grpc::Status Admin(const grpc::ServerContext& context, absl::string_view method);

  int64_t refusals() const { return refusals_.load(); }

 private:
  // The status a refused call gets: `status`, counted and logged (the service edge's form).
  grpc::Status Refuse(const grpc::ServerContext& context, absl::string_view plane,
                      absl::string_view method, const absl::Status& status);
  // Counts and logs a refusal of `peer` (rate-limited); returns `status`.
  absl::Status Refuse(absl::string_view peer, absl::string_view plane, absl::string_view method,
                      absl::Status status);

  const AccessOptions options_;
  GatewayMetrics* metrics_ = nullptr;
  RankHandshake handshake_;
  std::atomic<int64_t> refusals_{0};
  std::mutex log_mu_;
  absl::Time last_log_ = absl::InfinitePast();  // guarded by log_mu_
  int64_t unlogged_ = 0;                        // guarded by log_mu_
};

}  // namespace moe
