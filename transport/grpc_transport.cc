#include "transport/grpc_transport.h"

#include <cstdio>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "core/status.h"

namespace moe {

static_assert(moe::v1::internal::PRECISION_BF16 == WirePrecision(Precision::kBF16) &&
                  moe::v1::internal::PRECISION_FP32 == WirePrecision(Precision::kFP32),
              "one precision encoding on every wire");

using moe::v1::internal::GatewayToRank;
using moe::v1::internal::RankToGateway;
using moe::v1::internal::StepResult;

// ---- gateway side ---------------------------------------------------------------------------

GrpcGatewayTransport::GrpcGatewayTransport(int num_ranks, Backend* backend, StepStreams* streams)
    : backend_(backend), streams_(streams), ranks_(static_cast<size_t>(num_ranks)) {}

void GrpcGatewayTransport::SetDroppedResultCallback(std::function<void(int)> callback) {
  std::lock_guard<std::mutex> lock(mu_);
  on_dropped_result_ = std::move(callback);
}

int64_t GrpcGatewayTransport::dropped_results() const {
  std::lock_guard<std::mutex> lock(mu_);
  return dropped_results_;
}

void GrpcGatewayTransport::RankDown(int rank, absl::string_view why) {
  std::lock_guard<std::mutex> lock(mu_);
  if (rank < 0 || rank >= static_cast<int>(ranks_.size())) return;
  ranks_[rank].down_reason = why.empty() ? "went down" : std::string(why);
  ++ranks_[rank].epoch;
  cv_.notify_all();  // the steps waiting on this rank fail now
}

void GrpcGatewayTransport::RankUp(int rank) {
  std::lock_guard<std::mutex> lock(mu_);
  if (rank >= 0 && rank < static_cast<int>(ranks_.size())) ranks_[rank].down_reason.clear();
}

void GrpcGatewayTransport::OnResult(int rank, moe::v1::internal::StepResult result) {
  std::function<void(int)> on_dropped;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const auto key = std::make_pair(result.step_id(), rank);
    auto sent = sent_.find(key);
    // Only results for steps sent to this rank in its current session and still awaited are
    // kept: anything else (a step given up on, or one never sent) would stay in memory for good.
    if (sent == sent_.end() || rank < 0 || rank >= static_cast<int>(ranks_.size()) ||
        sent->second.epoch != ranks_[rank].epoch) {
      ++dropped_results_;
      on_dropped = on_dropped_result_;
    } else {
      results_[key] = std::move(result);
      cv_.notify_all();
    }
  }
  if (on_dropped) on_dropped(rank);
}

absl::Status GrpcGatewayTransport::Send(const StepDispatch& dispatch) {
  RETURN_IF_ERROR(CheckRowStorage(dispatch));
  for (const RankPart& part : dispatch.parts) {
    if (part.rank < 0 || part.rank >= static_cast<int>(ranks_.size()))
      return absl::InternalError(absl::StrCat("dispatch to unknown rank ", part.rank));
    GatewayToRank message;
    auto* step = message.mutable_step();
    step->set_step_id(dispatch.step_id);
    step->set_layer(dispatch.layer);
    step->set_placement_generation(dispatch.placement_generation);
    step->set_num_rows(static_cast<int32_t>(part.rows.rows));
    step->set_width(static_cast<int32_t>(part.rows.cols));
    step->set_precision(
        static_cast<moe::v1::internal::Precision>(WirePrecision(dispatch.precision)));
    ActivationView host_rows = part.rows;
    std::unique_lock<std::mutex> staging_lock(staging_mu_);
    if (backend_->space() == MemorySpace::kDevice) {
      const size_t bytes = part.rows.rows * part.rows.stride * part.rows.element_bytes();
      staging_.resize(bytes);
      RETURN_IF_ERROR(backend_->CopyToHost(staging_.data(), part.rows.data, bytes));
      host_rows.data = staging_.data();
    }
    EncodeRows(host_rows, step->mutable_rows());
    staging_lock.unlock();
    const RowAssignments& a = *part.assignments;
    step->mutable_row_offsets()->Add(a.offsets.begin(), a.offsets.end());
    step->mutable_local_experts()->Add(a.local_experts.begin(), a.local_experts.end());
    step->mutable_gates()->Add(a.gates.begin(), a.gates.end());

    {
      // Before the write: the rank's answer may arrive before Write returns.
      std::lock_guard<std::mutex> lock(mu_);
      const RankState& state = ranks_[part.rank];
      if (!state.down_reason.empty())
        return absl::UnavailableError(
            absl::StrCat("rank ", part.rank, " is down (", state.down_reason, ")"));
      sent_[{dispatch.step_id, part.rank}] =
          Sent{static_cast<int64_t>(message.ByteSizeLong()), state.epoch};
    }
    if (absl::Status s = streams_->Write(part.rank, message); !s.ok())
      return absl::UnavailableError(
          absl::StrCat("rank ", part.rank, ": exchange stream broke while sending"));
  }
  return absl::OkStatus();
}

absl::Status GrpcGatewayTransport::Collect(
    const StepDispatch& dispatch, absl::Time deadline,
    const std::function<absl::Status(size_t, ConstPartialView, const RankStepStats&)>& consume) {
  std::vector<StepResult> results(dispatch.parts.size());
  std::vector<int64_t> bytes_sent(dispatch.parts.size(), 0);
  {
    std::unique_lock<std::mutex> lock(mu_);
    for (size_t i = 0; i < dispatch.parts.size(); ++i) {
      const int rank = dispatch.parts[i].rank;
      const auto key = std::make_pair(dispatch.step_id, rank);
      for (;;) {
        auto it = results_.find(key);
        if (it != results_.end()) {
          results[i] = std::move(it->second);
          results_.erase(it);
          auto sent = sent_.find(key);
          if (sent != sent_.end()) {
            bytes_sent[i] = sent->second.bytes;
            sent_.erase(sent);
          }
          break;
        }
        // Down since the step was sent (even if back up already: its answer is lost).
        auto sent = sent_.find(key);
        const RankState& state = ranks_[rank];
        if (sent == sent_.end() || sent->second.epoch != state.epoch)
          return absl::UnavailableError(absl::StrCat(
              "rank ", rank, " ", state.down_reason.empty() ? "went down" : state.down_reason,
              " during step ", dispatch.step_id));
        const absl::Duration left = deadline - absl::Now();
        if (left <= absl::ZeroDuration())
          return absl::DeadlineExceededError(absl::StrCat(
              "step ", dispatch.step_id, ": rank ", rank, " did not answer before the deadline"));
        cv_.wait_for(lock, absl::ToChronoMilliseconds(std::min(left, absl::Milliseconds(100))) +
                               std::chrono::milliseconds(1));
      }
    }
  }
  // Hand the partials over in rank order.
  std::vector<double> host;
  std::unique_ptr<DeviceBuffer> device;
  for (size_t i = 0; i < results.size(); ++i) {
    const StepResult& r = results[i];
    const int rank = dispatch.parts[i].rank;
    if (r.code() != 0) return RankFailure(rank, static_cast<absl::StatusCode>(r.code()), r.error());
    const int64_t rows = dispatch.parts[i].rows.rows, width = dispatch.parts[i].rows.cols;
    const size_t bytes = rows * width * sizeof(double);
    if (r.partial().size() != bytes)
      return absl::InternalError(absl::StrCat("rank ", rank, " returned ", r.partial().size(),
                                              " bytes, expected ", bytes));
    host.resize(rows * width);
    std::memcpy(host.data(), r.partial().data(), bytes);
    ConstPartialView view(host.data(), rows, width, width);
    if (backend_->space() == MemorySpace::kDevice) {
      ASSIGN_OR_RETURN(device, backend_->Allocate(bytes));
      RETURN_IF_ERROR(backend_->CopyToBackend(device->data(), host.data(), bytes));
      view.data = static_cast<const double*>(device->data());
    }
    RankStepStats stats{r.compute_us(), r.active_experts(), bytes_sent[i],
                        static_cast<int64_t>(r.ByteSizeLong())};
    RETURN_IF_ERROR(consume(i, view, stats));
  }
  return absl::OkStatus();
}

void GrpcGatewayTransport::Abandon(uint64_t step_id) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = results_.begin(); it != results_.end();) {
    if (it->first.first == step_id) {
      it = results_.erase(it);
    } else {
      ++it;
    }
  }
  sent_.erase(sent_.lower_bound({step_id, 0}), sent_.lower_bound({step_id + 1, 0}));
}

// ---- rank side ------------------------------------------------------------------------------

GrpcRankTransport::GrpcRankTransport(std::unique_ptr<grpc::ClientContext> context,
                                     std::unique_ptr<ExchangeClientStream> stream, Backend* backend,
                                     const LivenessOptions& liveness,
                                     std::function<void(const GatewayToRank&)> on_control)
    : context_(std::move(context)),
      stream_(std::move(stream)),
      backend_(backend),
      liveness_options_(liveness),
      on_control_(std::move(on_control)) {
  liveness_ = std::make_unique<StreamLiveness>(
      liveness,
      [this] {
        std::unique_lock<std::mutex> write_lock(write_mu_, std::try_to_lock);
        if (!write_lock.owns_lock() || stream_closed_) return;  // a reply is being written
        RankToGateway heartbeat;
        heartbeat.mutable_heartbeat();
        stream_->Write(heartbeat);
      },
      [this] { context_->TryCancel(); });
  reader_ = std::thread([this] { ReadLoop(); });
}

GrpcRankTransport::~GrpcRankTransport() {
  Cancel();
  reader_.join();
  liveness_.reset();  // its threads write to stream_: stop them before the members go
}

void GrpcRankTransport::Cancel() {
  if (context_) context_->TryCancel();
}

// Reads all the time, computing or not, so that the gateway's heartbeats are heard during a
// long step (and its writes never wait on this rank's flow-control window).
void GrpcRankTransport::ReadLoop() {
  GatewayToRank message;
  while (stream_->Read(&message)) {
    liveness_->Heard();
    if (message.has_heartbeat()) continue;
    if (message.has_load_shards() || message.has_keep_shards()) {
      if (on_control_) on_control_(message);
      continue;
    }
    std::lock_guard<std::mutex> lock(inbox_mu_);
    inbox_.push_back(std::move(message));
    inbox_cv_.notify_one();
  }
  grpc::Status s;
  {
    std::lock_guard<std::mutex> write_lock(write_mu_);  // no Write may overlap Finish
    stream_closed_ = true;
    s = stream_->Finish();
  }
  absl::Status end;
  if (liveness_->silent()) {
    end = absl::UnavailableError(absl::StrCat(
        "the gateway sent nothing for ", absl::ToInt64Milliseconds(liveness_options_.peer_timeout),
        " ms; exchange closed"));
  } else if (s.ok() || s.error_code() == grpc::StatusCode::CANCELLED) {
    end = absl::CancelledError("the gateway closed the exchange");
  } else {
    end = absl::UnavailableError(absl::StrCat("exchange stream broke: ", s.error_message()));
  }
  std::lock_guard<std::mutex> lock(inbox_mu_);
  stream_end_ = std::move(end);
  inbox_cv_.notify_one();
}

absl::StatusOr<ReceivedStep> GrpcRankTransport::Receive() {
  GatewayToRank message;
  {
    std::unique_lock<std::mutex> lock(inbox_mu_);
    inbox_cv_.wait(lock, [this] { return !inbox_.empty() || !stream_end_.ok(); });
    if (inbox_.empty()) return stream_end_;
    message = std::move(inbox_.front());
    inbox_.pop_front();
  }
  if (!message.has_step()) return absl::InternalError("unexpected message on the exchange stream");
  const auto& step = message.step();
  ReceivedStep out;
  out.wire_bytes = static_cast<int64_t>(message.ByteSizeLong());
  RETURN_IF_ERROR(DecodeStepRequest(step, &host_rows_, &out));
  if (backend_->space() == MemorySpace::kDevice) {  // uploaded in the wire's dtype
    const size_t bytes = host_rows_.bytes();
    if (rows_ == nullptr || rows_->size() < bytes) {
      ASSIGN_OR_RETURN(rows_, backend_->Allocate(bytes));
    }
    RETURN_IF_ERROR(backend_->CopyToBackend(rows_->data(), host_rows_.data(), bytes));
    out.rows = ActivationView(rows_->data(), host_rows_.precision(), host_rows_.rows(),
                              host_rows_.cols(), host_rows_.cols());
  }
  return out;
}

absl::Status GrpcRankTransport::SendControl(const RankToGateway& message) {
  std::lock_guard<std::mutex> write_lock(write_mu_);
  if (stream_closed_ || !stream_->Write(message))
    return absl::UnavailableError("exchange stream broke while writing");
  return absl::OkStatus();
}

absl::Status GrpcRankTransport::Reply(uint64_t step_id,
                                      const absl::StatusOr<ConstPartialView>& partial,
                                      const RankStepStats& stats) {
  RankToGateway message;
  auto* result = message.mutable_result();
  result->set_step_id(step_id);
  result->set_compute_us(stats.compute_us);
  result->set_active_experts(stats.active_experts);
  if (!partial.ok()) {
    result->set_code(static_cast<int>(partial.status().code()));
    result->set_error(std::string(partial.status().message()));
  } else {
    const ConstPartialView& p = *partial;
    const size_t bytes = p.rows * p.cols * sizeof(double);
    std::string* out = result->mutable_partial();
    out->resize(bytes);
    if (backend_->space() == MemorySpace::kDevice) {
      host_partial_.resize(p.rows * p.stride);
      RETURN_IF_ERROR(
          backend_->CopyToHost(host_partial_.data(), p.data, p.rows * p.stride * sizeof(double)));
      for (int64_t r = 0; r < p.rows; ++r)
        std::memcpy(out->data() + r * p.cols * sizeof(double), host_partial_.data() + r * p.stride,
                    p.cols * sizeof(double));
    } else {
      for (int64_t r = 0; r < p.rows; ++r)
        std::memcpy(out->data() + r * p.cols * sizeof(double), p.Row(r), p.cols * sizeof(double));
    }
  }
  std::lock_guard<std::mutex> write_lock(write_mu_);
  if (stream_closed_ || !stream_->Write(message))
    return absl::UnavailableError("exchange stream broke while replying");
  return absl::OkStatus();
}

}  // namespace moe
