#include "server/control/cluster_control.h"

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "server/grpc_status.h"
#include "server/read_after_admission.h"

namespace moe {

using moe::v1::internal::ChallengeRequest;
using moe::v1::internal::ChallengeResponse;
using moe::v1::internal::RegisterRequest;
using moe::v1::internal::RegisterResponse;

// RankControl. Nothing is read before the peer proved it is a rank (RankAdmission); every unary
// method is registered streamed for that (read_after_admission.h).
class ClusterControl::Service final
    : public moe::v1::internal::RankControl::WithStreamedUnaryMethod_Challenge<
          moe::v1::internal::RankControl::WithStreamedUnaryMethod_Register<
              moe::v1::internal::RankControl::Service>> {
 public:
  explicit Service(ClusterControl* control) : control_(control) {}

  grpc::Status StreamedChallenge(
      grpc::ServerContext* context,
      grpc::ServerUnaryStreamer<ChallengeRequest, ChallengeResponse>* stream) override {
    return ReadAfterAdmission(
        *context, *stream, [&] { return control_->admission_->RankPeer(*context, "Challenge"); },
        [&](const ChallengeRequest&, ChallengeResponse* response) {
          RankHandshake& handshake = control_->admission_->handshake();
          response->set_nonce(handshake.NewNonce(absl::Now()));
          response->set_token_required(handshake.token_required());
          return grpc::Status::OK;
        });
  }

  grpc::Status StreamedRegister(
      grpc::ServerContext* context,
      grpc::ServerUnaryStreamer<RegisterRequest, RegisterResponse>* stream) override {
    int requested_rank = -1;
    return ReadAfterAdmission(
        *context, *stream,
        [&] { return control_->admission_->RankRegistration(*context, &requested_rank); },
        [&](const RegisterRequest& request, RegisterResponse* response) {
          return Register(request, requested_rank, context->peer(), response);
        });
  }

  grpc::Status Exchange(grpc::ServerContext* context, ExchangeServerStream* stream) override {
    int rank = -1;
    std::string session;
    if (grpc::Status s = control_->admission_->RankExchange(*context, &rank, &session); !s.ok())
      return s;
    moe::v1::internal::RankToGateway first;
    if (!stream->Read(&first))
      return ToGrpcStatus(absl::CancelledError("stream closed before hello"));
    if (!first.has_hello())
      return ToGrpcStatus(absl::InvalidArgumentError("the first exchange message must be a hello"));
    const auto& hello = first.hello();
    if (hello.rank() != rank || hello.session() != session)
      return ToGrpcStatus(absl::InvalidArgumentError(
          absl::StrCat("the hello names rank ", hello.rank(),
                       " and another session than the metadata (rank ", rank, ")")));
    const auto ranks = control_->ranks();
    if (rank >= static_cast<int>(ranks.size()) || !ranks[rank].registered)
      return ToGrpcStatus(
          absl::FailedPreconditionError(absl::StrCat("rank ", rank, " did not register")));
    RankRecord record = ranks[rank];
    record.weight_bytes = hello.weight_bytes();
    record.backend = hello.backend().substr(0, 256);
    control_->UpdateRank(rank, record);
    if (control_->hooks_.on_hello) control_->hooks_.on_hello(rank, hello.placement_generation());
    return ToGrpcStatus(control_->sessions_.Serve(rank, stream, context));
  }

 private:
  grpc::Status Register(const RegisterRequest& request, int requested_rank, const std::string& peer,
                        RegisterResponse* response) {
    if (request.requested_rank() != requested_rank)
      return ToGrpcStatus(absl::InvalidArgumentError(
          absl::StrCat("requested_rank ", request.requested_rank(), " differs from ", kRankIdKey,
                       " ", requested_rank, ", which the proof covers")));
    auto rank = control_->ClaimRank(requested_rank);
    if (!rank.ok()) return ToGrpcStatus(rank.status());
    RankRecord record;
    record.registered = true;
    record.hostname = request.hostname().empty() ? peer : request.hostname().substr(0, 256);
    record.backend = request.backend().substr(0, 256);
    control_->UpdateRank(*rank, record);
    if (control_->hooks_.fill_registration) control_->hooks_.fill_registration(*rank, response);
    response->set_rank(*rank);
    response->set_num_ranks(control_->num_ranks());
    response->set_session(control_->admission_->handshake().OpenSession(*rank));
    response->set_heartbeat_ms(
        static_cast<int32_t>(absl::ToInt64Milliseconds(control_->liveness_.heartbeat)));
    response->set_peer_timeout_ms(
        static_cast<int32_t>(absl::ToInt64Milliseconds(control_->liveness_.peer_timeout)));
    return grpc::Status::OK;
  }

  ClusterControl* const control_;
};

ClusterControl::ClusterControl(int num_ranks, const LivenessOptions& liveness,
                               RankAdmission* admission)
    : liveness_(liveness),
      admission_(admission),
      membership_(num_ranks),
      sessions_(&membership_, liveness),
      ranks_(static_cast<size_t>(num_ranks)),
      service_(std::make_unique<Service>(this)) {}

ClusterControl::~ClusterControl() = default;

void ClusterControl::SetHooks(Hooks hooks) {
  hooks_ = std::move(hooks);
  sessions_.SetHandlers({hooks_.on_control, hooks_.on_result});
}

grpc::Service* ClusterControl::service() { return service_.get(); }

absl::Status ClusterControl::SendControl(int rank,
                                         const moe::v1::internal::GatewayToRank& message) {
  return sessions_.Write(rank, message);
}

void ClusterControl::Close() { sessions_.CloseAll(); }

std::vector<RankRecord> ClusterControl::ranks() const {
  std::lock_guard<std::mutex> lock(ranks_mu_);
  return ranks_;
}

absl::StatusOr<int> ClusterControl::ClaimRank(int requested) {
  std::lock_guard<std::mutex> lock(ranks_mu_);
  const int n = static_cast<int>(ranks_.size());
  if (requested >= n)
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", requested, " requested, the gateway has ", n, " ranks"));
  if (requested >= 0) {
    if (membership_.IsUp(requested))
      return absl::AlreadyExistsError(
          absl::StrCat("rank ", requested, " is already registered and up"));
    return requested;
  }
  for (int r = 0; r < n; ++r)
    if (!ranks_[r].registered) return r;
  for (int r = 0; r < n; ++r)
    if (!membership_.IsUp(r)) return r;
  return absl::ResourceExhaustedError(absl::StrCat("all ", n, " ranks are registered and up"));
}

void ClusterControl::UpdateRank(int rank, const RankRecord& record) {
  {
    std::lock_guard<std::mutex> lock(ranks_mu_);
    ranks_[rank] = record;
  }
  if (hooks_.on_record) hooks_.on_record(rank, record);
}

}  // namespace moe
