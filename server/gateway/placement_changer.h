// Live re-placement of the routed experts (MoeDiagnostics/ApplyPlacement), and bringing a
// returning rank to the placement in use.
//
//   1. load    every live rank gets LoadShards(generation + 1, its new experts) on its exchange
//              stream and loads them beside the ones serving (steps go on meanwhile);
//   2. switch  once all have answered ShardsLoaded, steps that start from then on are planned
//              with the new placement (StepEngine::SwitchPlacement, a step boundary);
//   3. release once no step in flight uses the old generation, every rank gets KeepShards and
//              drops what it lost.
// A rank failing to load calls the change off (KeepShards(old)): the old placement never
// stopped serving. A rank down during the change, or one that registered with an older
// generation, loads the current one when it says hello and gets rows once it has.
//
// Several gateways over one rank pool: placement has one authority at a time, the gateway whose
// change the ranks loaded first; a generation is one layout on every rank, so a rival change of
// the same generation finds ALREADY_EXISTS on some rank and is called off. The others follow:
// a rank tells each of its other gateways, in a PlacementOffer, the generation a gateway
// committed (or registered it with) and its experts in it; once every rank has offered the same
// newer generation, this gateway switches to it at a step boundary and releases its old one
// (FollowLoop), as in 2. and 3. above.
#pragma once

#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "engine/step_engine.h"
#include "moe/v1/internal.pb.h"
#include "server/control/cluster_control.h"

namespace moe {

struct PlacementChange {
  uint64_t generation = 0;
  absl::Duration took;          // request to release
  absl::Duration slowest_load;  // the slowest rank's loading
  std::vector<int> ranks_loaded, ranks_down;
};

class PlacementChanger {
 public:
  // `on_change` runs (outside locks) whenever which ranks serve the current placement changed:
  // the gateway re-evaluates readiness.
  // `on_follow` runs (on the follower thread) after this gateway followed another's change.
  PlacementChanger(StepEngine* engine, RankControlChannel* ranks, std::function<void()> on_change,
                   std::function<void(const PlacementGeneration&)> on_follow = nullptr);
  ~PlacementChanger();  // stops and joins the follower thread

  // Runs steps 1-3. ABORTED while another change runs; INVALID_ARGUMENT for a placement of
  // another shape; UNAVAILABLE when a rank fails or times out loading, or when the new
  // placement would leave experts without a live replica (the old placement keeps serving).
  absl::StatusOr<PlacementChange> Apply(ExpertPlacement next, absl::Duration load_timeout);

  // The exchange stream's events for rank `rank`: the hello names the generation it loaded
  // (before its stream is up), then the stream is up: a rank without the current generation
  // loads it.
  void OnHello(int rank, uint64_t generation);
  void OnRankUp(int rank) { CatchUp(rank); }
  void OnShardsLoaded(int rank, const moe::v1::internal::ShardsLoaded& loaded);
  // A rank's offer of a generation another gateway uses (the stream's reader: never blocks).
  void OnOffer(int rank, const moe::v1::internal::PlacementOffer& offer);
  void OnRankDown(int rank);
  // Shutdown: a change in progress is called off (CANCELLED), later ones refused.
  void Stop();

 private:
  moe::v1::internal::GatewayToRank LoadMessage(const PlacementGeneration& placement,
                                               int rank) const;
  void Keep(int rank, uint64_t generation);  // KeepShards, and the engine's bookkeeping
  // A control message to a rank; a failure is logged (the rank is down: it catches up later).
  void Send(int rank, const moe::v1::internal::GatewayToRank& message, const char* what);
  void CatchUp(int rank);  // a live rank without the current generation loads it
  // Follows every generation all ranks offered, newest first (the follower thread).
  void FollowLoop();
  // Switches to `next` (generation next.generation), which every rank holds.
  void Follow(PlacementGeneration next);

  StepEngine* const engine_;
  RankControlChannel* const ranks_;
  const std::function<void()> on_change_;
  const std::function<void(const PlacementGeneration&)> on_follow_;
  std::mutex apply_mu_;  // one change at a time
  std::mutex mu_;
  std::condition_variable cv_;
  uint64_t pending_ = 0;  // guarded by mu_: the generation being loaded, 0 when none
  bool stopped_ = false;  // guarded by mu_
  std::map<int, moe::v1::internal::ShardsLoaded> answers_;  // guarded by mu_: for `pending_`
  // Guarded by mu_: offered generation -> rank -> its experts (newer than the current only).
  std::map<uint64_t, std::map<int, std::vector<int>>> offers_;
  std::thread follower_;  // last: starts after the members it uses
};

}  // namespace moe
