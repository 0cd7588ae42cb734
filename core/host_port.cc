#include "core/host_port.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>

#include <algorithm>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/status.h"

namespace moe {

absl::StatusOr<HostPort> ParseHostPort(absl::string_view entry) {
  const size_t colon = entry.rfind(':');
  if (colon == absl::string_view::npos || colon == 0 || colon + 1 == entry.size())
    return absl::InvalidArgumentError(absl::StrCat("'", entry, "' is not HOST:PORT"));
  HostPort out;
  out.host = std::string(entry.substr(0, colon));
  out.port = std::string(entry.substr(colon + 1));
  if (out.host.size() > 2 && out.host.front() == '[' && out.host.back() == ']')
    out.host = out.host.substr(1, out.host.size() - 2);
  in6_addr v6;
  in_addr v4;
  out.literal = inet_pton(AF_INET, out.host.c_str(), &v4) == 1 ||
                inet_pton(AF_INET6, out.host.c_str(), &v6) == 1;
  return out;
}

bool IsLoopback(absl::string_view host) {
  return host == "localhost" || host == "::1" || host == "[::1]" || absl::StartsWith(host, "127.");
}

absl::StatusOr<std::vector<std::string>> ResolveHostPort(absl::string_view entry) {
  ASSIGN_OR_RETURN(const HostPort parsed, ParseHostPort(entry));
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* addresses = nullptr;
  if (getaddrinfo(parsed.host.c_str(), parsed.port.c_str(), &hints, &addresses) != 0)
    return absl::NotFoundError(absl::StrCat("'", entry, "' does not resolve"));
  std::vector<std::string> v4, v6;
  char text[INET6_ADDRSTRLEN];
  for (addrinfo* a = addresses; a != nullptr; a = a->ai_next) {
    if (a->ai_family == AF_INET) {
      inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(a->ai_addr)->sin_addr, text, sizeof text);
      v4.push_back(absl::StrCat(text, ":", parsed.port));
    } else if (a->ai_family == AF_INET6) {
      inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(a->ai_addr)->sin6_addr, text,
                sizeof text);
      v6.push_back(absl::StrCat("[", text, "]:", parsed.port));
    }
  }
  freeaddrinfo(addresses);
  std::vector<std::string> out;
  for (auto* family : {&v4, &v6})
    for (std::string& address : *family)
      if (std::find(out.begin(), out.end(), address) == out.end()) out.push_back(address);
  if (out.empty()) return absl::NotFoundError(absl::StrCat("'", entry, "' does not resolve"));
  return out;
}

}  // namespace moe
