#include "transport/nccl_transport.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/growable_memory.h"

namespace moe {
namespace {

// ---- wire format ------------------------------------------------------------------------------

constexpr uint32_t kMagic = 0x314f454d;  // "MEO1" little-endian
constexpr uint32_t kKindStep = 1;
constexpr uint32_t kKindShutdown = 2;

// Phase 1: gateway -> every rank, every step.
struct StepHeader {
  uint32_t magic;
  uint32_t kind;  // kKindStep | kKindShutdown
  uint64_t step_id;
  int32_t layer;
  int32_t precision;  // WirePrecision (transport/transport.h): 1 bf16, 2 fp32
  int64_t num_rows;   // 0: nothing follows for this rank this step
  int64_t width;
  int64_t num_assignments;
  uint64_t placement_generation;  // StepDispatch::placement_generation
};
static_assert(sizeof(StepHeader) == 56, "wire layout");

// Phase 3: rank -> gateway, for every step that brought the rank rows.
struct ReplyHeader {
  uint32_t magic;
  int32_t code;  // absl::StatusCode; 0 = OK
  uint64_t step_id;
  int64_t compute_us;
  int32_t active_experts;
  int32_t reserved;
  int64_t num_rows;
  int64_t width;
  char message[208];  // NUL-terminated error text
};
static_assert(sizeof(ReplyHeader) == 256, "wire layout");

// Phase 2 meta: row_offsets i32[n + 1], local_experts i32[A], gates f32[A].
size_t MetaBytes(int64_t rows, int64_t assignments) {
  return static_cast<size_t>(rows + 1 + 2 * assignments) * 4;
}

size_t Align16(size_t v) { return (v + 15) / 16 * 16; }

// ---- status -----------------------------------------------------------------------------------

absl::Status NcclError(ncclResult_t r, absl::string_view what, ncclComm_t comm) {
  const char* last = ncclGetLastError(comm);
  const std::string message =
      absl::StrCat(what, ": ", ncclGetErrorString(r),
                   last != nullptr && *last ? absl::StrCat(" (", last, ")") : std::string());
  switch (r) {
    case ncclInvalidUsage:
      return absl::FailedPreconditionError(message);
    case ncclInvalidArgument:
      return absl::InvalidArgumentError(message);
    default:
      return absl::UnavailableError(message);
  }
}

// An NCCL call on `comm_object` (a Comm): in non-blocking mode ncclInProgress means "queued",
// not an error; a real error aborts the communicator and returns.
#define NCCL_RETURN_IF_ERROR(expr, comm_object) RETURN_IF_ERROR((comm_object).Check((expr), #expr))

// Polling: busy for the first 200 us (a decode step's exchange is that short), then sleeps
// of growing length up to 1 ms.
class Backoff {
 public:
  void Wait() {
    const auto elapsed = std::chrono::steady_clock::now() - start_;
    if (elapsed < std::chrono::microseconds(200)) {
      std::this_thread::yield();
    } else if (elapsed < std::chrono::milliseconds(20)) {
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }

 private:
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

// ---- the communicator ---------------------------------------------------------------------------

// One member's communicator and its stream. Every wait is bounded by a deadline (or a cancel
// flag); any failure aborts the communicator, after which it is `broken` for good.
class Comm {
 public:
  ~Comm() {
    cuda::ScopedDevice guard(device_);
    if (comm_ != nullptr) ncclCommAbort(comm_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);  // released once its work is done
  }

  cudaStream_t stream() const { return stream_; }
  ncclComm_t get() const { return comm_; }
  bool broken() const { return broken_; }
  absl::Status BrokenStatus() const {
    return absl::UnavailableError(
        absl::StrCat("NCCL communicator was aborted (", reason_,
                     "); the gateway and every rank must build a new one"));
  }

  // On `device` (the caller has made it current).
  absl::Status Init(const std::string& unique_id, int device, int world, int rank,
                    absl::Time deadline) {
    device_ = device;
    if (unique_id.size() != sizeof(ncclUniqueId))
      return absl::InvalidArgumentError(absl::StrCat("NCCL unique id has ", unique_id.size(),
                                                     " bytes, expected ", sizeof(ncclUniqueId)));
    CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    ncclUniqueId id;
    std::memcpy(&id, unique_id.data(), sizeof(id));
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;  // every wait below is ours, with a deadline
    const ncclResult_t r = ncclCommInitRankConfig(&comm_, world, id, rank, &config);
    if (r != ncclSuccess && r != ncclInProgress) {
      const absl::Status s = NcclError(
          r, absl::StrCat("ncclCommInitRankConfig(world ", world, ", rank ", rank, ")"), comm_);
      Abort(std::string(s.message()));
      return s;
    }
    absl::Status s = WaitReady(deadline);
    if (absl::IsDeadlineExceeded(s))
      return absl::DeadlineExceededError(
          absl::StrCat("NCCL communicator of ", world, " members (this is rank ", rank,
                       "): not every member joined before the deadline"));
    return s;
  }

  // Waits until the communicator's queued NCCL calls are issued (non-blocking mode).
  absl::Status WaitReady(absl::Time deadline) {
    if (broken_) return BrokenStatus();
    Backoff backoff;
    while (true) {
      ncclResult_t state = ncclSuccess;
      const ncclResult_t r = ncclCommGetAsyncError(comm_, &state);
      if (r != ncclSuccess) return Fail(NcclError(r, "ncclCommGetAsyncError", comm_));
      if (state == ncclSuccess) return absl::OkStatus();
      if (state != ncclInProgress) return Fail(NcclError(state, "NCCL", comm_));
      if (absl::Now() >= deadline)
        return Fail(absl::DeadlineExceededError("NCCL call did not complete before the deadline"));
      backoff.Wait();
    }
  }

  // Waits until the stream's queued work (NCCL and copies) completes.
  absl::Status WaitStream(absl::Time deadline, const std::atomic<bool>* cancel) {
    if (broken_) return BrokenStatus();
    Backoff backoff;
    while (true) {
      const cudaError_t q = cudaStreamQuery(stream_);
      if (q == cudaSuccess) return absl::OkStatus();
      if (q != cudaErrorNotReady)
        return Fail(cuda::CudaStatus(q, "cudaStreamQuery", __FILE__, __LINE__));
      ncclResult_t state = ncclSuccess;
      if (ncclCommGetAsyncError(comm_, &state) == ncclSuccess && state != ncclSuccess &&
          state != ncclInProgress)
        return Fail(NcclError(state, "NCCL asynchronous error (a peer failed?)", comm_));
      if (cancel != nullptr && cancel->load())
        return Fail(absl::CancelledError("exchange cancelled"));
      if (absl::Now() >= deadline)
        return Fail(
            absl::DeadlineExceededError("NCCL exchange did not complete before the deadline"));
      backoff.Wait();
    }
  }

  // The result of an NCCL call; a failure aborts the communicator (the peers are mid-protocol).
  absl::Status Check(ncclResult_t r, const char* expr) {
    if (r == ncclSuccess || r == ncclInProgress) return absl::OkStatus();
    return Fail(NcclError(r, expr, comm_));
  }

  // Graceful end: ncclCommFinalize (bounded), then ncclCommDestroy; abort if it does not
  // finish in time.
  void Finalize(absl::Time deadline) {
    if (comm_ == nullptr) return;
    if (!Check(ncclCommFinalize(comm_), "ncclCommFinalize").ok()) return;  // aborted
    if (!WaitReady(deadline).ok()) return;                                 // aborted
    ncclCommDestroy(comm_);
    comm_ = nullptr;
    broken_ = true;
    reason_ = "finalized";
  }

  void Abort(const std::string& reason) {
    if (comm_ != nullptr) ncclCommAbort(comm_);
    comm_ = nullptr;
    broken_ = true;
    reason_ = reason;
  }

 private:
  absl::Status Fail(absl::Status s) {
    Abort(std::string(s.message()));
    return s;
  }

  int device_ = 0;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  bool broken_ = false;
  std::string reason_;
};

}  // namespace

absl::StatusOr<std::string> NewNcclUniqueId() {
  ncclUniqueId id;
  const ncclResult_t r = ncclGetUniqueId(&id);
  if (r != ncclSuccess) return NcclError(r, "ncclGetUniqueId", nullptr);
  return std::string(reinterpret_cast<const char*>(&id), sizeof(id));
}

// ---- gateway ----------------------------------------------------------------------------------

struct NcclGatewayTransport::State {
  NcclGatewayOptions options;
  int device = 0;
  cudaStream_t backend_stream = nullptr;
  cudaEvent_t ready = nullptr;  // the backend's queued work, as the step starts
  std::mutex mu;

  struct Peer {
    cuda::DeviceMemory meta, rows, reply, partial;
  };
  std::vector<Peer> peers;
  cuda::DeviceMemory headers;  // R x StepHeader
  cuda::PinnedMemory host_headers, host_meta, host_replies;

  bool in_flight = false;
  uint64_t in_flight_step = 0;
  std::condition_variable slot_free;  // in_flight went false (or the transport stopped)
  // Set by RankDown from any thread; the stream waits poll it. `peer_down_why` is written
  // before the flag is raised and read only after it is seen.
  std::atomic<bool> peer_down{false};
  std::mutex peer_down_mu;  // serializes RankDown callers
  std::string peer_down_why;
  bool shut_down = false;
  Comm comm;  // last: destroyed (aborted if still alive) before the buffers it may use

  ~State() {
    if (ready != nullptr) cudaEventDestroy(ready);
  }

  int R() const { return options.num_ranks; }
  ReplyHeader* HostReply(int r) { return reinterpret_cast<ReplyHeader*>(host_replies.get()) + r; }

  // Sends a StepHeader to every rank (phase 1): `base` with rank r's row and assignment counts
  // (empty vectors: zeros, as a shutdown header has).
  absl::Status SendHeaders(const StepHeader& base, const std::vector<int64_t>& rows,
                           const std::vector<int64_t>& assignments) {
    auto* h = reinterpret_cast<StepHeader*>(host_headers.get());
    for (int r = 0; r < R(); ++r) {
      h[r] = base;
      h[r].num_rows = rows.empty() ? 0 : rows[r];
      h[r].num_assignments = assignments.empty() ? 0 : assignments[r];
    }
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(headers.get(), h, sizeof(StepHeader) * R(),
                                         cudaMemcpyHostToDevice, comm.stream()));
    NCCL_RETURN_IF_ERROR(ncclGroupStart(), comm);
    for (int r = 0; r < R(); ++r)
      NCCL_RETURN_IF_ERROR(ncclSend(headers.get() + sizeof(StepHeader) * r, sizeof(StepHeader),
                                    ncclUint8, r, comm.get(), comm.stream()),
                           comm);
    NCCL_RETURN_IF_ERROR(ncclGroupEnd(), comm);
    return comm.WaitReady(absl::Now() + options.drain_timeout);
  }

  absl::Status Drain() {
    if (!in_flight) return absl::OkStatus();
    in_flight = false;
    slot_free.notify_all();
    return comm.WaitStream(absl::Now() + options.drain_timeout, nullptr);
  }
};

NcclGatewayTransport::NcclGatewayTransport(std::unique_ptr<State> state)
    : state_(std::move(state)) {}

absl::StatusOr<std::unique_ptr<NcclGatewayTransport>> NcclGatewayTransport::Create(
    const NcclGatewayOptions& options) {
  if (options.backend == nullptr)
    return absl::InvalidArgumentError("NCCL gateway transport needs the gateway's CUDA backend");
  if (options.num_ranks <= 0)
    return absl::InvalidArgumentError(
        absl::StrCat("NCCL gateway transport: num_ranks ", options.num_ranks));
  auto state = std::make_unique<State>();
  state->options = options;
  state->device = options.backend->device();
  state->backend_stream = options.backend->stream();
  cuda::ScopedDevice guard(state->device);
  CUDA_RETURN_IF_ERROR(guard.status());
  CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&state->ready, cudaEventDisableTiming));
  state->peers.resize(options.num_ranks);
  RETURN_IF_ERROR(state->headers.Ensure(sizeof(StepHeader) * options.num_ranks));
  RETURN_IF_ERROR(state->host_headers.Ensure(sizeof(StepHeader) * options.num_ranks));
  RETURN_IF_ERROR(state->host_replies.Ensure(sizeof(ReplyHeader) * options.num_ranks));
  RETURN_IF_ERROR_CTX(state->comm.Init(options.unique_id, state->device, options.num_ranks + 1,
                                       options.num_ranks, absl::Now() + options.init_timeout),
                      "NCCL gateway");
  return std::unique_ptr<NcclGatewayTransport>(new NcclGatewayTransport(std::move(state)));
}

NcclGatewayTransport::~NcclGatewayTransport() {
  if (state_ == nullptr) return;
  Shutdown().IgnoreError();
}

bool NcclGatewayTransport::broken() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->comm.broken();
}

namespace {

// What a step's parts hold, per rank: rows, assignments; the common width and the pinned bytes
// their metadata takes. INVALID_ARGUMENT for parts out of rank order or inconsistent with their
// assignments (nothing has moved yet).
struct PartSizes {
  std::vector<int64_t> rows, assignments;
  int64_t width = -1;
  size_t meta_total = 0;
};

absl::StatusOr<PartSizes> SizeParts(const StepDispatch& dispatch, int R) {
  PartSizes sizes;
  sizes.rows.assign(R, 0);
  sizes.assignments.assign(R, 0);
  int previous = -1;
  for (const RankPart& part : dispatch.parts) {
    if (part.rank <= previous || part.rank >= R)
      return absl::InvalidArgumentError(absl::StrCat("NCCL Send: part for rank ", part.rank,
                                                     " out of order or outside [0, ", R, ")"));
    previous = part.rank;
    const RowAssignments* a = part.assignments;
    if (a == nullptr) return absl::InvalidArgumentError("NCCL Send: part without assignments");
    const int64_t n = part.rows.rows;
    if (a->num_rows() != n || a->offsets.front() != 0 ||
        a->offsets.back() != static_cast<int32_t>(a->local_experts.size()) ||
        a->gates.size() != a->local_experts.size())
      return absl::InvalidArgumentError(
          absl::StrCat("NCCL Send: rank ", part.rank, ": assignments do not match ", n, " rows"));
    if (sizes.width >= 0 && part.rows.cols != sizes.width)
      return absl::InvalidArgumentError("NCCL Send: parts of one step differ in width");
    sizes.width = part.rows.cols;
    if (n > 0 && (part.rows.data == nullptr || part.rows.stride < sizes.width || sizes.width <= 0))
      return absl::InvalidArgumentError("NCCL Send: bad rows view");
    sizes.rows[part.rank] = n;
    sizes.assignments[part.rank] = static_cast<int64_t>(a->local_experts.size());
    if (n > 0) sizes.meta_total += Align16(MetaBytes(n, sizes.assignments[part.rank]));
  }
  return sizes;
}

}  // namespace

absl::Status NcclGatewayTransport::Send(const StepDispatch& dispatch) {
  State& st = *state_;
  std::unique_lock<std::mutex> lock(st.mu);
  // One step on the wire at a time (the buffers are per peer): a step of another layer waits
  // here until the one in flight is collected or abandoned, which its own deadline bounds.
  st.slot_free.wait(lock, [&] { return !st.in_flight || st.shut_down || st.comm.broken(); });
  if (st.shut_down) return absl::FailedPreconditionError("NCCL transport was shut down");
  if (st.peer_down.load() && !st.comm.broken()) st.comm.Abort(st.peer_down_why);
  if (st.comm.broken()) return st.comm.BrokenStatus();
  // Validate everything before the first byte moves.
  const size_t esize = ElementBytes(dispatch.precision);
  RETURN_IF_ERROR(CheckRowStorage(dispatch));
  ASSIGN_OR_RETURN(const PartSizes sizes, SizeParts(dispatch, st.R()));
  const std::vector<int64_t>& rows = sizes.rows;
  const std::vector<int64_t>& assignments = sizes.assignments;
  const int64_t width = sizes.width;
  const size_t meta_total = sizes.meta_total;

  cuda::ScopedDevice guard(st.device);
  CUDA_RETURN_IF_ERROR(guard.status());
  // From here on a failure leaves the ranks mid-protocol: abort, the group must rebuild.
  auto fail = [&](const absl::Status& s) {
    st.comm.Abort(std::string(s.message()));
    return absl::UnavailableError(absl::StrCat("NCCL Send: ", s.message()));
  };
  auto run = [&]() -> absl::Status {
    // The rows were written by the backend's stream, and the partial buffers of the previous
    // step may still be read by it (consume): our stream starts after the backend's queued
    // work. Growing a buffer frees the old one, so then the host waits for it as well.
    CUDA_RETURN_IF_ERROR(cudaEventRecord(st.ready, st.backend_stream));
    bool grow = false;
    for (const RankPart& part : dispatch.parts) {
      const int64_t n = part.rows.rows;
      if (n == 0) continue;
      const State::Peer& peer = st.peers[part.rank];
      grow = grow || !peer.meta.Fits(MetaBytes(n, assignments[part.rank])) ||
             !peer.rows.Fits(static_cast<size_t>(n * width) * esize) ||
             !peer.reply.Fits(sizeof(ReplyHeader)) ||
             !peer.partial.Fits(static_cast<size_t>(n * width) * sizeof(double));
    }
    if (grow) CUDA_RETURN_IF_ERROR(cudaEventSynchronize(st.ready));
    CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(st.comm.stream(), st.ready, 0));
    RETURN_IF_ERROR(st.host_meta.Ensure(std::max<size_t>(meta_total, 16)));
    size_t meta_at = 0;
    for (const RankPart& part : dispatch.parts) {
      const int64_t n = part.rows.rows;
      if (n == 0) continue;
      State::Peer& peer = st.peers[part.rank];
      const RowAssignments& a = *part.assignments;
      const int64_t A = static_cast<int64_t>(a.local_experts.size());
      const size_t meta_bytes = MetaBytes(n, A);
      const size_t row_bytes = static_cast<size_t>(n * width) * esize;
      RETURN_IF_ERROR(peer.meta.Ensure(meta_bytes));
      RETURN_IF_ERROR(peer.rows.Ensure(row_bytes));
      RETURN_IF_ERROR(peer.reply.Ensure(sizeof(ReplyHeader)));
      RETURN_IF_ERROR(peer.partial.Ensure(static_cast<size_t>(n * width) * sizeof(double)));
      // meta: host (pinned) -> device
      uint8_t* m = st.host_meta.get() + meta_at;
      std::memcpy(m, a.offsets.data(), (n + 1) * 4);
      std::memcpy(m + (n + 1) * 4, a.local_experts.data(), A * 4);
      std::memcpy(m + (n + 1 + A) * 4, a.gates.data(), A * 4);
      meta_at += Align16(meta_bytes);
      CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(peer.meta.get(), m, meta_bytes, cudaMemcpyHostToDevice,
                                           st.comm.stream()));
      // rows: compacted, in the step's dtype already (bf16 from the gateway's gather)
      CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(peer.rows.get(), width * esize, part.rows.data,
                                             part.rows.stride * esize, width * esize, n,
                                             cudaMemcpyDeviceToDevice, st.comm.stream()));
    }
    // Phase 1: counts first, to every rank.
    StepHeader base{};
    base.magic = kMagic;
    base.kind = kKindStep;
    base.step_id = dispatch.step_id;
    base.layer = dispatch.layer;
    base.precision = WirePrecision(dispatch.precision);
    base.placement_generation = dispatch.placement_generation;
    base.width = width < 0 ? 0 : width;
    RETURN_IF_ERROR(st.SendHeaders(base, rows, assignments));
    // Phase 2: meta and rows to the ranks that get rows.
    bool any = false;
    NCCL_RETURN_IF_ERROR(ncclGroupStart(), st.comm);
    for (const RankPart& part : dispatch.parts) {
      const int64_t n = part.rows.rows;
      if (n == 0) continue;
      any = true;
      State::Peer& peer = st.peers[part.rank];
      NCCL_RETURN_IF_ERROR(ncclSend(peer.meta.get(), MetaBytes(n, assignments[part.rank]),
                                    ncclUint8, part.rank, st.comm.get(), st.comm.stream()),
                           st.comm);
      NCCL_RETURN_IF_ERROR(ncclSend(peer.rows.get(), static_cast<size_t>(n * width) * esize,
                                    ncclUint8, part.rank, st.comm.get(), st.comm.stream()),
                           st.comm);
    }
    NCCL_RETURN_IF_ERROR(ncclGroupEnd(), st.comm);
    if (!any) return absl::OkStatus();
    RETURN_IF_ERROR(st.comm.WaitReady(absl::Now() + st.options.drain_timeout));
    // Phase 3: post the receives of the replies now, so Collect only waits.
    NCCL_RETURN_IF_ERROR(ncclGroupStart(), st.comm);
    for (const RankPart& part : dispatch.parts) {
      const int64_t n = part.rows.rows;
      if (n == 0) continue;
      State::Peer& peer = st.peers[part.rank];
      NCCL_RETURN_IF_ERROR(ncclRecv(peer.reply.get(), sizeof(ReplyHeader), ncclUint8, part.rank,
                                    st.comm.get(), st.comm.stream()),
                           st.comm);
      NCCL_RETURN_IF_ERROR(
          ncclRecv(peer.partial.get(), static_cast<size_t>(n * width) * sizeof(double), ncclUint8,
                   part.rank, st.comm.get(), st.comm.stream()),
          st.comm);
    }
    NCCL_RETURN_IF_ERROR(ncclGroupEnd(), st.comm);
    RETURN_IF_ERROR(st.comm.WaitReady(absl::Now() + st.options.drain_timeout));
    for (const RankPart& part : dispatch.parts) {
      if (part.rows.rows == 0) continue;
      CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(st.HostReply(part.rank), st.peers[part.rank].reply.get(),
                                           sizeof(ReplyHeader), cudaMemcpyDeviceToHost,
                                           st.comm.stream()));
    }
    return absl::OkStatus();
  };
  const absl::Status s = run();
  if (!s.ok()) return st.comm.broken() ? s : fail(s);
  st.in_flight = true;
  st.in_flight_step = dispatch.step_id;
  return absl::OkStatus();
}

absl::Status NcclGatewayTransport::Collect(
    const StepDispatch& dispatch, absl::Time deadline,
    const std::function<absl::Status(size_t, ConstPartialView, const RankStepStats&)>& consume) {
  State& st = *state_;
  std::lock_guard<std::mutex> lock(st.mu);
  if (st.comm.broken()) return st.comm.BrokenStatus();
  if (!st.in_flight || st.in_flight_step != dispatch.step_id)
    return absl::FailedPreconditionError(
        absl::StrCat("NCCL Collect: step ", dispatch.step_id, " was not sent"));
  cuda::ScopedDevice guard(st.device);
  CUDA_RETURN_IF_ERROR(guard.status());
  st.in_flight = false;
  st.slot_free.notify_all();  // the next Send waits for st.mu, i.e. the end of this Collect
  const absl::Status waited = st.peer_down.load() ? absl::CancelledError("a rank is down")
                                                  : st.comm.WaitStream(deadline, &st.peer_down);
  if (st.peer_down.load()) {
    if (!st.comm.broken()) st.comm.Abort(st.peer_down_why);
    return absl::UnavailableError(absl::StrCat("step ", dispatch.step_id, ": ", st.peer_down_why,
                                               " (NCCL communicator aborted)"));
  }
  if (absl::IsDeadlineExceeded(waited))
    return absl::DeadlineExceededError(absl::StrCat("step ", dispatch.step_id,
                                                    ": ranks did not answer before the deadline "
                                                    "(NCCL communicator aborted)"));
  if (!waited.ok())
    return absl::UnavailableError(absl::StrCat("step ", dispatch.step_id, ": ", waited.message()));
  // Every reply first: a step is consumed whole or not at all.
  for (const RankPart& part : dispatch.parts) {
    if (part.rows.rows == 0) continue;
    const ReplyHeader& h = *st.HostReply(part.rank);
    if (h.magic != kMagic || h.step_id != dispatch.step_id || h.num_rows != part.rows.rows ||
        h.width != part.rows.cols) {
      st.comm.Abort("malformed reply");
      return absl::UnavailableError(
          absl::StrCat("rank ", part.rank, ": malformed reply to step ", dispatch.step_id));
    }
    if (h.code != 0) {
      const auto code = static_cast<absl::StatusCode>(h.code);
      const std::string message(h.message, strnlen(h.message, sizeof(h.message)));
      return RankFailure(part.rank, code, message);
    }
  }
  for (size_t i = 0; i < dispatch.parts.size(); ++i) {
    const RankPart& part = dispatch.parts[i];
    const int64_t n = part.rows.rows, width = part.rows.cols;
    RankStepStats stats;
    if (n > 0) {
      const ReplyHeader& h = *st.HostReply(part.rank);
      stats.compute_us = h.compute_us;
      stats.active_experts = h.active_experts;
      const size_t esize = ElementBytes(dispatch.precision);
      stats.bytes_sent = static_cast<int64_t>(
          sizeof(StepHeader) +
          MetaBytes(n, static_cast<int64_t>(part.assignments->local_experts.size())) +
          static_cast<size_t>(n * width) * esize);
      stats.bytes_received = static_cast<int64_t>(sizeof(ReplyHeader) +
                                                  static_cast<size_t>(n * width) * sizeof(double));
    }
    const ConstPartialView partial(
        n > 0 ? reinterpret_cast<const double*>(st.peers[part.rank].partial.get()) : nullptr, n,
        width, width);
    RETURN_IF_ERROR(consume(i, partial, stats));
  }
  return absl::OkStatus();
}

void NcclGatewayTransport::RankDown(int rank, absl::string_view why) {
  State& st = *state_;
  if (st.peer_down.load()) return;  // the first reason stands
  {
    // Not st.mu: a Collect holds it while it waits, and this must end that wait.
    std::lock_guard<std::mutex> lock(st.peer_down_mu);
    if (st.peer_down.load()) return;
    st.peer_down_why = absl::StrCat("rank ", rank, " ", why);
    st.peer_down.store(true);
  }
}

void NcclGatewayTransport::Abandon(uint64_t step_id) {
  State& st = *state_;
  std::lock_guard<std::mutex> lock(st.mu);
  if (!st.in_flight || st.in_flight_step != step_id) return;
  cuda::ScopedDevice guard(st.device);
  st.Drain().IgnoreError();  // aborts the communicator if the step cannot finish
}

absl::Status NcclGatewayTransport::Shutdown() {
  State& st = *state_;
  std::lock_guard<std::mutex> lock(st.mu);
  if (st.shut_down) return absl::OkStatus();
  st.shut_down = true;
  st.slot_free.notify_all();
  if (st.comm.broken()) return absl::OkStatus();
  cuda::ScopedDevice guard(st.device);
  CUDA_RETURN_IF_ERROR(guard.status());
  RETURN_IF_ERROR(st.Drain());
  StepHeader base{};
  base.magic = kMagic;
  base.kind = kKindShutdown;
  absl::Status s = st.SendHeaders(base, {}, {});
  if (s.ok()) s = st.comm.WaitStream(absl::Now() + st.options.drain_timeout, nullptr);
  if (!s.ok()) {
    st.comm.Abort(std::string(s.message()));
    return s;
  }
  st.comm.Finalize(absl::Now() + st.options.drain_timeout);
  return absl::OkStatus();
}

// ---- rank -------------------------------------------------------------------------------------

struct NcclRankTransport::State {
  NcclRankOptions options;
  int device = 0;
  cudaStream_t backend_stream = nullptr;
  cudaEvent_t ready = nullptr;
  std::mutex mu;
  std::atomic<bool> cancel{false};

  cuda::DeviceMemory header, meta, rows_wire, reply, partial;
  cuda::PinnedMemory host_header, host_meta, host_reply;

  bool awaiting_reply = false;
  uint64_t pending_step = 0;
  int64_t pending_rows = 0, pending_width = 0;
  bool shut_down = false;
  Comm comm;  // last: destroyed (aborted if still alive) before the buffers it may use

  ~State() {
    if (ready != nullptr) cudaEventDestroy(ready);
  }
  int gateway() const { return options.num_ranks; }
};

NcclRankTransport::NcclRankTransport(std::unique_ptr<State> state) : state_(std::move(state)) {}

absl::StatusOr<std::unique_ptr<NcclRankTransport>> NcclRankTransport::Create(
    const NcclRankOptions& options) {
  if (options.backend == nullptr)
    return absl::InvalidArgumentError("NCCL rank transport needs the rank's CUDA backend");
  if (options.num_ranks <= 0 || options.rank < 0 || options.rank >= options.num_ranks)
    return absl::InvalidArgumentError(
        absl::StrCat("NCCL rank transport: rank ", options.rank, " of ", options.num_ranks));
  auto state = std::make_unique<State>();
  state->options = options;
  state->device = options.backend->device();
  state->backend_stream = options.backend->stream();
  cuda::ScopedDevice guard(state->device);
  CUDA_RETURN_IF_ERROR(guard.status());
  CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&state->ready, cudaEventDisableTiming));
  RETURN_IF_ERROR(state->header.Ensure(sizeof(StepHeader)));
  RETURN_IF_ERROR(state->reply.Ensure(sizeof(ReplyHeader)));
  RETURN_IF_ERROR(state->host_header.Ensure(sizeof(StepHeader)));
  RETURN_IF_ERROR(state->host_reply.Ensure(sizeof(ReplyHeader)));
  RETURN_IF_ERROR_CTX(state->comm.Init(options.unique_id, state->device, options.num_ranks + 1,
                                       options.rank, absl::Now() + options.init_timeout),
                      absl::StrCat("NCCL rank ", options.rank));
  return std::unique_ptr<NcclRankTransport>(new NcclRankTransport(std::move(state)));
}

NcclRankTransport::~NcclRankTransport() = default;  // Comm aborts if not finalized

void NcclRankTransport::Cancel() { state_->cancel.store(true); }

absl::StatusOr<ReceivedStep> NcclRankTransport::Receive() {
  State& st = *state_;
  std::lock_guard<std::mutex> lock(st.mu);
  if (st.shut_down) return absl::CancelledError("the gateway closed the exchange");
  if (st.comm.broken()) return st.comm.BrokenStatus();
  if (st.awaiting_reply)
    return absl::FailedPreconditionError(
        absl::StrCat("step ", st.pending_step, " has not been replied to"));
  cuda::ScopedDevice guard(st.device);
  CUDA_RETURN_IF_ERROR(guard.status());
  auto as_unavailable = [&](const absl::Status& s) -> absl::Status {
    if (absl::IsCancelled(s)) return s;
    return absl::UnavailableError(absl::StrCat("NCCL rank ", st.options.rank, ": ", s.message()));
  };
  // Any failure after the first NCCL call leaves the gateway mid-protocol: abort.
  auto run = [&]() -> absl::StatusOr<ReceivedStep> {
    while (true) {
      // Phase 1: the header (every step).
      NCCL_RETURN_IF_ERROR(ncclGroupStart(), st.comm);
      NCCL_RETURN_IF_ERROR(ncclRecv(st.header.get(), sizeof(StepHeader), ncclUint8, st.gateway(),
                                    st.comm.get(), st.comm.stream()),
                           st.comm);
      NCCL_RETURN_IF_ERROR(ncclGroupEnd(), st.comm);
      absl::Status s = st.comm.WaitReady(absl::Now() + st.options.step_timeout);
      if (!s.ok()) return as_unavailable(s);
      CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(st.host_header.get(), st.header.get(),
                                           sizeof(StepHeader), cudaMemcpyDeviceToHost,
                                           st.comm.stream()));
      s = st.comm.WaitStream(absl::InfiniteFuture(), &st.cancel);  // idle between steps
      if (!s.ok()) return as_unavailable(s);
      StepHeader h;
      std::memcpy(&h, st.host_header.get(), sizeof(h));
      if (h.magic != kMagic || (h.kind != kKindStep && h.kind != kKindShutdown)) {
        st.comm.Abort("malformed step header");
        return absl::UnavailableError("NCCL rank: malformed step header");
      }
      if (h.kind == kKindShutdown) {
        st.shut_down = true;
        st.comm.Finalize(absl::Now() + st.options.step_timeout);
        return absl::CancelledError("the gateway closed the exchange");
      }
      if (h.num_rows == 0) continue;  // no rows for this rank in this step
      const absl::StatusOr<Precision> precision = PrecisionFromWire(h.precision);
      if (h.num_rows < 0 || h.width <= 0 || h.num_assignments < 0 || !precision.ok() ||
          h.num_rows > (int64_t{1} << 31) || h.width > (int64_t{1} << 24)) {
        st.comm.Abort("malformed step header");
        return absl::UnavailableError("NCCL rank: malformed step header sizes");
      }
      // Phase 2: meta and rows.
      const int64_t n = h.num_rows, width = h.width, A = h.num_assignments;
      const size_t meta_bytes = MetaBytes(n, A);
      const size_t row_bytes = static_cast<size_t>(n * width) * ElementBytes(*precision);
      RETURN_IF_ERROR(st.meta.Ensure(meta_bytes));
      RETURN_IF_ERROR(st.host_meta.Ensure(meta_bytes));
      RETURN_IF_ERROR(st.rows_wire.Ensure(row_bytes));
      NCCL_RETURN_IF_ERROR(ncclGroupStart(), st.comm);
      NCCL_RETURN_IF_ERROR(ncclRecv(st.meta.get(), meta_bytes, ncclUint8, st.gateway(),
                                    st.comm.get(), st.comm.stream()),
                           st.comm);
      NCCL_RETURN_IF_ERROR(ncclRecv(st.rows_wire.get(), row_bytes, ncclUint8, st.gateway(),
                                    st.comm.get(), st.comm.stream()),
                           st.comm);
      NCCL_RETURN_IF_ERROR(ncclGroupEnd(), st.comm);
      const absl::Time deadline = absl::Now() + st.options.step_timeout;
      s = st.comm.WaitReady(deadline);
      if (!s.ok()) return as_unavailable(s);
      CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(st.host_meta.get(), st.meta.get(), meta_bytes,
                                           cudaMemcpyDeviceToHost, st.comm.stream()));
      s = st.comm.WaitStream(deadline, &st.cancel);
      if (!s.ok()) return as_unavailable(s);

      ReceivedStep step;
      step.step_id = h.step_id;
      step.layer = h.layer;
      step.placement_generation = h.placement_generation;
      step.precision = *precision;
      step.rows = ActivationView(st.rows_wire.get(), step.precision, n, width, width);  // as sent
      step.wire_bytes = static_cast<int64_t>(sizeof(StepHeader) + meta_bytes + row_bytes);
      const uint8_t* m = st.host_meta.get();
      step.assignments.offsets.resize(n + 1);
      step.assignments.local_experts.resize(A);
      step.assignments.gates.resize(A);
      std::memcpy(step.assignments.offsets.data(), m, (n + 1) * 4);
      std::memcpy(step.assignments.local_experts.data(), m + (n + 1) * 4, A * 4);
      std::memcpy(step.assignments.gates.data(), m + (n + 1 + A) * 4, A * 4);
      st.awaiting_reply = true;
      st.pending_step = h.step_id;
      st.pending_rows = n;
      st.pending_width = width;
      return step;
    }
  };
  absl::StatusOr<ReceivedStep> result = run();
  if (!result.ok() && !st.comm.broken()) st.comm.Abort(std::string(result.status().message()));
  return result;
}

absl::Status NcclRankTransport::Reply(uint64_t step_id,
                                      const absl::StatusOr<ConstPartialView>& partial,
                                      const RankStepStats& stats) {
  State& st = *state_;
  std::lock_guard<std::mutex> lock(st.mu);
  if (st.comm.broken()) return st.comm.BrokenStatus();
  if (!st.awaiting_reply || st.pending_step != step_id)
    return absl::FailedPreconditionError(
        absl::StrCat("NCCL Reply: step ", step_id, " is not the step being processed"));
  cuda::ScopedDevice guard(st.device);
  CUDA_RETURN_IF_ERROR(guard.status());
  const int64_t n = st.pending_rows, width = st.pending_width;
  const size_t bytes = static_cast<size_t>(n * width) * sizeof(double);

  absl::Status result = partial.status();
  if (result.ok() && (partial->rows != n || partial->cols != width || partial->data == nullptr ||
                      partial->stride < width))
    result = absl::InternalError(absl::StrCat("partial is [", partial->rows, ", ", partial->cols,
                                              "], the step has [", n, ", ", width, "]"));
  auto* h = reinterpret_cast<ReplyHeader*>(st.host_reply.get());
  std::memset(h, 0, sizeof(*h));
  h->magic = kMagic;
  h->code = static_cast<int32_t>(result.code());
  h->step_id = step_id;
  h->compute_us = stats.compute_us;
  h->active_experts = stats.active_experts;
  h->num_rows = n;
  h->width = width;
  if (!result.ok()) {
    const absl::string_view text = result.message();
    std::memcpy(h->message, text.data(), std::min(text.size(), sizeof(h->message) - 1));
  }

  auto run = [&]() -> absl::Status {
    const bool direct = result.ok() && partial->stride == width;
    if (!direct) RETURN_IF_ERROR(st.partial.Ensure(bytes));
    // The partial was computed on the backend's stream.
    CUDA_RETURN_IF_ERROR(cudaEventRecord(st.ready, st.backend_stream));
    CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(st.comm.stream(), st.ready, 0));
    const void* src = direct ? static_cast<const void*>(partial->data) : st.partial.get();
    if (result.ok() && !direct) {
      CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(
          st.partial.get(), width * sizeof(double), partial->data, partial->stride * sizeof(double),
          width * sizeof(double), n, cudaMemcpyDeviceToDevice, st.comm.stream()));
    } else if (!result.ok()) {
      CUDA_RETURN_IF_ERROR(cudaMemsetAsync(st.partial.get(), 0, bytes, st.comm.stream()));
    }
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(st.reply.get(), h, sizeof(ReplyHeader),
                                         cudaMemcpyHostToDevice, st.comm.stream()));
    NCCL_RETURN_IF_ERROR(ncclGroupStart(), st.comm);
    NCCL_RETURN_IF_ERROR(ncclSend(st.reply.get(), sizeof(ReplyHeader), ncclUint8, st.gateway(),
                                  st.comm.get(), st.comm.stream()),
                         st.comm);
    NCCL_RETURN_IF_ERROR(
        ncclSend(src, bytes, ncclUint8, st.gateway(), st.comm.get(), st.comm.stream()), st.comm);
    NCCL_RETURN_IF_ERROR(ncclGroupEnd(), st.comm);
    const absl::Time deadline = absl::Now() + st.options.step_timeout;
    absl::Status s = st.comm.WaitReady(deadline);
    if (s.ok()) s = st.comm.WaitStream(deadline, &st.cancel);
    st.awaiting_reply = false;
    if (!s.ok())
      return absl::UnavailableError(absl::StrCat("NCCL rank ", st.options.rank, ": reply to step ",
                                                 step_id, ": ", s.message()));
    return absl::OkStatus();
  };
  const absl::Status sent = run();
  if (!sent.ok() && !st.comm.broken()) st.comm.Abort(std::string(sent.message()));
  st.awaiting_reply = false;
  return sent;
}

}  // namespace moe
