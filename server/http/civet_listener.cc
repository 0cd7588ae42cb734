#include "server/http/civet_listener.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <exception>
#include <thread>

#include "CivetServer.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace moe {
namespace {

// The host part of "HOST:PORT" / "[V6]:PORT", as a connectable address (wildcards -> loopback).
std::string WakeHost(const std::string& address) {
  std::string host = address.substr(0, address.rfind(':'));
  if (absl::StartsWith(host, "[") && absl::EndsWith(host, "]"))
    host = host.substr(1, host.size() - 2);
  if (host.empty() || host == "0.0.0.0") return "127.0.0.1";
  if (host == "::") return "::1";
  return host;
}

// One TCP connection attempt to host:port, closed at once (a numeric host; others are skipped).
void Poke(const std::string& host, int port) {
  sockaddr_storage storage{};
  socklen_t length = 0;
  auto* v4 = reinterpret_cast<sockaddr_in*>(&storage);
  auto* v6 = reinterpret_cast<sockaddr_in6*>(&storage);
  if (inet_pton(AF_INET, host.c_str(), &v4->sin_addr) == 1) {
    v4->sin_family = AF_INET;
    v4->sin_port = htons(static_cast<uint16_t>(port));
    length = sizeof *v4;
  } else if (inet_pton(AF_INET6, host.c_str(), &v6->sin6_addr) == 1) {
    v6->sin6_family = AF_INET6;
    v6->sin6_port = htons(static_cast<uint16_t>(port));
    length = sizeof *v6;
  } else {
    return;  // a host name: the server then stops at its own pace
  }
  const int fd = socket(storage.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return;
  (void)connect(fd, reinterpret_cast<sockaddr*>(&storage), length);
  close(fd);
}

}  // namespace

absl::StatusOr<std::unique_ptr<CivetListener>> CivetListener::Start(
    const std::vector<std::string>& options, const std::string& address, absl::string_view what) {
  std::unique_ptr<CivetServer> civet;
  try {
    civet = std::make_unique<CivetServer>(options);
  } catch (const std::exception& e) {  // civetweb reports bind failures by throwing
    return absl::UnavailableError(
        absl::StrCat("cannot serve ", what, " on ", address, ": ", e.what()));
  }
  const std::vector<int> ports = civet->getListeningPorts();
  const int port = ports.empty() ? 0 : ports.front();
  return std::unique_ptr<CivetListener>(
      new CivetListener(std::move(civet), WakeHost(address), port));
}

CivetListener::CivetListener(std::unique_ptr<CivetServer> civet, std::string wake_host, int port)
    : civet_(std::move(civet)), wake_host_(std::move(wake_host)), port_(port) {}

CivetListener::~CivetListener() {
  std::atomic<bool> stopped{false};
  std::thread waker([this, &stopped] {
    while (!stopped.load()) {
      Poke(wake_host_, port_);
      absl::SleepFor(absl::Milliseconds(20));
    }
  });
  civet_.reset();
  stopped = true;
  waker.join();
}

void RespondHttp(mg_connection* conn, int code, absl::string_view content_type,
                 absl::string_view body,
                 const std::vector<std::pair<std::string, std::string>>& headers) {
  mg_response_header_start(conn, code);
  mg_response_header_add(conn, "Content-Type", content_type.data(),
                         static_cast<int>(content_type.size()));
  const std::string length = absl::StrCat(body.size());
  mg_response_header_add(conn, "Content-Length", length.c_str(), -1);
  for (const auto& [name, value] : headers)
    mg_response_header_add(conn, name.c_str(), value.c_str(), static_cast<int>(value.size()));
  mg_response_header_send(conn);
  if (!body.empty()) mg_write(conn, body.data(), body.size());
}

}  // namespace moe
