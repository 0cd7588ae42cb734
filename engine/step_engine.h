// The step engine: the layer math of model/moe_layer.h with the experts behind a transport,
// written once for the gateway (gRPC or NCCL ranks) and for one process (LocalMoeLayer over
// the loopback transport).
//
//   route + down-projection -> dispatch (rank dedup) -> shared experts while the ranks work
//   -> combine the ranks' fp64 partials in rank order -> round, RMSNorm, up-projection, + shared
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/activations.h"
#include "core/progress.h"
#include "kernels/backend.h"
#include "model/checkpoint.h"
#include "model/dispatch.h"
#include "model/moe_layer.h"
#include "transport/membership.h"
#include "transport/transport.h"

namespace moe {

// What one step did, for metrics and load-balance diagnostics.
struct StepStats {
  int layer = 0;
  uint64_t step_id = 0;
  int64_t tokens = 0;
  // expert_compute: from Send to the last partial (the ranks' compute and the exchange, with
  // `shared` overlapping it); finish: the partials combined in rank order, RMSNorm, the latent
  // up-projection and the shared experts' sum.
  absl::Duration route, dispatch, expert_compute, shared, finish, total;
  std::vector<int64_t> rank_rows;            // token rows sent to each rank
  std::vector<int> rank_active_experts;      // distinct local experts each rank used
  std::vector<int64_t> rank_bytes_sent;      // bytes the transport put on the wire to each rank
  std::vector<int64_t> rank_bytes_received;  // and took off it (RankStepStats)
  int failovers = 0;                         // times the step was sent again (a rank went down)
  int64_t redispatched_rows = 0;             // rows of the ranks lost, sent to other replicas
  const Routing* routing = nullptr;          // this step's router choices
  const std::vector<float>* router_scores = nullptr;  // [tokens, E] sigmoid scores, when asked for
  bool ok = true;
};

// Serving a step partially (RunStep with `unserved`). In: where each caller's rows end (a
// caller with a token that chose an expert without a live replica is left out whole; empty:
// every token on its own). Out: the tokens left out, whose output rows are zeros, not results,
// and the UNAVAILABLE status naming those experts.
struct UnservedTokens {
  std::vector<int64_t> segment_ends;
  std::vector<int64_t> tokens;  // ascending
  absl::Status status;
};

class StepObserver {
 public:
  virtual ~StepObserver() = default;
  virtual void OnStep(const StepStats& stats) = 0;
  // Whether OnStep wants the router's scores (costs a [tokens, E] copy per step).
  virtual bool WantsRouterScores() const { return false; }
};

// An expert placement and its generation: 1 at start, +1 per live re-placement. Steps are
// planned with a snapshot (shared_ptr) taken as they start, so a switch happens between steps.
struct PlacementGeneration {
  uint64_t generation = 1;
  ExpertPlacement placement;
};

class StepEngine {
 public:
  // Loads the gateway tensors of `layers` and prepares them on `backend`.
  // Steps go through `transport` to the ranks `membership` says are up (both outlive it).
  static absl::StatusOr<std::unique_ptr<StepEngine>> Create(
      const Checkpoint& checkpoint, const std::vector<int>& layers, ExpertPlacement placement,
      Precision precision, Backend* backend, GatewayTransport* transport,
      const Membership* membership, Progress* progress = nullptr);

  const MoeConfig& config() const { return config_; }
  Precision precision() const { return precision_; }
  // The placement steps start with now.
  std::shared_ptr<const PlacementGeneration> placement() const;
  // Switches the steps that start from now on to `next` (as `generation`, by default the
  // current one + 1) and returns the previous one: steps in flight hold it until they end, so
  // once the caller's weak reference expires no step uses it. Only ranks holding the new
  // generation get rows.
  std::shared_ptr<const PlacementGeneration> SwitchPlacement(ExpertPlacement next,
                                                             uint64_t generation = 0);
  // Which placement generations rank `rank` has loaded (every rank starts with generation 1).
  // A rank gets rows only while it holds the generation the step was planned with.
  void SetRankGenerations(int rank, std::vector<uint64_t> generations);
  void AddRankGeneration(int rank, uint64_t generation);
  bool RankHolds(int rank, uint64_t generation) const;
  // Up (as far as the transport knows) and holding the current generation.
  bool RankServes(int rank) const;
  std::vector<int> layers() const;
  bool Serves(int layer) const { return layers_.count(layer) > 0; }
  GatewayLayer* layer(int index);
  // The router's selection bias of a layer (the newest, installed or pending), and replacing it:
  // checked at once, installed by the layer's next step before it routes. Neither waits for a
  // step in flight, so diagnostics never block behind a slow or stuck rank.
  std::vector<float> RouterBias(int layer);
  absl::Status SetRouterBias(int layer, std::vector<float> bias);
  void SetObserver(StepObserver* observer) { observer_ = observer; }

  // One step over host rows x: [tokens, H], in their precision (bf16 bits in bf16 mode, the
  // service's; fp32 only in the fp32 exactness mode). `out` gets [tokens, H] in the same
  // precision. Thread-safe; steps of one layer run one at a time, steps of different layers may
  // overlap. `stats` (optional) receives the step's figures (its routing and score pointers are
  // cleared: they do not outlive the step). With `unserved`, tokens that chose an expert without
  // a live replica are left out and listed there, and the step serves the others (it fails only
  // when it can serve none); without, the step fails UNAVAILABLE.
  absl::Status RunStep(int layer, const ActivationRows& x, absl::Time deadline, ActivationRows* out,
                       Routing* routing, StepStats* stats = nullptr,
                       UnservedTokens* unserved = nullptr);

 private:
  struct LayerState {
    std::unique_ptr<GatewayLayer> math;
    std::unique_ptr<Workspace> workspace;
    std::mutex mu;  // held by a step from start to end
    std::mutex bias_mu;
    std::vector<float> bias;    // guarded by bias_mu: the newest bias
    bool bias_pending = false;  // guarded by bias_mu: `bias` not installed in `math` yet
  };
  StepEngine() = default;
  // The newest router bias, when one is waiting (the step holds state.mu).
  absl::Status InstallPendingBias(LayerState& state);
  // The ranks of `dispatch` that went down or left `generation` since: marked not live; the
  // rows they had.
  int64_t MarkLostRanks(const StepDispatch& dispatch, uint64_t generation,
                        std::vector<bool>* live) const;
  // A failed step: counted by the observer, `status` returned.
  absl::Status FailStep(StepStats& stats, absl::Time t0, absl::Status status);
  // Each rank's rows of `plan` gathered from `expert_input` into the workspace, stored in
  // `dispatch`'s precision, as its parts; the row counts into `rank_rows`.
  absl::Status GatherParts(const DispatchPlan& plan, MatrixView expert_input, Workspace& ws,
                           StepDispatch* dispatch, std::vector<int64_t>* rank_rows);

  MoeConfig config_;
  Precision precision_ = Precision::kBF16;
  mutable std::mutex placement_mu_;
  std::shared_ptr<const PlacementGeneration> placement_;  // guarded by placement_mu_
  std::vector<std::vector<uint64_t>> rank_generations_;   // guarded by placement_mu_
  Backend* backend_ = nullptr;
  GatewayTransport* transport_ = nullptr;
  const Membership* membership_ = nullptr;
  std::map<int, std::unique_ptr<LayerState>> layers_;
  std::atomic<uint64_t> next_step_id_{1};
  StepObserver* observer_ = nullptr;
};

}  // namespace moe
