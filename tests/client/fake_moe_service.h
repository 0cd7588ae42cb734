// A fake moe.v1 service on loopback for the client tests. Its answers encode where they came
// from, so every value that crossed the wire can be checked exactly:
//   output = 2 * input + layer (fp32, then encoded as the requested output dtype)
//   routing: token t chooses experts {(layer + t) % 64, (layer + t + 17) % 64}, weights 0.75, 0.25
//   timing: queue_us 7, step_us 100 + tokens, step_tokens = tokens
// Special layers make it fail or wait (see the constants), plus the standard health service.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "grpcpp/grpcpp.h"
#include "moe/v1/moe.grpc.pb.h"

namespace moe {
namespace fake {

class FakeMoeService;

class FakeMoeServer {
 public:
  static constexpr int kHidden = 8;
  static constexpr int kTopK = 2;
  static constexpr int kExperts = 64;
  // Errors, with these messages:
  //   layer < 0         INVALID_ARGUMENT   "layer must be >= 0, got <layer>"
  //   hidden size != 8  INVALID_ARGUMENT   "hidden_states: hidden size must be 8, got <h>"
  //   kUnservedLayer    NOT_FOUND          "layer 404 is not served (served: 1, 2, 3)"
  //   kBusyLayer        RESOURCE_EXHAUSTED "queue full: 1 requests waiting, limit 0"
  //   kUnavailableLayer UNAVAILABLE        "ranks not ready (0 of 2)"
  static constexpr int kUnservedLayer = 404;
  static constexpr int kBusyLayer = 429;
  static constexpr int kUnavailableLayer = 503;
  static constexpr int kSlowLayer = 900;  // answers only after 10 s (or cancellation)
  static constexpr int kHeldLayer = 5;    // answers once ReleaseHeld() was called

  // Starts on 127.0.0.1 with a port picked by the OS. nullptr (and a message on stderr) when
  // the server cannot start.
  static std::unique_ptr<FakeMoeServer> Start();
  ~FakeMoeServer();

  std::string target() const { return "127.0.0.1:" + std::to_string(port_); }
  // The overall health status ("") and that of "moe.v1.MoeService".
  void SetServing(bool serving);
  // Lets requests for kHeldLayer through.
  void ReleaseHeld();
  // What GetModelInfo reports as max_request_tokens (1024 unless set).
  void SetMaxRequestTokens(int64_t tokens);
  // GetModelInfo calls that reached the service.
  int64_t model_info_calls() const;
  // Forward requests that reached the service (unary and stream), by layer.
  int64_t calls(int layer) const;
  int64_t total_calls() const;

 private:
  FakeMoeServer() = default;
  std::unique_ptr<FakeMoeService> service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

}  // namespace fake
}  // namespace moe
