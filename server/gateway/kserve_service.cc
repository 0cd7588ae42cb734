#include "server/gateway/kserve_service.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/status.h"
#include "core/version.h"
#include "model/config.h"
#include "server/gateway/kserve_codec.h"
#include "server/read_after_admission.h"
#include "server/gateway/services.h"
#include "server/grpc_status.h"

namespace moe {

bool KServeServiceImpl::Serving() const { return gateway_->ready() && !gateway_->draining(); }

absl::StatusOr<int> KServeServiceImpl::ServedLayer(const std::string& name,
                                                   const std::string& version) const {
  ASSIGN_OR_RETURN(const int layer, KServeModelLayer(name));
  RETURN_IF_ERROR(CheckKServeModelVersion(name, version));
  const std::vector<int>& served = gateway_->engine().layers();
  if (std::find(served.begin(), served.end(), layer) == served.end())
    return absl::NotFoundError(absl::StrCat("model '", name, "': layer ", layer,
                                            " is not served (GetModelInfo lists the layers)"));
  return layer;
}

namespace {
grpc::Status Open() { return grpc::Status::OK; }
}  // namespace

grpc::Status KServeServiceImpl::StreamedServerLive(
    grpc::ServerContext* context,
    grpc::ServerUnaryStreamer<inference::ServerLiveRequest, inference::ServerLiveResponse>*
        stream) {
  return ReadAfterAdmission(
      *context, *stream, Open,
      [](const inference::ServerLiveRequest&, inference::ServerLiveResponse* response) {
        response->set_live(true);  // answering at all is the liveness
        return grpc::Status::OK;
      });
}

grpc::Status KServeServiceImpl::StreamedServerReady(
    grpc::ServerContext* context,
    grpc::ServerUnaryStreamer<inference::ServerReadyRequest, inference::ServerReadyResponse>*
        stream) {
  return ReadAfterAdmission(
      *context, *stream, Open,
      [&](const inference::ServerReadyRequest&, inference::ServerReadyResponse* response) {
        response->set_ready(Serving());
        return grpc::Status::OK;
      });
}

grpc::Status KServeServiceImpl::StreamedModelReady(
    grpc::ServerContext* context,
    grpc::ServerUnaryStreamer<inference::ModelReadyRequest, inference::ModelReadyResponse>*
        stream) {
  return ReadAfterAdmission(
      *context, *stream, Open,
      [&](const inference::ModelReadyRequest& request, inference::ModelReadyResponse* response) {
        // A question, not a lookup: an unknown model is not ready (no error, as probes expect).
        response->set_ready(ServedLayer(request.name(), request.version()).ok() && Serving());
        return grpc::Status::OK;
      });
}

grpc::Status KServeServiceImpl::StreamedServerMetadata(
    grpc::ServerContext* context,
    grpc::ServerUnaryStreamer<inference::ServerMetadataRequest, inference::ServerMetadataResponse>*
        stream) {
  return ReadAfterAdmission(
      *context, *stream, [&] { return gateway_->access().Caller(*context, "ServerMetadata"); },
      [](const inference::ServerMetadataRequest&, inference::ServerMetadataResponse* response) {
        response->set_name("moe-gateway");
        response->set_version(Version());
        // Triton's names for what is served beyond the core protocol.
        for (const char* extension : {"binary_tensor_data", "parameters", "model_configuration",
                                      "statistics", "model_repository"})
          response->add_extensions(extension);
        return grpc::Status::OK;
      });
}

grpc::Status KServeServiceImpl::StreamedModelMetadata(
    grpc::ServerContext* context,
    grpc::ServerUnaryStreamer<inference::ModelMetadataRequest, inference::ModelMetadataResponse>*
        stream) {
  return ReadAfterAdmission(
      *context, *stream, [&] { return gateway_->access().Caller(*context, "ModelMetadata"); },
      [&](const inference::ModelMetadataRequest& request,
          inference::ModelMetadataResponse* response) {
        absl::StatusOr<int> layer = ServedLayer(request.name(), request.version());
        if (!layer.ok()) return ToGrpcStatus(layer.status());
        const MoeConfig& c = gateway_->engine().config();
        FillKServeModelMetadata(*layer, c.hidden_size, c.routing.top_k, ModelFamilyName(c.family),
                                response);
        return grpc::Status::OK;
      });
}

grpc::Status KServeServiceImpl::StreamedModelInfer(
    grpc::ServerContext* context,
    grpc::ServerUnaryStreamer<inference::ModelInferRequest, inference::ModelInferResponse>*
        stream) {
  return ReadAfterAdmission(
      *context, *stream, [&] { return gateway_->access().Caller(*context, "ModelInfer"); },
      [&](const inference::ModelInferRequest& request, inference::ModelInferResponse* response) {
        return ModelInfer(*context, request, response);
      });
}

grpc::Status KServeServiceImpl::ModelStreamInfer(
    grpc::ServerContext* context,
    grpc::ServerReaderWriter<inference::ModelStreamInferResponse, inference::ModelInferRequest>*
        stream) {
  if (grpc::Status s = gateway_->access().Caller(*context, "ModelStreamInfer"); !s.ok()) return s;
  // One request at a time, answered in order: a client that stops reading holds this stream's
  // next request back (flow control), nothing of another caller's.
  inference::ModelInferRequest request;
  while (stream->Read(&request)) {
    inference::ModelStreamInferResponse reply;
    const grpc::Status status = ModelInfer(*context, request, reply.mutable_infer_response());
    if (!status.ok()) {
      reply.set_error_message(status.error_message());
      reply.mutable_infer_response()->set_id(request.id());
      reply.mutable_infer_response()->set_model_name(request.model_name());
    }
    if (!stream->Write(reply)) break;
  }
  return context->IsCancelled()
             ? grpc::Status(grpc::StatusCode::CANCELLED, "the client cancelled the stream")
             : grpc::Status::OK;
}

grpc::Status KServeServiceImpl::StreamedModelConfig(
    grpc::ServerContext* context,
    grpc::ServerUnaryStreamer<inference::ModelConfigRequest, inference::ModelConfigResponse>*
        stream) {
  return ReadAfterAdmission(
      *context, *stream, [&] { return gateway_->access().Caller(*context, "ModelConfig"); },
      [&](const inference::ModelConfigRequest& request, inference::ModelConfigResponse* response) {
        absl::StatusOr<int> layer = ServedLayer(request.name(), request.version());
        if (!layer.ok()) return ToGrpcStatus(layer.status());
        const MoeConfig& c = gateway_->engine().config();
        FillKServeModelConfig(*layer, c.hidden_size, c.routing.top_k, response);
        return grpc::Status::OK;
      });
}

namespace {
void SetDuration(int64_t count, absl::Duration total, inference::StatisticDuration* out) {
  out->set_count(static_cast<uint64_t>(count));
  out->set_ns(static_cast<uint64_t>(std::max<int64_t>(0, absl::ToInt64Nanoseconds(total))));
}
}  // namespace

grpc::Status KServeServiceImpl::StreamedModelStatistics(
    grpc::ServerContext* context,
    grpc::ServerUnaryStreamer<inference::ModelStatisticsRequest,
                              inference::ModelStatisticsResponse>* stream) {
  return ReadAfterAdmission(
      *context, *stream, [&] { return gateway_->access().Caller(*context, "ModelStatistics"); },
      [&](const inference::ModelStatisticsRequest& request,
          inference::ModelStatisticsResponse* response) {
        std::vector<int> layers = gateway_->engine().layers();
        if (!request.name().empty()) {
          absl::StatusOr<int> layer = ServedLayer(request.name(), request.version());
          if (!layer.ok()) return ToGrpcStatus(layer.status());
          layers = {*layer};
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
          // Everything after the queue: the steps, with their gRPC exchange with the ranks.
          SetDuration(s.success_count, s.success_time - s.queue_time,
                      stats->mutable_compute_infer());
          // Decoding and encoding are in the steps' time: zero, counted alike (perf_analyzer
          // wants one count for the three compute parts).
          SetDuration(s.success_count, absl::ZeroDuration(), stats->mutable_compute_input());
          SetDuration(s.success_count, absl::ZeroDuration(), stats->mutable_compute_output());
        }
        return grpc::Status::OK;
      });
}

grpc::Status KServeServiceImpl::StreamedRepositoryIndex(
    grpc::ServerContext* context,
    grpc::ServerUnaryStreamer<inference::RepositoryIndexRequest,
                              inference::RepositoryIndexResponse>* stream) {
  return ReadAfterAdmission(
      *context, *stream, [&] { return gateway_->access().Caller(*context, "RepositoryIndex"); },
      [&](const inference::RepositoryIndexRequest& request,
          inference::RepositoryIndexResponse* response) {
        const bool serving = Serving();
        for (int layer : gateway_->engine().layers()) {
          if (request.ready() && !serving) continue;
          auto* model = response->add_models();
          model->set_name(KServeModelName(layer));
          model->set_version(kKServeModelVersion);
          model->set_state(serving ? "READY" : "UNAVAILABLE");
          if (!serving)
            model->set_reason(gateway_->draining() ? "draining" : gateway_->ReadinessMessage());
        }
        return grpc::Status::OK;
      });
}

grpc::Status KServeServiceImpl::ModelInfer(grpc::ServerContext& context,
                                           const inference::ModelInferRequest& request,
                                           inference::ModelInferResponse* response) {
  const absl::Time start = absl::Now();
  absl::Duration queue;
  grpc::Status status;
  // As Forward: the slot is taken before anything else, so drain sees this request.
  absl::StatusOr<Gateway::RequestSlot> slot = gateway_->TryBeginRequest();
  absl::StatusOr<KServeCall> call =
      slot.ok() ? ToForwardRequest(request) : absl::StatusOr<KServeCall>(slot.status());
  if (!call.ok()) {
    status = ToGrpcStatus(call.status());
  } else {
    moe::v1::ForwardResponse forward;
    status = RunForward(*gateway_, context, call->forward, &forward, &queue);
    if (status.ok()) ToModelInferResponse(request, *call, forward, response);
  }
  // The metrics label: the translated layer, else (refused early) whatever the name says.
  int layer = -1;
  if (call.ok()) {
    layer = call->forward.layer();
  } else if (absl::StatusOr<int> named = KServeModelLayer(request.model_name()); named.ok()) {
    layer = *named;
  }
  gateway_->metrics().OnRequest(layer, status.error_code(), absl::Now() - start, queue);
  return status;
}

}  // namespace moe
