// The Open Inference Protocol (KServe v2) on the gateway's public port, beside moe.v1: each
// served layer is the model "moe-layer-<L>". Thin, like services.h: admit, read, and ask
// KServeModels (kserve_model.h), which the HTTP/REST API asks too.
#pragma once

#include "inference/grpc_service.grpc.pb.h"
#include "server/gateway/gateway.h"
#include "server/gateway/kserve_model.h"

namespace moe {

// Every method registered streamed (read_after_admission.h): admitted on metadata, then read.
using KServeService = inference::GRPCInferenceService;
using KServeServiceBase = KServeService::WithStreamedUnaryMethod_ServerLive<
    KServeService::WithStreamedUnaryMethod_ServerReady<
        KServeService::WithStreamedUnaryMethod_ModelReady<
            KServeService::WithStreamedUnaryMethod_ServerMetadata<
                KServeService::WithStreamedUnaryMethod_ModelMetadata<
                    KServeService::WithStreamedUnaryMethod_ModelInfer<
                        KServeService::WithStreamedUnaryMethod_ModelConfig<
                            KServeService::WithStreamedUnaryMethod_ModelStatistics<
                                KServeService::WithStreamedUnaryMethod_RepositoryIndex<
                                    KServeService::Service>>>>>>>>>;

class KServeServiceImpl final : public KServeServiceBase {
 public:
  explicit KServeServiceImpl(Gateway* gateway) : gateway_(gateway), models_(gateway) {}

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
  // Triton's extensions, caller access as well.
  grpc::Status ModelStreamInfer(
      grpc::ServerContext* context,
      grpc::ServerReaderWriter<inference::ModelStreamInferResponse, inference::ModelInferRequest>*
          stream) override;
  grpc::Status StreamedModelConfig(
      grpc::ServerContext* context,
      grpc::ServerUnaryStreamer<inference::ModelConfigRequest, inference::ModelConfigResponse>*
          stream) override;
  grpc::Status StreamedModelStatistics(
      grpc::ServerContext* context,
      grpc::ServerUnaryStreamer<inference::ModelStatisticsRequest,
                                inference::ModelStatisticsResponse>* stream) override;
  grpc::Status StreamedRepositoryIndex(
      grpc::ServerContext* context,
      grpc::ServerUnaryStreamer<inference::RepositoryIndexRequest,
                                inference::RepositoryIndexResponse>* stream) override;

 private:
  Gateway* gateway_;  // its access control
  KServeModels models_;
};

}  // namespace moe
