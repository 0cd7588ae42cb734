#include "client/gateway_targets.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "core/host_port.h"

namespace moe {
absl::StatusOr<std::string> GatewayChannelTarget(absl::string_view targets) {
  targets = absl::StripAsciiWhitespace(targets);
  if (targets.empty()) return absl::InvalidArgumentError("empty target (want HOST:PORT)");
  if (targets.find(',') == absl::string_view::npos) return std::string(targets);
  std::vector<std::string> v4, v6;
  for (absl::string_view entry : absl::StrSplit(targets, ',')) {
    entry = absl::StripAsciiWhitespace(entry);
    if (entry.empty())
      return absl::InvalidArgumentError(absl::StrCat("empty gateway in '", targets, "'"));
    auto resolved = ResolveHostPort(entry);
    if (!resolved.ok()) return absl::InvalidArgumentError(resolved.status().message());
    // One address per gateway: the first of each family.
    bool have_v4 = false, have_v6 = false;
    for (const std::string& address : *resolved) {
      const bool is_v6 = address.front() == '[';
      bool& have = is_v6 ? have_v6 : have_v4;
      if (have) continue;
      have = true;
      (is_v6 ? v6 : v4).push_back(address);
    }
  }
  if (!v4.empty()) return absl::StrCat("ipv4:", absl::StrJoin(v4, ","));
  return absl::StrCat("ipv6:", absl::StrJoin(v6, ","));
}

std::string GatewayAuthority(absl::string_view targets) {
  targets = absl::StripAsciiWhitespace(targets);
  const size_t comma = targets.find(',');
  if (comma == absl::string_view::npos) return "";
  return std::string(absl::StripAsciiWhitespace(targets.substr(0, comma)));
}

std::string GatewayServiceConfig(bool health_checked, int attempts) {
  return absl::StrCat(
      R"({"loadBalancingConfig": [{"round_robin": {}}],)",
      health_checked ? R"( "healthCheckConfig": {"serviceName": "moe.v1.MoeService"},)" : "",
      R"( "methodConfig": [{"name": [{"service": "moe.v1.MoeService"},)",
      R"( {"service": "moe.v1.MoeDiagnostics"}, {"service": "inference.GRPCInferenceService"}],)",
      R"( "retryPolicy": {"maxAttempts": )", attempts,
      R"(, "initialBackoff": "0.01s", "maxBackoff": "0.1s", "backoffMultiplier": 2,)",
      R"( "retryableStatusCodes": ["UNAVAILABLE"]}}]})");
}

void AddGatewayFailoverArgs(int message_limit, bool health_checked, grpc::ChannelArguments* args) {
  args->SetServiceConfigJSON(GatewayServiceConfig(health_checked));
  args->SetInt(GRPC_ARG_ENABLE_RETRIES, 1);
  args->SetInt(GRPC_ARG_PER_RPC_RETRY_BUFFER_SIZE, message_limit);
  // A gateway that hangs (SIGSTOP, a stalled host) keeps its connection open: pings find it
  // within kGatewayKeepalive + kGatewayKeepaliveTimeout, and its calls go to another.
  args->SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, kGatewayKeepaliveMs);
  args->SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, kGatewayKeepaliveTimeoutMs);
  args->SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  args->SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
}

}  // namespace moe
