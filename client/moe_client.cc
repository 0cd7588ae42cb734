#include "client/moe_client.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "client/gateway_targets.h"
#include "core/status.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "proto/tensor_codec.h"
#include "security/tokens.h"

namespace moe {

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

absl::StatusOr<moe::v1::DType> ParseWireDType(absl::string_view name) {
  const std::string lower = absl::AsciiStrToLower(name);
  if (lower == "bf16") return moe::v1::BF16;
  if (lower == "fp16") return moe::v1::FP16;
  if (lower == "fp32") return moe::v1::FP32;
  return absl::InvalidArgumentError(
      absl::StrCat("dtype must be bf16, fp16 or fp32, got '", name, "'"));
}

absl::StatusOr<moe::v1::ForwardRequest> MakeForwardRequest(int layer,
                                                           const std::vector<int64_t>& shape,
                                                           const float* values,
                                                           const ForwardOptions& options) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) return absl::InvalidArgumentError("negative dimension in the input shape");
    n *= d;
  }
  if (n > 0 && values == nullptr) return absl::InvalidArgumentError("input values are null");
  moe::v1::ForwardRequest request;
  request.set_layer(layer);
  RETURN_IF_ERROR(EncodeTensor(values, shape, options.dtype, request.mutable_hidden_states()));
  request.set_return_routing(options.return_routing);
  request.set_output_dtype(options.output_dtype);
  request.set_request_id(options.request_id);
  return request;
}

absl::StatusOr<ForwardResult> DecodeForwardResponse(const moe::v1::ForwardResponse& response) {
  if (response.has_error() && response.error().code() != 0)
    return absl::Status(static_cast<absl::StatusCode>(response.error().code()),
                        response.error().message());
  ForwardResult result;
  absl::StatusOr<HostTensor> output = DecodeTensor(response.output(), "response output");
  // A bad output from the server is the server's fault, not the caller's argument.
  if (!output.ok()) return absl::InternalError(output.status().message());
  result.shape = std::move(output->shape);
  result.values = std::move(output->values);

  const moe::v1::Routing& routing = response.routing();
  const size_t ids = routing.expert_ids_size();
  if (routing.top_k() < 0 || static_cast<size_t>(routing.weights_size()) != ids ||
      (routing.top_k() == 0 ? ids != 0 : ids % routing.top_k() != 0))
    return absl::InternalError(absl::StrCat("malformed routing in the response: top_k ",
                                            routing.top_k(), ", ", ids, " expert ids, ",
                                            routing.weights_size(), " weights"));
  result.routing.top_k = routing.top_k();
  result.routing.expert_ids.assign(routing.expert_ids().begin(), routing.expert_ids().end());
  result.routing.weights.assign(routing.weights().begin(), routing.weights().end());

  result.timing.queue_us = response.timing().queue_us();
  result.timing.step_us = response.timing().step_us();
  result.timing.step_tokens = response.timing().step_tokens();
  result.request_id = response.request_id();
  return result;
}

namespace {

// What is left of `timeout` since `start` (infinite stays infinite): a call's deadline also
// covers the sizing before it.
absl::Duration Left(absl::Time start, absl::Duration timeout) {
  if (timeout == absl::InfiniteDuration()) return timeout;
  return std::max(absl::ZeroDuration(), timeout - (absl::Now() - start));
}

}  // namespace

int MessageLimit(const moe::v1::ModelInfo& info) {
  // In double: a server's fields are not trusted to keep an int64 product from overflowing.
  const double tokens = static_cast<double>(std::max<int64_t>(info.max_request_tokens(), 1));
  const double hidden = static_cast<double>(std::max<int64_t>(info.hidden_size(), 0));
  const double top_k = static_cast<double>(std::max<int32_t>(info.top_k(), 1));
  const double bytes = tokens * hidden * 4 + tokens * top_k * 12 + (1 << 20);
  if (bytes >= static_cast<double>(INT32_MAX)) return INT32_MAX;
  return std::max(kMinMessageBytes, static_cast<int>(bytes));
}

// ---- MoeClient ---------------------------------------------------------------------------------

MoeClient::MoeClient(std::string target, const ClientOptions& options,
                     std::shared_ptr<Channel> channel)
    : target_(std::move(target)),
      options_(options),
      channel_(std::move(channel)),
      sized_(options.max_message_bytes > 0) {}

absl::StatusOr<std::shared_ptr<MoeClient::Channel>> MoeClient::MakeChannel(
    const std::string& target, const ClientOptions& options, int message_limit) {
  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(message_limit);
  args.SetMaxReceiveMessageSize(message_limit);
  const int64_t backoff_ms = std::max<int64_t>(
      100, std::min<int64_t>(absl::ToInt64Milliseconds(options.max_reconnect_backoff), 120000));
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, static_cast<int>(backoff_ms));
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS,
              static_cast<int>(std::min<int64_t>(backoff_ms, 1000)));
  AddTlsChannelArgs(options.tls, &args);
  ASSIGN_OR_RETURN(std::string channel_target, GatewayChannelTarget(target));
  if (std::string authority = GatewayAuthority(target); !authority.empty())
    args.SetString(GRPC_ARG_DEFAULT_AUTHORITY, authority);
  ASSIGN_OR_RETURN(std::shared_ptr<grpc::ChannelCredentials> credentials,
                   ChannelCredentials(options.tls));
  auto made = std::make_shared<Channel>();
  // Forwards go only to gateways that take requests; health, model info and diagnostics to any
  // (a gateway still waiting for its ranks answers them).
  grpc::ChannelArguments forward_args = args, plain_args = args;
  AddGatewayFailoverArgs(message_limit, /*health_checked=*/true, &forward_args);
  AddGatewayFailoverArgs(message_limit, /*health_checked=*/false, &plain_args);
  made->channel = grpc::CreateCustomChannel(channel_target, credentials, forward_args);
  made->plain = grpc::CreateCustomChannel(channel_target, credentials, plain_args);
  if (made->channel == nullptr || made->plain == nullptr)
    return absl::InvalidArgumentError(absl::StrCat("cannot create a channel to '", target, "'"));
  made->stub = moe::v1::MoeService::NewStub(made->channel);
  made->info = moe::v1::MoeService::NewStub(made->plain);
  made->diagnostics = moe::v1::MoeDiagnostics::NewStub(made->plain);
  made->message_limit = message_limit;
  return made;
}

absl::StatusOr<std::unique_ptr<MoeClient>> MoeClient::Connect(const std::string& target,
                                                              const ClientOptions& options) {
  if (options.max_message_bytes < 0)
    return absl::InvalidArgumentError(
        "max_message_bytes must be positive (or 0: sized from the server)");
  ASSIGN_OR_RETURN(
      std::shared_ptr<Channel> channel,
      MakeChannel(target, options,
                  options.max_message_bytes > 0 ? options.max_message_bytes : kMinMessageBytes));
  return std::unique_ptr<MoeClient>(new MoeClient(target, options, std::move(channel)));
}

std::shared_ptr<MoeClient::Channel> MoeClient::channel() const {
  std::lock_guard<std::mutex> lock(channel_mu_);
  return channel_;
}

int MoeClient::max_message_bytes() const { return channel()->message_limit; }

absl::Status MoeClient::SizeFromServer(absl::Duration timeout) {
  if (sized_.load(std::memory_order_acquire)) return absl::OkStatus();
  std::lock_guard<std::mutex> size_lock(size_mu_);
  if (sized_.load(std::memory_order_acquire)) return absl::OkStatus();
  ASSIGN_OR_RETURN(moe::v1::ModelInfo info, GetModelInfo(timeout));
  const int limit = MessageLimit(info);
  if (limit > channel()->message_limit) {
    ASSIGN_OR_RETURN(std::shared_ptr<Channel> larger, MakeChannel(target_, options_, limit));
    std::lock_guard<std::mutex> lock(channel_mu_);
    channel_ = std::move(larger);
  }
  sized_.store(true, std::memory_order_release);
  return absl::OkStatus();
}

void MoeClient::Prepare(grpc::ClientContext* context, absl::Duration timeout) const {
  if (timeout != absl::InfiniteDuration())
    context->set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  context->set_wait_for_ready(options_.wait_for_ready);
  AddBearerToken(context, options_.token);
}

absl::StatusOr<moe::v1::ForwardResponse> MoeClient::ForwardRaw(
    const moe::v1::ForwardRequest& request, absl::Duration timeout) {
  const absl::Time start = absl::Now();
  RETURN_IF_ERROR(SizeFromServer(timeout));
  grpc::ClientContext context;
  Prepare(&context, Left(start, timeout));
  moe::v1::ForwardResponse response;
  RETURN_IF_ERROR(FromGrpcStatus(channel()->stub->Forward(&context, request, &response)));
  return response;
}

absl::StatusOr<ForwardResult> MoeClient::Forward(int layer, const std::vector<int64_t>& shape,
                                                 const float* values,
                                                 const ForwardOptions& options) {
  ASSIGN_OR_RETURN(moe::v1::ForwardRequest request,
                   MakeForwardRequest(layer, shape, values, options));
  ASSIGN_OR_RETURN(moe::v1::ForwardResponse response, ForwardRaw(request, options.timeout));
  return DecodeForwardResponse(response);
}

absl::StatusOr<moe::v1::ModelInfo> MoeClient::GetModelInfo(absl::Duration timeout) {
  grpc::ClientContext context;
  Prepare(&context, timeout);
  moe::v1::ModelInfo info;
  RETURN_IF_ERROR(FromGrpcStatus(
      channel()->info->GetModelInfo(&context, moe::v1::GetModelInfoRequest(), &info)));
  return info;
}

absl::StatusOr<moe::v1::PlacementAdvice> MoeClient::GetPlacementAdvice(int layer,
                                                                       int redundant_experts,
                                                                       absl::Duration timeout) {
  grpc::ClientContext context;
  Prepare(&context, timeout);
  moe::v1::GetPlacementAdviceRequest request;
  request.set_layer(layer);
  request.set_redundant_experts(redundant_experts);
  moe::v1::PlacementAdvice advice;
  RETURN_IF_ERROR(
      FromGrpcStatus(channel()->diagnostics->GetPlacementAdvice(&context, request, &advice)));
  return advice;
}

absl::StatusOr<moe::v1::LoadBalanceReport> MoeClient::GetLoadBalance(int layer,
                                                                     absl::Duration timeout) {
  grpc::ClientContext context;
  Prepare(&context, timeout);
  moe::v1::GetLoadBalanceRequest request;
  request.set_layer(layer);
  moe::v1::LoadBalanceReport report;
  RETURN_IF_ERROR(
      FromGrpcStatus(channel()->diagnostics->GetLoadBalance(&context, request, &report)));
  return report;
}

absl::StatusOr<moe::v1::SetRouterBiasResponse> MoeClient::SetRouterBias(
    int layer, const std::vector<float>& bias, const std::string& source, absl::Duration timeout) {
  grpc::ClientContext context;
  Prepare(&context, timeout);
  moe::v1::SetRouterBiasRequest request;
  request.set_layer(layer);
  request.mutable_bias()->Add(bias.begin(), bias.end());
  request.set_source(source);
  moe::v1::SetRouterBiasResponse response;
  RETURN_IF_ERROR(
      FromGrpcStatus(channel()->diagnostics->SetRouterBias(&context, request, &response)));
  return response;
}

absl::StatusOr<moe::v1::ApplyPlacementResponse> MoeClient::ApplyPlacement(
    const std::string& placement, const std::string& source, absl::Duration timeout) {
  grpc::ClientContext context;
  Prepare(&context, timeout);
  moe::v1::ApplyPlacementRequest request;
  request.set_placement(placement);
  request.set_source(source);
  moe::v1::ApplyPlacementResponse response;
  RETURN_IF_ERROR(
      FromGrpcStatus(channel()->diagnostics->ApplyPlacement(&context, request, &response)));
  return response;
}

absl::StatusOr<bool> MoeClient::IsServing(const std::string& service, absl::Duration timeout) {
  grpc::ClientContext context;
  Prepare(&context, timeout);
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  grpc::health::v1::HealthCheckResponse response;
  auto stub = grpc::health::v1::Health::NewStub(channel()->plain);
  RETURN_IF_ERROR(FromGrpcStatus(stub->Check(&context, request, &response)));
  return response.status() == grpc::health::v1::HealthCheckResponse::SERVING;
}

absl::Status MoeClient::WaitUntilServing(absl::Duration timeout, const std::string& service) {
  const absl::Time deadline = absl::Now() + timeout;
  std::string last = "no answer";
  auto stub = grpc::health::v1::Health::NewStub(channel()->plain);
  for (;;) {
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) break;
    grpc::ClientContext context;
    // wait_for_ready: ride out connection failures until the attempt's deadline instead of
    // spinning on UNAVAILABLE.
    context.set_wait_for_ready(true);
    context.set_deadline(absl::ToChronoTime(absl::Now() + std::min(left, absl::Seconds(1))));
    grpc::health::v1::HealthCheckRequest request;
    request.set_service(service);
    grpc::health::v1::HealthCheckResponse response;
    const grpc::Status status = stub->Check(&context, request, &response);
    if (status.ok()) {
      if (response.status() == grpc::health::v1::HealthCheckResponse::SERVING)
        return absl::OkStatus();
      last = grpc::health::v1::HealthCheckResponse::ServingStatus_Name(response.status());
    } else if (status.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED || last == "no answer") {
      last = FromGrpcStatus(status).ToString();
    }
    // Pace the polling of a server that answers NOT_SERVING or fails fast.
    const absl::Duration pause = std::min(absl::Milliseconds(100), deadline - absl::Now());
    if (pause > absl::ZeroDuration()) absl::SleepFor(pause);
  }
  return absl::DeadlineExceededError(absl::StrCat(
      target_, " not serving after ", absl::FormatDuration(timeout), " (last: ", last, ")"));
}

absl::StatusOr<std::unique_ptr<ForwardStreamSession>> MoeClient::OpenStream(
    absl::Duration timeout) {
  const absl::Time start = absl::Now();
  RETURN_IF_ERROR(SizeFromServer(timeout));
  return std::unique_ptr<ForwardStreamSession>(new ForwardStreamSession(
      channel()->channel, Left(start, timeout), options_.wait_for_ready, options_.token));
}

// ---- ForwardStreamSession ---------------------------------------------------------------------

ForwardStreamSession::ForwardStreamSession(std::shared_ptr<grpc::Channel> channel,
                                           absl::Duration timeout, bool wait_for_ready,
                                           const std::string& token)
    : stub_(moe::v1::MoeService::NewStub(channel)) {
  AddBearerToken(&context_, token);
  if (timeout != absl::InfiniteDuration())
    context_.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  context_.set_wait_for_ready(wait_for_ready);
  stream_ = stub_->ForwardStream(&context_);
  reader_ = std::thread([this] { ReadLoop(); });
}

ForwardStreamSession::~ForwardStreamSession() {
  if (reader_.joinable()) {
    context_.TryCancel();
    reader_.join();
  }
}

void ForwardStreamSession::ReadLoop() {
  moe::v1::ForwardResponse response;
  while (stream_->Read(&response)) {
    std::lock_guard<std::mutex> lock(mu_);
    // Responses nobody waits for (unknown ids) are dropped rather than kept forever.
    if (in_flight_.count(response.request_id()) == 0) continue;
    std::string id = response.request_id();
    arrived_[id] = std::move(response);
    response.Clear();
    cv_.notify_all();
  }
  const absl::Status status = FromGrpcStatus(stream_->Finish());
  std::lock_guard<std::mutex> lock(mu_);
  ended_ = true;
  end_status_ = status;
  cv_.notify_all();
}

absl::Status ForwardStreamSession::EndStatus() {
  std::unique_lock<std::mutex> lock(mu_);
  // A failed write means the call is over; the reader sees that promptly.
  cv_.wait_for(lock, std::chrono::seconds(5), [this] { return ended_; });
  if (ended_ && !end_status_.ok()) return end_status_;
  return absl::UnavailableError("ForwardStream is closed");
}

absl::StatusOr<std::string> ForwardStreamSession::Send(int layer, const std::vector<int64_t>& shape,
                                                       const float* values,
                                                       const ForwardOptions& options) {
  ASSIGN_OR_RETURN(moe::v1::ForwardRequest request,
                   MakeForwardRequest(layer, shape, values, options));
  return Send(std::move(request));
}

absl::StatusOr<std::string> ForwardStreamSession::Send(moe::v1::ForwardRequest request) {
  std::lock_guard<std::mutex> write_lock(write_mu_);
  if (writes_done_) return absl::FailedPreconditionError("ForwardStream already finished");
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (ended_)
      return end_status_.ok() ? absl::UnavailableError("ForwardStream ended") : end_status_;
    if (request.request_id().empty()) {
      do {
        request.set_request_id(absl::StrCat("stream-", next_id_++));
      } while (in_flight_.count(request.request_id()) != 0);
    }
    // Registered before the write: the answer may arrive before Write returns.
    if (!in_flight_.insert(request.request_id()).second)
      return absl::InvalidArgumentError(
          absl::StrCat("request_id '", request.request_id(), "' is already in flight"));
  }
  if (!stream_->Write(request)) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      in_flight_.erase(request.request_id());
    }
    return EndStatus();
  }
  return request.request_id();
}

absl::StatusOr<moe::v1::ForwardResponse> ForwardStreamSession::ReceiveRaw(
    const std::string& request_id, absl::Duration timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  if (in_flight_.count(request_id) == 0)
    return absl::InvalidArgumentError(
        absl::StrCat("no request '", request_id, "' in flight on this stream"));
  auto ready = [&] { return ended_ || arrived_.count(request_id) != 0; };
  // Beyond a year counts as forever: wait_for(nanoseconds::max()) would overflow the clock.
  if (timeout >= absl::Hours(24 * 365)) {
    cv_.wait(lock, ready);
  } else if (!cv_.wait_for(lock, absl::ToChronoNanoseconds(std::max(timeout, absl::ZeroDuration())),
                           ready)) {
    return absl::DeadlineExceededError(
        absl::StrCat("no response to '", request_id, "' within ", absl::FormatDuration(timeout)));
  }
  auto it = arrived_.find(request_id);
  if (it == arrived_.end()) {
    in_flight_.erase(request_id);
    if (!end_status_.ok()) return end_status_;
    return absl::UnavailableError(
        absl::StrCat("ForwardStream ended without a response to '", request_id, "'"));
  }
  moe::v1::ForwardResponse response = std::move(it->second);
  arrived_.erase(it);
  in_flight_.erase(request_id);
  lock.unlock();
  if (response.has_error() && response.error().code() != 0)
    return absl::Status(static_cast<absl::StatusCode>(response.error().code()),
                        response.error().message());
  return response;
}

absl::StatusOr<ForwardResult> ForwardStreamSession::Receive(const std::string& request_id,
                                                            absl::Duration timeout) {
  ASSIGN_OR_RETURN(moe::v1::ForwardResponse response, ReceiveRaw(request_id, timeout));
  return DecodeForwardResponse(response);
}

bool ForwardStreamSession::ended() const {
  std::lock_guard<std::mutex> lock(mu_);
  return ended_;
}

absl::Status ForwardStreamSession::Finish() {
  std::lock_guard<std::mutex> write_lock(write_mu_);
  if (!writes_done_) {
    writes_done_ = true;
    stream_->WritesDone();
  }
  if (reader_.joinable()) reader_.join();
  std::lock_guard<std::mutex> lock(mu_);
  return end_status_;
}

}  // namespace moe
