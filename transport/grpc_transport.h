// The gRPC transport: the step exchange over one persistent bidirectional stream per rank
// (moe.v1.internal.RankControl/Exchange), opened by the rank so that only the gateway needs
// to be reachable. Usable across hosts; the default on hosts without GPUs. On the gateway it is
// a data plane only: the control plane (server/control) runs the streams, their liveness and
// membership, and hands it results (OnResult) and membership changes (RankDown / RankUp).
//
// Wire format per step (docs/DESIGN.md "Dispatch rule"):
//   gateway -> rank r  StepRequest: rows [num_rows, width] as bf16 (bf16 mode, exact: the
//                      rows are bf16 values) or fp32, plus per row its local experts and gates.
//   rank r -> gateway  StepResult: fp64 partial sums [num_rows, width], or an error code.
// Both sides also send a Heartbeat every LivenessOptions::heartbeat (the gateway's from its
// control plane); a rank silent for peer_timeout is marked down (its waiting steps fail
// UNAVAILABLE) and its stream cancelled, and a rank that hears nothing from the gateway for as
// long gives up on the stream.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "grpcpp/grpcpp.h"
#include "kernels/backend.h"
#include "moe/v1/internal.grpc.pb.h"
#include "transport/step_codec.h"
#include "transport/stream_liveness.h"
#include "transport/transport.h"

namespace moe {

using ExchangeServerStream =
    grpc::ServerReaderWriter<moe::v1::internal::GatewayToRank, moe::v1::internal::RankToGateway>;
using ExchangeClientStream =
    grpc::ClientReaderWriter<moe::v1::internal::RankToGateway, moe::v1::internal::GatewayToRank>;

// Where the gRPC data plane writes steps: the ranks' exchange streams, which the control plane
// owns (server/control/rank_sessions.h) together with their liveness and membership.
class StepStreams {
 public:
  virtual ~StepStreams() = default;
  // Writes `message` on rank `rank`'s exchange stream; UNAVAILABLE when it has none.
  virtual absl::Status Write(int rank, const moe::v1::internal::GatewayToRank& message) = 0;
};

class GrpcGatewayTransport final : public GatewayTransport {
 public:
  // `backend` is the gateway's: rows are read from, partials written to, its memory. Steps go
  // out through `streams`; results come in through OnResult. Every rank starts down.
  GrpcGatewayTransport(int num_ranks, Backend* backend, StepStreams* streams);

  std::string name() const override { return "grpc"; }
  absl::Status Send(const StepDispatch& dispatch) override;
  absl::Status Collect(const StepDispatch& dispatch, absl::Time deadline,
                       const std::function<absl::Status(size_t, ConstPartialView,
                                                        const RankStepStats&)>& consume) override;
  void Abandon(uint64_t step_id) override;
  void RankDown(int rank, absl::string_view why) override;
  void RankUp(int rank) override;

  // A result from rank `rank`'s stream (its reader thread). Kept only when it answers a step
  // sent to that rank in its current session and still awaited: anything else (a step given up
  // on, never sent, or sent before the rank went down) is dropped and counted.
  void OnResult(int rank, moe::v1::internal::StepResult result);
  // Results dropped as not awaited.
  int64_t dropped_results() const;
  // Called (outside locks) for every result dropped as not awaited, with the rank it came from.
  void SetDroppedResultCallback(std::function<void(int rank)> callback);

 private:
  struct RankState {
    std::string down_reason = "has not registered";  // "" while up
    uint64_t epoch = 0;  // +1 whenever the rank goes down: a step sent before never returns
  };
  Backend* backend_;
  StepStreams* const streams_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<RankState> ranks_;                                               // guarded by mu_
  std::map<std::pair<uint64_t, int>, moe::v1::internal::StepResult> results_;  // (step, rank)
  struct Sent {
    int64_t bytes = 0;
    uint64_t epoch = 0;
  };
  // (step, rank) -> what was sent, for every part sent and not yet collected or abandoned: also
  // the set of results a rank may deliver.
  std::map<std::pair<uint64_t, int>, Sent> sent_;  // guarded by mu_
  int64_t dropped_results_ = 0;                    // guarded by mu_
  std::function<void(int)> on_dropped_result_;
  std::vector<uint8_t> staging_;  // device -> host copies of rows (GPU gateway)
  std::mutex staging_mu_;
};

class GrpcRankTransport final : public RankTransport {
 public:
  // `stream` is an open Exchange stream on which the rank already sent its hello.
  // Control messages from the gateway (LoadShards, KeepShards) go to `on_control`, on the
  // reader thread: it must not block (the rank's heartbeats are heard there).
  GrpcRankTransport(
      std::unique_ptr<grpc::ClientContext> context, std::unique_ptr<ExchangeClientStream> stream,
      Backend* backend, const LivenessOptions& liveness = {},
      std::function<void(const moe::v1::internal::GatewayToRank&)> on_control = nullptr);
  ~GrpcRankTransport() override;

  std::string name() const override { return "grpc"; }
  absl::StatusOr<ReceivedStep> Receive() override;
  absl::Status Reply(uint64_t step_id, const absl::StatusOr<ConstPartialView>& partial,
                     const RankStepStats& stats) override;
  // Writes a control message (ShardsLoaded) between replies.
  absl::Status SendControl(const moe::v1::internal::RankToGateway& message);
  // Unblocks Receive (shutdown).
  void Cancel();

 private:
  void ReadLoop();

  std::unique_ptr<grpc::ClientContext> context_;
  std::unique_ptr<ExchangeClientStream> stream_;
  Backend* backend_;
  const LivenessOptions liveness_options_;
  const std::function<void(const moe::v1::internal::GatewayToRank&)> on_control_;
  std::mutex write_mu_;         // Reply, heartbeats and the final Finish
  bool stream_closed_ = false;  // guarded by write_mu_
  std::mutex inbox_mu_;
  std::condition_variable inbox_cv_;
  std::deque<moe::v1::internal::GatewayToRank> inbox_;  // steps read ahead by reader_
  absl::Status stream_end_;                             // set (not OK) once the stream ended
  std::unique_ptr<DeviceBuffer> rows_;
  ActivationRows host_rows_;  // the current step's rows, in the wire's dtype
  std::vector<double> host_partial_;
  std::unique_ptr<StreamLiveness> liveness_;  // its threads use the members above
  std::thread reader_;
};

}  // namespace moe
