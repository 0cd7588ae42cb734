#include "server/gateway/kserve_service.h"

#include "server/grpc_status.h"
#include "server/read_after_admission.h"

namespace moe {
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
        response->set_ready(models_.Serving());
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
        response->set_ready(models_.ModelReady(request.name(), request.version()));
        return grpc::Status::OK;
      });
}

grpc::Status KServeServiceImpl::StreamedServerMetadata(
    grpc::ServerContext* context,
    grpc::ServerUnaryStreamer<inference::ServerMetadataRequest, inference::ServerMetadataResponse>*
        stream) {
  return ReadAfterAdmission(
      *context, *stream, [&] { return gateway_->access().Caller(*context, "ServerMetadata"); },
      [&](const inference::ServerMetadataRequest&, inference::ServerMetadataResponse* response) {
        models_.ServerMetadata(response);
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
        return ToGrpcStatus(models_.ModelMetadata(request.name(), request.version(), response));
      });
}

grpc::Status KServeServiceImpl::StreamedModelInfer(
    grpc::ServerContext* context,
    grpc::ServerUnaryStreamer<inference::ModelInferRequest, inference::ModelInferResponse>*
        stream) {
  return ReadAfterAdmission(
      *context, *stream, [&] { return gateway_->access().Caller(*context, "ModelInfer"); },
      [&](const inference::ModelInferRequest& request, inference::ModelInferResponse* response) {
        return ToGrpcStatus(models_.Infer(CallerWaitOf(*context), request, response));
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
    const absl::Status status =
        models_.Infer(CallerWaitOf(*context), request, reply.mutable_infer_response());
    if (!status.ok()) {
      reply.set_error_message(std::string(status.message()));
      reply.mutable_infer_response()->set_id(request.id());
      reply.mutable_infer_response()->set_model_name(request.model_name());
    }
    if (!stream->Write(reply)) break;
  }
  return context->IsCancelled()
             ? ToGrpcStatus(absl::CancelledError("the client cancelled the stream"))
             : grpc::Status::OK;
}

grpc::Status KServeServiceImpl::StreamedModelConfig(
    grpc::ServerContext* context,
    grpc::ServerUnaryStreamer<inference::ModelConfigRequest, inference::ModelConfigResponse>*
        stream) {
  return ReadAfterAdmission(
      *context, *stream, [&] { return gateway_->access().Caller(*context, "ModelConfig"); },
      [&](const inference::ModelConfigRequest& request, inference::ModelConfigResponse* response) {
        return ToGrpcStatus(models_.ModelConfig(request.name(), request.version(), response));
      });
}

grpc::Status KServeServiceImpl::StreamedModelStatistics(
    grpc::ServerContext* context,
    grpc::ServerUnaryStreamer<inference::ModelStatisticsRequest,
                              inference::ModelStatisticsResponse>* stream) {
  return ReadAfterAdmission(
      *context, *stream, [&] { return gateway_->access().Caller(*context, "ModelStatistics"); },
      [&](const inference::ModelStatisticsRequest& request,
          inference::ModelStatisticsResponse* response) {
        return ToGrpcStatus(models_.Statistics(request.name(), request.version(), response));
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
        models_.RepositoryIndex(request.ready(), response);
        return grpc::Status::OK;
      });
}

}  // namespace moe
