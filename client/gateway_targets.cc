#include "client/gateway_targets.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>

#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace moe {
namespace {

struct Resolved {
  std::string v4, v6;  // "IP:port" / "[IP]:port", "" when the name has none of that family
};

absl::StatusOr<Resolved> Resolve(absl::string_view entry) {
  const size_t colon = entry.rfind(':');
  if (colon == absl::string_view::npos || colon + 1 == entry.size())
    return absl::InvalidArgumentError(
        absl::StrCat("gateway '", entry, "' has no port (want HOST:PORT)"));
  std::string host(entry.substr(0, colon));
  const std::string port(entry.substr(colon + 1));
  if (host.size() > 2 && host.front() == '[' && host.back() == ']')
    host = host.substr(1, host.size() - 2);
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* addresses = nullptr;
  if (host.empty() || getaddrinfo(host.c_str(), port.c_str(), &hints, &addresses) != 0)
    return absl::InvalidArgumentError(absl::StrCat("gateway '", entry, "' does not resolve"));
  Resolved out;
  char text[INET6_ADDRSTRLEN];
  for (addrinfo* a = addresses; a != nullptr; a = a->ai_next) {
    if (a->ai_family == AF_INET && out.v4.empty()) {
      inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(a->ai_addr)->sin_addr, text, sizeof text);
      out.v4 = absl::StrCat(text, ":", port);
    } else if (a->ai_family == AF_INET6 && out.v6.empty()) {
      inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(a->ai_addr)->sin6_addr, text,
                sizeof text);
      out.v6 = absl::StrCat("[", text, "]:", port);
    }
  }
  freeaddrinfo(addresses);
  return out;
}

}  // namespace

absl::StatusOr<std::string> GatewayChannelTarget(absl::string_view targets) {
  targets = absl::StripAsciiWhitespace(targets);
  if (targets.empty()) return absl::InvalidArgumentError("empty target (want HOST:PORT)");
  if (targets.find(',') == absl::string_view::npos) return std::string(targets);
  std::vector<std::string> v4, v6;
  for (absl::string_view entry : absl::StrSplit(targets, ',')) {
    entry = absl::StripAsciiWhitespace(entry);
    if (entry.empty())
      return absl::InvalidArgumentError(absl::StrCat("empty gateway in '", targets, "'"));
    auto resolved = Resolve(entry);
    if (!resolved.ok()) return resolved.status();
    if (!resolved->v4.empty()) v4.push_back(resolved->v4);
    if (!resolved->v6.empty()) v6.push_back(resolved->v6);
  }
  if (!v4.empty()) return absl::StrCat("ipv4:", absl::StrJoin(v4, ","));
  return absl::StrCat("ipv6:", absl::StrJoin(v6, ","));
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
