#include "server/gateway/kserve_model.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/status.h"
#include "core/version.h"
#include "model/config.h"
#include "server/gateway/kserve_codec.h"

namespace moe {
namespace {

void SetDuration(int64_t count, absl::Duration total, inference::StatisticDuration* out) {
  out->set_count(static_cast<uint64_t>(count));
  out->set_ns(static_cast<uint64_t>(std::max<int64_t>(0, absl::ToInt64Nanoseconds(total))));
}

// The metrics label of a request for `model`: the layer the name says, else -1.
int MetricsLayer(const std::string& model) {
  const absl::StatusOr<int> layer = KServeModelLayer(model);
  return layer.ok() ? *layer : -1;
}

}  // namespace

bool KServeModels::Serving() const { return gateway_->ready() && !gateway_->draining(); }

absl::StatusOr<int> KServeModels::ServedLayer(const std::string& name,
                                              const std::string& version) const {
  ASSIGN_OR_RETURN(const int layer, KServeModelLayer(name));
  RETURN_IF_ERROR(CheckKServeModelVersion(name, version));
  const std::vector<int>& served = gateway_->engine().layers();
  if (std::find(served.begin(), served.end(), layer) == served.end())
    return absl::NotFoundError(absl::StrCat("model '", name, "': layer ", layer,
                                            " is not served (GetModelInfo lists the layers)"));
  return layer;
}

bool KServeModels::ModelReady(const std::string& name, const std::string& version) const {
  return ServedLayer(name, version).ok() && Serving();
}

void KServeModels::ServerMetadata(inference::ServerMetadataResponse* response) const {
  response->set_name("moe-gateway");
  response->set_version(Version());
  // Triton's names for what is served beyond the core protocol.
  for (const char* extension : {"binary_tensor_data", "parameters", "model_configuration",
                                "statistics", "model_repository"})
    response->add_extensions(extension);
}

absl::Status KServeModels::ModelMetadata(const std::string& name, const std::string& version,
                                         inference::ModelMetadataResponse* response) const {
  ASSIGN_OR_RETURN(const int layer, ServedLayer(name, version));
  const MoeConfig& c = gateway_->engine().config();
  FillKServeModelMetadata(layer, c.hidden_size, c.routing.top_k, ModelFamilyName(c.family),
                          response);
  return absl::OkStatus();
}

absl::Status KServeModels::ModelConfig(const std::string& name, const std::string& version,
                                       inference::ModelConfigResponse* response) const {
  ASSIGN_OR_RETURN(const int layer, ServedLayer(name, version));
  const MoeConfig& c = gateway_->engine().config();
  FillKServeModelConfig(layer, c.hidden_size, c.routing.top_k, response);
  return absl::OkStatus();
}

absl::Status KServeModels::Statistics(const std::string& name, const std::string& version,
                                      inference::ModelStatisticsResponse* response) const {
  std::vector<int> layers = gateway_->engine().layers();
  if (!name.empty()) {
    ASSIGN_OR_RETURN(const int layer, ServedLayer(name, version));
    layers = {layer};
  }
  for (int layer : layers) {
    const InferenceStats s = gateway_->metrics().Inference(layer);
    inference::ModelStatistics* m = response->add_model_stats();
    m->set_name(KServeModelName(layer));
    m->set_version(kKServeModelVersion);
    if (s.last_request > absl::UnixEpoch())
      m->set_last_inference(static_cast<uint64_t>(absl::ToUnixMillis(s.last_request)));
    m->set_inference_count(static_cast<uint64_t>(s.success_count));
    m->set_execution_count(static_cast<uint64_t>(s.steps));
    inference::InferStatistics* stats = m->mutable_inference_stats();
    SetDuration(s.success_count, s.success_time, stats->mutable_success());
    SetDuration(s.fail_count, s.fail_time, stats->mutable_fail());
    SetDuration(s.success_count, s.queue_time, stats->mutable_queue());
    // Everything after the queue: the steps, with their exchange with the ranks.
    SetDuration(s.success_count, s.success_time - s.queue_time, stats->mutable_compute_infer());
    // Decoding and encoding are in the steps' time: zero, counted alike (perf_analyzer wants one
    // count for the three compute parts).
    SetDuration(s.success_count, absl::ZeroDuration(), stats->mutable_compute_input());
    SetDuration(s.success_count, absl::ZeroDuration(), stats->mutable_compute_output());
  }
  return absl::OkStatus();
}

void KServeModels::RepositoryIndex(bool ready_only,
                                   inference::RepositoryIndexResponse* response) const {
  const bool serving = Serving();
  for (int layer : gateway_->engine().layers()) {
    if (ready_only && !serving) continue;
    auto* model = response->add_models();
    model->set_name(KServeModelName(layer));
    model->set_version(kKServeModelVersion);
    model->set_state(serving ? "READY" : "UNAVAILABLE");
    if (!serving)
      model->set_reason(gateway_->draining() ? "draining" : gateway_->ReadinessMessage());
  }
}

absl::Status KServeModels::Infer(const CallerWait& caller,
                                 const inference::ModelInferRequest& request,
                                 inference::ModelInferResponse* response) {
  const absl::Time start = absl::Now();
  absl::Duration queue;
  absl::Status status;
  // As Forward: the slot is taken before anything else, so drain sees this request.
  absl::StatusOr<Gateway::RequestSlot> slot = gateway_->TryBeginRequest();
  absl::StatusOr<KServeCall> call =
      slot.ok() ? ToForwardRequest(request) : absl::StatusOr<KServeCall>(slot.status());
  if (!call.ok()) {
    status = call.status();
  } else {
    moe::v1::ForwardResponse forward;
    status = RunForward(*gateway_, caller, call->forward, &forward, &queue);
    if (status.ok()) ToModelInferResponse(request, *call, forward, response);
  }
  // The metrics label: the translated layer, else (refused early) whatever the name says.
  const int layer = call.ok() ? call->forward.layer() : MetricsLayer(request.model_name());
  gateway_->metrics().OnRequest(layer, static_cast<int>(status.code()), absl::Now() - start, queue);
  return status;
}

absl::Status KServeModels::Refuse(const std::string& model, absl::Status status,
                                  absl::Duration latency) {
  gateway_->metrics().OnRequest(MetricsLayer(model), static_cast<int>(status.code()), latency,
                                absl::ZeroDuration());
  return status;
}

}  // namespace moe
