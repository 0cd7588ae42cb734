#include "tests/testing/recording_relay.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include "absl/time/clock.h"

namespace moe::testing {
namespace {

int ConnectLoopback(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

bool SendAll(int fd, const char* data, size_t size) {
  while (size > 0) {
    const ssize_t n = send(fd, data, size, MSG_NOSIGNAL);
    if (n <= 0) return false;
    data += n;
    size -= static_cast<size_t>(n);
  }
  return true;
}

}  // namespace

RecordingRelay::RecordingRelay(int target_port) : target_port_(target_port) {
  listener_ = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(listener_, reinterpret_cast<sockaddr*>(&address), sizeof address);
  listen(listener_, 16);
  socklen_t length = sizeof address;
  getsockname(listener_, reinterpret_cast<sockaddr*>(&address), &length);
  port_ = ntohs(address.sin_port);
  acceptor_ = std::thread([this] { AcceptLoop(); });
}

RecordingRelay::~RecordingRelay() {
  stop_ = true;
  shutdown(listener_, SHUT_RDWR);
  acceptor_.join();
  close(listener_);
  std::vector<std::thread> threads;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (int fd : sockets_) shutdown(fd, SHUT_RDWR);
    threads.swap(threads_);
  }
  for (auto& t : threads) t.join();
  for (int fd : sockets_) close(fd);
}

std::vector<std::string> RecordingRelay::client_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return recorded_;
}

void RecordingRelay::AcceptLoop() {
  while (!stop_) {
    const int client = accept(listener_, nullptr, nullptr);
    if (client < 0) return;
    std::lock_guard<std::mutex> lock(mu_);
    recorded_.emplace_back();
    sockets_.push_back(client);
    threads_.emplace_back([this, client, index = recorded_.size() - 1] { Relay(client, index); });
  }
}

void RecordingRelay::Relay(int client, size_t index) {
  const int server = ConnectLoopback(target_port_);
  if (server < 0) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    sockets_.push_back(server);
  }
  pollfd fds[2] = {{client, POLLIN, 0}, {server, POLLIN, 0}};
  char buffer[1 << 16];
  while (!stop_) {
    if (poll(fds, 2, 100) < 0) return;
    for (int i = 0; i < 2; ++i) {
      if ((fds[i].revents & (POLLIN | POLLHUP | POLLERR)) == 0) continue;
      const ssize_t n = recv(fds[i].fd, buffer, sizeof buffer, 0);
      if (n <= 0) {  // one side closed: close the other's sending half
        shutdown(fds[1 - i].fd, SHUT_WR);
        return;
      }
      if (i == 0) {
        std::lock_guard<std::mutex> lock(mu_);
        recorded_[index].append(buffer, static_cast<size_t>(n));
      }
      if (!SendAll(fds[1 - i].fd, buffer, static_cast<size_t>(n))) return;
    }
  }
}

std::string Replay(int port, const std::string& bytes, absl::Duration listen_for) {
  const int fd = ConnectLoopback(port);
  if (fd < 0) return "";
  SendAll(fd, bytes.data(), bytes.size());
  std::string answer;
  const absl::Time end = absl::Now() + listen_for;
  char buffer[1 << 16];
  pollfd pfd{fd, POLLIN, 0};
  while (absl::Now() < end) {
    if (poll(&pfd, 1, 50) <= 0) continue;
    const ssize_t n = recv(fd, buffer, sizeof buffer, 0);
    if (n <= 0) break;
    answer.append(buffer, static_cast<size_t>(n));
  }
  close(fd);
  return answer;
}

}  // namespace moe::testing
