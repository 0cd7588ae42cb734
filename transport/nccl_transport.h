// The NCCL transport: the gateway and its R expert ranks form ONE communicator of R + 1
// members (expert rank r = NCCL rank r, the gateway = NCCL rank R). The gateway creates the
// ncclUniqueId (NewNcclUniqueId) and the control plane hands it out
// (RegisterResponse.nccl_unique_id / nccl_rank / num_ranks); every member then calls Create,
// which joins the communicator (ncclCommInitRankConfig, non-blocking, bounded by
// init_timeout). Both sides need a CudaBackend (device memory, one device per process).
//
// One step, in three grouped phases (one ncclGroupStart/End each), all on the transport's
// own CUDA stream, which is ordered after the backend's stream by an event:
//
//   phase    who -> whom          what (bytes)                         lands in
//   1 head   gateway -> EVERY r   StepHeader (56 B): magic, kind        rank r: header buffer
//                                 (step | shutdown), step_id, layer,
//                                 precision, num_rows, width,
//                                 num_assignments (counts first)
//   2 rows   gateway -> r with    meta: row_offsets i32[num_rows + 1],  rank r: meta buffer,
//            num_rows > 0         local_experts i32[A], gates f32[A];   then row_offsets /
//                                 rows [num_rows, width]: bf16 in bf16  local_experts / gates
//                                 mode (as the gateway's gather wrote   on the host, rows in
//                                 them), else fp32                      the device as sent
//   3 reply  r -> gateway, for    ReplyHeader (256 B): magic, code      gateway: reply slot
//            each r that got      (absl::StatusCode), step_id,          of r, partial slot of
//            rows                 compute_us, active_experts, sizes,    r (fp64 [num_rows,
//                                 error text; partial fp64              width], contiguous)
//                                 [num_rows, width] (zeros on error)
//
// The gateway posts phases 1-3 in Send (non-blocking) and Collect polls the stream
// (cudaStreamQuery) until the deadline, then hands the partials to `consume` in ascending
// rank order. A rank that received num_rows == 0 gets nothing more and sends nothing
// (RankTransport::Receive keeps waiting for its next step). A rank that fails a step still
// sends its ReplyHeader with the error code and a zero partial, so the gateway never hangs on
// a rank error. Shutdown sends a `shutdown` header to every rank (their Receive returns
// CANCELLED).
//
// Failures: a deadline that passes or an asynchronous NCCL error (a peer died) aborts the
// communicator (ncclCommAbort) and fails with DEADLINE_EXCEEDED / UNAVAILABLE. An aborted
// communicator cannot be reused: every later call fails with UNAVAILABLE, and the whole group
// (gateway and every rank) must build a new one from a new unique id (the control plane
// re-registers the ranks).
//
// Two members on one GPU: NCCL refuses them ("Duplicate GPU detected", ncclInvalidUsage)
// unless they claim different hosts (NCCL_HOSTID differs per process), in which case they
// talk through the socket transport; tests/cuda/nccl_transport_test.cc does that on
// one-GPU machines.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kernels/cuda/cuda_backend.h"
#include "transport/transport.h"

namespace moe {

// A fresh ncclUniqueId as bytes (sizeof(ncclUniqueId) = 128). Call it in the gateway
// process: NCCL's bootstrap root listens in the process that created the id.
absl::StatusOr<std::string> NewNcclUniqueId();

struct NcclGatewayOptions {
  int num_ranks = 0;      // R expert ranks; the communicator has R + 1 members
  std::string unique_id;  // NewNcclUniqueId()
  // The gateway's: the rows are read from its device memory and the partials land in it; the
  // transport's stream waits for its stream's queued work before each step.
  CudaBackend* backend = nullptr;
  // Create waits at most this long for every rank to join.
  absl::Duration init_timeout = absl::Seconds(120);
  // Bound on draining a step (Abandon) and on Shutdown.
  absl::Duration drain_timeout = absl::Seconds(30);
};

class NcclGatewayTransport final : public GatewayTransport {
 public:
  // Joins the communicator as NCCL rank num_ranks. Blocks until all R ranks have joined
  // (so run it beside the control plane that hands out the id), or fails: DEADLINE_EXCEEDED
  // after init_timeout, FAILED_PRECONDITION when NCCL refuses the setup (e.g. two members
  // on one GPU), UNAVAILABLE for other NCCL failures.
  static absl::StatusOr<std::unique_ptr<NcclGatewayTransport>> Create(
      const NcclGatewayOptions& options);
  ~NcclGatewayTransport() override;  // Shutdown (best effort), then frees the communicator

  std::string name() const override { return "nccl"; }
  absl::Status Send(const StepDispatch& dispatch) override;
  absl::Status Collect(const StepDispatch& dispatch, absl::Time deadline,
                       const std::function<absl::Status(size_t, ConstPartialView,
                                                        const RankStepStats&)>& consume) override;
  void Abandon(uint64_t step_id) override;
  // Aborts the communicator (a member is gone: the group cannot finish a step without it), so
  // a Collect waiting on the stream fails UNAVAILABLE at once. Any thread, any time.
  void RankDown(int rank, absl::string_view why) override;

  // Tells every rank the exchange is over (their Receive returns CANCELLED) and finalizes
  // the communicator. Idempotent.
  absl::Status Shutdown();
  // True after an abort: the group must build a new communicator.
  bool broken() const;

  struct State;

 private:
  explicit NcclGatewayTransport(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

struct NcclRankOptions {
  int rank = 0;                    // this rank's index = its NCCL rank (RegisterResponse.nccl_rank)
  int num_ranks = 0;               // R; the gateway is NCCL rank R
  std::string unique_id;           // RegisterResponse.nccl_unique_id
  CudaBackend* backend = nullptr;  // the rank's: received rows live in, partials are read from
  absl::Duration init_timeout = absl::Seconds(120);
  // After a header announcing rows, the rows must arrive within this; a Reply must be
  // taken by the gateway within this. Past it the communicator is aborted (UNAVAILABLE).
  absl::Duration step_timeout = absl::Seconds(60);
};

class NcclRankTransport final : public RankTransport {
 public:
  static absl::StatusOr<std::unique_ptr<NcclRankTransport>> Create(const NcclRankOptions& options);
  ~NcclRankTransport() override;

  std::string name() const override { return "nccl"; }
  // Blocks (no deadline: a rank idles between steps) until a step brings rows for this
  // rank. CANCELLED on the gateway's shutdown or after Cancel(); UNAVAILABLE when the
  // communicator broke. FAILED_PRECONDITION if the previous step has not been replied to.
  absl::StatusOr<ReceivedStep> Receive() override;
  // Sends the step's partial sums ([rows, width] fp64 in the rank backend's memory, any row
  // stride) or its error (then a zero partial); returns once NCCL has taken the data.
  absl::Status Reply(uint64_t step_id, const absl::StatusOr<ConstPartialView>& partial,
                     const RankStepStats& stats) override;
  // From any thread: makes a blocked Receive return CANCELLED (aborts the communicator).
  void Cancel();

  struct State;

 private:
  explicit NcclRankTransport(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace moe
