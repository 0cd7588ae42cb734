// An expert rank: registers with the gateway, loads its shard of the routed experts of every
// served layer, then answers steps over the transport until stopped.
//
// If the gateway goes away the rank registers again (with backoff) and keeps the experts it
// already holds when its shard is unchanged, so a restarted gateway finds its ranks quickly.
//
// Live re-placement: shards are kept per placement generation. LoadShards (on the exchange
// stream) loads the next generation on a loader thread while steps keep being answered with the
// current one; steps name the generation they were planned with; KeepShards drops the others.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "kernels/cpu/cpu_backend.h"
#include "model/checkpoint.h"
#include "model/moe_layer.h"
#include "moe/v1/internal.grpc.pb.h"
#include "security/credentials.h"
#include "transport/grpc_transport.h"

namespace moe {

struct RankOptions {
  std::string gateway;          // HOST:PORT of moe-gateway's control port (--control-port)
  TlsFiles tls;                 // trust for the gateway; cert + key: this rank's identity (mTLS)
  std::string cluster_token;    // the gateway's cluster token ("" = none)
  int requested_rank = -1;      // -1: the gateway picks
  std::string checkpoint;       // overrides the gateway's path (other mount point)
  std::string backend = "cpu";  // "cpu" or "cuda"
  int device = 0;               // CUDA device (backend cuda)
  CpuBackendOptions cpu;        // expert compute threads
  absl::Duration connect_timeout = absl::Minutes(10);  // how long to wait for the gateway
  bool reconnect = true;                               // register again when the gateway goes away
  int64_t max_message_bytes = int64_t{1} << 30;
  // Fault in every page of the shard at load (predictable first steps; CPU backend).
  bool prefault = true;
  bool progress = true;  // loading progress on stderr (a line every 5 s, a bar on a terminal)
  // Refuse experts holding NaN/Inf at load (ExpertLoadOptions::check_values).
  bool check_weights = true;
  // Fault injection for tests: sleep this long before answering each step.
  absl::Duration debug_step_delay = absl::ZeroDuration();
  // Fault injection for tests: answer every step with NaN partial sums (a faulty rank).
  bool debug_nan_partials = false;
};

// What a rank reports about each step (metrics).
struct RankStepReport {
  int layer = 0;
  int64_t rows = 0;
  int active_experts = 0;
  absl::Duration compute;
  int64_t bytes_received = 0;
  int64_t bytes_sent = 0;
};

class RankStepObserver {
 public:
  virtual ~RankStepObserver() = default;
  virtual void OnRegistered(int rank, int64_t weight_bytes) = 0;
  virtual void OnRankStep(const RankStepReport& report) = 0;
  // Loading experts: the fraction of their bytes mapped and prefaulted so far (1 when done).
  virtual void OnLoadProgress(double ratio) {}
};

class RankWorker {
 public:
  explicit RankWorker(const RankOptions& options);
  ~RankWorker();

  // Runs until Stop() or an unrecoverable error.
  absl::Status Run();
  void Stop();

  int rank() const { return rank_.load(); }
  int64_t weight_bytes() const { return weight_bytes_.load(); }
  std::string backend_name() const { return backend_ != nullptr ? backend_->name() : "none"; }
  // Must be set before Run().
  void SetObserver(RankStepObserver* observer) { observer_ = observer; }

 private:
  absl::Status RegisterAndLoad(moe::v1::internal::RegisterResponse* registration);
  absl::Status ServeSession(const moe::v1::internal::RegisterResponse& registration);
  // Answers steps from `transport` until it fails or is cancelled.
  absl::Status ServeSteps(RankTransport& transport);
  // Makes Stop() cancel `cancel` while a session runs.
  void SetCancel(std::function<void()> cancel);
  // Per layer, the shard of one placement generation.
  using LayerShards = std::map<int, std::shared_ptr<ExpertShard>>;
  static int64_t Bytes(const LayerShards& shards);  // their weight bytes
  absl::Status LoadRegisteredShards(const moe::v1::internal::RegisterResponse& registration);
  // Loads `shards`, reusing the layers of `reuse` whose expert lists are the same.
  absl::StatusOr<LayerShards> BuildShards(
      const google::protobuf::RepeatedPtrField<moe::v1::internal::LayerShard>& shards,
      const LayerShards& reuse);
  std::shared_ptr<ExpertShard> FindShard(uint64_t generation, int layer);
  // A control message from the gateway (reader thread: must not block).
  void OnControl(const moe::v1::internal::GatewayToRank& message);
  void LoaderLoop();  // runs LoadShards requests one at a time
  // Where ShardsLoaded answers go during a session (null between sessions).
  void SetControlSink(std::function<absl::Status(const moe::v1::internal::RankToGateway&)> sink);

  RankOptions options_;
  absl::Status backend_status_;
  std::unique_ptr<Backend> backend_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<moe::v1::internal::RankControl::Stub> stub_;
  std::unique_ptr<Checkpoint> checkpoint_;  // guarded by load_mu_
  std::mutex load_mu_;                      // one load at a time (registration or LoadShards)
  std::string loaded_prefix_;  // guarded by load_mu_: checkpoint | precision of the shards held
  std::mutex shards_mu_;
  std::map<uint64_t, LayerShards> generations_;  // guarded by shards_mu_
  // Device backends (one CUDA stream): loading and steps take turns; a CPU rank loads beside
  // its steps (its weights are views of the memory-mapped checkpoint).
  std::mutex device_mu_;
  std::mutex loader_mu_;
  std::condition_variable loader_cv_;
  std::deque<moe::v1::internal::LoadShards> load_queue_;  // guarded by loader_mu_
  bool loader_stop_ = false;                              // guarded by loader_mu_
  // Held while the sink is called, so clearing it waits for a call in progress (the sink
  // writes on the session's stream, which goes away with the session).
  std::mutex sink_mu_;
  std::function<absl::Status(const moe::v1::internal::RankToGateway&)>
      control_sink_;  // guarded by sink_mu_
  std::thread loader_;
  std::unique_ptr<Workspace> workspace_;
  std::atomic<int> rank_{-1};
  std::atomic<int64_t> weight_bytes_{0};
  std::atomic<bool> stop_{false};
  std::mutex transport_mu_;
  std::function<void()> cancel_;  // guarded by transport_mu_: unblocks the running session
  RankStepObserver* observer_ = nullptr;
};

}  // namespace moe
