// The gateway's gRPC services. Thin: parse, call the gateway, map the status.
#pragma once

#include "moe/v1/internal.grpc.pb.h"
#include "moe/v1/moe.grpc.pb.h"
#include "server/gateway/gateway.h"

namespace moe {

// One unary Forward: validates `request`, runs it in the batcher's steps and waits, watching for
// the caller going away. Both public APIs (moe.v1 Forward and the Open Inference Protocol's
// ModelInfer) call it, so they share validation, status codes and batching. `queue` gets the
// time the request waited to join a step.
grpc::Status RunForward(Gateway& gateway, grpc::ServerContext& context,
                        const moe::v1::ForwardRequest& request, moe::v1::ForwardResponse* response,
                        absl::Duration* queue);

class MoeServiceImpl final : public moe::v1::MoeService::Service {
 public:
  explicit MoeServiceImpl(Gateway* gateway) : gateway_(gateway) {}

  grpc::Status Forward(grpc::ServerContext* context, const moe::v1::ForwardRequest* request,
                       moe::v1::ForwardResponse* response) override;
  grpc::Status ForwardStream(
      grpc::ServerContext* context,
      grpc::ServerReaderWriter<moe::v1::ForwardResponse, moe::v1::ForwardRequest>* stream) override;
  grpc::Status GetModelInfo(grpc::ServerContext* context,
                            const moe::v1::GetModelInfoRequest* request,
                            moe::v1::ModelInfo* response) override;

 private:
  Gateway* gateway_;
};

class DiagnosticsServiceImpl final : public moe::v1::MoeDiagnostics::Service {
 public:
  explicit DiagnosticsServiceImpl(Gateway* gateway) : gateway_(gateway) {}

  grpc::Status GetLoadBalance(grpc::ServerContext* context,
                              const moe::v1::GetLoadBalanceRequest* request,
                              moe::v1::LoadBalanceReport* response) override;
  grpc::Status GetPlacementAdvice(grpc::ServerContext* context,
                                  const moe::v1::GetPlacementAdviceRequest* request,
                                  moe::v1::PlacementAdvice* response) override;
  grpc::Status SetRouterBias(grpc::ServerContext* context,
                             const moe::v1::SetRouterBiasRequest* request,
                             moe::v1::SetRouterBiasResponse* response) override;
  grpc::Status ApplyPlacement(grpc::ServerContext* context,
                              const moe::v1::ApplyPlacementRequest* request,
                              moe::v1::ApplyPlacementResponse* response) override;

 private:
  Gateway* gateway_;
};

class RankControlServiceImpl final : public moe::v1::internal::RankControl::Service {
 public:
  explicit RankControlServiceImpl(Gateway* gateway) : gateway_(gateway) {}

  grpc::Status Register(grpc::ServerContext* context,
                        const moe::v1::internal::RegisterRequest* request,
                        moe::v1::internal::RegisterResponse* response) override;
  grpc::Status Exchange(grpc::ServerContext* context, ExchangeServerStream* stream) override;

 private:
  Gateway* gateway_;
};

}  // namespace moe
