// The Open Inference Protocol over HTTP/REST (KServe v2, with Triton's binary tensor, statistics,
// model configuration and repository extensions) on the gateway: civetweb reads and writes,
// kserve_json.h reshapes the bodies, KServeModels answers as it does for gRPC. Same tokens, same
// validation and limits, same metrics.
//
// Trust boundary, in order: a request's headers (civetweb caps them at 16 KiB) decide everything
// before its body is read: the route, then the API token (401), then the declared
// Content-Length against the public port's message limit (413; a body without a length is 411).
// Only then is the body read, into one buffer of exactly that length. (The body of a refused
// request is read and dropped by civetweb, in 8 KiB pieces: it costs a worker, no memory.) JSON
// bodies are decoded a few at a time (kMaxJsonDecodes), since a DOM of numbers takes up to ~16x the
// text; they nest at most 64 levels (model/bounded_json.h).
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/gateway/gateway.h"

namespace moe {

class CivetListener;

struct RestOptions {
  std::string address;  // "HOST:PORT"; port 0 = any free one
  int threads = 16;     // civetweb workers: connections served at once
};

class KServeHttpServer {
 public:
  static absl::StatusOr<std::unique_ptr<KServeHttpServer>> Start(Gateway* gateway,
                                                                 const RestOptions& options);
  ~KServeHttpServer();
  int port() const;

  // How long a connection may take to send its request (headers and body), or sit idle between
  // requests when kept alive.
  static constexpr int kRequestTimeoutMs = 10000;
  static constexpr int kKeepAliveTimeoutMs = 5000;
  static constexpr int kMaxJsonDecodes = 2;

 private:
  class Handler;
  KServeHttpServer() = default;

  std::unique_ptr<Handler> handler_;
  std::unique_ptr<CivetListener> listener_;  // last: stopped before the handler goes
};

}  // namespace moe
