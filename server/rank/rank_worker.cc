#include "server/rank/rank_worker.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <optional>
#include <set>
#include <thread>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/host_port.h"
#include "core/log.h"
#include "core/progress.h"
#include "core/status.h"
#include "security/rank_handshake.h"
#include "server/backend_factory.h"
#include "server/grpc_status.h"
#include "transport/cuda_plugin.h"

namespace moe {
namespace {

std::string Hostname() {
  char name[256] = {};
  gethostname(name, sizeof(name) - 1);
  return name;
}

// Touches one byte per page of every expert tensor so the first steps do not pay the page
// faults (and the shard's resident size is visible right after loading); `done` hears of each
// tensor's bytes (load progress).
void PrefaultWeights(const ExpertShardWeights& weights, const std::function<void(int64_t)>& done) {
  volatile uint8_t sink = 0;
  auto touch = [&](const void* data, int64_t bytes) {
    const auto* p = static_cast<const uint8_t*>(data);
    for (int64_t i = 0; i < bytes; i += 4096) sink = sink + p[i];
    if (bytes > 0) sink = sink + p[bytes - 1];
    done(bytes);
  };
  for (const MlpWeights& e : weights.experts)
    for (const WeightMatrix* m : {&e.gate, &e.up, &e.down}) {
      touch(m->data, m->DataBytes());
      if (m->scales != nullptr) touch(m->scales, m->ScaleBytes());
    }
}

// Each layer's experts, as a registration asks for them or as a shard set holds them.
using ShardLayout = std::vector<std::pair<int, std::vector<int>>>;

// Overwrites the first partial sum with NaN, wherever the backend keeps it.
// Each layer's experts, ascending by layer.
ShardLayout LayoutOf(
    const google::protobuf::RepeatedPtrField<moe::v1::internal::LayerShard>& shards) {
  ShardLayout layout;
  for (const auto& shard : shards)
    layout.emplace_back(shard.layer(),
                        std::vector<int>(shard.experts().begin(), shard.experts().end()));
  std::sort(layout.begin(), layout.end());
  return layout;
}

ShardLayout LayoutOfShards(const std::map<int, std::shared_ptr<ExpertShard>>& shards) {
  ShardLayout layout;
  for (const auto& [layer, shard] : shards) layout.emplace_back(layer, shard->expert_ids());
  return layout;
}

}  // namespace

void FairTurn::Acquire() {
  std::unique_lock<std::mutex> lock(mu_);
  const uint64_t ticket = next_++;
  cv_.wait(lock, [&] { return serving_ == ticket; });
}

void FairTurn::Release() {
  std::lock_guard<std::mutex> lock(mu_);
  ++serving_;
  cv_.notify_all();
}

// ---- one gateway ----------------------------------------------------------------------------

class RankWorker::Session {
 public:
  // `tls_name`: the name `gateway` (an address) was resolved from, which its certificate carries.
  Session(RankWorker* worker, int index, std::string gateway, const std::string& tls_name);

  // Registers, serves steps, and registers again when the gateway goes away (with backoff),
  // until Stop(), an error retrying cannot fix, or (reconnect off) the end of an exchange.
  absl::Status Run();
  void Cancel();  // unblocks the exchange in progress (Stop)
  // Ends Run() for good: the gateway left the directory.
  void Retire() {
    retired_ = true;
    Cancel();
  }
  bool retired() const { return retired_; }
  // Writes a control message (ShardsLoaded) on the current exchange; UNAVAILABLE without one.
  absl::Status SendControl(const moe::v1::internal::RankToGateway& message);

 private:
  absl::Status RegisterAndLoad(moe::v1::internal::RegisterResponse* registration);
  absl::Status Serve(const moe::v1::internal::RegisterResponse& registration);
  // Answers steps from `transport` until it fails or is cancelled.
  absl::Status ServeSteps(RankTransport& transport);
  // A control message from the gateway (the reader thread: must not block).
  void OnControl(const moe::v1::internal::GatewayToRank& message);
  void SetCancel(std::function<void()> cancel);
  void SetControlSink(std::function<absl::Status(const moe::v1::internal::RankToGateway&)> sink);
  // "moe-rank R" with one gateway, "moe-rank R (gateway HOST:PORT)" with several.
  std::string Who() const;

  RankWorker* const worker_;
  const int index_;
  const std::string gateway_;
  std::atomic<bool> retired_{false};
  absl::Status setup_;  // the channel's credentials
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<moe::v1::internal::RankControl::Stub> stub_;
  Workspace workspace_;  // this session's step buffers: replies read them after the turn
  std::mutex transport_mu_;
  std::function<void()> cancel_;  // guarded by transport_mu_
  // Held while the sink is called, so clearing it waits for a call in progress (the sink writes
  // on the exchange stream, which goes away with the exchange).
  std::mutex sink_mu_;
  std::function<absl::Status(const moe::v1::internal::RankToGateway&)>
      control_sink_;  // guarded by sink_mu_
};

RankWorker::Session::Session(RankWorker* worker, int index, std::string gateway,
                             const std::string& tls_name)
    : worker_(worker),
      index_(index),
      gateway_(std::move(gateway)),
      workspace_(worker->backend_.get()) {
  const RankOptions& options = worker->options_;
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(
      static_cast<int>(std::min<int64_t>(options.max_message_bytes, INT32_MAX)));
  args.SetMaxSendMessageSize(
      static_cast<int>(std::min<int64_t>(options.max_message_bytes, INT32_MAX)));
  // A restarted gateway is found within a second (gRPC's reconnect backoff grows to 120 s).
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  AddTlsChannelArgs(options.tls, &args);
  if (options.tls.channel_enabled() && options.tls.server_name.empty() && !tls_name.empty())
    args.SetSslTargetNameOverride(tls_name);  // the certificate names the Service, not the pod
  auto credentials = ChannelCredentials(options.tls);
  if (!credentials.ok()) {
    setup_ = credentials.status();
    credentials = grpc::InsecureChannelCredentials();  // never used: Run() fails first
  }
  channel_ = grpc::CreateCustomChannel(gateway_, *credentials, args);
  stub_ = moe::v1::internal::RankControl::NewStub(channel_);
}

std::string RankWorker::Session::Who() const {
  if (worker_->options_.gateways.size() == 1 && worker_->options_.gateways[0] == gateway_)
    return absl::StrCat("moe-rank ", worker_->rank());
  return absl::StrCat("moe-rank ", worker_->rank(), " (gateway ", gateway_, ")");
}

void RankWorker::Session::Cancel() {
  std::lock_guard<std::mutex> lock(transport_mu_);
  if (cancel_) cancel_();
}

void RankWorker::Session::SetCancel(std::function<void()> cancel) {
  std::lock_guard<std::mutex> lock(transport_mu_);
  cancel_ = std::move(cancel);
}

void RankWorker::Session::SetControlSink(
    std::function<absl::Status(const moe::v1::internal::RankToGateway&)> sink) {
  std::lock_guard<std::mutex> lock(sink_mu_);
  control_sink_ = std::move(sink);
}

absl::Status RankWorker::Session::SendControl(const moe::v1::internal::RankToGateway& message) {
  std::lock_guard<std::mutex> lock(sink_mu_);
  if (!control_sink_) return absl::UnavailableError("no exchange with this gateway now");
  return control_sink_(message);
}

void RankWorker::Session::OnControl(const moe::v1::internal::GatewayToRank& message) {
  if (message.has_load_shards()) worker_->QueueLoad(index_, message.load_shards());
  if (message.has_keep_shards()) worker_->Keep(index_, message.keep_shards().generation());
}

absl::Status RankWorker::Session::RegisterAndLoad(
    moe::v1::internal::RegisterResponse* registration) {
  const RankOptions& options = worker_->options_;
  // The gateway may still be starting: the challenge waits for it, at start until connect_by_.
  const absl::Time deadline = worker_->registered_once_
                                  ? absl::Now() + options.connect_timeout
                                  : std::max(worker_->connect_by_, absl::Now() + absl::Seconds(1));
  moe::v1::internal::ChallengeResponse challenge;
  {
    grpc::ClientContext context;
    context.set_wait_for_ready(true);
    context.set_deadline(absl::ToChronoTime(deadline));
    RETURN_IF_ERROR_CTX(FromGrpcStatus(stub_->Challenge(
                            &context, moe::v1::internal::ChallengeRequest(), &challenge)),
                        absl::StrCat("asking ", gateway_, " for a registration challenge"));
  }
  moe::v1::internal::RegisterRequest request;
  request.set_requested_rank(options.requested_rank >= 0 ? options.requested_rank
                                                         : worker_->rank_.load());
  request.set_hostname(Hostname());
  request.set_pid(getpid());
  request.add_transports(TransportName(TransportKind::kGrpc));
  const bool nccl = TransportBuilt(TransportKind::kNccl) && options.backend == BackendKind::kCuda;
  if (nccl) request.add_transports(TransportName(TransportKind::kNccl));
  request.set_backend(BackendName(options.backend));
  request.set_device(worker_->backend_->name());
  grpc::ClientContext context;
  // The token is proven, never sent: a recording of this call cannot be replayed.
  context.AddMetadata(kRankIdKey, absl::StrCat(request.requested_rank()));
  context.AddMetadata(kRankNonceKey, challenge.nonce());
  if (!options.cluster_token.empty())
    context.AddMetadata(kRankProofKey, RegistrationProof(options.cluster_token, challenge.nonce(),
                                                         request.requested_rank()));
  context.set_deadline(absl::ToChronoTime(std::max(deadline, absl::Now() + absl::Seconds(30))));
  RETURN_IF_ERROR_CTX(FromGrpcStatus(stub_->Register(&context, request, registration)),
                      absl::StrCat("registering with ", gateway_));
  worker_->rank_ = registration->rank();
  ASSIGN_OR_RETURN(const TransportKind transport, ParseTransport(registration->transport()));
  if (transport == TransportKind::kNccl && !nccl)
    return absl::FailedPreconditionError(absl::StrCat(
        "the gateway uses transport nccl: start moe-rank with --backend cuda",
        TransportBuilt(TransportKind::kNccl) ? "" : " (this build has no NCCL transport)"));
  const absl::Time t0 = absl::Now();
  RETURN_IF_ERROR_CTX(worker_->LoadRegisteredShards(index_, *registration),
                      absl::StrCat("registered with ", gateway_));
  worker_->Commit(index_, registration->placement_generation());
  const int layers = registration->shards_size();
  const int experts = layers == 0 ? 0 : registration->shards(0).experts_size();
  LogLine("%s: %d layers, %d experts each, %.2f GB of weights, backend %s, ready in %.1f s",
          Who().c_str(), layers, experts, worker_->weight_bytes_.load() / 1e9,
          worker_->backend_->name().c_str(), absl::ToDoubleSeconds(absl::Now() - t0));
  if (worker_->observer_ != nullptr)
    worker_->observer_->OnRegistered(worker_->rank(), worker_->weight_bytes_.load());
  return absl::OkStatus();
}

absl::Status RankWorker::Session::Serve(const moe::v1::internal::RegisterResponse& registration) {
  const RankOptions& options = worker_->options_;
  auto context = std::make_unique<grpc::ClientContext>();
  context->AddMetadata(kRankIdKey, absl::StrCat(registration.rank()));
  context->AddMetadata(kRankSessionKey, registration.session());
  if (!options.cluster_token.empty())
    context->AddMetadata(kRankProofKey, ExchangeProof(options.cluster_token, registration.session(),
                                                      registration.rank()));
  grpc::ClientContext* raw_context = context.get();
  std::unique_ptr<ExchangeClientStream> stream = stub_->Exchange(raw_context);
  moe::v1::internal::RankToGateway hello;
  hello.mutable_hello()->set_rank(registration.rank());
  hello.mutable_hello()->set_session(registration.session());
  hello.mutable_hello()->set_weight_bytes(worker_->weight_bytes_.load());
  hello.mutable_hello()->set_backend(worker_->backend_->name());
  hello.mutable_hello()->set_placement_generation(registration.placement_generation());
  struct ClearCancel {
    Session* self;
    ~ClearCancel() {
      self->SetCancel(nullptr);
      self->SetControlSink(nullptr);
    }
  } clear_cancel{this};

  // The gateway's liveness settings (older gateways send none: the defaults).
  LivenessOptions liveness;
  if (registration.heartbeat_ms() > 0)
    liveness.heartbeat = absl::Milliseconds(registration.heartbeat_ms());
  if (registration.peer_timeout_ms() > 0)
    liveness.peer_timeout = absl::Milliseconds(registration.peer_timeout_ms());

  if (registration.transport() == TransportName(TransportKind::kGrpc)) {
    if (!stream->Write(hello)) return absl::UnavailableError("exchange stream closed before hello");
    GrpcRankTransport transport(
        std::move(context), std::move(stream), worker_->backend_.get(), liveness,
        [this](const moe::v1::internal::GatewayToRank& message) { OnControl(message); });
    SetControlSink([&transport](const moe::v1::internal::RankToGateway& message) {
      return transport.SendControl(message);
    });
    worker_->OfferNewest(index_);
    SetCancel([&transport] { transport.Cancel(); });
    absl::Status status = worker_->stop_ ? absl::CancelledError("stopping") : ServeSteps(transport);
    SetControlSink(nullptr);  // before the transport goes
    return status;
  }
  // NCCL carries the steps; the exchange stream stays open as the liveness channel (the
  // gateway sees this rank die when it breaks, and the rank stops when the gateway goes).
  // One gateway at a time: waiting in two communicators at once can deadlock the device (NCCL's
  // kernels of different communicators need not run concurrently), so another gateway stands by
  // (FAILED_PRECONDITION: its session retries) until this one goes.
  int none = -1;
  if (!worker_->nccl_session_.compare_exchange_strong(none, index_) && none != index_)
    return absl::FailedPreconditionError(
        "this rank serves another gateway over NCCL: under NCCL a rank serves one gateway at a "
        "time, the others stand by (docs/ARCHITECTURE.md, \"Several gateways\")");
  struct ReleaseNccl {
    std::atomic<int>* owner;
    ~ReleaseNccl() { owner->store(-1); }
  } release_nccl{&worker_->nccl_session_};
  ASSIGN_OR_RETURN(const CudaPluginApi* plugin, LoadCudaPlugin());
  NcclRankSetup setup;
  setup.rank = registration.nccl_rank();
  setup.num_ranks = registration.num_ranks();
  setup.unique_id = registration.nccl_unique_id();
  setup.backend = worker_->backend_.get();
  ASSIGN_OR_RETURN(NcclRankSession session, plugin->create_nccl_rank(setup));
  std::function<void()> cancel = session.cancel;
  SetCancel([cancel, raw_context] {
    cancel();
    raw_context->TryCancel();
  });
  if (!stream->Write(hello)) return absl::UnavailableError("exchange stream closed before hello");
  // Heartbeats and ShardsLoaded out (the only writes after the hello, one at a time); a gateway
  // silent for the timeout counts as gone, like a broken stream.
  std::mutex write_mu;
  SetControlSink([&stream, &write_mu](const moe::v1::internal::RankToGateway& message) {
    std::lock_guard<std::mutex> lock(write_mu);
    return stream->Write(message) ? absl::OkStatus()
                                  : absl::UnavailableError("exchange stream broke");
  });
  worker_->OfferNewest(index_);
  StreamLiveness stream_liveness(
      liveness,
      [&stream, &write_mu] {
        std::unique_lock<std::mutex> lock(write_mu, std::try_to_lock);
        if (!lock.owns_lock()) return;  // another message is going out: proof enough
        moe::v1::internal::RankToGateway heartbeat;
        heartbeat.mutable_heartbeat();
        stream->Write(heartbeat);
      },
      [cancel, raw_context] {
        cancel();
        raw_context->TryCancel();
      });
  std::thread watcher([this, &stream, &stream_liveness, cancel] {
    moe::v1::internal::GatewayToRank message;
    while (stream->Read(&message)) {
      stream_liveness.Heard();
      OnControl(message);  // heartbeats are ignored there
    }
    cancel();  // the gateway went away: leave the NCCL group
  });
  absl::Status status =
      worker_->stop_ ? absl::CancelledError("stopping") : ServeSteps(*session.transport);
  raw_context->TryCancel();
  watcher.join();
  SetControlSink(nullptr);  // before the stream and its mutex go
  return status;
}

absl::Status RankWorker::Session::ServeSteps(RankTransport& transport) {
  const RankOptions& options = worker_->options_;
  Backend* backend = worker_->backend_.get();
  RankStepObserver* observer = worker_->observer_;
  for (;;) {
    ASSIGN_OR_RETURN(ReceivedStep step, transport.Receive());
    // Held to the end of the step: a KeepShards meanwhile drops the generation, not this shard.
    const std::shared_ptr<ExpertShard> shard =
        worker_->FindShard(step.placement_generation, step.layer);
    absl::StatusOr<ConstPartialView> result = absl::FailedPreconditionError(
        absl::StrCat("layer ", step.layer, " of placement generation ", step.placement_generation,
                     " is not loaded here"));
    std::set<int32_t> active(step.assignments.local_experts.begin(),
                             step.assignments.local_experts.end());
    // The gateways' steps take turns in arrival order; a device also takes turns with loading.
    worker_->compute_turn_.Acquire();
    const absl::Time t0 = absl::Now();
    std::unique_lock<std::mutex> device_lock(worker_->device_mu_, std::defer_lock);
    if (backend->space() == MemorySpace::kDevice) device_lock.lock();
    if (shard != nullptr) {
      auto partial = workspace_.Partial(0, step.rows.rows, step.rows.cols);
      if (!partial.ok()) {
        result = partial.status();
      } else {
        absl::Status s = shard->Compute(step.rows, step.assignments, step.precision, *partial);
        if (s.ok() && options.after_compute) s = options.after_compute(*partial, backend);
        result = s.ok() ? absl::StatusOr<ConstPartialView>(ConstPartialView(*partial))
                        : absl::StatusOr<ConstPartialView>(s);
      }
    }
    device_lock = {};
    worker_->compute_turn_.Release();
    if (options.before_reply) options.before_reply();
    RankStepStats stats;
    stats.compute_us = absl::ToInt64Microseconds(absl::Now() - t0);
    stats.active_experts = static_cast<int>(active.size());
    if (observer != nullptr) {
      RankStepReport report;
      report.layer = step.layer;
      report.rows = step.rows.rows;
      report.active_experts = stats.active_experts;
      report.compute = absl::Microseconds(stats.compute_us);
      report.bytes_received = step.wire_bytes;
      // The reply's payload: one fp64 partial per row (the transport adds a few bytes of framing).
      report.bytes_sent = step.rows.rows * step.rows.cols * static_cast<int64_t>(sizeof(double));
      observer->OnRankStep(report);
    }
    RETURN_IF_ERROR(transport.Reply(step.step_id, result, stats));
  }
}

absl::Status RankWorker::Session::Run() {
  if (!setup_.ok()) return setup_;
  absl::Duration backoff = absl::Milliseconds(200);
  for (;;) {
    if (worker_->stop_ || retired_) return absl::OkStatus();
    moe::v1::internal::RegisterResponse registration;
    absl::Status s = RegisterAndLoad(&registration);
    if (s.ok()) {
      worker_->registered_once_ = true;
      backoff = absl::Milliseconds(200);
      s = Serve(registration);
    }
    if (worker_->stop_ || retired_) return absl::OkStatus();
    // Configuration errors will not fix themselves; connection problems may. ALREADY_EXISTS:
    // the gateway still counts this rank id up, i.e. a previous process of this rank that died
    // or hung and that liveness has not yet timed out; it will, and then this one takes over.
    const bool retryable = absl::IsUnavailable(s) || absl::IsCancelled(s) ||
                           absl::IsDeadlineExceeded(s) || absl::IsFailedPrecondition(s) ||
                           absl::IsAlreadyExists(s);
    if (!worker_->options_.reconnect || !retryable) return s;
    if (!worker_->registered_once_ && absl::Now() >= worker_->connect_by_)
      return absl::DeadlineExceededError(
          absl::StrCat("no gateway took this rank's registration within --connect-timeout-s (",
                       absl::ToInt64Seconds(worker_->options_.connect_timeout), " s); last from ",
                       gateway_, ": ", s.message()));
    LogLine("%s: %s; registering again", Who().c_str(), s.ToString().c_str());
    absl::SleepFor(backoff);
    backoff = std::min(backoff * 2, absl::Seconds(1));
  }
}

// ---- the rank: sessions, shards ---------------------------------------------------------------

RankWorker::RankWorker(const RankOptions& options) : options_(options) {
  auto backend = CreateBackend(options.backend, options.device, options.cpu);
  if (backend.ok()) {
    backend_ = std::move(*backend);
  } else {
    backend_status_ = backend.status();
    return;
  }
  if (options.gateways.empty()) backend_status_ = absl::InvalidArgumentError("no gateway given");
  for (const std::string& entry : options.gateways)
    if (absl::StatusOr<HostPort> parsed = ParseHostPort(entry); !parsed.ok())
      backend_status_ =
          absl::InvalidArgumentError(absl::StrCat("--gateway ", parsed.status().message()));
}

RankWorker::~RankWorker() {
  Stop();
  {
    std::lock_guard<std::mutex> lock(loader_mu_);
    loader_stop_ = true;
    loader_cv_.notify_all();
  }
  if (loader_.joinable()) loader_.join();
}

void RankWorker::Stop() {
  stop_ = true;
  std::lock_guard<std::mutex> lock(sessions_mu_);
  for (auto& [index, session] : sessions_) session->Cancel();
  sessions_cv_.notify_all();
}

std::shared_ptr<RankWorker::Session> RankWorker::FindSession(int session) {
  std::lock_guard<std::mutex> lock(sessions_mu_);
  auto it = sessions_.find(session);
  return it == sessions_.end() ? nullptr : it->second;
}

std::map<std::string, std::string> RankWorker::ResolveGateways() const {
  std::map<std::string, std::string> out;
  for (const std::string& entry : options_.gateways) {
    const absl::StatusOr<HostPort> parsed = ParseHostPort(entry);
    if (!parsed.ok()) continue;  // refused in the constructor
    if (parsed->literal) {
      out.emplace(entry, "");
      continue;
    }
    absl::StatusOr<std::vector<std::string>> addresses = ResolveHostPort(entry);
    if (!addresses.ok()) continue;  // not (yet) in DNS: asked again next round
    // IPv4 when the name has any: a dual-stack name must not count as two gateways.
    const bool any_v4 = std::any_of(addresses->begin(), addresses->end(),
                                    [](const std::string& a) { return a.front() != '['; });
    for (const std::string& address : *addresses)
      if (!any_v4 || address.front() != '[') out.emplace(address, parsed->host);
  }
  return out;
}

void RankWorker::RetireSession(int session) {
  {
    std::lock_guard<std::mutex> lock(shards_mu_);
    holds_.erase(session);
    committed_.erase(session);
    DropUnheldLocked();
  }
  std::lock_guard<std::mutex> lock(sessions_mu_);
  sessions_.erase(session);
}

absl::Status RankWorker::Run() {
  if (!backend_status_.ok()) return backend_status_;
  {
    std::lock_guard<std::mutex> lock(loader_mu_);
    if (!loader_.joinable()) loader_ = std::thread([this] { LoaderLoop(); });
  }
  std::mutex mu;
  absl::Status first_error;  // guarded by mu
  std::vector<std::thread> threads;
  std::map<std::string, int> active;   // address -> session
  std::map<std::string, int> missing;  // address -> directory rounds it was not in
  int next_index = 0;
  bool warned_rank = false;
  connect_by_ = absl::Now() + options_.connect_timeout;  // before the sessions' threads start
  const absl::Time resolve_by = connect_by_;
  for (;;) {
    const std::map<std::string, std::string> directory = ResolveGateways();
    for (const auto& [address, name] : directory) {
      missing.erase(address);
      if (active.count(address) != 0) continue;
      if (!active.empty() && options_.requested_rank < 0) {
        if (!warned_rank)
          LogLine(
              "moe-rank: %s is another gateway: serving it needs --rank (every gateway "
              "must know this rank by the same id)",
              address.c_str());
        warned_rank = true;
        continue;
      }
      const int index = next_index++;
      auto session = std::make_shared<Session>(this, index, address, name);
      {
        std::lock_guard<std::mutex> lock(sessions_mu_);
        if (stop_) break;
        sessions_[index] = session;
      }
      active[address] = index;
      threads.emplace_back([&, session, index] {
        const absl::Status status = session->Run();
        if (session->retired()) {
          RetireSession(index);
          return;
        }
        if (stop_) return;  // stopping: whatever the session says is about the stop
        {
          std::lock_guard<std::mutex> lock(mu);
          if (first_error.ok())
            first_error = status.ok() ? absl::CancelledError("a session ended") : status;
        }
        // An error retrying cannot fix (or, without reconnecting, a lost gateway) ends the rank.
        Stop();
      });
    }
    // A gateway gone from the directory for three rounds in a row (a replaced pod) is left.
    for (auto it = active.begin(); it != active.end();) {
      if (directory.count(it->first) == 0 && ++missing[it->first] >= 3) {
        if (std::shared_ptr<Session> session = FindSession(it->second)) session->Retire();
        missing.erase(it->first);
        it = active.erase(it);
      } else {
        ++it;
      }
    }
    if (active.empty() && absl::Now() > resolve_by) {
      std::lock_guard<std::mutex> lock(mu);
      if (first_error.ok())
        first_error = absl::NotFoundError(absl::StrCat("no gateway address found for --gateway ",
                                                       absl::StrJoin(options_.gateways, ","),
                                                       " within --connect-timeout-s"));
      break;
    }
    std::unique_lock<std::mutex> lock(sessions_mu_);
    if (sessions_cv_.wait_for(
            lock, active.empty() ? std::chrono::milliseconds(500) : std::chrono::seconds(5),
            [this] { return stop_.load(); }))
      break;
  }
  Stop();
  for (auto& t : threads) t.join();
  std::lock_guard<std::mutex> lock(mu);
  return first_error;
}

int64_t RankWorker::Bytes(const LayerShards& shards) {
  int64_t bytes = 0;
  for (const auto& [layer, shard] : shards) bytes += shard->weight_bytes();
  return bytes;
}

std::shared_ptr<ExpertShard> RankWorker::FindShard(uint64_t generation, int layer) {
  std::lock_guard<std::mutex> lock(shards_mu_);
  auto g = generations_.find(generation);
  if (g == generations_.end()) return nullptr;
  auto it = g->second.find(layer);
  return it == g->second.end() ? nullptr : it->second;
}

void RankWorker::DropUnheldLocked() {
  for (auto it = generations_.begin(); it != generations_.end();) {
    bool held = false;
    for (const auto& [session, generations] : holds_) held = held || generations.count(it->first);
    // Steps still running hold their shards (shared_ptr).
    it = held ? std::next(it) : generations_.erase(it);
  }
}

void RankWorker::Keep(int session, uint64_t generation) {
  int64_t bytes = 0;
  {
    std::lock_guard<std::mutex> lock(shards_mu_);
    auto kept = generations_.find(generation);
    if (kept == generations_.end()) return;  // never loaded here: keep what serves
    holds_[session] = {generation};
    DropUnheldLocked();
    bytes = Bytes(kept->second);
  }
  weight_bytes_ = bytes;
  Commit(session, generation);
  LogLine("moe-rank %d: serving placement generation %llu (%.2f GB of weights)", rank_.load(),
          static_cast<unsigned long long>(generation), bytes / 1e9);
  if (observer_ != nullptr) observer_->OnRegistered(rank_.load(), bytes);
}

void RankWorker::Commit(int session, uint64_t generation) {
  std::vector<int> behind;
  {
    std::lock_guard<std::mutex> lock(shards_mu_);
    committed_[session] = generation;
    for (const auto& [other, used] : committed_)
      if (other != session && used < generation) behind.push_back(other);
  }
  for (int other : behind) Offer(other, generation);
}

void RankWorker::OfferNewest(int session) {
  uint64_t own = 0, newest = 0;
  {
    std::lock_guard<std::mutex> lock(shards_mu_);
    for (const auto& [other, used] : committed_)
      (other == session ? own : newest) = std::max(other == session ? own : newest, used);
  }
  if (newest > own) Offer(session, newest);
}

void RankWorker::Offer(int session, uint64_t generation) {
  moe::v1::internal::RankToGateway message;
  auto* offer = message.mutable_placement_offer();
  offer->set_generation(generation);
  {
    std::lock_guard<std::mutex> lock(shards_mu_);
    auto held = generations_.find(generation);
    if (held == generations_.end() || held->second.empty()) return;
    for (int e : held->second.begin()->second->expert_ids()) offer->add_experts(e);
  }
  // Without an exchange now, its gateway is offered the newest when the exchange opens.
  if (std::shared_ptr<Session> s = FindSession(session)) (void)s->SendControl(message);
}

void RankWorker::QueueLoad(int session, const moe::v1::internal::LoadShards& request) {
  {
    // Held from the request on: another gateway's KeepShards must not drop it once loaded.
    std::lock_guard<std::mutex> lock(shards_mu_);
    holds_[session].insert(request.generation());
  }
  std::lock_guard<std::mutex> lock(loader_mu_);
  load_queue_.emplace_back(session, request);
  loader_cv_.notify_all();
}

void RankWorker::Answer(int session, const moe::v1::internal::RankToGateway& message) {
  // Without an exchange the gateway saw this rank go, and asks again once it is back.
  if (std::shared_ptr<Session> s = FindSession(session)) (void)s->SendControl(message);
}

void RankWorker::LoaderLoop() {
  for (;;) {
    int session = 0;
    moe::v1::internal::LoadShards request;
    {
      std::unique_lock<std::mutex> lock(loader_mu_);
      loader_cv_.wait(lock, [this] { return loader_stop_ || !load_queue_.empty(); });
      if (loader_stop_) return;
      std::tie(session, request) = std::move(load_queue_.front());
      load_queue_.pop_front();
    }
    const absl::Time t0 = absl::Now();
    const uint64_t generation = request.generation();
    LayerShards current;  // its unchanged layers are shared, not loaded twice
    bool held_already = false;
    absl::StatusOr<LayerShards> built;
    {
      std::lock_guard<std::mutex> lock(shards_mu_);
      auto same = generations_.find(generation);
      if (same != generations_.end()) {
        held_already = true;
        if (LayoutOfShards(same->second) == LayoutOf(request.shards())) {
          built = same->second;
        } else {
          built = absl::AlreadyExistsError(absl::StrCat(
              "placement generation ", generation,
              " is held here with another layout: another gateway changed the placement (one "
              "placement authority at a time)"));
        }
      } else if (!generations_.empty()) {
        current = generations_.rbegin()->second;
      }
    }
    if (!held_already) {
      std::lock_guard<std::mutex> load_lock(load_mu_);
      std::unique_lock<std::mutex> device_lock(device_mu_, std::defer_lock);
      if (backend_->space() == MemorySpace::kDevice) device_lock.lock();
      built = BuildShards(request.shards(), current);
    }
    moe::v1::internal::RankToGateway answer;
    auto* loaded = answer.mutable_shards_loaded();
    loaded->set_generation(generation);
    loaded->set_load_seconds(absl::ToDoubleSeconds(absl::Now() - t0));
    if (built.ok()) {
      loaded->set_weight_bytes(Bytes(*built));
      std::lock_guard<std::mutex> lock(shards_mu_);
      generations_[generation] = std::move(*built);
    } else {
      loaded->set_code(static_cast<int>(built.status().code()));
      loaded->set_error(std::string(built.status().message()));
      std::lock_guard<std::mutex> lock(shards_mu_);
      holds_[session].erase(generation);  // what another gateway holds under it stays
    }
    LogLine("moe-rank %d: placement generation %llu %s in %.2f s%s%s", rank_.load(),
            static_cast<unsigned long long>(generation), built.ok() ? "loaded" : "failed to load",
            loaded->load_seconds(), built.ok() ? "" : ": ",
            built.ok() ? "" : loaded->error().c_str());
    Answer(session, answer);
  }
}

absl::StatusOr<RankWorker::LayerShards> RankWorker::BuildShards(
    const google::protobuf::RepeatedPtrField<moe::v1::internal::LayerShard>& shards,
    const LayerShards& reuse) {
  if (checkpoint_ == nullptr) return absl::FailedPreconditionError("no checkpoint open");
  LayerShards out;
  // The total is known layer by layer (each is mapped before it is read): done so far plus
  // this layer's bytes for every layer still to come.
  Progress progress(absl::StrCat("moe-rank ", rank_.load(), ": loading experts"), 0,
                    options_.progress);
  progress.on_ratio = [this](double ratio) {
    if (observer_ != nullptr) observer_->OnLoadProgress(ratio);
  };
  int index = 0;
  for (const auto& shard : shards) {
    ++index;
    std::vector<int> experts(shard.experts().begin(), shard.experts().end());
    auto same = reuse.find(shard.layer());
    if (same != reuse.end() && same->second->expert_ids() == experts) {
      out[shard.layer()] = same->second;
      continue;
    }
    ExpertLoadOptions load;
    load.prefetch = true;
    load.check_values = options_.check_weights;
    ASSIGN_OR_RETURN(ExpertShardWeights weights,
                     checkpoint_->LoadExperts(shard.layer(), experts, load));
    const int64_t bytes = weights.TotalBytes();
    progress.SetTotal(progress.done() + bytes * (shards.size() - index + 1));
    const std::string stage =
        absl::StrCat("layer ", shard.layer(), " (", index, "/", shards.size(), ")");
    if (options_.prefault && backend_->space() == MemorySpace::kHost) {
      PrefaultWeights(weights, [&](int64_t touched) { progress.Add(touched, stage); });
    } else {
      progress.Add(bytes, stage);
    }
    ASSIGN_OR_RETURN(out[shard.layer()],
                     ExpertShard::Create(checkpoint_->config(), weights, backend_.get()));
  }
  progress.Finish();
  return out;
}

absl::Status RankWorker::LoadRegisteredShards(
    int session, const moe::v1::internal::RegisterResponse& registration) {
  const std::string dir =
      options_.checkpoint.empty() ? registration.checkpoint() : options_.checkpoint;
  const std::string prefix =
      absl::StrCat(dir, "|", moe::v1::internal::Precision_Name(registration.precision()));
  const ShardLayout wanted = LayoutOf(registration.shards());
  const uint64_t generation = registration.placement_generation();
  std::lock_guard<std::mutex> load_lock(load_mu_);
  {
    // Loads this session asked for on its previous exchange: its gateway asks again if need be.
    std::lock_guard<std::mutex> loader_lock(loader_mu_);
    for (auto it = load_queue_.begin(); it != load_queue_.end();)
      it = it->first == session ? load_queue_.erase(it) : std::next(it);
  }
  LayerShards reuse;  // its unchanged layers are shared, not loaded twice
  {
    std::lock_guard<std::mutex> lock(shards_mu_);
    auto used_elsewhere = [&](std::optional<uint64_t> which) {
      for (const auto& [other, held] : holds_)
        if (other != session && !held.empty() && (!which || held.count(*which))) return true;
      return false;
    };
    if (prefix != loaded_prefix_) {
      if (!loaded_prefix_.empty() && used_elsewhere(std::nullopt))
        return absl::FailedPreconditionError(absl::StrCat(
            "this gateway serves ", prefix, ", another gateway of this rank ", loaded_prefix_,
            " (checkpoint | precision): the gateways must serve one checkpoint in one precision"));
      generations_.clear();
      holds_.clear();
      loaded_prefix_.clear();
    } else if (auto held = generations_.find(generation); held != generations_.end()) {
      if (LayoutOfShards(held->second) == wanted) {
        holds_[session] = {generation};
        DropUnheldLocked();
        weight_bytes_ = Bytes(held->second);
        return absl::OkStatus();
      }
      if (used_elsewhere(generation))
        return absl::FailedPreconditionError(absl::StrCat(
            "this gateway's placement generation ", generation,
            " has another layout than another gateway's: the gateways must start from one "
            "placement (--placement) and change it through one authority"));
      generations_.erase(held);
    }
    if (!generations_.empty()) reuse = generations_.rbegin()->second;
  }
  if (loaded_prefix_.empty()) {
    ASSIGN_OR_RETURN(checkpoint_, Checkpoint::Open(dir));
  }
  ASSIGN_OR_RETURN(LayerShards shards, BuildShards(registration.shards(), reuse));
  loaded_prefix_ = prefix;
  std::lock_guard<std::mutex> lock(shards_mu_);
  weight_bytes_ = Bytes(shards);
  generations_[generation] = std::move(shards);
  holds_[session] = {generation};
  DropUnheldLocked();
  return absl::OkStatus();
}

}  // namespace moe
