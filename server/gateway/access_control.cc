#include "server/gateway/access_control.h"

#include <cstdio>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "security/tokens.h"
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

grpc::Status AccessControl::Rank(const grpc::ServerContext& context, absl::string_view method) {
  // Under mTLS the handshake already refused peers without a CA-signed certificate; checked
  // again here so a misconfigured server can never accept one.
  if (options_.control_mtls && !context.auth_context()->IsPeerAuthenticated())
    return Refuse(
        context, "control", method,
        grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "no verified client certificate"));
  grpc::Status s = CheckToken(context, options_.cluster_token, "cluster token");
  return s.ok() ? s : Refuse(context, "control", method, s);
}

grpc::Status AccessControl::Caller(const grpc::ServerContext& context, absl::string_view method) {
  grpc::Status s = CheckToken(context, options_.api_token, "API token");
  return s.ok() ? s : Refuse(context, "api", method, s);
}

grpc::Status AccessControl::Admin(const grpc::ServerContext& context, absl::string_view method) {
  if (options_.admin_token.empty()) {
    grpc::Status s = CheckToken(context, options_.api_token, "API token");
    return s.ok() ? s : Refuse(context, "admin", method, s);
  }
  grpc::Status s = CheckToken(context, options_.admin_token, "admin token");
  if (s.ok()) return s;
  return Refuse(context, "admin", method,
                grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                             absl::StrCat(s.error_message(),
                                          ": MoeDiagnostics needs the admin "
                                          "token (--admin-token-file)")));
}

grpc::Status AccessControl::Refuse(const grpc::ServerContext& context, absl::string_view plane,
                                   absl::string_view method, grpc::Status status) {
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
  std::fprintf(
      stderr, "moe-gateway: refused %s call %s from %s: %s%s\n", std::string(plane).c_str(),
      std::string(method).c_str(), absl::CHexEscape(context.peer()).c_str(),
      status.error_message().c_str(),
      unlogged_ > 0 ? absl::StrCat(" (", unlogged_, " more refusals not logged)").c_str() : "");
  std::fflush(stderr);
  last_log_ = now;
  unlogged_ = 0;
  return status;
}

}  // namespace moe
