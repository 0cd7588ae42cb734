// The Open Inference Protocol (KServe v2) on the gateway's public port, beside moe.v1: each
// served layer is the model "moe-layer-<L>". Thin, like services.h: translate (kserve_codec.h),
// run the same Forward path, translate back.
#pragma once

#include "inference/grpc_service.grpc.pb.h"
#include "server/gateway/gateway.h"

namespace moe {

// Every method registered streamed (read_after_admission.h): admitted on metadata, then read.
using KServeServiceBase = inference::GRPCInferenceService::WithStreamedUnaryMethod_ServerLive<
    inference::GRPCInferenceService::WithStreamedUnaryMethod_ServerReady<
        inference::GRPCInferenceService::WithStreamedUnaryMethod_ModelReady<
            inference::GRPCInferenceService::WithStreamedUnaryMethod_ServerMetadata<
                inference::GRPCInferenceService::WithStreamedUnaryMethod_ModelMetadata<
                    inference::GRPCInferenceService::WithStreamedUnaryMethod_ModelInfer<
                        inference::GRPCInferenceService::Service>>>>>>;

class KServeServiceImpl final : public KServeServiceBase {
 public:
  explicit KServeServiceImpl(Gateway* gateway) : gateway_(gateway) {}

  // Open like grpc.health.v1: probes carry no token.
  grpc::Status StreamedServerLive(
      grpc::ServerContext* context,
      grpc::ServerUnaryStreamer<inference::ServerLiveRequest, inference::ServerLiveResponse>*
          stream) override;
  grpc::Status StreamedServerReady(
      grpc::ServerContext* context,
      grpc::ServerUnaryStreamer<inference::ServerReadyRequest, inference::ServerReadyResponse>*
          stream) override;
  grpc::Status StreamedModelReady(
      grpc::ServerContext* context,
      grpc::ServerUnaryStreamer<inference::ModelReadyRequest, inference::ModelReadyResponse>*
          stream) override;
  // Caller access, as moe.v1.
  grpc::Status StreamedServerMetadata(
      grpc::ServerContext* context,
      grpc::ServerUnaryStreamer<inference::ServerMetadataRequest,
                                inference::ServerMetadataResponse>* stream) override;
  grpc::Status StreamedModelMetadata(
      grpc::ServerContext* context,
      grpc::ServerUnaryStreamer<inference::ModelMetadataRequest, inference::ModelMetadataResponse>*
          stream) override;
  grpc::Status StreamedModelInfer(
      grpc::ServerContext* context,
      grpc::ServerUnaryStreamer<inference::ModelInferRequest, inference::ModelInferResponse>*
          stream) override;

 private:
  bool Serving() const;
  // NOT_FOUND unless `name`/`version` is a model of a served layer; the layer otherwise.
  absl::StatusOr<int> ServedLayer(const std::string& name, const std::string& version) const;
  grpc::Status ModelInfer(grpc::ServerContext& context, const inference::ModelInferRequest& request,
                          inference::ModelInferResponse* response);

  Gateway* gateway_;
};

}  // namespace moe
