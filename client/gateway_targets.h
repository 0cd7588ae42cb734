// Several gateways behind one client channel. A Forward is a pure function of its input, so a
// call that finds its gateway gone may run again on another: gRPC's own round_robin policy
// spreads calls over every gateway it can reach, and its retryPolicy sends a call that failed
// UNAVAILABLE (gateway killed, draining, or down) to the next one at once, without waiting out
// the lost gateway's reconnect backoff. No hand-written balancer.
//
//   "host:port"               gRPC's DNS resolver: every address the name has (a Kubernetes
//                             headless Service, or several A records), re-resolved by gRPC
//   "host:port,host:port,..." each name resolved once, here: "ipv4:IP:port,IP:port" (or ipv6:)
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "grpcpp/support/channel_arguments.h"

namespace moe {

// The channel target for `targets` (above). INVALID_ARGUMENT for an empty entry, a missing port
// or a name that does not resolve; a list mixing IPv4 and IPv6 gateways uses the IPv4 ones.
absl::StatusOr<std::string> GatewayChannelTarget(absl::string_view targets);

// The authority (":authority", and the name TLS verifies unless a server name is given) of a
// channel to `targets`: empty for one entry (gRPC takes it from the target), the first entry for
// a list, whose "ipv4:" target would otherwise lend it the whole address list. Gateways behind
// one list therefore share a certificate that names the first entry's host.
std::string GatewayAuthority(absl::string_view targets);

// round_robin over the gateways (`health_checked`: only those whose health service
// "moe.v1.MoeService" says SERVING: they take requests, not draining, not just restarted), and
// UNAVAILABLE retried up to `attempts` times in all (10 ms backoff, 2x, at most 100 ms) on every
// moe.v1 and Open Inference Protocol method.
std::string GatewayServiceConfig(bool health_checked, int attempts = 4);

// Client keepalive pings: a hung gateway is left within about 3 s (the gateway accepts pings
// this often: Gateway::Listen).
inline constexpr int kGatewayKeepaliveMs = 2000;
inline constexpr int kGatewayKeepaliveTimeoutMs = 1000;

// The service config, retries on, a per-call retry buffer of `message_limit` (gRPC's default,
// 256 KiB, would make any larger request unretryable), and keepalive pings.
void AddGatewayFailoverArgs(int message_limit, bool health_checked, grpc::ChannelArguments* args);

}  // namespace moe
