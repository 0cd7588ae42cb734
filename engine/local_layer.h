// One MoE layer in one process: the step engine over the loopback transport, with the layer's
// experts split into in-process shards as a placement says. moe-forward, moe-bench and the
// tests' reference run it; it is the same code path as the service, so the service's results
// can be required to be bit-identical to it.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/progress.h"
#include "engine/step_engine.h"
#include "kernels/backend.h"
#include "model/checkpoint.h"
#include "model/dispatch.h"
#include "model/moe_layer.h"
#include "transport/loopback_transport.h"

namespace moe {

// Where one in-process forward spent its time (benchmarks).
struct LayerTimings {
  absl::Duration route, experts, shared, finish;
};

class LocalMoeLayer {
 public:
  // Loads layer `layer` of `checkpoint` with its experts split over `placement` (in-process);
  // `progress` (optional) hears of the experts' value check, the long part of a full layer.
  static absl::StatusOr<std::unique_ptr<LocalMoeLayer>> Load(const Checkpoint& checkpoint,
                                                             int layer,
                                                             const ExpertPlacement& placement,
                                                             Backend* backend,
                                                             Progress* progress = nullptr);

  // out = layer(x) for host arrays x, out: [tokens, H]. routing (optional) receives the
  // router's choices.
  absl::Status Forward(const float* x, int64_t tokens, Precision p, float* out,
                       Routing* routing = nullptr, LayerTimings* timings = nullptr);

  const MoeConfig& config() const { return engine_->config(); }
  GatewayLayer& gateway() { return *engine_->layer(layer_); }

 private:
  explicit LocalMoeLayer(Backend* backend, int num_ranks)
      : transport_(backend), membership_(num_ranks, /*up=*/true) {}
  int layer_ = 0;
  LoopbackTransport transport_;
  Membership membership_;               // the in-process shards never go down
  std::unique_ptr<StepEngine> engine_;  // after transport_: it sends to it
};

}  // namespace moe
