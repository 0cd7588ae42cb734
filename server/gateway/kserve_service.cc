#include "server/gateway/kserve_service.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
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
  absl::StatusOr<int> layer = KServeModelLayer(name);
  if (!layer.ok()) return layer.status();
  if (absl::Status s = CheckKServeModelVersion(name, version); !s.ok()) return s;
  const std::vector<int>& served = gateway_->engine().layers();
  if (std::find(served.begin(), served.end(), *layer) == served.end())
    return absl::NotFoundError(absl::StrCat("model '", name, "': layer ", *layer,
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
