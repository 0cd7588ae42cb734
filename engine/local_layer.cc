#include "engine/local_layer.h"

#include "absl/strings/str_cat.h"
#include "core/status.h"

namespace moe {

absl::StatusOr<std::unique_ptr<LocalMoeLayer>> LocalMoeLayer::Load(const Checkpoint& checkpoint,
                                                                   int layer,
                                                                   const ExpertPlacement& placement,
                                                                   Backend* backend,
                                                                   Progress* progress) {
  const MoeConfig& config = checkpoint.config();
  if (placement.num_experts != config.routing.num_experts)
    return absl::InvalidArgumentError(absl::StrCat("placement covers ", placement.num_experts,
                                                   " experts, model has ",
                                                   config.routing.num_experts));
  std::unique_ptr<LocalMoeLayer> local(new LocalMoeLayer(backend, placement.num_ranks()));
  local->layer_ = layer;
  int64_t before = 0;  // bytes of the shards loaded already
  for (int r = 0; r < placement.num_ranks(); ++r) {
    ExpertLoadOptions load;
    if (progress != nullptr) {
      const std::string stage = absl::StrCat("layer ", layer, ", shard ", r + 1, "/",
                                             placement.num_ranks(), ", checking values");
      load.on_checked = [&, stage](int64_t done, int64_t total) {
        progress->SetTotal(before + total * (placement.num_ranks() - r));
        progress->Add(before + done - progress->done(), stage);
      };
    }
    ASSIGN_OR_RETURN(ExpertShardWeights weights,
                     checkpoint.LoadExperts(layer, placement.rank_experts[r], load));
    before = progress != nullptr ? progress->done() : 0;
    ASSIGN_OR_RETURN(auto shard, ExpertShard::Create(config, weights, backend));
    local->transport_.AddShard(r, std::move(shard));
  }
  if (progress != nullptr) progress->Finish();
  // The engine's own precision is unused: Forward names one per call.
  ASSIGN_OR_RETURN(local->engine_,
                   StepEngine::Create(checkpoint, {layer}, placement, Precision::kBF16, backend,
                                      &local->transport_, &local->membership_));
  return local;
}

absl::Status LocalMoeLayer::Forward(const float* x, int64_t tokens, Precision p, float* out,
                                    Routing* routing, LayerTimings* timings) {
  // The offline callers (moe-forward's .npy, tests) hold fp32: converted once at this edge (to
  // bf16 by rounding, as the layer's contract defines its input) and back.
  const int64_t H = engine_->config().hidden_size;
  const ActivationRows input = ActivationRows::FromFloats(p, x, tokens, H);
  ActivationRows output;
  StepStats stats;
  RETURN_IF_ERROR(
      engine_->RunStep(layer_, input, absl::InfiniteFuture(), &output, routing, &stats));
  for (int64_t i = 0; i < tokens * H; ++i) out[i] = output.Value(i);
  // Loopback computes the shards inside Collect, after the shared experts.
  if (timings != nullptr)
    *timings = {stats.route, stats.dispatch + stats.expert_compute - stats.shared, stats.shared,
                stats.finish};
  return absl::OkStatus();
}

}  // namespace moe
