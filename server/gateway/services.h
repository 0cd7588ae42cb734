// The gateway's gRPC services. Thin: parse, call the gateway, map the status.
#pragma once

#include <functional>

#include "absl/time/time.h"
#include "moe/v1/moe.grpc.pb.h"
#include "server/gateway/gateway.h"

namespace moe {

// What a forward call knows of its caller, whatever carries it: the deadline, and whether the
// caller went away (null: never asked).
struct CallerWait {
  absl::Time deadline = absl::InfiniteFuture();
  std::function<bool()> cancelled;
};
CallerWait CallerWaitOf(grpc::ServerContext& context);

// One unary Forward: validates `request`, runs it in the batcher's steps and waits, watching for
// the caller going away. Every public API (moe.v1 Forward, the Open Inference Protocol's
// ModelInfer over gRPC and over HTTP) calls it, so they share validation, status codes and
// batching. `queue` gets the time the request waited to join a step.
absl::Status RunForward(Gateway& gateway, const CallerWait& caller,
                        const moe::v1::ForwardRequest& request, moe::v1::ForwardResponse* response,
                        absl::Duration* queue);

// Every unary method is registered streamed (read_after_admission.h): the caller is admitted on
// its metadata before its request is read.
using MoeServiceBase = moe::v1::MoeService::WithStreamedUnaryMethod_Forward<
    moe::v1::MoeService::WithStreamedUnaryMethod_GetModelInfo<moe::v1::MoeService::Service>>;

class MoeServiceImpl final : public MoeServiceBase {
 public:
  explicit MoeServiceImpl(Gateway* gateway) : gateway_(gateway) {}

  grpc::Status StreamedForward(
      grpc::ServerContext* context,
      grpc::ServerUnaryStreamer<moe::v1::ForwardRequest, moe::v1::ForwardResponse>* stream)
      override;
  grpc::Status ForwardStream(
      grpc::ServerContext* context,
      grpc::ServerReaderWriter<moe::v1::ForwardResponse, moe::v1::ForwardRequest>* stream) override;
  grpc::Status StreamedGetModelInfo(
      grpc::ServerContext* context,
      grpc::ServerUnaryStreamer<moe::v1::GetModelInfoRequest, moe::v1::ModelInfo>* stream) override;

 private:
  grpc::Status Forward(grpc::ServerContext& context, const moe::v1::ForwardRequest& request,
                       moe::v1::ForwardResponse* response);
  grpc::Status GetModelInfo(moe::v1::ModelInfo* info);

  Gateway* gateway_;
};

using DiagnosticsServiceBase = moe::v1::MoeDiagnostics::WithStreamedUnaryMethod_GetLoadBalance<
    moe::v1::MoeDiagnostics::WithStreamedUnaryMethod_GetPlacementAdvice<
        moe::v1::MoeDiagnostics::WithStreamedUnaryMethod_SetRouterBias<
            moe::v1::MoeDiagnostics::WithStreamedUnaryMethod_ApplyPlacement<
                moe::v1::MoeDiagnostics::Service>>>>;

class DiagnosticsServiceImpl final : public DiagnosticsServiceBase {
 public:
  explicit DiagnosticsServiceImpl(Gateway* gateway) : gateway_(gateway) {}

  grpc::Status StreamedGetLoadBalance(
      grpc::ServerContext* context,
      grpc::ServerUnaryStreamer<moe::v1::GetLoadBalanceRequest, moe::v1::LoadBalanceReport>* stream)
      override;
  grpc::Status StreamedGetPlacementAdvice(
      grpc::ServerContext* context,
      grpc::ServerUnaryStreamer<moe::v1::GetPlacementAdviceRequest, moe::v1::PlacementAdvice>*
          stream) override;
  grpc::Status StreamedSetRouterBias(
      grpc::ServerContext* context,
      grpc::ServerUnaryStreamer<moe::v1::SetRouterBiasRequest, moe::v1::SetRouterBiasResponse>*
          stream) override;
  grpc::Status StreamedApplyPlacement(
      grpc::ServerContext* context,
      grpc::ServerUnaryStreamer<moe::v1::ApplyPlacementRequest, moe::v1::ApplyPlacementResponse>*
          stream) override;

 private:
  Gateway* gateway_;
};

}  // namespace moe
