// The in-process transport: the "ranks" are ExpertShards in this process, computed during
// Collect in ascending rank order on the caller's thread (and backend). It is what
// LocalMoeLayer (moe-forward, moe-bench, the tests' reference) runs the step engine over, and
// the third implementation the transport conformance suite checks.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "model/moe_layer.h"
#include "transport/transport.h"

namespace moe {

class LoopbackTransport final : public GatewayTransport {
 public:
  // Partial sums are computed into buffers of `backend`, the backend the shards were made on.
  explicit LoopbackTransport(Backend* backend) : backend_(backend) {}

  // What a rank does with its part of a step: fill `partial` ([rows, width] fp64, backend
  // memory) or fail. An ExpertShard's Compute, or a stand-in (tests inject slow and failing
  // ranks).
  using RankCompute =
      std::function<absl::Status(const RankPart& part, Precision precision, PartialView partial)>;

  // Rank `rank` hosts `shard` for its layer. Not thread-safe against steps: set up first.
  void AddShard(int rank, std::unique_ptr<ExpertShard> shard);
  void AddRank(int layer, int rank, RankCompute compute);

  std::string name() const override { return "loopback"; }
  absl::Status Send(const StepDispatch& dispatch) override;
  absl::Status Collect(const StepDispatch& dispatch, absl::Time deadline,
                       const std::function<absl::Status(size_t, ConstPartialView,
                                                        const RankStepStats&)>& consume) override;
  void Abandon(uint64_t step_id) override;
  // Told by whoever keeps the membership (tests, a supervisor): a rank down gets no steps.
  void RankDown(int rank, absl::string_view why) override;
  void RankUp(int rank) override;

 private:
  // UNAVAILABLE naming the first part's rank that is down (mu_ held).
  absl::Status DownLocked(const StepDispatch& dispatch) const;
  struct LayerRanks {
    std::vector<std::unique_ptr<ExpertShard>> owned;
    std::map<int, RankCompute> ranks;
    std::unique_ptr<Workspace> workspace;  // partials; one step of a layer at a time
    std::mutex mu;
  };
  Backend* backend_;
  std::map<int, std::unique_ptr<LayerRanks>> layers_;
  std::mutex mu_;
  std::set<uint64_t> sent_;          // guarded by mu_: sent, not yet collected or abandoned
  std::map<int, std::string> down_;  // guarded by mu_: rank -> why, for ranks told down
};

}  // namespace moe
