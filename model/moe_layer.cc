#include "model/moe_layer.h"

#include <numeric>

#include "absl/strings/str_cat.h"
#include "core/status.h"

namespace moe {
namespace {

// Workspace slots of GatewayLayer.
enum GatewaySlot {
  kLogits,
  kIds,
  kWeights,
  kSharedGate,
  kSharedUp,
  kSharedAct,
  kRounded,
  kNormed,
  kRouted
};

absl::StatusOr<MlpWeights> PrepareMlp(Backend* backend, const MlpWeights& host) {
  MlpWeights out;
  ASSIGN_OR_RETURN(out.gate, backend->PrepareWeight(host.gate));
  ASSIGN_OR_RETURN(out.up, backend->PrepareWeight(host.up));
  ASSIGN_OR_RETURN(out.down, backend->PrepareWeight(host.down));
  return out;
}

std::vector<int32_t> Iota(int64_t n) {
  std::vector<int32_t> v(n);
  std::iota(v.begin(), v.end(), 0);
  return v;
}

}  // namespace

// ---- GatewayLayer ---------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<GatewayLayer>> GatewayLayer::Create(
    const MoeConfig& config, const GatewayLayerWeights& weights, Backend* backend) {
  std::unique_ptr<GatewayLayer> layer(new GatewayLayer(config, backend));
  layer->layer_ = weights.layer;
  const int64_t H = config.hidden_size, E = config.routing.num_experts;
  if (weights.router.rows != E || weights.router.cols != H)
    return absl::InvalidArgumentError(absl::StrCat("router weight is [", weights.router.rows, ", ",
                                                   weights.router.cols, "], config says [", E, ", ",
                                                   H, "]"));
  ASSIGN_OR_RETURN(layer->router_, backend->PrepareWeight(weights.router));
  RETURN_IF_ERROR(layer->SetRouterBias(weights.router_bias));
  if (config.has_latent()) {
    if (!weights.has_latent)
      return absl::InvalidArgumentError("latent MoE config but no latent projections");
    ASSIGN_OR_RETURN(layer->latent_down_, backend->PrepareWeight(weights.latent_down));
    ASSIGN_OR_RETURN(layer->latent_up_, backend->PrepareWeight(weights.latent_up));
    if (config.latent_norm) {
      if (!weights.has_latent_norm)
        return absl::InvalidArgumentError("latent_moe_use_norm but no norm weight");
      ASSIGN_OR_RETURN(layer->latent_norm_, backend->PrepareVector(weights.latent_norm));
    }
  }
  layer->has_shared_ = weights.has_shared;
  if (weights.has_shared) {
    ASSIGN_OR_RETURN(layer->shared_, PrepareMlp(backend, weights.shared));
  }
  return layer;
}

absl::Status GatewayLayer::SetRouterBias(std::vector<float> bias) {
  if (static_cast<int>(bias.size()) != config_.routing.num_experts)
    return absl::InvalidArgumentError(absl::StrCat(
        "router bias has ", bias.size(), " entries, expected ", config_.routing.num_experts));
  if (backend_->space() == MemorySpace::kDevice) {  // uploaded once, not per step
    if (device_bias_ == nullptr) {
      ASSIGN_OR_RETURN(device_bias_, backend_->Allocate(bias.size() * sizeof(float)));
    }
    RETURN_IF_ERROR(
        backend_->CopyToBackend(device_bias_->data(), bias.data(), bias.size() * sizeof(float)));
  }
  bias_ = std::move(bias);
  return absl::OkStatus();
}

absl::Status GatewayLayer::Route(ConstMatrixView x, Precision p, Routing* routing,
                                 MatrixView expert_input, std::vector<float>* router_scores) {
  const int64_t T = x.rows;
  const int E = config_.routing.num_experts, k = config_.routing.top_k;
  // Router logits in fp32 whatever the precision (x is already bf16-valued in bf16 mode).
  ASSIGN_OR_RETURN(MatrixView logits, workspace_.Matrix(kLogits, T, E));
  RETURN_IF_ERROR(backend_->Linear(x, router_, logits, Precision::kFP32));
  ASSIGN_OR_RETURN(int32_t * ids, workspace_.Ids(kIds, T * k));
  ASSIGN_OR_RETURN(MatrixView weights_buf, workspace_.Matrix(kWeights, T, k));
  const float* bias = device_bias_ ? static_cast<const float*>(device_bias_->data()) : bias_.data();
  RETURN_IF_ERROR(backend_->SelectExperts(logits, bias, config_.routing, ids, weights_buf.data));
  routing->tokens = T;
  routing->top_k = k;
  routing->ids.resize(T * k);
  routing->weights.resize(T * k);
  RETURN_IF_ERROR(backend_->CopyToHost(routing->ids.data(), ids, T * k * sizeof(int32_t)));
  RETURN_IF_ERROR(
      backend_->CopyToHost(routing->weights.data(), weights_buf.data, T * k * sizeof(float)));
  if (router_scores != nullptr) {
    router_scores->resize(T * E);
    RETURN_IF_ERROR(
        backend_->CopyToHost(router_scores->data(), logits.data, T * E * sizeof(float)));
    for (float& s : *router_scores) s = Sigmoid(s);
  }
  if (config_.has_latent()) return backend_->Linear(x, latent_down_, expert_input, p);
  const std::vector<int32_t> all = Iota(T);
  return backend_->GatherRows(x, all, expert_input);
}

absl::Status GatewayLayer::SharedExperts(ConstMatrixView x, Precision p, MatrixView shared) {
  if (!has_shared_) return absl::OkStatus();  // Finish does not read `shared` then
  const int64_t T = x.rows, S = shared_.gate.rows;
  ASSIGN_OR_RETURN(MatrixView g, workspace_.Matrix(kSharedGate, T, S));
  ASSIGN_OR_RETURN(MatrixView u, workspace_.Matrix(kSharedUp, T, S));
  ASSIGN_OR_RETURN(MatrixView a, workspace_.Matrix(kSharedAct, T, S));
  RETURN_IF_ERROR(backend_->Linear(x, shared_.gate, g, p));
  RETURN_IF_ERROR(backend_->Linear(x, shared_.up, u, p));
  RETURN_IF_ERROR(backend_->GluActivation(g, u, config_.activation, a, p));
  return backend_->Linear(a, shared_.down, shared, p);
}

absl::Status GatewayLayer::Finish(ConstPartialView combined, ConstMatrixView shared, Precision p,
                                  MatrixView out) {
  const int64_t T = combined.rows;
  ASSIGN_OR_RETURN(MatrixView y, workspace_.Matrix(kRounded, T, combined.cols));
  RETURN_IF_ERROR(backend_->RoundPartials(combined, y, p));
  MatrixView routed = y;
  if (config_.has_latent()) {
    if (config_.latent_norm) {
      ASSIGN_OR_RETURN(MatrixView normed, workspace_.Matrix(kNormed, T, combined.cols));
      RETURN_IF_ERROR(backend_->RmsNorm(y, latent_norm_, config_.rms_norm_eps, normed, p));
      y = normed;
    }
    ASSIGN_OR_RETURN(routed, workspace_.Matrix(kRouted, T, config_.hidden_size));
    RETURN_IF_ERROR(backend_->Linear(y, latent_up_, routed, p));
  }
  if (has_shared_) return backend_->Add(routed, shared, out, p);
  const std::vector<int32_t> all = Iota(T);
  return backend_->GatherRows(routed, all, out);
}

// ---- ExpertShard ----------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<ExpertShard>> ExpertShard::Create(const MoeConfig& config,
                                                                 const ExpertShardWeights& weights,
                                                                 Backend* backend) {
  std::unique_ptr<ExpertShard> shard(new ExpertShard(config, backend));
  shard->layer_ = weights.layer;
  shard->expert_ids_ = weights.expert_ids;
  for (size_t i = 0; i < weights.experts.size(); ++i) {
    const MlpWeights& w = weights.experts[i];
    if (w.gate.cols != config.expert_input_size() || w.gate.rows != config.expert_hidden_size)
      return absl::InvalidArgumentError(absl::StrCat(
          "expert ", weights.expert_ids[i], " has shape [", w.gate.rows, ", ", w.gate.cols,
          "], config says [", config.expert_hidden_size, ", ", config.expert_input_size(), "]"));
    auto prepared = PrepareMlp(backend, w);
    if (!prepared.ok())
      return Annotate(prepared.status(),
                      absl::StrCat("layer ", weights.layer, " expert ", weights.expert_ids[i]));
    shard->experts_.push_back(*prepared);
    shard->weight_bytes_ += w.TotalBytes();
  }
  return shard;
}

absl::Status ExpertShard::Compute(ActivationView x, const RowAssignments& rows, Precision p,
                                  PartialView partial) {
  if (rows.num_rows() != x.rows)
    return absl::InvalidArgumentError(
        absl::StrCat(x.rows, " rows but ", rows.num_rows(), " row assignments"));
  ASSIGN_OR_RETURN(ExpertAssignments grouped,
                   GroupByExpert(rows, static_cast<int>(experts_.size())));
  return backend_->ExpertMlp(x, grouped, experts_, config_.activation, partial, p);
}

// ---- LocalMoeLayer --------------------------------------------------------------------------

}  // namespace moe
