// The gRPC transport: the step exchange over one persistent bidirectional stream per rank
// (moe.v1.internal.RankControl/Exchange), opened by the rank so that only the gateway needs
// to be reachable. Usable across hosts; the default on hosts without GPUs.
//
// Wire format per step (DESIGN.md "Dispatch rule"):
//   gateway -> rank r  StepRequest: rows [num_rows, width] as bf16 (bf16 mode, exact: the
//                      rows are bf16 values) or fp32, plus per row its local experts and gates.
//   rank r -> gateway  StepResult: fp64 partial sums [num_rows, width], or an error code.
// Both sides also send a Heartbeat every LivenessOptions::heartbeat; a rank silent for
// peer_timeout is marked down (its waiting steps fail UNAVAILABLE) and its stream cancelled, and
// a rank that hears nothing from the gateway for as long gives up on the stream.
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

class GrpcGatewayTransport final : public GatewayTransport {
 public:
  // `backend` is the gateway's: rows are read from, partials written to, its memory.
  GrpcGatewayTransport(int num_ranks, Backend* backend, const LivenessOptions& liveness = {});

  std::string name() const override { return "grpc"; }
  absl::Status Send(const StepDispatch& dispatch) override;
  absl::Status Collect(const StepDispatch& dispatch, absl::Time deadline,
                       const std::function<absl::Status(size_t, ConstPartialView,
                                                        const RankStepStats&)>& consume) override;
  void Abandon(uint64_t step_id) override;

  // Runs rank `rank`'s side of the exchange on `stream` (the Exchange handler's thread, whose
  // `context` it cancels when the rank falls silent) until the stream ends. The rank counts as
  // up meanwhile, unless it fell silent. Control messages from the rank (anything but results
  // and heartbeats: ShardsLoaded, PlacementOffer) go to `on_control`, on this thread.
  absl::Status ServeRank(
      int rank, ExchangeServerStream* stream, grpc::ServerContext* context,
      const std::function<void(const moe::v1::internal::RankToGateway&)>& on_control = nullptr);
  // Writes a control message (LoadShards, KeepShards) on rank `rank`'s stream, between steps'
  // writes. UNAVAILABLE when the rank is down.
  absl::Status SendControl(int rank, const moe::v1::internal::GatewayToRank& message);
  // Cancels every rank's stream (shutdown: they never end on their own).
  void CloseRankStreams();
  bool RankUp(int rank) const override { return IsUp(rank); }
  bool IsUp(int rank) const;
  // Results that came for steps not awaited (abandoned, or never sent to that rank): dropped.
  int64_t dropped_results() const;
  int num_up() const;
  // Called (outside locks) whenever a rank goes up or down.
  void SetRankStateCallback(std::function<void(int rank, bool up)> callback);
  // Called (outside locks) for every result dropped as not awaited, with the rank it came from.
  void SetDroppedResultCallback(std::function<void(int rank)> callback);

 private:
  struct Channel {
    std::mutex write_mu;                     // one Write at a time per stream
    ExchangeServerStream* stream = nullptr;  // guarded by mu_
    grpc::ServerContext* context = nullptr;  // guarded by mu_: the stream's call
    bool silent = false;                     // guarded by mu_: heard nothing for peer_timeout
    // Guarded by mu_; set once the rank was reported down (so a caller that sees its step fail
    // also sees health updated): why, for the steps that waited on it. Empty while up.
    std::string down_reason;
  };
  bool UpLocked(int rank) const;  // mu_ held
  // After the rank state callback ran: fails the steps waiting on the channel with `reason`.
  void MarkDown(Channel& channel, std::string reason);
  Backend* backend_;
  const LivenessOptions liveness_;
  std::vector<std::unique_ptr<Channel>> channels_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::pair<uint64_t, int>, moe::v1::internal::StepResult> results_;  // (step, rank)
  // (step, rank) -> bytes, for every part sent and not yet collected or abandoned: also the
  // set of results a rank may deliver.
  std::map<std::pair<uint64_t, int>, int64_t> sent_bytes_;
  int64_t dropped_results_ = 0;  // results for steps not awaited (guarded by mu_)
  std::function<void(int, bool)> on_rank_state_;
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
  std::vector<float> host_rows_;
  std::vector<double> host_partial_;
  std::unique_ptr<StreamLiveness> liveness_;  // its threads use the members above
  std::thread reader_;
};

}  // namespace moe
