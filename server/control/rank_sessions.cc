#include "server/control/rank_sessions.h"

#include <cstdio>

#include "absl/strings/str_cat.h"
#include "core/log.h"

namespace moe {

using moe::v1::internal::GatewayToRank;
using moe::v1::internal::RankToGateway;

RankSessions::RankSessions(Membership* membership, const LivenessOptions& liveness)
    : membership_(membership), liveness_(liveness) {
  for (int r = 0; r < membership->size(); ++r) streams_.push_back(std::make_unique<Stream>());
}

void RankSessions::SetHandlers(Handlers handlers) { handlers_ = std::move(handlers); }

bool RankSessions::HasStream(int rank) const {
  std::lock_guard<std::mutex> lock(mu_);
  return rank >= 0 && rank < static_cast<int>(streams_.size()) && streams_[rank]->stream != nullptr;
}

void RankSessions::CloseAll() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& s : streams_)
    if (s->context != nullptr) s->context->TryCancel();
}

absl::Status RankSessions::Write(int rank, const GatewayToRank& message) {
  if (rank < 0 || rank >= static_cast<int>(streams_.size()))
    return absl::InvalidArgumentError(absl::StrCat("no rank ", rank));
  Stream& s = *streams_[rank];
  std::lock_guard<std::mutex> write_lock(s.write_mu);
  ExchangeServerStream* stream;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stream = membership_->IsUp(rank) ? s.stream : nullptr;
  }
  if (stream == nullptr || !stream->Write(message))
    return absl::UnavailableError(absl::StrCat("rank ", rank, " is down"));
  return absl::OkStatus();
}

absl::Status RankSessions::Serve(int rank, ExchangeServerStream* stream,
                                 grpc::ServerContext* context) {
  if (rank < 0 || rank >= static_cast<int>(streams_.size()))
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", rank, " outside [0, ", streams_.size(), ")"));
  Stream& s = *streams_[rank];
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (s.stream != nullptr)
      return absl::AlreadyExistsError(
          absl::StrCat("rank ", rank, " already has an exchange stream"));
    s.stream = stream;
    s.context = context;
  }
  membership_->SetUp(rank);
  {
    // A rank that sends nothing, not even a heartbeat, is marked down at once and its stream
    // cancelled (which also unblocks a Write stuck on its full flow-control window).
    StreamLiveness liveness(
        liveness_,
        [&s, stream] {
          std::unique_lock<std::mutex> write_lock(s.write_mu, std::try_to_lock);
          if (!write_lock.owns_lock()) return;  // a step is being written: proof enough
          GatewayToRank heartbeat;
          heartbeat.mutable_heartbeat();
          stream->Write(heartbeat);
        },
        [this, context, rank] {
          const int64_t ms = absl::ToInt64Milliseconds(liveness_.peer_timeout);
          LogLine("moe-gateway: rank %d sent nothing for %lld ms: marked down", rank,
                  static_cast<long long>(ms));
          membership_->SetDown(rank,
                               absl::StrCat("sent nothing for ", ms, " ms (hung or cut off)"));
          context->TryCancel();
        });
    RankToGateway message;
    while (stream->Read(&message)) {
      liveness.Heard();
      if (message.has_result()) {
        if (handlers_.on_result) handlers_.on_result(rank, std::move(*message.mutable_result()));
      } else if ((message.has_shards_loaded() || message.has_placement_offer()) &&
                 handlers_.on_control) {
        handlers_.on_control(rank, message);
      }
    }
  }
  // The stream ended: the rank is down (a silent one was already) before its slot frees, so a
  // successor's exchange (ALREADY_EXISTS until then: it retries) is never marked down by this
  // one's end; then wait out any Write in progress.
  membership_->SetDown(rank, "went down");
  {
    std::lock_guard<std::mutex> write_lock(s.write_mu);
    std::lock_guard<std::mutex> lock(mu_);
    s.stream = nullptr;
    s.context = nullptr;
  }
  return absl::OkStatus();
}

}  // namespace moe
