// The control plane of a gateway: who the ranks are and whether they are up, on a port of its
// own (RankControl). It admits ranks (RankAdmission: certificates, the cluster token's
// handshake), keeps their records, runs their exchange streams with liveness (RankSessions), and
// publishes the one membership feed (transport/membership.h) that the step engine, the data
// plane transports and readiness follow. What a rank is to load, and what its control messages
// mean for the placement, are the gateway's (Hooks): the control plane carries them.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "grpcpp/grpcpp.h"
#include "moe/v1/internal.grpc.pb.h"
#include "security/rank_handshake.h"
#include "server/control/rank_sessions.h"
#include "transport/membership.h"

namespace moe {

// What the control port asks of every call, from its metadata alone (before any message).
class RankAdmission {
 public:
  virtual ~RankAdmission() = default;
  virtual grpc::Status RankPeer(const grpc::ServerContext& context, absl::string_view method) = 0;
  virtual grpc::Status RankRegistration(const grpc::ServerContext& context,
                                        int* requested_rank) = 0;
  virtual grpc::Status RankExchange(const grpc::ServerContext& context, int* rank,
                                    std::string* session) = 0;
  virtual RankHandshake& handshake() = 0;
};

// What a rank told us about itself (model info).
struct RankRecord {
  bool registered = false;
  std::string hostname;
  std::string backend;
  int64_t weight_bytes = 0;
};

// Control messages to the ranks, for what changes the placement (PlacementChanger).
class RankControlChannel {
 public:
  virtual ~RankControlChannel() = default;
  virtual bool IsUp(int rank) const = 0;
  // UNAVAILABLE when the rank is down (it learns the current state when it registers again).
  virtual absl::Status SendControl(int rank, const moe::v1::internal::GatewayToRank& message) = 0;
};

class ClusterControl final : public RankControlChannel {
 public:
  struct Hooks {
    // The rest of a registration's answer for `rank`: checkpoint, shards and their generation,
    // precision, transport and its bootstrap, step size (the control plane fills in the rank,
    // the session and liveness).
    std::function<void(int rank, moe::v1::internal::RegisterResponse*)> fill_registration;
    // A rank's hello, before its stream is up: the placement generation it loaded.
    std::function<void(int rank, uint64_t generation)> on_hello;
    // ShardsLoaded, PlacementOffer (the stream's reader thread).
    std::function<void(int rank, const moe::v1::internal::RankToGateway&)> on_control;
    // Step results, for the gRPC data plane.
    std::function<void(int rank, moe::v1::internal::StepResult)> on_result;
    // A rank's record changed (registration, hello).
    std::function<void(int rank, const RankRecord&)> on_record;
  };

  ClusterControl(int num_ranks, const LivenessOptions& liveness, RankAdmission* admission);
  ~ClusterControl() override;
  void SetHooks(Hooks hooks);  // before the control port serves

  Membership& membership() { return membership_; }
  RankSessions& sessions() { return sessions_; }
  grpc::Service* service();  // RankControl, for the control port
  int num_ranks() const { return membership_.size(); }

  bool IsUp(int rank) const override { return membership_.IsUp(rank); }
  absl::Status SendControl(int rank, const moe::v1::internal::GatewayToRank& message) override;
  std::vector<RankRecord> ranks() const;
  void Close();  // cancels the exchange streams (shutdown)

 private:
  class Service;
  // A rank id for a registration: `requested`, or the first never registered, else the first
  // down. ALREADY_EXISTS while the requested one is up, RESOURCE_EXHAUSTED when all are.
  absl::StatusOr<int> ClaimRank(int requested);
  void UpdateRank(int rank, const RankRecord& record);

  const LivenessOptions liveness_;
  RankAdmission* const admission_;
  Membership membership_;
  RankSessions sessions_;
  Hooks hooks_;
  mutable std::mutex ranks_mu_;
  std::vector<RankRecord> ranks_;  // guarded by ranks_mu_
  std::unique_ptr<Service> service_;
};

}  // namespace moe
