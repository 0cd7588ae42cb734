// The step exchange between the gateway and its ranks (the data plane): one interface, three
// equal implementations, none of which decides who is up (the control plane does, and tells
// them: RankDown / RankUp).
//
//   gRPC (transport/grpc_transport.h): steps and results on the ranks' exchange streams, any
//        host, CPU or GPU.
//   NCCL (transport/nccl_transport.h): the gateway and the ranks form one communicator;
//        counts first, then rows, then partial sums, as grouped ncclSend/ncclRecv.
//   loopback (transport/loopback_transport.h): in-process shards.
//
// One step, as the gateway sees it:
//   Send(dispatch)   rank r receives the expert-input rows of the tokens that chose at least
//                    one of its experts (each token once), with per row its local expert ids
//                    and gates (RowAssignments). Ranks that get no rows get no message.
//   Collect(...)     waits for one fp64 partial sum per row from every rank that got rows,
//                    and hands them over in ascending rank order.
// A rank's view: Receive() the next step, compute, Reply() with the partial sums.
//
// The contract every implementation keeps (tests/transport/conformance_test.cc checks loopback,
// gRPC, and NCCL on the CUDA emulator with every member on a device of its own):
//   - Steps of different layers may be in flight at once, one caller thread per layer: none
//     fails because another is in flight (Send may wait for the wire: NCCL has one step on it).
//   - Rows travel as the gateway stored them, in the step's precision (bf16 bits in a bf16
//     step); Send refuses others (INVALID_ARGUMENT) before anything moves.
//   - Partials reach `consume` in ascending rank order, exactly as the rank computed them.
//   - Collect fails DEADLINE_EXCEEDED once `deadline` passes, UNAVAILABLE naming the rank when a
//     rank that got rows is told down (it died, or stayed silent for the liveness timeout:
//     stream_liveness.h), and RankFailure(rank, its error) when a rank reports one.
//   - Abandon(step) after a failure: the step's late results are dropped, later steps work;
//     except that a collective (NCCL) cannot lose a member or a step and go on: after a passed
//     deadline or a rank gone it has aborted its communicator, and later steps fail
//     UNAVAILABLE until the group forms a new one.
//   - The transport counts the bytes it moved per rank and step (RankStepStats, ReceivedStep).
//   - A step's placement generation reaches the rank unchanged (ReceivedStep).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "kernels/backend.h"
#include "model/dispatch.h"

namespace moe {

// Precision on every wire (moe.v1.internal.Precision, whose values these are: checked where
// the generated code is visible, transport/grpc_transport.cc). 0 is "unspecified": refused.
constexpr int32_t WirePrecision(Precision p) { return p == Precision::kBF16 ? 1 : 2; }
inline absl::StatusOr<Precision> PrecisionFromWire(int32_t value) {
  if (value == 1) return Precision::kBF16;
  if (value == 2) return Precision::kFP32;
  return absl::InvalidArgumentError(absl::StrCat("unknown step precision ", value));
}

// What one rank gets in a step. `rows` lives in the gateway backend's memory, stored in the
// step's precision (bf16 bits in a bf16 step, as the wire carries them; fp32 in an fp32 step):
// transports send them as they are.
struct RankPart {
  int rank = 0;
  ActivationView rows;  // [num_rows, width]
  const RowAssignments* assignments = nullptr;
};

struct StepDispatch {
  uint64_t step_id = 0;
  int layer = 0;
  Precision precision = Precision::kBF16;
  // The expert placement the step was planned with: the assignments' local expert ids index
  // that generation's shard on each rank (live re-placement keeps two generations loaded).
  uint64_t placement_generation = 0;
  std::vector<RankPart> parts;  // ascending rank, non-empty parts only
};

// INVALID_ARGUMENT unless every part's rows are stored in the step's precision (each Send
// checks this before anything moves).
inline absl::Status CheckRowStorage(const StepDispatch& dispatch) {
  for (const RankPart& part : dispatch.parts)
    if (part.rows.dtype != dispatch.precision)
      return absl::InvalidArgumentError(absl::StrCat(
          "step ", dispatch.step_id, ": rank ", part.rank, "'s rows are ",
          PrecisionName(part.rows.dtype), ", the step is ", PrecisionName(dispatch.precision)));
  return absl::OkStatus();
}

// Per-rank statistics returned with a result.
struct RankStepStats {
  int64_t compute_us = 0;
  int active_experts = 0;  // distinct local experts touched
  // What the step moved between the gateway and this rank, counted by the transport: the bytes
  // it put on the wire to the rank and took off it (message framing included; 0 for loopback).
  int64_t bytes_sent = 0, bytes_received = 0;
};

// The caller's status for a rank's failed step, the same in every transport: a rank's internal
// failure (INTERNAL, UNKNOWN, DATA_LOSS: a fault of that process, not of the request) makes the
// service UNAVAILABLE for the step, so clients may retry elsewhere; any other code (the rank
// found the request bad, ran out of memory, ...) passes through. The message names the rank.
inline absl::Status RankFailure(int rank, absl::StatusCode code, absl::string_view message) {
  const bool fault = code == absl::StatusCode::kInternal || code == absl::StatusCode::kUnknown ||
                     code == absl::StatusCode::kDataLoss;
  return absl::Status(fault ? absl::StatusCode::kUnavailable : code,
                      absl::StrCat("rank ", rank, ": ", message));
}
inline absl::Status RankFailure(int rank, const absl::Status& status) {
  return RankFailure(rank, status.code(), status.message());
}

class GatewayTransport {
 public:
  virtual ~GatewayTransport() = default;
  virtual std::string name() const = 0;

  // Starts a step (non-blocking where the transport allows). Fails with UNAVAILABLE when a
  // rank that gets rows is down.
  virtual absl::Status Send(const StepDispatch& dispatch) = 0;

  // Waits for the partial sums of `dispatch` and calls consume(part index, partial) in
  // ascending rank order; `partial` ([rows, width] fp64) lives in the gateway backend's
  // memory and is valid during the call. Errors: UNAVAILABLE (a rank died or reported an
  // internal failure), DEADLINE_EXCEEDED (deadline passed), or the rank's own error.
  virtual absl::Status Collect(
      const StepDispatch& dispatch, absl::Time deadline,
      const std::function<absl::Status(size_t, ConstPartialView, const RankStepStats&)>&
          consume) = 0;

  // Gives up on a step (after a failure): late results are dropped.
  virtual void Abandon(uint64_t step_id) = 0;

  // Membership, told by the control plane (transport/membership.h, server/control), which
  // alone decides who is up: `rank` went down (its exchange ended or fell silent), and the steps
  // waiting on it fail UNAVAILABLE now, not at their deadline; or it is up again. The step
  // engine dispatches only to ranks the membership has up, and after a failed step
  // re-dispatches to live replicas of the same experts.
  virtual void RankDown(int rank, absl::string_view why) {}
  virtual void RankUp(int rank) {}
};

// A step as a rank receives it; `rows` lives in the rank backend's memory and stays valid
// until the next Receive. A bf16 step's rows are bf16 as they came off the wire (gRPC, NCCL);
// loopback hands over the gateway's fp32 rows in place.
struct ReceivedStep {
  uint64_t step_id = 0;
  int layer = 0;
  Precision precision = Precision::kBF16;
  uint64_t placement_generation = 0;
  ActivationView rows;
  RowAssignments assignments;
  int64_t wire_bytes = 0;  // what the transport took off the wire for this step
};

class RankTransport {
 public:
  virtual ~RankTransport() = default;
  virtual std::string name() const = 0;
  // Blocks for the next step. CANCELLED when the gateway closed the exchange (shutdown),
  // UNAVAILABLE when the connection broke.
  virtual absl::StatusOr<ReceivedStep> Receive() = 0;
  // Sends the step's partial sums ([rows, width] fp64, rank backend memory) or its error.
  virtual absl::Status Reply(uint64_t step_id, const absl::StatusOr<ConstPartialView>& partial,
                             const RankStepStats& stats) = 0;
};

}  // namespace moe
