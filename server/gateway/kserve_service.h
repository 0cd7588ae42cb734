// The Open Inference Protocol (KServe v2) on the gateway's public port, beside moe.v1: each
// served layer is the model "moe-layer-<L>". Thin, like services.h: translate (kserve_codec.h),
// run the same Forward path, translate back.
#pragma once

#include "inference/grpc_service.grpc.pb.h"
#include "server/gateway/gateway.h"

namespace moe {

class KServeServiceImpl final : public inference::GRPCInferenceService::Service {
 public:
  explicit KServeServiceImpl(Gateway* gateway) : gateway_(gateway) {}

  // Open like grpc.health.v1: probes carry no token.
  grpc::Status ServerLive(grpc::ServerContext* context, const inference::ServerLiveRequest* request,
                          inference::ServerLiveResponse* response) override;
  grpc::Status ServerReady(grpc::ServerContext* context,
                           const inference::ServerReadyRequest* request,
                           inference::ServerReadyResponse* response) override;
  grpc::Status ModelReady(grpc::ServerContext* context, const inference::ModelReadyRequest* request,
                          inference::ModelReadyResponse* response) override;
  // Caller access, as moe.v1.
  grpc::Status ServerMetadata(grpc::ServerContext* context,
                              const inference::ServerMetadataRequest* request,
                              inference::ServerMetadataResponse* response) override;
  grpc::Status ModelMetadata(grpc::ServerContext* context,
                             const inference::ModelMetadataRequest* request,
                             inference::ModelMetadataResponse* response) override;
  grpc::Status ModelInfer(grpc::ServerContext* context, const inference::ModelInferRequest* request,
                          inference::ModelInferResponse* response) override;

 private:
  bool Serving() const;
  // NOT_FOUND unless `name`/`version` is a model of a served layer; the layer otherwise.
  absl::StatusOr<int> ServedLayer(const std::string& name, const std::string& version) const;

  Gateway* gateway_;
};

}  // namespace moe
