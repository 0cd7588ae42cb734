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
#pragma once

#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "engine/step_engine.h"
#include "moe/v1/internal.pb.h"
#include "transport/grpc_transport.h"

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
  PlacementChanger(StepEngine* engine, GrpcGatewayTransport* transport,
                   std::function<void()> on_change);

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
  void OnRankDown(int rank);
  // Shutdown: a change in progress is called off (CANCELLED), later ones refused.
  void Stop();

 private:
  moe::v1::internal::GatewayToRank LoadMessage(const PlacementGeneration& placement,
                                               int rank) const;
  void Keep(int rank, uint64_t generation);  // KeepShards, and the engine's bookkeeping
  void CatchUp(int rank);                    // a live rank without the current generation loads it

  StepEngine* const engine_;
  GrpcGatewayTransport* const transport_;
  const std::function<void()> on_change_;
  std::mutex apply_mu_;  // one change at a time
  std::mutex mu_;
  std::condition_variable cv_;
  uint64_t pending_ = 0;  // guarded by mu_: the generation being loaded, 0 when none
  bool stopped_ = false;  // guarded by mu_
  std::map<int, moe::v1::internal::ShardsLoaded> answers_;  // guarded by mu_: for `pending_`
};

}  // namespace moe
