// C++ client of the moe.v1 service (proto/moe/v1/moe.proto) and of grpc.health.v1.
//
//   ASSIGN_OR_RETURN(auto client, MoeClient::Connect("localhost:50051", ClientOptions{}));
//   ASSIGN_OR_RETURN(ForwardResult y, client->Forward(layer, {tokens, hidden}, x, {}));
//
// One MoeClient owns one channel and is safe to share between threads: every call builds its
// own context. gRPC errors come back as absl::Status with the same code and message.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "moe/v1/moe.grpc.pb.h"
#include "moe/v1/moe.pb.h"
#include "security/credentials.h"

namespace moe {

// gRPC's own default receive limit, and the least a client sized from the server uses.
constexpr int kMinMessageBytes = 4 << 20;

// The largest message the server's limits imply, as the Python client computes it
// (moe_serve.message_limit): a response to its largest request, max_request_tokens fp32 rows of
// the hidden size, its routing (12 bytes per choice) and 1 MiB of framing; at least
// kMinMessageBytes (so diagnostics and small models keep gRPC's default), at most INT32_MAX.
int MessageLimit(const moe::v1::ModelInfo& info);

struct ClientOptions {
  // Largest message either way. 0: sized from the server's GetModelInfo before the first
  // Forward or stream (MessageLimit; kMinMessageBytes until then), so a batch as large as the
  // server takes is one the client can receive. > 0: exactly this, the server not asked.
  int max_message_bytes = 0;
  // Calls wait for the channel to connect (up to their deadline) instead of failing fast with
  // UNAVAILABLE while the server is down.
  bool wait_for_ready = false;
  // Cap on gRPC's reconnect backoff (its default grows to 120 s), so a restarted gateway is
  // found again quickly.
  absl::Duration max_reconnect_backoff = absl::Seconds(2);
  TlsFiles tls;       // TLS to the gateway (its CA; a client certificate under mTLS)
  std::string token;  // sent as `authorization: Bearer <token>` (the gateway's API/admin token)
};

struct ForwardOptions {
  // Dtype of the input on the wire (values are rounded to nearest even for BF16/FP16).
  moe::v1::DType dtype = moe::v1::FP32;
  // Dtype of the output on the wire; DTYPE_UNSPECIFIED = `dtype`. Decoded to fp32 either way.
  moe::v1::DType output_dtype = moe::v1::DTYPE_UNSPECIFIED;
  bool return_routing = false;
  // Deadline of a unary call; ignored by ForwardStreamSession::Send (see Receive).
  absl::Duration timeout = absl::InfiniteDuration();
  // Echoed by the server; ForwardStreamSession assigns one when empty.
  std::string request_id;
};

// Router choices, [tokens, top_k] row-major, in descending order of biased score.
struct ForwardRouting {
  int top_k = 0;  // 0 when routing was not requested
  std::vector<int32_t> expert_ids;
  std::vector<float> weights;
};

// Timing the gateway reports for the step a request ran in.
struct StepTiming {
  int64_t queue_us = 0;     // waiting to join a step
  int64_t step_us = 0;      // the step, end to end
  int32_t step_tokens = 0;  // tokens in that step (all callers')
};

struct ForwardResult {
  std::vector<int64_t> shape;  // the input's shape
  std::vector<float> values;   // decoded to fp32 (exact for every wire dtype)
  ForwardRouting routing;
  StepTiming timing;
  std::string request_id;
};

// grpc::Status -> absl::Status with the same code and message (the codes are numerically equal).
absl::Status FromGrpcStatus(const grpc::Status& status);

// "bf16" | "fp16" | "fp32" (any case) -> the wire dtype; InvalidArgument otherwise.
absl::StatusOr<moe::v1::DType> ParseWireDType(absl::string_view name);

// The request Forward sends: `values` holds prod(shape) fp32 values, encoded as options.dtype.
absl::StatusOr<moe::v1::ForwardRequest> MakeForwardRequest(int layer,
                                                           const std::vector<int64_t>& shape,
                                                           const float* values,
                                                           const ForwardOptions& options);

// Decodes a response. A set `error` (ForwardStream) becomes its status; a malformed output or
// routing is an InternalError.
absl::StatusOr<ForwardResult> DecodeForwardResponse(const moe::v1::ForwardResponse& response);

class ForwardStreamSession;

class MoeClient {
 public:
  // Creates the channel (insecure) without waiting for it to connect: a server that is down
  // shows up as UNAVAILABLE on the first call, or use WaitUntilServing.
  static absl::StatusOr<std::unique_ptr<MoeClient>> Connect(const std::string& target,
                                                            const ClientOptions& options);

  // Runs `layer` on hidden states `values` of `shape` ([T, H] or [B, T, H]).
  absl::StatusOr<ForwardResult> Forward(int layer, const std::vector<int64_t>& shape,
                                        const float* values, const ForwardOptions& options);
  // The same call on a prepared request, response not decoded: for load generators, which
  // encode once and reuse the request. An infinite `timeout` sets no deadline.
  absl::StatusOr<moe::v1::ForwardResponse> ForwardRaw(const moe::v1::ForwardRequest& request,
                                                      absl::Duration timeout);

  absl::StatusOr<moe::v1::ModelInfo> GetModelInfo(absl::Duration timeout = absl::Seconds(10));

  // MoeDiagnostics (the gateway's admin token, when it has one, as ClientOptions::token).
  absl::StatusOr<moe::v1::PlacementAdvice> GetPlacementAdvice(
      int layer, int redundant_experts, absl::Duration timeout = absl::Seconds(30));
  // The layer's load-balance window: tokens per rank and expert, balancedness, the bias in use
  // and the Quantile Balancing suggestion.
  absl::StatusOr<moe::v1::LoadBalanceReport> GetLoadBalance(
      int layer, absl::Duration timeout = absl::Seconds(10));
  // Installs `bias` ([E]; empty: the checkpoint's own) as the layer's router selection bias.
  // The gateway needs --allow-bias-override (and its admin token, when it has one).
  absl::StatusOr<moe::v1::SetRouterBiasResponse> SetRouterBias(
      int layer, const std::vector<float>& bias, const std::string& source,
      absl::Duration timeout = absl::Seconds(10));
  // Live re-placement; `placement` in the --placement file format. Loading the new experts may
  // take minutes on a real model: give it a `timeout` to match.
  absl::StatusOr<moe::v1::ApplyPlacementResponse> ApplyPlacement(const std::string& placement,
                                                                 const std::string& source,
                                                                 absl::Duration timeout);

  // grpc.health.v1.Health/Check: true for SERVING, false for NOT_SERVING / UNKNOWN; an RPC
  // failure (server down, unknown service = NOT_FOUND) is an error.
  absl::StatusOr<bool> IsServing(const std::string& service = "",
                                 absl::Duration timeout = absl::Seconds(5));
  // Polls the health service until it reports SERVING. DeadlineExceeded (with the last
  // answer in the message) when `timeout` passes first.
  absl::Status WaitUntilServing(absl::Duration timeout, const std::string& service = "");

  // Opens a ForwardStream. `timeout` bounds the whole stream (infinite: no deadline).
  absl::StatusOr<std::unique_ptr<ForwardStreamSession>> OpenStream(
      absl::Duration timeout = absl::InfiniteDuration());

  const std::string& target() const { return target_; }
  // The message limit of the channel in use (both directions): options.max_message_bytes when
  // set, else kMinMessageBytes until sized from the server, then MessageLimit(its info).
  int max_message_bytes() const;

 private:
  // One channel and its stubs. Replaced by a larger one once sized; calls and streams still on
  // the old one keep it alive through their shared_ptr.
  // Both channels round-robin over the gateways and retry UNAVAILABLE elsewhere
  // (client/gateway_targets.h); `channel` skips gateways that take no requests.
  struct Channel {
    std::shared_ptr<grpc::Channel> channel;  // Forward, ForwardStream
    std::shared_ptr<grpc::Channel> plain;    // health, model info, diagnostics
    std::unique_ptr<moe::v1::MoeService::Stub> stub;
    std::unique_ptr<moe::v1::MoeService::Stub> info;
    std::unique_ptr<moe::v1::MoeDiagnostics::Stub> diagnostics;
    int message_limit = 0;
  };
  MoeClient(std::string target, const ClientOptions& options, std::shared_ptr<Channel> channel);
  static absl::StatusOr<std::shared_ptr<Channel>> MakeChannel(const std::string& target,
                                                              const ClientOptions& options,
                                                              int message_limit);
  std::shared_ptr<Channel> channel() const;
  // With max_message_bytes 0, asks GetModelInfo once (within `timeout`) and moves to a channel
  // of MessageLimit(info) when that is larger. Its error, when it fails (asked again next time).
  absl::Status SizeFromServer(absl::Duration timeout);
  void Prepare(grpc::ClientContext* context, absl::Duration timeout) const;

  std::string target_;
  ClientOptions options_;
  mutable std::mutex channel_mu_;
  std::shared_ptr<Channel> channel_;  // guarded by channel_mu_
  std::mutex size_mu_;                // held while sizing: one GetModelInfo for all callers
  std::atomic<bool> sized_{false};
};

// Many requests on one ForwardStream. The server serves them concurrently and answers in any
// order; Receive matches responses to requests by request_id. Send and Receive may be called
// from many threads at once (writes are serialized; one thread reads).
// NOTES: std::mutex rather than absl::Mutex: TSan cannot see into Debian's uninstrumented Abseil.
class ForwardStreamSession {
 public:
  ~ForwardStreamSession();  // cancels the stream unless Finish was called
  ForwardStreamSession(const ForwardStreamSession&) = delete;
  ForwardStreamSession& operator=(const ForwardStreamSession&) = delete;

  // Sends one request and returns its request_id (options.request_id, or a fresh one).
  // InvalidArgument when that id is already in flight; the stream's status once it has ended.
  absl::StatusOr<std::string> Send(int layer, const std::vector<int64_t>& shape,
                                   const float* values, const ForwardOptions& options);
  absl::StatusOr<std::string> Send(moe::v1::ForwardRequest request);

  // Waits for the response to `request_id`. A per-request error comes back as its status;
  // DeadlineExceeded when `timeout` passes first (the request stays in flight); the stream's
  // final status when it ended without answering.
  absl::StatusOr<ForwardResult> Receive(const std::string& request_id,
                                        absl::Duration timeout = absl::InfiniteDuration());
  absl::StatusOr<moe::v1::ForwardResponse> ReceiveRaw(
      const std::string& request_id, absl::Duration timeout = absl::InfiniteDuration());

  // Half-closes the stream, waits for the server to end it and returns its status. Responses
  // that arrived before the end can still be received.
  absl::Status Finish();

  // True once the stream is over (finished, failed, cancelled): every later Send fails.
  bool ended() const;

 private:
  friend class MoeClient;
  ForwardStreamSession(std::shared_ptr<grpc::Channel> channel, absl::Duration timeout,
                       bool wait_for_ready, const std::string& token);
  void ReadLoop();
  // Waits (bounded) for the reader to see the end of the stream; returns its status.
  absl::Status EndStatus();

  std::unique_ptr<moe::v1::MoeService::Stub> stub_;
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReaderWriter<moe::v1::ForwardRequest, moe::v1::ForwardResponse>>
      stream_;
  std::thread reader_;

  std::mutex write_mu_;  // gRPC allows one writer at a time
  bool writes_done_ = false;
  uint64_t next_id_ = 0;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::set<std::string> in_flight_;                          // sent, not yet received
  std::map<std::string, moe::v1::ForwardResponse> arrived_;  // answered, not yet received
  bool ended_ = false;
  absl::Status end_status_;
};

}  // namespace moe
