#include "server/gateway/access_control.h"

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/log.h"
#include "security/tokens.h"
#include "server/grpc_status.h"
#include "server/metrics/gateway_metrics.h"

namespace moe {

absl::Status AccessControl::CheckConfiguration(const AccessOptions& options) {
  if (options.cluster_token.empty() && !options.control_mtls && !options.insecure_cluster)
    return absl::FailedPreconditionError(
        "ranks would register unauthenticated: give --cluster-token-file FILE (the ranks get the "
        "same file), or --tls-cert/--tls-key/--tls-ca (mTLS), or --insecure-cluster when only "
        "trusted processes can reach the control port");
  return absl::OkStatus();
}

grpc::Status AccessControl::RankPeer(const grpc::ServerContext& context, absl::string_view method) {
  if (!options_.control_mtls) return grpc::Status::OK;
  // The handshake already refused peers without a CA-signed certificate; checked again here so a
  // misconfigured server can never accept one.
  const std::shared_ptr<const grpc::AuthContext> auth = context.auth_context();
  if (auth == nullptr || !auth->IsPeerAuthenticated())
    return Refuse(context, "control", method,
                  absl::UnauthenticatedError("no verified client certificate"));
  for (const grpc::string_ref& uri : auth->FindPropertyValues(GRPC_PEER_URI_PROPERTY_NAME))
    if (absl::string_view(uri.data(), uri.size()) == options_.rank_identity)
      return grpc::Status::OK;
  return Refuse(context, "control", method,
                absl::PermissionDeniedError(
                    absl::StrCat("the client certificate is not a rank's: it carries no URI SAN ",
                                 options_.rank_identity, " (--rank-identity)")));
}

namespace {

// The rank id in metadata moe-rank-id: -1 (any) or a rank number.
bool ParseRankId(const grpc::ServerContext& context, int* rank) {
  const std::string value = MetadataValue(context, kRankIdKey);
  return absl::SimpleAtoi(value, rank) && *rank >= -1 && *rank < (1 << 20) &&
         value == absl::StrCat(*rank);
}

}  // namespace

grpc::Status AccessControl::RankRegistration(const grpc::ServerContext& context,
                                             int* requested_rank) {
  if (grpc::Status s = RankPeer(context, "Register"); !s.ok()) return s;
  if (!ParseRankId(context, requested_rank))
    return Refuse(context, "control", "Register",
                  absl::UnauthenticatedError(
                      absl::StrCat("no ", kRankIdKey, " metadata (moe-rank sends it)")));
  const absl::Status s = handshake_.CheckRegistration(MetadataValue(context, kRankNonceKey),
                                                      MetadataValue(context, kRankProofKey),
                                                      *requested_rank, absl::Now());
  return s.ok() ? grpc::Status::OK : Refuse(context, "control", "Register", s);
}

grpc::Status AccessControl::RankExchange(const grpc::ServerContext& context, int* rank,
                                         std::string* session) {
  if (grpc::Status s = RankPeer(context, "Exchange"); !s.ok()) return s;
  *session = MetadataValue(context, kRankSessionKey);
  if (!ParseRankId(context, rank) || *rank < 0)
    return Refuse(context, "control", "Exchange",
                  absl::UnauthenticatedError(
                      absl::StrCat("no ", kRankIdKey, " metadata (moe-rank sends it)")));
  const absl::Status s =
      handshake_.ClaimSession(*rank, *session, MetadataValue(context, kRankProofKey));
  if (s.ok()) return grpc::Status::OK;
  // A session that is merely stale (the rank registered again meanwhile) is the rank's own race,
  // not a refusal of an impostor: not counted.
  if (absl::IsFailedPrecondition(s)) return ToGrpcStatus(s);
  return Refuse(context, "control", "Exchange", s);
}

grpc::Status AccessControl::Caller(const grpc::ServerContext& context, absl::string_view method) {
  const absl::Status s =
      CheckBearer(MetadataValue(context, "authorization"), options_.api_token, "API token");
  return s.ok() ? grpc::Status::OK : Refuse(context, "api", method, s);
}

grpc::Status AccessControl::Admin(const grpc::ServerContext& context, absl::string_view method) {
  const std::string authorization = MetadataValue(context, "authorization");
  if (options_.admin_token.empty()) {
    const absl::Status s = CheckBearer(authorization, options_.api_token, "API token");
    return s.ok() ? grpc::Status::OK : Refuse(context, "admin", method, s);
  }
  const absl::Status s = CheckBearer(authorization, options_.admin_token, "admin token");
  if (s.ok()) return grpc::Status::OK;
  return Refuse(context, "admin", method,
                absl::PermissionDeniedError(absl::StrCat(
                    s.message(), ": MoeDiagnostics needs the admin token (--admin-token-file)")));
}

absl::Status AccessControl::HttpCaller(absl::string_view authorization, absl::string_view peer,
                                       absl::string_view method) {
  absl::Status s = CheckBearer(authorization, options_.api_token, "API token");
  return s.ok() ? s : Refuse(peer, "api", method, s);
}

grpc::Status AccessControl::Refuse(const grpc::ServerContext& context, absl::string_view plane,
                                   absl::string_view method, const absl::Status& status) {
  return ToGrpcStatus(Refuse(context.peer(), plane, method, status));
}

absl::Status AccessControl::Refuse(absl::string_view peer, absl::string_view plane,
                                   absl::string_view method, absl::Status status) {
  ++refusals_;
  if (metrics_ != nullptr) metrics_->OnAuthFailure(std::string(plane));
  std::lock_guard<std::mutex> lock(log_mu_);
  const absl::Time now = absl::Now();
  if (now - last_log_ < absl::Seconds(1)) {
    ++unlogged_;
    return status;
  }
  // The peer string comes from the transport, the method from our own tables: nothing the
  // caller chose verbatim reaches the log except through CHexEscape.
  LogLine("moe-gateway: refused %s call %s from %s: %s%s", plane, method, absl::CHexEscape(peer),
          status.message(),
          unlogged_ > 0 ? absl::StrCat(" (", unlogged_, " more refusals not logged)") : "");
  last_log_ = now;
  unlogged_ = 0;
  return status;
}

}  // namespace moe
