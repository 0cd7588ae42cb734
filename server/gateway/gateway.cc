#include "server/gateway/gateway.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/host_port.h"
#include "core/log.h"
#include "core/status.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/resource_quota.h"
#include "server/backend_factory.h"
#include "server/gateway/kserve_http.h"
#include "server/gateway/kserve_service.h"
#include "server/gateway/services.h"

#include <thread>

#include "transport/cuda_plugin.h"

namespace moe {

absl::StatusOr<std::unique_ptr<Gateway>> Gateway::Create(const GatewayOptions& options) {
  if (options.num_ranks < 1) return absl::InvalidArgumentError("--ranks must be at least 1");
  if (!TransportBuilt(options.transport))
    return absl::UnimplementedError(
        absl::StrCat("transport '", TransportName(options.transport),
                     "' is not available in this build (built without CUDA/NCCL)"));
  if (options.transport == TransportKind::kNccl && options.backend != BackendKind::kCuda)
    return absl::InvalidArgumentError(
        "--transport nccl needs --backend cuda (NCCL moves device memory)");
  if (options.max_concurrent_requests < 1)
    return absl::InvalidArgumentError("--max-concurrent-requests must be at least 1");
  if (options.port == options.control_port && options.port != 0)
    return absl::InvalidArgumentError(
        absl::StrCat("--control-port must differ from --port (both ", options.port, ")"));
  RETURN_IF_ERROR(CheckTlsFiles(options.tls, /*server=*/true));
  AccessOptions access = options.access;
  access.control_mtls = options.tls.mutual() || !options.rank_ca.empty();
  if (!options.rank_ca.empty()) {
    TlsFiles control = options.tls;
    control.ca = options.rank_ca;
    RETURN_IF_ERROR_CTX(CheckTlsFiles(control, /*server=*/true), "--rank-ca");
  }
  if (access.control_mtls && access.rank_identity.empty())
    return absl::InvalidArgumentError(
        "--rank-identity must name the URI SAN of rank certificates (mTLS on the control port)");
  RETURN_IF_ERROR(AccessControl::CheckConfiguration(access));
  std::unique_ptr<Gateway> gateway(new Gateway(options));
  ASSIGN_OR_RETURN(gateway->checkpoint_, Checkpoint::Open(options.checkpoint));
  const MoeConfig& config = gateway->checkpoint_->config();
  std::vector<int> layers = options.layers;
  if (layers.empty()) layers = gateway->checkpoint_->layers();
  for (int layer : layers)
    if (!gateway->checkpoint_->HasLayer(layer))
      return absl::NotFoundError(absl::StrCat(
          "layer ", layer, " is not in ", options.checkpoint,
          " (MoE layers present: ", absl::StrJoin(gateway->checkpoint_->layers(), ", "), ")"));
  if (layers.empty())
    return absl::NotFoundError(absl::StrCat(options.checkpoint, " has no MoE layers"));

  ExpertPlacement placement;
  if (!options.placement_file.empty()) {
    std::ifstream in(options.placement_file);
    if (!in)
      return absl::NotFoundError(
          absl::StrCat("cannot open placement file ", options.placement_file));
    std::stringstream text;
    text << in.rdbuf();
    ASSIGN_OR_RETURN(placement, ExpertPlacement::Parse(config.routing.num_experts, text.str(),
                                                       options.num_ranks));
    if (placement.num_ranks() != options.num_ranks)
      return absl::InvalidArgumentError(absl::StrCat("placement file has ", placement.num_ranks(),
                                                     " ranks, --ranks is ", options.num_ranks));
  } else {
    placement = ExpertPlacement::Contiguous(config.routing.num_experts, options.num_ranks);
  }

  ASSIGN_OR_RETURN(gateway->backend_, CreateBackend(options.backend, options.device, options.cpu));
  // The control plane first: the data planes and the engine follow its membership. The ranks'
  // exchange streams always exist: they carry the steps (transport grpc) or only the control
  // plane's liveness and messages (transport nccl, whose communicator forms once all joined).
  gateway->access_ = std::make_unique<AccessControl>(access);
  gateway->control_ =
      std::make_unique<ClusterControl>(options.num_ranks, options.liveness, gateway->access_.get());
  GatewayTransport* steps = nullptr;
  if (options.transport == TransportKind::kNccl) {
    gateway->nccl_ = std::make_shared<DeferredTransport>("nccl");
    steps = gateway->nccl_.get();
    ASSIGN_OR_RETURN(const CudaPluginApi* plugin, LoadCudaPlugin());
    ASSIGN_OR_RETURN(gateway->nccl_unique_id_, plugin->new_nccl_unique_id());
  } else {
    gateway->grpc_ = std::make_unique<GrpcGatewayTransport>(
        options.num_ranks, gateway->backend_.get(), &gateway->control_->sessions());
    steps = gateway->grpc_.get();
  }
  Progress progress("moe-gateway: loading layers", 0);
  ASSIGN_OR_RETURN(gateway->engine_,
                   StepEngine::Create(*gateway->checkpoint_, layers, std::move(placement),
                                      options.precision, gateway->backend_.get(), steps,
                                      &gateway->control_->membership(), &progress));
  gateway->metrics_ =
      std::make_unique<GatewayMetrics>(config, gateway->engine_->layers(),
                                       gateway->engine_->placement()->placement, options.metrics);
  gateway->engine_->SetObserver(gateway->metrics_.get());
  gateway->metrics_->SetBuildInfo(gateway->backend_->name());
  gateway->access_->SetMetrics(gateway->metrics_.get());
  BalanceOptions balance = options.balance;
  balance.per_expert = options.metrics.per_expert;
  gateway->diagnostics_ = std::make_unique<BalanceDiagnostics>(gateway->engine_.get(),
                                                               gateway->metrics_.get(), balance);
  gateway->placement_changer_ = std::make_unique<PlacementChanger>(
      gateway->engine_.get(), gateway->control_.get(),
      [g = gateway.get()] { g->OnRankState(-1, true); },
      [metrics = gateway->metrics_.get()](const PlacementGeneration& followed) {
        metrics->SetPlacement(followed.generation, followed.placement);
      });
  gateway->batcher_ = std::make_unique<StepBatcher>(gateway->engine_.get(), options.batcher);
  gateway->stream_buffers_.SetObserver(
      [metrics = gateway->metrics_.get()](int64_t bytes) { metrics->SetStreamBufferBytes(bytes); });
  gateway->batcher_->SetQueueObserver(
      [metrics = gateway->metrics_.get()](int64_t tokens) { metrics->SetQueuedTokens(tokens); });

  Gateway* g = gateway.get();
  ClusterControl::Hooks hooks;
  hooks.fill_registration = [g](int rank, moe::v1::internal::RegisterResponse* response) {
    g->FillRegistration(rank, response);
  };
  hooks.on_hello = [g](int rank, uint64_t generation) {
    // The rank's shards are those of the generation it registered with; if the placement
    // changed since, it loads the current one now and gets rows once it has.
    g->placement_changer_->OnHello(rank, generation);
  };
  hooks.on_control = [g](int rank, const moe::v1::internal::RankToGateway& message) {
    if (message.has_shards_loaded())
      g->placement_changer_->OnShardsLoaded(rank, message.shards_loaded());
    if (message.has_placement_offer())
      g->placement_changer_->OnOffer(rank, message.placement_offer());
  };
  hooks.on_record = [g](int rank, const RankRecord& record) {
    g->metrics_->SetRankWeightBytes(rank, record.weight_bytes);
  };
  if (g->grpc_ != nullptr) {
    hooks.on_result = [g](int rank, moe::v1::internal::StepResult result) {
      g->grpc_->OnResult(rank, std::move(result));
    };
    g->grpc_->SetDroppedResultCallback(
        [metrics = g->metrics_.get()](int rank) { metrics->OnDroppedResult(rank); });
  }
  g->control_->SetHooks(std::move(hooks));
  // Membership, in this order: health and metrics first (a caller who sees its step fail also
  // sees health updated), then the data plane (the steps waiting on a rank that went fail).
  g->control_->membership().Subscribe(
      [g](int rank, bool up, const std::string&) { g->OnRankState(rank, up); });
  GatewayTransport* data_plane = steps;
  g->control_->membership().Subscribe([data_plane](int rank, bool up, const std::string& why) {
    if (up) {
      data_plane->RankUp(rank);
    } else {
      data_plane->RankDown(rank, why);
    }
  });
  return gateway;
}

Gateway::Gateway(const GatewayOptions& options)
    : options_(options), stream_buffers_(options.max_stream_buffer_total_bytes) {}

Gateway::~Gateway() {
  if (metrics_ != nullptr) metrics_->SetReadiness(nullptr);  // /readyz no longer asks this
  Shutdown(absl::Seconds(1));
}

void Gateway::StartNcclGroup() {
  // NCCL init is collective and blocks until every rank has joined, so it runs beside the
  // control plane. The thread shares ownership of what it touches: a gateway shut down while
  // ranks are still loading does not wait for it.
  auto plugin = LoadCudaPlugin();
  if (!plugin.ok()) return;  // Create checked it already
  auto deferred = nccl_;
  auto backend = backend_;
  auto alive = nccl_callback_;
  NcclGatewaySetup setup;
  setup.num_ranks = options_.num_ranks;
  setup.unique_id = nccl_unique_id_;
  setup.backend = backend.get();
  setup.init_timeout = options_.nccl_init_timeout;
  const CudaPluginApi* api = *plugin;
  std::thread([deferred, backend, alive, setup, api] {
    auto transport = api->create_nccl_gateway(setup);
    if (!transport.ok()) {
      LogLine("moe-gateway: NCCL group failed to form: %s", transport.status().ToString().c_str());
      return;
    }
    deferred->Install(std::move(*transport));
    LogLine("moe-gateway: NCCL communicator formed (%d ranks + gateway)", setup.num_ranks);
    alive->Notify();
  }).detach();
}

absl::Status Gateway::Start() {
  if (options_.auto_rebalance.enabled) {
    AutoRebalanceOptions rebalance = options_.auto_rebalance;
    const int E = engine_->config().routing.num_experts, R = options_.num_ranks;
    if (rebalance.redundant < 0) rebalance.redundant = R + (R - E % R) % R;
    AutoRebalancer::Hooks hooks;
    hooks.balancedness = [this] {
      double worst = 1.0;
      for (int layer : engine_->layers()) {
        const LayerLoad load = metrics_->Load(layer);
        if (load.tokens > 0) worst = std::min(worst, load.rank_balancedness);
      }
      return worst;
    };
    hooks.advise = [this](int redundant) { return diagnostics_->Advice(-1, redundant); };
    hooks.apply = [this](const std::string& placement) {
      return ChangePlacement(placement, "--auto-rebalance").status();
    };
    auto_rebalancer_ = std::make_unique<AutoRebalancer>(rebalance, std::move(hooks));
  }
  if (nccl_ != nullptr) {
    nccl_callback_->Set([this] { OnRankState(-1, true); });
    StartNcclGroup();
  }
  if (options_.metrics_port >= 0) {
    RETURN_IF_ERROR(
        metrics_->Serve(absl::StrCat(options_.metrics_host, ":", options_.metrics_port)));
    // /readyz as the overall gRPC health: every expert has a live replica, not draining.
    metrics_->SetReadiness([this]() -> std::string {
      if (draining_) return "draining";
      return ready() ? "" : ReadinessMessage();
    });
  }
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  moe_service_ = std::make_unique<MoeServiceImpl>(this);
  diagnostics_service_ = std::make_unique<DiagnosticsServiceImpl>(this);
  kserve_service_ = std::make_unique<KServeServiceImpl>(this);
  // The control port first: ranks may connect as soon as the public port answers health.
  const std::string control_host =
      options_.control_host.empty() ? options_.host : options_.control_host;
  const MoeConfig& c = engine_->config();
  // A rank's connection carries Challenge, Register and one Exchange at a time.
  ASSIGN_OR_RETURN(
      control_server_,
      Listen(control_host, options_.control_port, &control_port_, ControlTls(),
             ControlMessageLimit(),
             options_.batcher.max_tokens_per_step * c.expert_input_size() * int64_t{4} +
                 (int64_t{1} << 20),
             ControlTransportMemory(), /*max_streams=*/8, {control_->service()}, "--control-port"));
  ASSIGN_OR_RETURN(
      server_,
      Listen(options_.host, options_.port, &port_, options_.tls, RequestLimit(),
             options_.max_request_tokens * c.hidden_size * int64_t{4} + (int64_t{1} << 20),
             PublicTransportMemory(), /*max_streams=*/256,
             {moe_service_.get(), diagnostics_service_.get(), kserve_service_.get()}, "--port"));
  if (options_.http_port >= 0) {
    const std::string http_host = options_.http_host.empty() ? options_.host : options_.http_host;
    // civetweb serves plaintext here: a gateway configured for TLS keeps its callers' tokens and
    // tensors off the network by listening on loopback, for a proxy that terminates TLS.
    if (options_.tls.server_enabled() && !IsLoopback(http_host))
      return absl::FailedPreconditionError(absl::StrCat(
          "--http-port serves plaintext HTTP and the gateway is configured for TLS: give "
          "--http-host 127.0.0.1 and terminate TLS in front of it (not ",
          http_host, ")"));
    ASSIGN_OR_RETURN(rest_, KServeHttpServer::Start(
                                this, RestOptions{absl::StrCat(http_host, ":", options_.http_port),
                                                  options_.http_threads}));
  }
  std::lock_guard<std::mutex> lock(health_mu_);
  health_ = server_->GetHealthCheckService();
  SetHealthLocked();
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<grpc::Server>> Gateway::Listen(
    const std::string& host, int port, int* bound, const TlsFiles& tls, int64_t receive_limit,
    int64_t send_limit, int64_t transport_memory, int max_streams,
    const std::vector<grpc::Service*>& services, const std::string& flag) {
  ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> credentials, ServerCredentials(tls));
  grpc::ServerBuilder builder;
  // A second gateway on a port in use must fail, not share (and steal half of) its callers.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.AddListeningPort(absl::StrCat(host, ":", port), credentials, bound);
  // Receive limits guard the gateway's memory; send limits only need to fit what it sends.
  builder.SetMaxReceiveMessageSize(static_cast<int>(std::min<int64_t>(receive_limit, INT32_MAX)));
  builder.SetMaxSendMessageSize(static_cast<int>(std::min<int64_t>(send_limit, INT32_MAX)));
  // What the transport may hold of messages still arriving, all connections together: gRPC reads
  // a message whole before checking its size against the limit, so without a quota four callers
  // sending 1 GB each made it hold 4 GB before refusing them. Past the quota gRPC resets a stream
  // of a connection that holds memory (RST_STREAM ENHANCE_YOUR_CALM: RESOURCE_EXHAUSTED).
  grpc::ResourceQuota quota(absl::StrCat("moe-gateway", flag));
  quota.Resize(static_cast<size_t>(transport_memory));
  builder.SetResourceQuota(quota);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, max_streams);
  builder.AddChannelArgument(GRPC_ARG_MAX_METADATA_SIZE, 16 << 10);
  // Failover clients ping every 2 s to notice a hung gateway (client/gateway_targets.h); gRPC
  // would answer pings more often than every 5 minutes with GOAWAY "too_many_pings".
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 1000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  for (grpc::Service* service : services) builder.RegisterService(service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || *bound == 0)
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", host, ":", port, " (", flag, ")"));
  return server;
}

TlsFiles Gateway::ControlTls() const {
  TlsFiles tls = options_.tls;
  if (!options_.rank_ca.empty()) tls.ca = options_.rank_ca;
  return tls;
}

absl::StatusOr<Gateway::RequestSlot> Gateway::TryBeginRequest() {
  std::lock_guard<std::mutex> lock(in_flight_mu_);
  if (in_flight_ >= options_.max_concurrent_requests)
    return absl::ResourceExhaustedError(absl::StrCat(in_flight_,
                                                     " requests in flight, the gateway's limit "
                                                     "(--max-concurrent-requests); retry later"));
  metrics_->SetRequestsInFlight(++in_flight_);
  return RequestSlot(this);
}

void Gateway::EndRequest() {
  std::lock_guard<std::mutex> lock(in_flight_mu_);
  metrics_->SetRequestsInFlight(--in_flight_);
  if (in_flight_ == 0) in_flight_cv_.notify_all();
}

int64_t Gateway::Drain(absl::Duration timeout) {
  draining_ = true;
  {
    std::lock_guard<std::mutex> lock(health_mu_);
    if (health_ != nullptr) health_->SetServingStatus(false);  // every service name
  }
  std::unique_lock<std::mutex> lock(in_flight_mu_);
  in_flight_cv_.wait_for(lock, absl::ToChronoNanoseconds(timeout),
                         [this] { return in_flight_ == 0; });
  return in_flight_;
}

void Gateway::Shutdown(absl::Duration grace) {
  draining_ = true;
  if (placement_changer_ != nullptr) placement_changer_->Stop();
  auto_rebalancer_.reset();
  if (nccl_callback_ != nullptr) nccl_callback_->Set(nullptr);
  {
    std::lock_guard<std::mutex> lock(health_mu_);
    if (health_ != nullptr) health_->SetServingStatus(false);
    health_ = nullptr;
  }
  if (server_ != nullptr) {
    control_->Close();
    server_->Shutdown(absl::ToChronoTime(absl::Now() + grace));
    server_->Wait();
    server_.reset();
  }
  rest_.reset();  // waits for its handlers, whose steps end like the gRPC calls' did
  if (control_server_ != nullptr) {
    control_server_->Shutdown(absl::ToChronoTime(absl::Now()));
    control_server_->Wait();
    control_server_.reset();
  }
  batcher_.reset();
  diagnostics_.reset();
}

int Gateway::http_port() const { return rest_ != nullptr ? rest_->port() : -1; }

void Gateway::Wait() {
  if (server_ != nullptr) server_->Wait();
}

int64_t Gateway::RequestLimit() const {
  if (options_.max_request_bytes > 0) return options_.max_request_bytes;
  const MoeConfig& c = engine_->config();
  // The response is no larger: the same rows (fp32 at most) and the routing (an id and a
  // weight per choice) within the 1 MiB of headroom up to K3's top-16 at 4096 tokens.
  return options_.max_request_tokens * c.hidden_size * int64_t{4} + (int64_t{1} << 20);
}

int64_t Gateway::PublicTransportMemory() const {
  if (options_.transport_memory_bytes > 0) return options_.transport_memory_bytes;
  // Four largest requests in flight at once, and no less than 64 MiB.
  return std::max<int64_t>(int64_t{64} << 20, 4 * RequestLimit());
}

int64_t Gateway::ControlTransportMemory() const {
  if (options_.transport_memory_bytes > 0) return options_.transport_memory_bytes;
  // Every rank's largest result at once, with room for one more.
  return std::max<int64_t>(int64_t{64} << 20, (options_.num_ranks + 1) * ControlMessageLimit());
}

int64_t Gateway::ControlMessageLimit() const {
  const MoeConfig& c = engine_->config();
  return options_.batcher.max_tokens_per_step * c.expert_input_size() * int64_t{8} +
         (int64_t{1} << 20);
}

std::vector<int> Gateway::ExpertsWithoutLiveReplica() const {
  // Asked on every request (ready()): one look at each rank, not one per replica. A live
  // rank counts once it holds the placement in use (a returning rank may still be loading it).
  std::vector<bool> live(options_.num_ranks);
  for (int r = 0; r < options_.num_ranks; ++r) live[r] = engine_->RankServes(r);
  std::vector<int> missing;
  const auto current = engine_->placement();
  const ExpertPlacement& placement = current->placement;
  for (int e = 0; e < placement.num_experts; ++e) {
    bool covered = false;
    for (const auto& replica : placement.replicas[e]) covered = covered || live[replica.rank];
    if (!covered) missing.push_back(e);
  }
  return missing;
}

bool Gateway::ready() const {
  // NCCL needs every member of the communicator; over gRPC streams the gateway serves while
  // every expert has a live replica (redundant placements ride out a rank's loss).
  if (nccl_ != nullptr)
    return control_->membership().num_up() == options_.num_ranks && nccl_->installed();
  return ExpertsWithoutLiveReplica().empty();
}

bool Gateway::AcceptsRequests() const {
  if (nccl_ != nullptr) return ready();
  for (int r = 0; r < options_.num_ranks; ++r)
    if (engine_->RankServes(r)) return true;
  return false;
}

void Gateway::SetHealthLocked() {
  if (health_ == nullptr) return;
  // Overall (""): ready, every expert has a live replica (probes, moe-cluster). The service
  // name is what clients' round_robin checks (GatewayServiceConfig): a gateway that has been
  // ready takes requests while some rank serves, so a degraded cluster still serves the calls
  // whose experts are up (NOT_SERVING everywhere would fail them all); one that has never been
  // ready (just restarted, its ranks still registering) or is draining gets none.
  const bool ready_now = ready();
  ever_ready_ = ever_ready_ || ready_now;
  health_->SetServingStatus(ready_now && !draining_);
  health_->SetServingStatus("moe.v1.MoeService", ever_ready_ && AcceptsRequests() && !draining_);
}

std::string Gateway::ReadinessMessage() const {
  std::string message =
      absl::StrCat(control_->membership().num_up(), " of ", options_.num_ranks, " ranks up");
  if (nccl_ != nullptr && !nccl_->installed())
    absl::StrAppend(&message, ", NCCL communicator not formed yet");
  const std::vector<int> missing = ExpertsWithoutLiveReplica();
  if (!missing.empty())
    absl::StrAppend(&message, ", ", missing.size(), " experts without a live replica");
  return message;
}

void Gateway::FillRegistration(int rank, moe::v1::internal::RegisterResponse* response) {
  response->set_checkpoint(options_.checkpoint);
  const auto current = engine_->placement();
  response->set_placement_generation(current->generation);
  for (int layer : engine_->layers()) {
    auto* shard = response->add_shards();
    shard->set_layer(layer);
    for (int e : current->placement.rank_experts[rank]) shard->add_experts(e);
  }
  response->set_precision(
      static_cast<moe::v1::internal::Precision>(WirePrecision(engine_->precision())));
  response->set_transport(TransportName(options_.transport));
  if (options_.transport == TransportKind::kNccl) {
    response->set_nccl_unique_id(nccl_unique_id_);
    response->set_nccl_rank(rank);
  }
  response->set_max_tokens_per_step(options_.batcher.max_tokens_per_step);
}

absl::StatusOr<PlacementChange> Gateway::ApplyPlacement(const std::string& text,
                                                        const std::string& source) {
  if (!options_.allow_placement_changes && options_.access.admin_token.empty())
    return absl::PermissionDeniedError(
        "placement changes need an admin token (moe-gateway --admin-token-file) or "
        "--allow-placement-changes");
  return ChangePlacement(text, source);
}

absl::StatusOr<PlacementChange> Gateway::ChangePlacement(const std::string& text,
                                                         const std::string& source) {
  ASSIGN_OR_RETURN(
      ExpertPlacement next,
      ExpertPlacement::Parse(engine_->config().routing.num_experts, text, options_.num_ranks));
  LogLine("moe-gateway: placement change requested by %s",
          absl::CEscape(source.substr(0, 256)).c_str());
  const ExpertPlacement staged = next;
  absl::StatusOr<PlacementChange> change =
      placement_changer_->Apply(std::move(next), options_.placement_load_timeout);
  metrics_->OnPlacementChange(change.ok(), change.ok() ? change->took : absl::ZeroDuration());
  if (change.ok()) metrics_->SetPlacement(change->generation, staged);
  return change;
}

void Gateway::OnRankState(int rank, bool up) {
  if (rank >= 0) metrics_->OnRankState(rank, up);
  if (rank >= 0 && !up) placement_changer_->OnRankDown(rank);
  if (rank >= 0 && up) placement_changer_->OnRankUp(rank);
  metrics_->SetExpertsUnavailable(static_cast<int>(ExpertsWithoutLiveReplica().size()));
  // Serialized, and the state re-read under the lock: the last callback leaves the health
  // status matching the transport, however rank transitions interleave.
  std::lock_guard<std::mutex> lock(health_mu_);
  const bool all_up = ready();
  if (rank >= 0)
    LogLine("moe-gateway: rank %d %s (%s)", rank, up ? "up" : "DOWN", ReadinessMessage().c_str());
  if (all_up && control_->membership().num_up() == options_.num_ranks)
    LogLine("moe-gateway: ready (%d rank%s)", options_.num_ranks,
            options_.num_ranks == 1 ? "" : "s");
  else if (all_up)
    LogLine("moe-gateway: serving degraded (%s): every expert has a live replica",
            ReadinessMessage().c_str());
  SetHealthLocked();
}

}  // namespace moe
