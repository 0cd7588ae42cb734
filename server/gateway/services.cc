#include "server/gateway/services.h"

#include <unistd.h>

#include <condition_variable>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/status.h"
#include "proto/tensor_codec.h"
#include "server/gateway/request_validation.h"
#include "server/gateway/stream_outbox.h"
#include "server/grpc_status.h"
#include "server/read_after_admission.h"

namespace moe {
namespace {

using moe::v1::ForwardRequest;
using moe::v1::ForwardResponse;

// A stream stops reading requests while this many of its responses wait to be written.
constexpr size_t kMaxQueuedStreamResponses = 1024;

// Validates a request and turns it into a call for the batcher.
absl::StatusOr<std::shared_ptr<ForwardCall>> MakeCall(Gateway& gateway,
                                                      const ForwardRequest& request,
                                                      absl::Time deadline,
                                                      ValidatedRequest* validated) {
  if (gateway.draining())
    return absl::UnavailableError("the gateway is shutting down (draining); try another replica");
  if (!gateway.AcceptsRequests())
    return absl::UnavailableError(absl::StrCat("not ready: ", gateway.ReadinessMessage()));
  RequestLimits limits{gateway.engine().config().hidden_size, gateway.options().max_request_tokens,
                       gateway.engine().layers(), gateway.engine().precision()};
  ASSIGN_OR_RETURN(*validated, ValidateForwardRequest(request, limits));
  auto call = std::make_shared<ForwardCall>();
  call->layer = validated->layer;
  call->tokens = validated->tokens;
  call->input = std::move(validated->input);
  call->deadline = deadline;
  call->want_routing = request.return_routing();
  return call;
}

void FillResponse(const ForwardCall& call, const ValidatedRequest& v, const ForwardRequest& request,
                  ForwardResponse* response) {
  response->set_request_id(request.request_id());
  (void)EncodeActivations(call.output, v.shape, v.output_dtype, response->mutable_output());
  if (call.want_routing) {
    auto* routing = response->mutable_routing();
    routing->set_top_k(call.routing.top_k);
    routing->mutable_expert_ids()->Add(call.routing.ids.begin(), call.routing.ids.end());
    routing->mutable_weights()->Add(call.routing.weights.begin(), call.routing.weights.end());
  }
  auto* timing = response->mutable_timing();
  timing->set_queue_us(absl::ToInt64Microseconds(call.queue_time));
  timing->set_step_us(absl::ToInt64Microseconds(call.step_time));
  timing->set_step_tokens(static_cast<int32_t>(call.step_tokens));
}

// About what the response to a validated request takes on the wire: the output, and the
// routing (an int32 id and a float weight per choice, each with up to a byte of varint framing
// slack: 10 bytes, rounded up to 12).
int64_t ResponseBytes(const ValidatedRequest& v, const ForwardRequest& request, int top_k) {
  int64_t elements = 1;
  for (int64_t d : v.shape) elements *= d;
  const int64_t width = v.output_dtype == moe::v1::FP32 ? 4 : 2;
  return elements * width + (request.return_routing() ? v.tokens * top_k * int64_t{12} : 0);
}

absl::Time DeadlineOf(const grpc::ServerContext& context) {
  const auto deadline = context.deadline();
  if (deadline == std::chrono::system_clock::time_point::max()) return absl::InfiniteFuture();
  return absl::FromChrono(deadline);
}

}  // namespace

grpc::Status MoeServiceImpl::StreamedForward(
    grpc::ServerContext* context,
    grpc::ServerUnaryStreamer<ForwardRequest, ForwardResponse>* stream) {
  return ReadAfterAdmission(
      *context, *stream, [&] { return gateway_->access().Caller(*context, "Forward"); },
      [&](const ForwardRequest& request, ForwardResponse* response) {
        return Forward(*context, request, response);
      });
}

grpc::Status MoeServiceImpl::Forward(grpc::ServerContext& context, const ForwardRequest& request,
                                     ForwardResponse* response) {
  const absl::Time start = absl::Now();
  absl::Duration queue;
  // Counted before MakeCall checks draining(): Drain either sees this request or it sees drain.
  absl::StatusOr<Gateway::RequestSlot> slot = gateway_->TryBeginRequest();
  const grpc::Status status = ToGrpcStatus(
      slot.ok() ? RunForward(*gateway_, CallerWaitOf(context), request, response, &queue)
                : slot.status());
  gateway_->metrics().OnRequest(request.layer(), status.error_code(), absl::Now() - start, queue);
  return status;
}

absl::Status RunForward(Gateway& gateway, const CallerWait& caller, const ForwardRequest& request,
                        ForwardResponse* response, absl::Duration* queue) {
  ValidatedRequest validated;
  ASSIGN_OR_RETURN(std::shared_ptr<ForwardCall> call,
                   MakeCall(gateway, request, caller.deadline, &validated));
  RETURN_IF_ERROR(gateway.batcher().Submit(call));
  // Wait for the step, watching for the client going away.
  while (!call->done.WaitFor(absl::Milliseconds(20))) {
    if (caller.cancelled && caller.cancelled()) {
      call->cancelled = true;
      return absl::CancelledError("the client cancelled the request");
    }
  }
  *queue = call->queue_time;
  RETURN_IF_ERROR(call->status);
  FillResponse(*call, validated, request, response);
  return absl::OkStatus();
}

CallerWait CallerWaitOf(grpc::ServerContext& context) {
  return CallerWait{DeadlineOf(context), [&context] { return context.IsCancelled(); }};
}

grpc::Status MoeServiceImpl::ForwardStream(
    grpc::ServerContext* context,
    grpc::ServerReaderWriter<ForwardResponse, ForwardRequest>* stream) {
  if (grpc::Status s = gateway_->access().Caller(*context, "ForwardStream"); !s.ok()) return s;
  // Requests run concurrently; each response is queued when its step completes and written by
  // the outbox's thread, so a client that stops reading never holds up a step.
  std::mutex mu;
  std::condition_variable cv;
  int outstanding = 0;  // guarded by mu
  StreamOutbox outbox(stream, gateway_->options().max_stream_buffer_bytes,
                      &gateway_->stream_buffers());
  auto error_response = [](const ForwardRequest& request, const absl::Status& status) {
    ForwardResponse response;
    // Echoed only as far as an id may be long (a longer one is what this error is about).
    response.set_request_id(request.request_id().substr(0, kMaxRequestIdBytes));
    response.mutable_error()->set_code(static_cast<int>(status.code()));
    response.mutable_error()->set_message(std::string(status.message()));
    return response;
  };
  std::vector<std::shared_ptr<ForwardCall>> calls;
  ForwardRequest request;
  for (;;) {
    outbox.WaitBelow(kMaxQueuedStreamResponses);
    if (!stream->Read(&request)) break;
    auto validated = std::make_shared<ValidatedRequest>();
    // Released in on_done, or when it goes out of scope here because the request never runs.
    absl::StatusOr<Gateway::RequestSlot> admitted = gateway_->TryBeginRequest();
    if (!admitted.ok()) {
      outbox.Push(error_response(request, admitted.status()));
      continue;
    }
    auto slot = std::make_shared<Gateway::RequestSlot>(std::move(*admitted));
    auto call = MakeCall(*gateway_, request, DeadlineOf(*context), validated.get());
    const int64_t reserved =
        call.ok() ? ResponseBytes(*validated, request, gateway_->engine().config().routing.top_k)
                  : 0;
    if (call.ok()) {
      if (absl::Status s = outbox.Admit(reserved); !s.ok()) {
        gateway_->metrics().OnRequest(request.layer(), static_cast<int>(s.code()),
                                      absl::ZeroDuration(), absl::ZeroDuration());
        call = s;
      }
    }
    if (!call.ok()) {
      outbox.Push(error_response(request, call.status()));
      continue;
    }
    auto owned_request = std::make_shared<ForwardRequest>();
    owned_request->set_request_id(request.request_id());
    owned_request->set_return_routing(request.return_routing());
    (*call)->on_done = [&, validated, owned_request, reserved, slot,
                        start = absl::Now()](ForwardCall& done) {
      gateway_->metrics().OnRequest(done.layer, static_cast<int>(done.status.code()),
                                    absl::Now() - start, done.queue_time);
      if (done.status.ok()) {
        ForwardResponse response;
        FillResponse(done, *validated, *owned_request, &response);
        outbox.Push(std::move(response), reserved);
      } else {
        outbox.Push(error_response(*owned_request, done.status), reserved);
      }
      slot->Release();
      std::lock_guard<std::mutex> lock(mu);
      --outstanding;
      cv.notify_all();
    };
    {
      std::lock_guard<std::mutex> lock(mu);
      ++outstanding;
    }
    if (absl::Status s = gateway_->batcher().Submit(*call); !s.ok()) {
      {
        std::lock_guard<std::mutex> lock(mu);
        --outstanding;
      }
      slot->Release();  // on_done, which holds it too, will not run
      outbox.Push(error_response(request, s), reserved);
      continue;
    }
    calls.push_back(*call);
  }
  // The client half-closed (or went away): finish what is in flight before returning, since
  // the completions use this frame (the outbox then writes what is left as it is destroyed).
  std::unique_lock<std::mutex> lock(mu);
  while (outstanding > 0) {
    if (context->IsCancelled())
      for (auto& call : calls) call->cancelled = true;
    cv.wait_for(lock, std::chrono::milliseconds(20));
  }
  if (context->IsCancelled())
    return ToGrpcStatus(absl::CancelledError("the client cancelled the stream"));
  return grpc::Status::OK;
}

grpc::Status MoeServiceImpl::StreamedGetModelInfo(
    grpc::ServerContext* context,
    grpc::ServerUnaryStreamer<moe::v1::GetModelInfoRequest, moe::v1::ModelInfo>* stream) {
  return ReadAfterAdmission(
      *context, *stream, [&] { return gateway_->access().Caller(*context, "GetModelInfo"); },
      [&](const moe::v1::GetModelInfoRequest&, moe::v1::ModelInfo* info) {
        return GetModelInfo(info);
      });
}

grpc::Status MoeServiceImpl::GetModelInfo(moe::v1::ModelInfo* info) {
  const MoeConfig& c = gateway_->engine().config();
  info->set_family(ModelFamilyName(c.family));
  info->set_model_type(c.model_type);
  for (int layer : gateway_->engine().layers()) info->add_layers(layer);
  info->set_hidden_size(c.hidden_size);
  info->set_latent_size(c.latent_size);
  info->set_expert_hidden_size(c.expert_hidden_size);
  info->set_num_experts(c.routing.num_experts);
  info->set_top_k(c.routing.top_k);
  info->set_num_shared_experts(c.num_shared_experts);
  info->set_expert_format(WeightFormatName(c.expert_format));
  info->set_dense_format(WeightFormatName(c.dense_format));
  info->set_precision(gateway_->engine().precision() == Precision::kBF16 ? "bf16" : "fp32");
  info->set_transport(TransportName(gateway_->options().transport));
  info->set_max_tokens_per_step(gateway_->options().batcher.max_tokens_per_step);
  info->set_max_request_tokens(gateway_->options().max_request_tokens);
  info->set_checkpoint(gateway_->options().checkpoint);
  info->set_gateway_backend(gateway_->backend_name());
  const auto ranks = gateway_->ranks();
  const auto current = gateway_->engine().placement();
  const ExpertPlacement& placement = current->placement;
  info->set_placement_generation(current->generation);
  for (int e : gateway_->ExpertsWithoutLiveReplica()) info->add_experts_without_live_replica(e);
  for (int r = 0; r < static_cast<int>(ranks.size()); ++r) {
    auto* rank = info->add_ranks();
    rank->set_rank(r);
    rank->set_address(ranks[r].hostname);
    rank->set_ready(gateway_->engine().RankServes(r));
    rank->set_backend(ranks[r].backend);
    rank->set_weight_bytes(ranks[r].weight_bytes);
    for (int e : placement.rank_experts[r]) rank->add_experts(e);
  }
  for (const auto& record : gateway_->diagnostics().overrides())
    *info->add_bias_overrides() = record;
  return grpc::Status::OK;
}

// ---- diagnostics ----------------------------------------------------------------------------

grpc::Status DiagnosticsServiceImpl::StreamedGetLoadBalance(
    grpc::ServerContext* context,
    grpc::ServerUnaryStreamer<moe::v1::GetLoadBalanceRequest, moe::v1::LoadBalanceReport>* stream) {
  return ReadAfterAdmission(
      *context, *stream, [&] { return gateway_->access().Admin(*context, "GetLoadBalance"); },
      [&](const moe::v1::GetLoadBalanceRequest& request, moe::v1::LoadBalanceReport* response) {
        auto report = gateway_->diagnostics().Report(request.layer());
        if (!report.ok()) return ToGrpcStatus(report.status());
        *response = std::move(*report);
        return grpc::Status::OK;
      });
}

grpc::Status DiagnosticsServiceImpl::StreamedGetPlacementAdvice(
    grpc::ServerContext* context,
    grpc::ServerUnaryStreamer<moe::v1::GetPlacementAdviceRequest, moe::v1::PlacementAdvice>*
        stream) {
  return ReadAfterAdmission(
      *context, *stream, [&] { return gateway_->access().Admin(*context, "GetPlacementAdvice"); },
      [&](const moe::v1::GetPlacementAdviceRequest& request, moe::v1::PlacementAdvice* response) {
        auto advice = gateway_->diagnostics().Advice(request.layer(), request.redundant_experts());
        if (!advice.ok()) return ToGrpcStatus(advice.status());
        *response = std::move(*advice);
        return grpc::Status::OK;
      });
}

grpc::Status DiagnosticsServiceImpl::StreamedSetRouterBias(
    grpc::ServerContext* context,
    grpc::ServerUnaryStreamer<moe::v1::SetRouterBiasRequest, moe::v1::SetRouterBiasResponse>*
        stream) {
  return ReadAfterAdmission(
      *context, *stream, [&] { return gateway_->access().Admin(*context, "SetRouterBias"); },
      [&](const moe::v1::SetRouterBiasRequest& request, moe::v1::SetRouterBiasResponse* response) {
        const std::string source = request.source().empty() ? context->peer() : request.source();
        auto record = gateway_->diagnostics().SetRouterBias(
            request.layer(), std::vector<float>(request.bias().begin(), request.bias().end()),
            source);
        if (!record.ok()) return ToGrpcStatus(record.status());
        *response->mutable_override() = std::move(*record);
        return grpc::Status::OK;
      });
}

grpc::Status DiagnosticsServiceImpl::StreamedApplyPlacement(
    grpc::ServerContext* context,
    grpc::ServerUnaryStreamer<moe::v1::ApplyPlacementRequest, moe::v1::ApplyPlacementResponse>*
        stream) {
  return ReadAfterAdmission(
      *context, *stream, [&] { return gateway_->access().Admin(*context, "ApplyPlacement"); },
      [&](const moe::v1::ApplyPlacementRequest& request,
          moe::v1::ApplyPlacementResponse* response) {
        const std::string source = request.source().empty() ? context->peer() : request.source();
        auto change = gateway_->ApplyPlacement(request.placement(), source);
        if (!change.ok()) return ToGrpcStatus(change.status());
        response->set_generation(change->generation);
        response->set_seconds(absl::ToDoubleSeconds(change->took));
        response->set_load_seconds(absl::ToDoubleSeconds(change->slowest_load));
        response->mutable_ranks_loaded()->Add(change->ranks_loaded.begin(),
                                              change->ranks_loaded.end());
        response->mutable_ranks_down()->Add(change->ranks_down.begin(), change->ranks_down.end());
        return grpc::Status::OK;
      });
}

}  // namespace moe
