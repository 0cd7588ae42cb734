// The ranks' exchange streams with this gateway (RankControl/Exchange), one per rank, as the
// control plane runs them: liveness (a heartbeat out while idle; a rank silent for the timeout
// is marked down and cut off), the membership feed (a rank is up while its stream serves), the
// control messages in both directions, and for the gRPC data plane the way steps go out
// (StepStreams) and results come in (Handlers::on_result).
#pragma once

#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "grpcpp/grpcpp.h"
#include "moe/v1/internal.grpc.pb.h"
#include "transport/grpc_transport.h"
#include "transport/membership.h"
#include "transport/stream_liveness.h"

namespace moe {

class RankSessions final : public StepStreams {
 public:
  struct Handlers {
    // ShardsLoaded, PlacementOffer: on the stream's reader thread (must not block long: the
    // rank's heartbeats are heard there).
    std::function<void(int rank, const moe::v1::internal::RankToGateway&)> on_control;
    // Step results (the gRPC data plane), on the reader thread.
    std::function<void(int rank, moe::v1::internal::StepResult)> on_result;
  };

  RankSessions(Membership* membership, const LivenessOptions& liveness);
  void SetHandlers(Handlers handlers);  // before any stream

  // Runs rank `rank`'s exchange on `stream` (the Exchange handler's thread, whose `context` it
  // cancels when the rank falls silent) until the stream ends; the rank is up meanwhile.
  // ALREADY_EXISTS when the rank has a stream already, INVALID_ARGUMENT for no such rank.
  absl::Status Serve(int rank, ExchangeServerStream* stream, grpc::ServerContext* context);
  // Writes on rank `rank`'s stream, between other writes; UNAVAILABLE when it has none.
  absl::Status Write(int rank, const moe::v1::internal::GatewayToRank& message) override;
  bool HasStream(int rank) const;
  // Cancels every stream (shutdown: they never end on their own).
  void CloseAll();

 private:
  struct Stream {
    std::mutex write_mu;                     // one Write at a time per stream
    ExchangeServerStream* stream = nullptr;  // guarded by mu_
    grpc::ServerContext* context = nullptr;  // guarded by mu_
  };

  Membership* const membership_;
  const LivenessOptions liveness_;
  Handlers handlers_;
  mutable std::mutex mu_;
  std::vector<std::unique_ptr<Stream>> streams_;
};

}  // namespace moe
