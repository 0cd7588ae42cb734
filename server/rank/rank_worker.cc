#include "server/rank/rank_worker.h"

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/status.h"
#include "security/tokens.h"
#include "server/backend_factory.h"
#include "server/grpc_status.h"

#include <thread>

#include "transport/cuda_plugin.h"

namespace moe {
namespace {

std::string Hostname() {
  char name[256] = {};
  gethostname(name, sizeof(name) - 1);
  return name;
}

// Touches one byte per page of every expert tensor so the first steps do not pay the page
// faults (and the shard's resident size is visible right after loading).
void PrefaultWeights(const ExpertShardWeights& weights) {
  volatile uint8_t sink = 0;
  auto touch = [&](const void* data, int64_t bytes) {
    const auto* p = static_cast<const uint8_t*>(data);
    for (int64_t i = 0; i < bytes; i += 4096) sink = sink + p[i];
    if (bytes > 0) sink = sink + p[bytes - 1];
  };
  for (const MlpWeights& e : weights.experts)
    for (const WeightMatrix* m : {&e.gate, &e.up, &e.down}) {
      touch(m->data, m->DataBytes());
      if (m->scales != nullptr) touch(m->scales, m->ScaleBytes());
    }
}

std::string ShardKey(const std::string& checkpoint, const moe::v1::internal::RegisterResponse& r) {
  std::string key = absl::StrCat(checkpoint, "|", moe::v1::internal::Precision_Name(r.precision()));
  for (const auto& shard : r.shards())
    absl::StrAppend(&key, "|", shard.layer(), ":", absl::StrJoin(shard.experts(), ","));
  return key;
}

// Overwrites the first partial sum with NaN, wherever the backend keeps it.
absl::Status PoisonPartials(PartialView partial, Backend* backend) {
  if (partial.rows == 0 || partial.cols == 0) return absl::OkStatus();
  const double nan = std::nan("");
  return backend->CopyToBackend(partial.data, &nan, sizeof nan);
}

}  // namespace

RankWorker::RankWorker(const RankOptions& options) : options_(options) {
  auto backend = CreateBackend(options.backend, options.device, options.cpu);
  if (backend.ok()) {
    backend_ = std::move(*backend);
    workspace_ = std::make_unique<Workspace>(backend_.get());
  } else {
    backend_status_ = backend.status();
  }
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(
      static_cast<int>(std::min<int64_t>(options.max_message_bytes, INT32_MAX)));
  args.SetMaxSendMessageSize(
      static_cast<int>(std::min<int64_t>(options.max_message_bytes, INT32_MAX)));
  AddTlsChannelArgs(options.tls, &args);
  auto credentials = ChannelCredentials(options.tls);
  if (!credentials.ok()) {
    backend_status_ = credentials.status();
    credentials = grpc::InsecureChannelCredentials();  // never used: Run() fails first
  }
  channel_ = grpc::CreateCustomChannel(options.gateway, *credentials, args);
  stub_ = moe::v1::internal::RankControl::NewStub(channel_);
}

RankWorker::~RankWorker() { Stop(); }

void RankWorker::Stop() {
  stop_ = true;
  std::lock_guard<std::mutex> lock(transport_mu_);
  if (cancel_) cancel_();
}

void RankWorker::SetCancel(std::function<void()> cancel) {
  std::lock_guard<std::mutex> lock(transport_mu_);
  cancel_ = std::move(cancel);
}

absl::Status RankWorker::LoadShards(const moe::v1::internal::RegisterResponse& registration) {
  const std::string dir =
      options_.checkpoint.empty() ? registration.checkpoint() : options_.checkpoint;
  const std::string key = ShardKey(dir, registration);
  if (key == loaded_shard_key_) return absl::OkStatus();  // same shard as before a reconnect
  shards_.clear();
  ASSIGN_OR_RETURN(checkpoint_, Checkpoint::Open(dir));
  int64_t bytes = 0;
  for (const auto& shard : registration.shards()) {
    std::vector<int> experts(shard.experts().begin(), shard.experts().end());
    ExpertLoadOptions load;
    load.prefetch = true;
    load.check_values = options_.check_weights;
    ASSIGN_OR_RETURN(ExpertShardWeights weights,
                     checkpoint_->LoadExperts(shard.layer(), experts, load));
    if (options_.prefault && backend_->space() == MemorySpace::kHost) PrefaultWeights(weights);
    ASSIGN_OR_RETURN(auto expert_shard,
                     ExpertShard::Create(checkpoint_->config(), weights, backend_.get()));
    bytes += expert_shard->weight_bytes();
    shards_[shard.layer()] = std::move(expert_shard);
  }
  weight_bytes_ = bytes;
  loaded_shard_key_ = key;
  return absl::OkStatus();
}

absl::Status RankWorker::RegisterAndLoad(moe::v1::internal::RegisterResponse* registration) {
  moe::v1::internal::RegisterRequest request;
  request.set_requested_rank(options_.requested_rank >= 0 ? options_.requested_rank : rank_.load());
  request.set_hostname(Hostname());
  request.set_pid(getpid());
  request.add_transports("grpc");
  if (TransportBuilt("nccl") && options_.backend == "cuda") request.add_transports("nccl");
  request.set_backend(options_.backend);
  request.set_device(backend_->name());
  grpc::ClientContext context;
  AddBearerToken(&context, options_.cluster_token);
  context.set_wait_for_ready(true);  // the gateway may still be starting
  context.set_deadline(absl::ToChronoTime(absl::Now() + options_.connect_timeout));
  RETURN_IF_ERROR_CTX(FromGrpcStatus(stub_->Register(&context, request, registration)),
                      absl::StrCat("registering with ", options_.gateway));
  rank_ = registration->rank();
  if (registration->transport() == "nccl" &&
      (!TransportBuilt("nccl") || options_.backend != "cuda"))
    return absl::FailedPreconditionError(
        absl::StrCat("the gateway uses transport nccl: start moe-rank with --backend cuda",
                     TransportBuilt("nccl") ? "" : " (this build has no NCCL transport)"));
  if (registration->transport() != "grpc" && registration->transport() != "nccl")
    return absl::UnimplementedError(
        absl::StrCat("unknown transport '", registration->transport(), "'"));
  const absl::Time t0 = absl::Now();
  RETURN_IF_ERROR(LoadShards(*registration));
  std::fprintf(
      stderr,
      "moe-rank %d: %zu layers, %s experts each, %.2f GB of weights, backend %s, ready in %.1f s\n",
      rank_.load(), shards_.size(),
      shards_.empty() ? "0" : absl::StrCat(shards_.begin()->second->expert_ids().size()).c_str(),
      weight_bytes_.load() / 1e9, backend_->name().c_str(),
      absl::ToDoubleSeconds(absl::Now() - t0));
  std::fflush(stderr);
  if (observer_ != nullptr) observer_->OnRegistered(rank_.load(), weight_bytes_.load());
  return absl::OkStatus();
}

absl::Status RankWorker::ServeSession(const moe::v1::internal::RegisterResponse& registration) {
  auto context = std::make_unique<grpc::ClientContext>();
  AddBearerToken(context.get(), options_.cluster_token);
  grpc::ClientContext* raw_context = context.get();
  std::unique_ptr<ExchangeClientStream> stream = stub_->Exchange(raw_context);
  moe::v1::internal::RankToGateway hello;
  hello.mutable_hello()->set_rank(registration.rank());
  hello.mutable_hello()->set_session(registration.session());
  hello.mutable_hello()->set_weight_bytes(weight_bytes_);
  hello.mutable_hello()->set_backend(backend_->name());
  struct ClearCancel {
    RankWorker* self;
    ~ClearCancel() { self->SetCancel(nullptr); }
  } clear_cancel{this};

  // The gateway's liveness settings (older gateways send none: the defaults).
  LivenessOptions liveness;
  if (registration.heartbeat_ms() > 0)
    liveness.heartbeat = absl::Milliseconds(registration.heartbeat_ms());
  if (registration.peer_timeout_ms() > 0)
    liveness.peer_timeout = absl::Milliseconds(registration.peer_timeout_ms());

  if (registration.transport() == "grpc") {
    if (!stream->Write(hello)) return absl::UnavailableError("exchange stream closed before hello");
    GrpcRankTransport transport(std::move(context), std::move(stream), backend_.get(), liveness);
    SetCancel([&transport] { transport.Cancel(); });
    if (stop_) return absl::CancelledError("stopping");
    return ServeSteps(transport);
  }
  // NCCL carries the steps; the exchange stream stays open as the liveness channel (the
  // gateway sees this rank die when it breaks, and the rank stops when the gateway goes).
  ASSIGN_OR_RETURN(const CudaPluginApi* plugin, LoadCudaPlugin());
  NcclRankSetup setup;
  setup.rank = registration.nccl_rank();
  setup.num_ranks = registration.num_ranks();
  setup.unique_id = registration.nccl_unique_id();
  setup.backend = backend_.get();
  ASSIGN_OR_RETURN(NcclRankSession session, plugin->create_nccl_rank(setup));
  std::function<void()> cancel = session.cancel;
  SetCancel([cancel, raw_context] {
    cancel();
    raw_context->TryCancel();
  });
  if (!stream->Write(hello)) return absl::UnavailableError("exchange stream closed before hello");
  // Heartbeats out (the only writes after the hello); a gateway silent for the timeout counts
  // as gone, like a broken stream.
  StreamLiveness stream_liveness(
      liveness,
      [&stream] {
        moe::v1::internal::RankToGateway heartbeat;
        heartbeat.mutable_heartbeat();
        stream->Write(heartbeat);
      },
      [cancel, raw_context] {
        cancel();
        raw_context->TryCancel();
      });
  std::thread watcher([&stream, &stream_liveness, cancel] {
    moe::v1::internal::GatewayToRank ignored;
    while (stream->Read(&ignored)) stream_liveness.Heard();
    cancel();  // the gateway went away: leave the NCCL group
  });
  absl::Status status = stop_ ? absl::CancelledError("stopping") : ServeSteps(*session.transport);
  raw_context->TryCancel();
  watcher.join();
  return status;
}

absl::Status RankWorker::ServeSteps(RankTransport& transport) {
  for (;;) {
    auto step = transport.Receive();
    if (!step.ok()) return step.status();
    const absl::Time t0 = absl::Now();
    auto shard = shards_.find(step->layer);
    absl::StatusOr<ConstPartialView> result =
        absl::NotFoundError(absl::StrCat("layer ", step->layer, " not loaded"));
    std::set<int32_t> active(step->assignments.local_experts.begin(),
                             step->assignments.local_experts.end());
    if (shard != shards_.end()) {
      auto partial = workspace_->Partial(0, step->rows.rows, step->rows.cols);
      if (!partial.ok()) {
        result = partial.status();
      } else {
        absl::Status s =
            shard->second->Compute(step->rows, step->assignments, step->precision, *partial);
        if (s.ok() && options_.debug_nan_partials) s = PoisonPartials(*partial, backend_.get());
        result = s.ok() ? absl::StatusOr<ConstPartialView>(ConstPartialView(*partial))
                        : absl::StatusOr<ConstPartialView>(s);
      }
    }
    if (options_.debug_step_delay > absl::ZeroDuration()) absl::SleepFor(options_.debug_step_delay);
    RankStepStats stats;
    stats.compute_us = absl::ToInt64Microseconds(absl::Now() - t0);
    stats.active_experts = static_cast<int>(active.size());
    if (observer_ != nullptr) {
      RankStepReport report;
      report.layer = step->layer;
      report.rows = step->rows.rows;
      report.active_experts = stats.active_experts;
      report.compute = absl::Microseconds(stats.compute_us);
      report.bytes_received = step->wire_bytes;
      // The reply's payload: one fp64 partial per row (the transport adds a few bytes of framing).
      report.bytes_sent = step->rows.rows * step->rows.cols * static_cast<int64_t>(sizeof(double));
      observer_->OnRankStep(report);
    }
    RETURN_IF_ERROR(transport.Reply(step->step_id, result, stats));
  }
}

absl::Status RankWorker::Run() {
  if (!backend_status_.ok()) return backend_status_;
  absl::Duration backoff = absl::Milliseconds(200);
  for (;;) {
    if (stop_) return absl::OkStatus();
    moe::v1::internal::RegisterResponse registration;
    absl::Status s = RegisterAndLoad(&registration);
    if (s.ok()) {
      backoff = absl::Milliseconds(200);
      s = ServeSession(registration);
    }
    if (stop_) return absl::OkStatus();
    // Configuration errors will not fix themselves; connection problems may. ALREADY_EXISTS:
    // the gateway still counts this rank id up, i.e. a previous process of this rank that died
    // or hung and that liveness has not yet timed out; it will, and then this one takes over.
    const bool retryable = absl::IsUnavailable(s) || absl::IsCancelled(s) ||
                           absl::IsDeadlineExceeded(s) || absl::IsFailedPrecondition(s) ||
                           absl::IsAlreadyExists(s);
    if (!options_.reconnect || !retryable) return s;
    std::fprintf(stderr, "moe-rank %d: %s; registering again\n", rank_.load(),
                 s.ToString().c_str());
    std::fflush(stderr);
    absl::SleepFor(backoff);
    backoff = std::min(backoff * 2, absl::Seconds(5));
  }
}

}  // namespace moe
