// The gateway process: public gRPC API, rank control plane, batching, the layer math.
//
//   Gateway::Create   loads the checkpoint's gateway tensors, builds backend + transport
//   Gateway::Start    serves moe.v1.MoeService, MoeDiagnostics, grpc.health.v1 and server
//                     reflection on the public port, moe.v1.internal.RankControl on the control
//                     port; NOT_SERVING until every rank has loaded
//   Gateway::Drain    NOT_SERVING at once, new calls UNAVAILABLE, waits for in-flight ones
//   Gateway::Shutdown stops the server (after Drain: at once)
#pragma once

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "engine/step_engine.h"
#include "grpcpp/grpcpp.h"
#include "kernels/backend.h"
#include "kernels/cpu/cpu_backend.h"
#include "model/checkpoint.h"
#include "security/credentials.h"
#include "server/backend_factory.h"
#include "server/control/cluster_control.h"
#include "server/gateway/access_control.h"
#include "server/gateway/auto_rebalancer.h"
#include "server/gateway/balance_diagnostics.h"
#include "server/gateway/deferred_transport.h"
#include "server/gateway/placement_changer.h"
#include "server/gateway/step_batcher.h"
#include "server/gateway/stream_outbox.h"
#include "server/metrics/gateway_metrics.h"
#include "transport/grpc_transport.h"

namespace moe {

class MoeServiceImpl;
class DiagnosticsServiceImpl;
class KServeServiceImpl;
class KServeHttpServer;

struct GatewayOptions {
  std::string checkpoint;        // checkpoint directory (config.json + safetensors)
  std::vector<int> layers;       // served MoE layers; empty = all layers in the checkpoint
  int num_ranks = 1;             // expert ranks to wait for
  std::string host = "0.0.0.0";  // listen address
  int port = 50051;              // 0 = pick a free port (see Gateway::port)
  // RankControl (registration, the exchange streams) on a port of its own: it can stay off
  // published ports and load balancers, and the public reflection never lists it.
  std::string control_host;  // "" = host
  int control_port = 50052;  // 0 = pick a free port (see Gateway::control_port)
  TlsFiles tls;              // both ports; tls.ca makes client certificates required (mTLS)
  // The control port's CA for rank certificates ("" = tls.ca): a CA of their own keeps every
  // other certificate off the control port. Either makes the control port mTLS.
  std::string rank_ca;
  AccessOptions access;  // tokens (read from their files by the caller)
  // Requests accepted at once (a stream's requests count one each); beyond: RESOURCE_EXHAUSTED.
  int64_t max_concurrent_requests = 1024;
  Precision precision = Precision::kBF16;
  TransportKind transport = TransportKind::kGrpc;  // NCCL on GPUs
  std::string placement_file;  // explicit rank -> experts map; default: contiguous ranges
  BatcherOptions batcher;
  int64_t max_request_tokens = 4096;
  BackendKind backend = BackendKind::kCpu;
  int device = 0;         // CUDA device (backend cuda)
  CpuBackendOptions cpu;  // gateway compute threads
  // NCCL: how long the communicator may take to form (ranks load their experts first).
  absl::Duration nccl_init_timeout = absl::Minutes(30);
  // Largest message on the public port; 0 = what the model needs: max_request_tokens fp32 rows
  // plus 1 MiB. gRPC refuses a larger one on arrival, before the gateway allocates it. (The
  // control port's limit is a rank's largest step result: max_tokens_per_step fp64 rows.)
  int64_t max_request_bytes = 0;
  // Responses of one ForwardStream buffered for a client that reads slowly, and of all streams
  // together; beyond either, the stream's new requests get RESOURCE_EXHAUSTED.
  int64_t max_stream_buffer_bytes = int64_t{64} << 20;
  int64_t max_stream_buffer_total_bytes = int64_t{256} << 20;
  // What gRPC may hold of messages still arriving, per port (a grpc::ResourceQuota: past it,
  // gRPC resets a stream of a connection holding memory, RESOURCE_EXHAUSTED); 0 = sized from the
  // message limits.
  int64_t transport_memory_bytes = 0;
  // The Open Inference Protocol over HTTP/REST (kserve_http.h): -1 off, 0 any free port.
  // Plaintext: with TLS configured it listens on loopback only (behind a TLS-terminating proxy).
  std::string http_host;  // "" = host
  int http_port = -1;
  int http_threads = 16;
  std::string metrics_host = "0.0.0.0";
  int metrics_port = -1;  // Prometheus /metrics: -1 off, 0 any free port
  MetricsOptions metrics;
  BalanceOptions balance;  // Quantile Balancing window, bias override permission
  // Heartbeats on every rank's exchange stream; a rank silent for peer_timeout is marked down.
  // Ranks get both values at registration.
  LivenessOptions liveness;
  // MoeDiagnostics/ApplyPlacement: allowed with an admin token (which callers must show), or
  // with this on (a trusted network); how long ranks may take to load their new experts.
  bool allow_placement_changes = false;
  absl::Duration placement_load_timeout = absl::Minutes(10);
  AutoRebalanceOptions auto_rebalance;  // applies the EPLB advice by itself (--auto-rebalance)
};

class Gateway {
 public:
  static absl::StatusOr<std::unique_ptr<Gateway>> Create(const GatewayOptions& options);
  ~Gateway();

  absl::Status Start();
  // Graceful stop, first half: health NOT_SERVING at once and new requests UNAVAILABLE, then
  // waits up to `timeout` for the requests in flight. Returns how many are still in flight.
  int64_t Drain(absl::Duration timeout);
  // Stops the server: calls still running after `grace` are cancelled. Rank streams never end
  // on their own, so they are cancelled first: after Drain only responses being sent (and
  // open client streams) remain.
  void Shutdown(absl::Duration grace = absl::Seconds(5));
  void Wait();

  bool draining() const { return draining_.load(); }
  // A request accepted and not yet answered (a ForwardStream counts each of its requests):
  // counted from TryBeginRequest until its slot is released or destroyed, so no path through
  // a service can forget to end it. Drain waits for the count to reach zero.
  class RequestSlot {
   public:
    RequestSlot() = default;
    RequestSlot(RequestSlot&& other) noexcept : gateway_(std::exchange(other.gateway_, nullptr)) {}
    RequestSlot& operator=(RequestSlot&& other) noexcept {
      Release();
      gateway_ = std::exchange(other.gateway_, nullptr);
      return *this;
    }
    ~RequestSlot() { Release(); }
    void Release() {
      if (gateway_ != nullptr) std::exchange(gateway_, nullptr)->EndRequest();
    }

   private:
    friend class Gateway;
    explicit RequestSlot(Gateway* gateway) : gateway_(gateway) {}
    Gateway* gateway_ = nullptr;
  };
  // RESOURCE_EXHAUSTED past max_concurrent_requests.
  absl::StatusOr<RequestSlot> TryBeginRequest();

  int port() const { return port_; }
  int control_port() const { return control_port_; }
  int http_port() const;  // -1 when the REST API is off
  AccessControl& access() { return *access_; }
  int64_t RequestLimit() const;         // the public port's message limit (max_request_bytes)
  int64_t ControlMessageLimit() const;  // the control port's: one rank's step result
  // The ResourceQuota sizes (options' transport_memory_bytes, else from the message limits).
  int64_t PublicTransportMemory() const;
  int64_t ControlTransportMemory() const;
  StreamBufferBudget& stream_buffers() { return stream_buffers_; }
  bool ready() const;
  // Whether requests are taken now: under NCCL when ready(); over gRPC while some rank serves
  // the placement in use, since a request fails only when its tokens choose an expert without a
  // live replica (health says NOT_SERVING meanwhile: ready() is false).
  bool AcceptsRequests() const;
  // Experts none of whose replicas is on a live rank (the gateway is not ready while any).
  std::vector<int> ExpertsWithoutLiveReplica() const;
  std::string ReadinessMessage() const;  // "3 of 4 ranks up" when not ready
  const GatewayOptions& options() const { return options_; }
  const Checkpoint& checkpoint() const { return *checkpoint_; }
  StepEngine& engine() { return *engine_; }
  StepBatcher& batcher() { return *batcher_; }
  GatewayMetrics& metrics() { return *metrics_; }
  BalanceDiagnostics& diagnostics() { return *diagnostics_; }
  int metrics_port() const { return metrics_->port(); }
  const std::string& nccl_unique_id() const { return nccl_unique_id_; }
  std::string backend_name() const { return backend_->name(); }
  // The TLS files of the control port: tls with rank_ca as the client CA when given.
  TlsFiles ControlTls() const;

  // Live re-placement from the --placement text format (MoeDiagnostics/ApplyPlacement):
  // PERMISSION_DENIED unless allowed (GatewayOptions::allow_placement_changes or an admin
  // token), INVALID_ARGUMENT for bad text, else PlacementChanger::Apply's result. `source`
  // (who asks) is logged.
  absl::StatusOr<PlacementChange> ApplyPlacement(const std::string& text,
                                                 const std::string& source);
  // The ranks as the control plane knows them (model info).
  std::vector<RankRecord> ranks() const { return control_->ranks(); }

 private:
  explicit Gateway(const GatewayOptions& options);
  // Starts one of the two servers: `credentials`, message limits, a ResourceQuota of
  // `transport_memory` bytes and at most `max_streams` concurrent calls per connection.
  absl::StatusOr<std::unique_ptr<grpc::Server>> Listen(const std::string& host, int port,
                                                       int* bound, const TlsFiles& tls,
                                                       int64_t receive_limit, int64_t send_limit,
                                                       int64_t transport_memory, int max_streams,
                                                       const std::vector<grpc::Service*>& services,
                                                       const std::string& flag);
  void OnRankState(int rank, bool up);
  // What a registration of `rank` loads: the placement in use, precision, transport.
  void FillRegistration(int rank, moe::v1::internal::RegisterResponse* response);
  void SetHealthLocked();  // health_mu_ held: both health statuses from the state now
  void EndRequest();       // by RequestSlot
  // ApplyPlacement without the permission check (the operator's own --auto-rebalance).
  absl::StatusOr<PlacementChange> ChangePlacement(const std::string& text,
                                                  const std::string& source);

  GatewayOptions options_;
  std::unique_ptr<Checkpoint> checkpoint_;
  // A callback the detached NCCL-init thread may call while the gateway lives.
  class LateCallback {
   public:
    void Set(std::function<void()> fn) {
      std::lock_guard<std::mutex> lock(mu_);
      fn_ = std::move(fn);
    }
    void Notify() {
      std::lock_guard<std::mutex> lock(mu_);
      if (fn_) fn_();
    }

   private:
    std::mutex mu_;
    std::function<void()> fn_;
  };
  void StartNcclGroup();

  std::shared_ptr<Backend> backend_;
  std::unique_ptr<AccessControl> access_;
  // The control plane: rank admission, records, exchange streams, membership. Before the data
  // planes and the engine, which follow its membership.
  std::unique_ptr<ClusterControl> control_;
  std::shared_ptr<DeferredTransport> nccl_;  // transport nccl: the steps' transport
  std::string nccl_unique_id_;
  std::shared_ptr<LateCallback> nccl_callback_ = std::make_shared<LateCallback>();
  std::unique_ptr<GrpcGatewayTransport> grpc_;  // transport grpc: the steps' transport
  std::unique_ptr<StepEngine> engine_;
  std::unique_ptr<GatewayMetrics> metrics_;
  std::unique_ptr<BalanceDiagnostics> diagnostics_;
  std::unique_ptr<PlacementChanger> placement_changer_;
  std::unique_ptr<StepBatcher> batcher_;
  std::unique_ptr<AutoRebalancer> auto_rebalancer_;  // its thread uses the members above
  std::unique_ptr<MoeServiceImpl> moe_service_;
  std::unique_ptr<DiagnosticsServiceImpl> diagnostics_service_;
  std::unique_ptr<KServeServiceImpl> kserve_service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<KServeHttpServer> rest_;
  std::unique_ptr<grpc::Server> control_server_;
  std::mutex health_mu_;
  grpc::HealthCheckServiceInterface* health_ = nullptr;  // guarded by health_mu_
  bool ever_ready_ = false;                              // guarded by health_mu_
  int port_ = 0;
  int control_port_ = 0;
  std::atomic<bool> draining_{false};
  StreamBufferBudget stream_buffers_;
  std::mutex in_flight_mu_;
  std::condition_variable in_flight_cv_;
  int64_t in_flight_ = 0;  // guarded by in_flight_mu_
};

}  // namespace moe
