// civetweb, the project's HTTP server library (the metrics and probe endpoints, the Open Inference
// Protocol's REST API), in one place: its exceptions become a status, its shutdown takes
// milliseconds, and responses are written whole with their length (so keep-alive works).
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

class CivetServer;
struct mg_connection;

namespace moe {

// A running civetweb server. Destruction returns within milliseconds: civetweb's listener thread
// polls with a 2 s quantum and checks its stop flag only between polls, so the destructor
// connects to the port while the server stops (which wakes the poll) instead of making every
// process exit wait for up to 2 s.
class CivetListener {
 public:
  // `options` are civetweb's (name, value, ...) and must include "listening_ports" = `address`
  // ("HOST:PORT", port 0 = any free one). `what` names the endpoint in errors.
  static absl::StatusOr<std::unique_ptr<CivetListener>> Start(
      const std::vector<std::string>& options, const std::string& address, absl::string_view what);
  ~CivetListener();
  CivetListener(const CivetListener&) = delete;
  CivetListener& operator=(const CivetListener&) = delete;

  CivetServer& server() { return *civet_; }
  int port() const { return port_; }

 private:
  CivetListener(std::unique_ptr<CivetServer> civet, std::string wake_host, int port);

  std::unique_ptr<CivetServer> civet_;
  const std::string wake_host_;  // where the destructor connects: the bound address, or loopback
  const int port_;
};

// One whole response: status line, Content-Type, Content-Length, `headers`, then `body`.
void RespondHttp(mg_connection* conn, int code, absl::string_view content_type,
                 absl::string_view body,
                 const std::vector<std::pair<std::string, std::string>>& headers = {});

}  // namespace moe
