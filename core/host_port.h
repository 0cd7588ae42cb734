// HOST:PORT entries (a list of gateways) and the addresses a name stands for.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace moe {

struct HostPort {
  std::string host;  // without IPv6 brackets
  std::string port;
  bool literal = false;  // host is an IPv4 or IPv6 address
};

// Splits "host:port" / "[v6]:port". INVALID_ARGUMENT without a host or a port.
absl::StatusOr<HostPort> ParseHostPort(absl::string_view entry);

// Whether a listen host is loopback only (localhost, 127.x.y.z, ::1).
bool IsLoopback(absl::string_view host);

// Every address `entry` resolves to now (getaddrinfo), IPv4 first, as "IP:port" / "[IP]:port",
// without repeats. INVALID_ARGUMENT for a malformed entry, NOT_FOUND when the name resolves to
// nothing.
absl::StatusOr<std::vector<std::string>> ResolveHostPort(absl::string_view entry);

}  // namespace moe
