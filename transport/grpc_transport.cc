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

GrpcGatewayTransport::GrpcGatewayTransport(int num_ranks, Backend* backend,
                                           const LivenessOptions& liveness)
    : backend_(backend), liveness_(liveness) {
  for (int r = 0; r < num_ranks; ++r) channels_.push_back(std::make_unique<Channel>());
}

void GrpcGatewayTransport::SetRankStateCallback(std::function<void(int, bool)> callback) {
  std::lock_guard<std::mutex> lock(mu_);
  on_rank_state_ = std::move(callback);
}

void GrpcGatewayTransport::SetDroppedResultCallback(std::function<void(int)> callback) {
  std::lock_guard<std::mutex> lock(mu_);
  on_dropped_result_ = std::move(callback);
}

bool GrpcGatewayTransport::UpLocked(int rank) const {
  // Down as soon as a reason is recorded: the moment its waiting steps fail, so the engine's
  // re-dispatch sees the same state.
  return rank >= 0 && rank < static_cast<int>(channels_.size()) &&
         channels_[rank]->stream != nullptr && !channels_[rank]->silent &&
         channels_[rank]->down_reason.empty();
}

void GrpcGatewayTransport::MarkDown(Channel& channel, std::string reason) {
  std::lock_guard<std::mutex> lock(mu_);
  if (channel.down_reason.empty()) channel.down_reason = std::move(reason);
  cv_.notify_all();  // the steps waiting on this rank fail now
}

void GrpcGatewayTransport::CloseRankStreams() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& channel : channels_)
    if (channel->context != nullptr) channel->context->TryCancel();
}

bool GrpcGatewayTransport::IsUp(int rank) const {
  std::lock_guard<std::mutex> lock(mu_);
  return UpLocked(rank);
}

int64_t GrpcGatewayTransport::dropped_results() const {
  std::lock_guard<std::mutex> lock(mu_);
  return dropped_results_;
}

int GrpcGatewayTransport::num_up() const {
  std::lock_guard<std::mutex> lock(mu_);
  int n = 0;
  for (int r = 0; r < static_cast<int>(channels_.size()); ++r) n += UpLocked(r);
  return n;
}

absl::Status GrpcGatewayTransport::ServeRank(
    int rank, ExchangeServerStream* stream, grpc::ServerContext* context,
    const std::function<void(const RankToGateway&)>& on_control) {
  if (rank < 0 || rank >= static_cast<int>(channels_.size()))
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", rank, " outside [0, ", channels_.size(), ")"));
  Channel& channel = *channels_[rank];
  std::function<void(int, bool)> notify;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (channel.stream != nullptr)
      return absl::AlreadyExistsError(
          absl::StrCat("rank ", rank, " already has an exchange stream"));
    channel.stream = stream;
    channel.context = context;
    channel.silent = false;
    channel.down_reason.clear();
    notify = on_rank_state_;
  }
  if (notify) notify(rank, true);

  {
    // A rank that sends nothing, not even a heartbeat, is marked down at once and its stream
    // cancelled (which also unblocks a Write stuck on its full flow-control window).
    StreamLiveness liveness(
        liveness_,
        [&channel, stream] {
          std::unique_lock<std::mutex> write_lock(channel.write_mu, std::try_to_lock);
          if (!write_lock.owns_lock()) return;  // a step is being written: proof enough
          GatewayToRank heartbeat;
          heartbeat.mutable_heartbeat();
          stream->Write(heartbeat);
        },
        [this, &channel, context, rank] {
          std::function<void(int, bool)> on_down;
          {
            std::lock_guard<std::mutex> lock(mu_);
            channel.silent = true;
            on_down = on_rank_state_;
          }
          const int64_t ms = absl::ToInt64Milliseconds(liveness_.peer_timeout);
          std::fprintf(stderr, "moe-gateway: rank %d sent nothing for %lld ms: marked down\n", rank,
                       static_cast<long long>(ms));
          if (on_down) on_down(rank, false);
          MarkDown(channel, absl::StrCat("sent nothing for ", ms, " ms (hung or cut off)"));
          context->TryCancel();
        });
    RankToGateway message;
    while (stream->Read(&message)) {
      liveness.Heard();
      if ((message.has_shards_loaded() || message.has_placement_offer()) && on_control)
        on_control(message);
      if (!message.has_result()) continue;
      std::function<void(int)> on_dropped;
      {
        std::lock_guard<std::mutex> lock(mu_);
        const uint64_t step = message.result().step_id();
        // Only results for steps sent to this rank and still awaited are kept: anything else (a
        // step given up on, or one never sent) would otherwise stay in memory for good.
        if (sent_bytes_.count({step, rank}) == 0) {
          ++dropped_results_;
          on_dropped = on_dropped_result_;
        } else {
          results_[{step, rank}] = std::move(*message.mutable_result());
          cv_.notify_all();
        }
      }
      if (on_dropped) on_dropped(rank);
    }
  }
  // The stream ended: wait out any Write in progress, then mark the rank down.
  {
    std::lock_guard<std::mutex> write_lock(channel.write_mu);
    std::lock_guard<std::mutex> lock(mu_);
    const bool was_silent = channel.silent;
    channel.stream = nullptr;
    channel.context = nullptr;
    channel.silent = false;
    notify = was_silent ? nullptr : on_rank_state_;  // a silent rank was reported down already
  }
  if (notify) notify(rank, false);
  MarkDown(channel, "went down");
  return absl::OkStatus();
}

absl::Status GrpcGatewayTransport::SendControl(int rank, const GatewayToRank& message) {
  if (rank < 0 || rank >= static_cast<int>(channels_.size()))
    return absl::InvalidArgumentError(absl::StrCat("no rank ", rank));
  Channel& channel = *channels_[rank];
  std::lock_guard<std::mutex> write_lock(channel.write_mu);
  ExchangeServerStream* stream;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stream = UpLocked(rank) ? channel.stream : nullptr;
  }
  if (stream == nullptr || !stream->Write(message))
    return absl::UnavailableError(absl::StrCat("rank ", rank, " is down"));
  return absl::OkStatus();
}

absl::Status GrpcGatewayTransport::Send(const StepDispatch& dispatch) {
  for (const RankPart& part : dispatch.parts) {
    if (part.rank < 0 || part.rank >= static_cast<int>(channels_.size()))
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
    ConstMatrixView host_rows = part.rows;
    std::unique_lock<std::mutex> staging_lock(staging_mu_);
    if (backend_->space() == MemorySpace::kDevice) {
      const size_t bytes = part.rows.rows * part.rows.stride * sizeof(float);
      staging_.resize(bytes);
      RETURN_IF_ERROR(backend_->CopyToHost(staging_.data(), part.rows.data, bytes));
      host_rows.data = reinterpret_cast<const float*>(staging_.data());
    }
    EncodeRows(host_rows, dispatch.precision, step->mutable_rows());
    staging_lock.unlock();
    const RowAssignments& a = *part.assignments;
    step->mutable_row_offsets()->Add(a.offsets.begin(), a.offsets.end());
    step->mutable_local_experts()->Add(a.local_experts.begin(), a.local_experts.end());
    step->mutable_gates()->Add(a.gates.begin(), a.gates.end());

    Channel& channel = *channels_[part.rank];
    std::lock_guard<std::mutex> write_lock(channel.write_mu);
    ExchangeServerStream* stream;
    {
      std::lock_guard<std::mutex> lock(mu_);
      stream = UpLocked(part.rank) ? channel.stream : nullptr;
    }
    if (stream == nullptr)
      return absl::UnavailableError(absl::StrCat("rank ", part.rank, " is down"));
    {
      // Before the write: the rank's answer may arrive before Write returns.
      std::lock_guard<std::mutex> lock(mu_);
      sent_bytes_[{dispatch.step_id, part.rank}] = static_cast<int64_t>(message.ByteSizeLong());
    }
    if (!stream->Write(message))
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
          auto sent = sent_bytes_.find(key);
          if (sent != sent_bytes_.end()) {
            bytes_sent[i] = sent->second;
            sent_bytes_.erase(sent);
          }
          break;
        }
        const Channel& channel = *channels_[rank];
        if (!channel.down_reason.empty())
          return absl::UnavailableError(absl::StrCat("rank ", rank, " ", channel.down_reason,
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
  sent_bytes_.erase(sent_bytes_.lower_bound({step_id, 0}),
                    sent_bytes_.lower_bound({step_id + 1, 0}));
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
  if (backend_->space() == MemorySpace::kDevice) {
    const int64_t rows = out.rows.rows, width = out.rows.cols;
    const size_t bytes = rows * width * sizeof(float);
    if (rows_ == nullptr || rows_->size() < bytes) {
      ASSIGN_OR_RETURN(rows_, backend_->Allocate(bytes));
    }
    RETURN_IF_ERROR(backend_->CopyToBackend(rows_->data(), host_rows_.data(), bytes));
    out.rows = ConstMatrixView(static_cast<const float*>(rows_->data()), rows, width, width);
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
