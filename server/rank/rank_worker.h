// An expert rank: registers with every gateway it is given (one session each, under the same
// rank id), loads its shard of the routed experts of every served layer once, then answers the
// steps of all its gateways until stopped.
//
// Sessions are independent: a gateway that goes away costs only its own session, which
// registers again with backoff (and finds its experts still loaded when its shard is
// unchanged); a gateway that hangs holds only its own steps. Steps of different gateways take
// turns at the compute in arrival order (FairTurn), so a burst from one gateway cannot starve
// another's; each gateway keeps at most one step per layer in flight, which bounds its queue.
//
// Live re-placement: shards are kept per placement generation, one layout per generation on
// every gateway (a registration or LoadShards naming a held generation with another layout is
// refused). LoadShards (on a session's exchange stream) loads a generation on a loader thread
// while steps keep being answered; steps name the generation they were planned with; KeepShards
// says which generation that session's gateway still uses, and a generation no session uses any
// more is dropped.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
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
#include "server/backend_factory.h"
#include "transport/grpc_transport.h"

namespace moe {

struct RankOptions {
  // HOST:PORT of moe-gateways' control ports (--control-port): one session per gateway. A name
  // stands for every address it resolves to (IPv4 when it has any), re-resolved every few
  // seconds: a Kubernetes headless Service of a gateway Deployment lists each pod.
  std::vector<std::string> gateways;
  TlsFiles tls;               // trust for the gateway; cert + key: this rank's identity (mTLS)
  std::string cluster_token;  // the gateway's cluster token ("" = none)
  int requested_rank = -1;    // -1: the gateway picks (one gateway only)
  std::string checkpoint;     // overrides the gateway's path (other mount point)
  BackendKind backend = BackendKind::kCpu;
  int device = 0;         // CUDA device (backend cuda)
  CpuBackendOptions cpu;  // expert compute threads
  // How long the rank waits at start for its first registration with any gateway (then Run fails
  // DEADLINE_EXCEEDED); once registered, a lost gateway is waited for without a limit.
  absl::Duration connect_timeout = absl::Minutes(10);
  bool reconnect = true;  // register again when the gateway goes away
  int64_t max_message_bytes = int64_t{1} << 30;
  // Fault in every page of the shard at load (predictable first steps; CPU backend).
  bool prefault = true;
  bool progress = true;  // loading progress on stderr (a line every 5 s, a bar on a terminal)
  // Refuse experts holding NaN/Inf at load (ExpertLoadOptions::check_values).
  bool check_weights = true;
  // Fault injection, set only by the tests' build (moe-rank-faults, server/rank/rank_faults.h):
  // each step's partial sums after its compute (a faulty rank), and a pause before its reply,
  // after its compute turn (a slow or hung rank). moe-rank leaves both empty.
  std::function<absl::Status(PartialView partial, Backend* backend)> after_compute;
  std::function<void()> before_reply;
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

// Turns in arrival order: a thread that asked first goes first (std::mutex promises nothing).
class FairTurn {
 public:
  void Acquire();
  void Release();

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  uint64_t next_ = 0, serving_ = 0;  // guarded by mu_
};

class RankWorker {
 public:
  explicit RankWorker(const RankOptions& options);
  ~RankWorker();

  // Runs every session until Stop() or an unrecoverable error of any of them (a refusal that
  // retrying cannot fix, or, with reconnect off, a session that ended).
  absl::Status Run();
  void Stop();

  int rank() const { return rank_.load(); }
  int64_t weight_bytes() const { return weight_bytes_.load(); }
  std::string backend_name() const { return backend_ != nullptr ? backend_->name() : "none"; }
  // Must be set before Run().
  void SetObserver(RankStepObserver* observer) { observer_ = observer; }

 private:
  class Session;  // one gateway (rank_worker.cc)

  // The gateways the options name now: address -> the name it came from ("" for an address).
  std::map<std::string, std::string> ResolveGateways() const;
  std::shared_ptr<Session> FindSession(int session);
  // A session whose gateway left the directory: its holds go, its generations may drop.
  void RetireSession(int session);

  // Per layer, the shard of one placement generation.
  using LayerShards = std::map<int, std::shared_ptr<ExpertShard>>;
  static int64_t Bytes(const LayerShards& shards);  // their weight bytes
  // Makes the registration's generation available (loading what is not held yet) and makes it
  // the one session `session` holds. FAILED_PRECONDITION when another session's gateway uses
  // the same generation with another layout, or another checkpoint or precision.
  absl::Status LoadRegisteredShards(int session,
                                    const moe::v1::internal::RegisterResponse& registration);
  // Loads `shards`, reusing the layers of `reuse` whose expert lists are the same.
  absl::StatusOr<LayerShards> BuildShards(
      const google::protobuf::RepeatedPtrField<moe::v1::internal::LayerShard>& shards,
      const LayerShards& reuse);
  std::shared_ptr<ExpertShard> FindShard(uint64_t generation, int layer);
  // Session `session`'s gateway uses only `generation` now (KeepShards): drops every generation
  // no session holds, and offers it to the gateways still on older ones (Commit).
  void Keep(int session, uint64_t generation);
  // Session `session`'s gateway uses `generation` (registration, KeepShards): a PlacementOffer
  // of it to each other gateway on an older one, so they follow (placement_changer.h).
  void Commit(int session, uint64_t generation);
  // A newly opened exchange of `session`: offered the newest generation another gateway uses,
  // when that is newer than its own.
  void OfferNewest(int session);
  void Offer(int session, uint64_t generation);
  void DropUnheldLocked();  // shards_mu_ held
  // Queues a LoadShards of session `session` for the loader thread, which answers it there.
  void QueueLoad(int session, const moe::v1::internal::LoadShards& request);
  void LoaderLoop();  // runs LoadShards requests one at a time
  // The answer of a load, on the session's exchange stream (dropped when it has none now).
  void Answer(int session, const moe::v1::internal::RankToGateway& message);

  RankOptions options_;
  absl::Status backend_status_;
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<Checkpoint> checkpoint_;  // guarded by load_mu_
  std::mutex load_mu_;                      // one load at a time (registration or LoadShards)
  std::string loaded_prefix_;  // guarded by load_mu_: checkpoint | precision of the shards held
  std::mutex shards_mu_;
  std::map<uint64_t, LayerShards> generations_;  // guarded by shards_mu_
  // Guarded by shards_mu_: per session, the generations its gateway may still use (what it
  // registered with, what it asked to load) until it says which one it keeps.
  std::map<int, std::set<uint64_t>> holds_;
  std::map<int, uint64_t> committed_;  // guarded by shards_mu_: session -> the generation it uses
  // Device backends (one CUDA stream): loading and steps take turns; a CPU rank loads beside
  // its steps (its weights are views of the memory-mapped checkpoint).
  std::mutex device_mu_;
  FairTurn compute_turn_;  // the sessions' steps, one at a time, in arrival order
  std::mutex loader_mu_;
  std::condition_variable loader_cv_;
  // Guarded by loader_mu_: (session, request).
  std::deque<std::pair<int, moe::v1::internal::LoadShards>> load_queue_;
  bool loader_stop_ = false;  // guarded by loader_mu_
  std::thread loader_;
  std::mutex sessions_mu_;
  std::condition_variable sessions_cv_;               // Stop() wakes the directory loop
  std::map<int, std::shared_ptr<Session>> sessions_;  // guarded by sessions_mu_
  std::atomic<int> rank_{-1};
  // The session serving its gateway over NCCL, -1 when none: one at a time (rank_worker.cc).
  std::atomic<int> nccl_session_{-1};
  std::atomic<int64_t> weight_bytes_{0};
  std::atomic<bool> stop_{false};
  absl::Time connect_by_ = absl::InfiniteFuture();  // set by Run: start + connect_timeout
  std::atomic<bool> registered_once_{false};        // some session has registered
  RankStepObserver* observer_ = nullptr;
};

}  // namespace moe
