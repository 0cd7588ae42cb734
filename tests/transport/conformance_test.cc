// The transport contract (transport/transport.h), one suite for every implementation:
//   loopback  the in-process ranks LocalMoeLayer uses;
//   grpc      GrpcGatewayTransport and real GrpcRankTransports over a gRPC server on
//             loopback, each rank on a thread of its own with its own channel.
//   nccl      NcclGatewayTransport and NcclRankTransports of one communicator, each rank on
//             a thread; built only with the CUDA emulator (MOE_CONFORMANCE_NCCL, the
//             transport_conformance_nccl_emulated_test binary of tests/cuda), whose device
//             memory is host memory, so the ranks' ExpertShards read the rows in place.
//
// One difference is part of the contract: a collective transport cannot lose one member and
// go on. After a passed deadline or a rank gone, NCCL has aborted its communicator and every
// later step fails UNAVAILABLE until the group is formed again (transport/nccl_transport.h);
// the stream transports go on with the other ranks. `Harness::survives_faults` says which.
//
// Each rank computes with a real ExpertShard of k3-mini (64 experts over 3 ranks: 22/21/21);
// every partial handed to Collect's consumer must equal, bit for bit, the same shard run
// directly on the same rows. Ranks can be made slow, made to fail with a code, or taken away.
#include <atomic>
#include <map>
#include <memory>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/numerics.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "model/checkpoint.h"
#include "model/moe_layer.h"
#include "server/control/rank_sessions.h"
#include "tests/testing/test_checkpoints.h"
#include "transport/grpc_transport.h"
#include "transport/loopback_transport.h"
#include "transport/membership.h"
#ifdef MOE_CONFORMANCE_NCCL
#include "kernels/cuda/cuda_backend.h"
#include "transport/nccl_transport.h"
#endif

namespace moe {
namespace {

constexpr int kRanks = 3;

// How a rank misbehaves; set by the test, read by the rank for each step.
struct RankBehavior {
  std::atomic<int> delay_ms{0};
  std::atomic<int> fail_code{0};  // absl::StatusCode to reply with; 0 = compute
  std::atomic<bool> gone{false};  // loopback: the rank is unreachable
};

// The shards of both layers for every rank, and what a rank does with a step.
// Every step of the suite names a placement generation of its own (wide, to see truncation).
uint64_t PlacementGenerationOf(uint64_t step_id) { return (step_id << 33) + 7; }

class Ranks {
 public:
  Ranks() {
    checkpoint_ = std::move(*Checkpoint::Open(testing::TestCheckpoint("k3-mini")));
    placement_ = ExpertPlacement::Contiguous(checkpoint_->config().routing.num_experts, kRanks);
    for (int layer : checkpoint_->layers())
      for (int r = 0; r < kRanks; ++r) {
        auto weights = checkpoint_->LoadExperts(layer, placement_.rank_experts[r]);
        EXPECT_TRUE(weights.ok());
        shards_[{layer, r}] =
            std::move(*ExpertShard::Create(checkpoint_->config(), *weights, &backend_));
      }
  }
  const MoeConfig& config() const { return checkpoint_->config(); }
  std::vector<int> layers() const { return checkpoint_->layers(); }
  int local_experts(int rank) const {
    return static_cast<int>(placement_.rank_experts[rank].size());
  }
  RankBehavior& behavior(int rank) { return behavior_[rank]; }

  // Rank `rank`'s answer to rows of `layer`, as its process would compute it.
  absl::Status Compute(int layer, int rank, ActivationView rows, const RowAssignments& a,
                       Precision p, PartialView partial) {
    RankBehavior& b = behavior_[rank];
    if (b.delay_ms > 0) absl::SleepFor(absl::Milliseconds(b.delay_ms.load()));
    if (b.gone) return absl::UnavailableError(absl::StrCat("rank ", rank, " is gone"));
    if (b.fail_code != 0)
      return absl::Status(static_cast<absl::StatusCode>(b.fail_code.load()), "injected failure");
    return shards_.at({layer, rank})->Compute(rows, a, p, partial);
  }
  // The same rows computed directly: what the transport must hand over.
  std::vector<double> Expected(int layer, int rank, ActivationView rows, const RowAssignments& a,
                               Precision p) {
    std::vector<double> out(rows.rows * rows.cols);
    PartialView view(out.data(), rows.rows, rows.cols, rows.cols);
    EXPECT_TRUE(shards_.at({layer, rank})->Compute(rows, a, p, view).ok());
    return out;
  }
  CpuBackend& backend() { return backend_; }

  // A rank process's loop: Receive, compute, Reply, until the transport ends. A step whose
  // placement generation did not come through unchanged fails (wire transports; the loopback's
  // in-process shards are of one placement).
  void Serve(int rank, RankTransport& transport) {
    Workspace workspace(&backend_);
    for (;;) {
      auto step = transport.Receive();
      if (!step.ok()) return;
      auto partial = workspace.Partial(0, step->rows.rows, step->rows.cols);
      ASSERT_TRUE(partial.ok());
      const absl::Status s = step->placement_generation != PlacementGenerationOf(step->step_id)
                                 ? absl::InvalidArgumentError(absl::StrCat(
                                       "placement generation ", step->placement_generation,
                                       " of step ", step->step_id, " came through changed"))
                                 : Compute(step->layer, rank, step->rows, step->assignments,
                                           step->precision, *partial);
      const absl::StatusOr<ConstPartialView> result =
          s.ok() ? absl::StatusOr<ConstPartialView>(ConstPartialView(*partial))
                 : absl::StatusOr<ConstPartialView>(s);
      if (!transport.Reply(step->step_id, result, RankStepStats{}).ok()) return;
    }
  }

 private:
  CpuBackend backend_{CpuBackendOptions{1, ""}};
  std::unique_ptr<Checkpoint> checkpoint_;
  ExpertPlacement placement_;
  std::map<std::pair<int, int>, std::unique_ptr<ExpertShard>> shards_;
  RankBehavior behavior_[kRanks];
};

// One implementation under test: its gateway side, and a way to take a rank away.
class Harness {
 public:
  virtual ~Harness() = default;
  virtual GatewayTransport& gateway() = 0;
  virtual void KillRank(int rank) = 0;
  // False: after a passed deadline or a rank gone, later steps fail UNAVAILABLE (NCCL).
  virtual bool survives_faults() const { return true; }
};

class LoopbackHarness final : public Harness {
 public:
  explicit LoopbackHarness(Ranks& ranks) : ranks_(ranks), transport_(&ranks.backend()) {
    for (int layer : ranks.layers())
      for (int r = 0; r < kRanks; ++r)
        transport_.AddRank(
            layer, r, [this, layer, r](const RankPart& part, Precision p, PartialView partial) {
              return ranks_.Compute(layer, r, part.rows, *part.assignments, p, partial);
            });
  }
  GatewayTransport& gateway() override { return transport_; }
  void KillRank(int rank) override { ranks_.behavior(rank).gone = true; }

 private:
  Ranks& ranks_;
  LoopbackTransport transport_;
};

// The gateway's Exchange handler, minus registration: the hello names the rank; the control
// plane's RankSessions run the stream (liveness, membership), the transport only moves steps.
class ExchangeOnly final : public moe::v1::internal::RankControl::Service {
 public:
  explicit ExchangeOnly(RankSessions* sessions) : sessions_(sessions) {}
  grpc::Status Exchange(grpc::ServerContext* context, ExchangeServerStream* stream) override {
    moe::v1::internal::RankToGateway hello;
    if (!stream->Read(&hello) || !hello.has_hello())
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "expected a hello");
    const absl::Status s = sessions_->Serve(hello.hello().rank(), stream, context);
    return s.ok() ? grpc::Status::OK
                  : grpc::Status(grpc::StatusCode::UNAVAILABLE, std::string(s.message()));
  }

 private:
  RankSessions* sessions_;
};

class GrpcHarness final : public Harness {
 public:
  explicit GrpcHarness(Ranks& ranks)
      : ranks_(ranks),
        membership_(kRanks),
        sessions_(&membership_, LivenessOptions{}),
        gateway_(kRanks, &gateway_backend_, &sessions_),
        service_(&sessions_) {
    // As the gateway wires them (server/gateway/gateway.cc): results to the data plane, and
    // the membership told to it.
    sessions_.SetHandlers({nullptr, [this](int rank, moe::v1::internal::StepResult result) {
                             gateway_.OnResult(rank, std::move(result));
                           }});
    membership_.Subscribe([this](int rank, bool up, const std::string& why) {
      if (up) {
        gateway_.RankUp(rank);
      } else {
        gateway_.RankDown(rank, why);
      }
    });
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
    EXPECT_NE(server_, nullptr);
    for (int r = 0; r < kRanks; ++r) rank_threads_.emplace_back([this, r] { RunRank(r); });
    // Up at the gateway, and each rank's transport in place (a stray result needs it).
    const absl::Time deadline = absl::Now() + absl::Seconds(20);
    auto all_in = [this] {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto* t : rank_transports_)
        if (t == nullptr) return false;
      return membership_.num_up() == kRanks;
    };
    while (!all_in() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(10));
    EXPECT_TRUE(all_in());
  }
  ~GrpcHarness() override {
    for (int r = 0; r < kRanks; ++r) KillRank(r);
    for (auto& t : rank_threads_) t.join();
    sessions_.CloseAll();
    server_->Shutdown(absl::ToChronoTime(absl::Now()));
  }
  GatewayTransport& gateway() override { return gateway_; }
  GrpcGatewayTransport& grpc_gateway() { return gateway_; }
  // Rank `rank` sends a result for a step it was never given (a confused or hostile peer).
  void SendStrayResult(int rank, uint64_t step_id) {
    std::vector<double> zeros(8, 0.0);
    std::lock_guard<std::mutex> lock(mu_);
    ASSERT_NE(rank_transports_[rank], nullptr);
    EXPECT_TRUE(rank_transports_[rank]
                    ->Reply(step_id, ConstPartialView(zeros.data(), 1, 8, 8), RankStepStats{})
                    .ok());
  }
  void KillRank(int rank) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (rank_transports_[rank] != nullptr) rank_transports_[rank]->Cancel();
    killed_[rank] = true;
  }

 private:
  void RunRank(int rank) {
    auto stub = moe::v1::internal::RankControl::NewStub(
        grpc::CreateChannel(absl::StrCat("127.0.0.1:", port_), grpc::InsecureChannelCredentials()));
    auto context = std::make_unique<grpc::ClientContext>();
    auto stream = stub->Exchange(context.get());
    moe::v1::internal::RankToGateway hello;
    hello.mutable_hello()->set_rank(rank);
    ASSERT_TRUE(stream->Write(hello));
    GrpcRankTransport transport(std::move(context), std::move(stream), &ranks_.backend());
    {
      std::lock_guard<std::mutex> lock(mu_);
      rank_transports_[rank] = &transport;
      if (killed_[rank]) transport.Cancel();
    }
    ranks_.Serve(rank, transport);
    std::lock_guard<std::mutex> lock(mu_);
    rank_transports_[rank] = nullptr;
  }

  Ranks& ranks_;
  CpuBackend gateway_backend_{CpuBackendOptions{1, ""}};
  Membership membership_;
  RankSessions sessions_;
  GrpcGatewayTransport gateway_;
  ExchangeOnly service_;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
  std::mutex mu_;
  GrpcRankTransport* rank_transports_[kRanks] = {};  // guarded by mu_
  bool killed_[kRanks] = {};                         // guarded by mu_
  std::vector<std::thread> rank_threads_;
};

#ifdef MOE_CONFORMANCE_NCCL
// One communicator of kRanks ranks + the gateway, every member on a thread of this process.
class NcclHarness final : public Harness {
 public:
  explicit NcclHarness(Ranks& ranks) : ranks_(ranks) {
    setenv("MOE_EMU_DEVICES", "4", 1);  // the gateway's device 0 and one per rank
    auto id = NewNcclUniqueId();
    EXPECT_TRUE(id.ok()) << id.status();
    auto backend = CudaBackend::Create(CudaBackendOptions{});
    EXPECT_TRUE(backend.ok()) << backend.status();
    gateway_backend_ = std::move(*backend);
    for (int r = 0; r < kRanks; ++r) rank_threads_.emplace_back([this, r, id] { RunRank(r, *id); });
    NcclGatewayOptions options;
    options.num_ranks = kRanks;
    options.unique_id = *id;
    options.backend = gateway_backend_.get();
    options.init_timeout = absl::Seconds(30);
    options.drain_timeout = absl::Seconds(5);
    auto gateway = NcclGatewayTransport::Create(options);
    EXPECT_TRUE(gateway.ok()) << gateway.status();
    gateway_ = std::move(*gateway);
  }
  ~NcclHarness() override {
    shutting_down_ = true;
    if (gateway_ != nullptr) (void)gateway_->Shutdown();  // the ranks' Receive: CANCELLED
    for (int r = 0; r < kRanks; ++r) KillRank(r);
    for (auto& t : rank_threads_) t.join();
    gateway_.reset();
  }
  GatewayTransport& gateway() override { return *gateway_; }
  // The rank leaves the communicator, and the liveness verdict reaches the gateway, as
  // Gateway::OnRankState passes it on in the service.
  void KillRank(int rank) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      killed_[rank] = true;
      if (rank_transports_[rank] != nullptr) rank_transports_[rank]->Cancel();
    }
    if (gateway_ != nullptr && !shutting_down_) gateway_->RankDown(rank, "is gone (test)");
  }
  bool survives_faults() const override { return false; }

 private:
  void RunRank(int rank, const std::string& id) {
    CudaBackendOptions device;
    device.device = 1 + rank;  // a device of its own, as in a deployment (MOE_EMU_DEVICES)
    auto backend = CudaBackend::Create(device);
    ASSERT_TRUE(backend.ok()) << backend.status();
    NcclRankOptions options;
    options.rank = rank;
    options.num_ranks = kRanks;
    options.unique_id = id;
    options.backend = backend->get();
    options.init_timeout = absl::Seconds(30);
    auto created = NcclRankTransport::Create(options);
    ASSERT_TRUE(created.ok()) << created.status();
    std::unique_ptr<NcclRankTransport> transport = std::move(*created);
    {
      std::lock_guard<std::mutex> lock(mu_);
      rank_transports_[rank] = transport.get();
      if (killed_[rank]) transport->Cancel();
    }
    ranks_.Serve(rank, *transport);  // host memory: the emulator's device memory too
    std::lock_guard<std::mutex> lock(mu_);
    rank_transports_[rank] = nullptr;
  }

  Ranks& ranks_;
  std::unique_ptr<CudaBackend> gateway_backend_;
  std::unique_ptr<NcclGatewayTransport> gateway_;
  std::atomic<bool> shutting_down_{false};
  std::mutex mu_;
  NcclRankTransport* rank_transports_[kRanks] = {};  // guarded by mu_
  bool killed_[kRanks] = {};                         // guarded by mu_
  std::vector<std::thread> rank_threads_;
};
#endif  // MOE_CONFORMANCE_NCCL

// One step's rows and assignments for some ranks, random but reproducible.
struct StepData {
  std::vector<ActivationRows> rows;  // per part, stored in the step's precision (as gathered)
  std::vector<RowAssignments> assignments;
  StepDispatch dispatch;
};

std::atomic<uint64_t> g_step_ids{1};

std::unique_ptr<StepData> MakeStep(Ranks& ranks, int layer, const std::vector<int>& to_ranks,
                                   uint32_t seed, Precision p = Precision::kBF16) {
  auto step = std::make_unique<StepData>();
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> gate(0.05f, 1.0f);
  const int64_t D = ranks.config().expert_input_size();
  step->rows.resize(to_ranks.size());
  step->assignments.resize(to_ranks.size());
  step->dispatch.step_id = g_step_ids.fetch_add(1);
  step->dispatch.placement_generation = PlacementGenerationOf(step->dispatch.step_id);
  step->dispatch.layer = layer;
  step->dispatch.precision = p;
  for (size_t i = 0; i < to_ranks.size(); ++i) {
    const int r = to_ranks[i];
    const int64_t m = 1 + static_cast<int64_t>(rng() % 40);
    std::vector<float> values(m * D);
    for (float& v : values) v = normal(rng);
    step->rows[i] = ActivationRows::FromFloats(p, values.data(), m, D);
    RowAssignments& a = step->assignments[i];
    const int E = ranks.local_experts(r);
    for (int64_t row = 0; row < m; ++row) {
      const int first = static_cast<int>(rng() % E);
      a.local_experts.push_back(first);
      a.gates.push_back(gate(rng));
      if (rng() % 2 == 0 && E > 1) {
        a.local_experts.push_back((first + 1 + static_cast<int>(rng() % (E - 1))) % E);
        a.gates.push_back(gate(rng));
      }
      a.offsets.push_back(static_cast<int32_t>(a.local_experts.size()));
    }
  }
  for (size_t i = 0; i < to_ranks.size(); ++i)
    step->dispatch.parts.push_back(
        {to_ranks[i], ActivationView(step->rows[i]), &step->assignments[i]});
  return step;
}

// Send + Collect; every partial checked against the direct computation, and the bytes the
// transport counted: nothing for loopback, at least the payload for a wire.
absl::Status RunStep(GatewayTransport& transport, Ranks& ranks, const StepData& step,
                     absl::Duration timeout = absl::Seconds(30)) {
  if (absl::Status s = transport.Send(step.dispatch); !s.ok()) return s;
  std::vector<int> seen;
  const bool wire = transport.name() != "loopback";
  absl::Status s = transport.Collect(
      step.dispatch, absl::Now() + timeout,
      [&](size_t i, ConstPartialView partial, const RankStepStats& stats) {
        const RankPart& part = step.dispatch.parts[i];
        seen.push_back(part.rank);
        const int64_t cells = part.rows.rows * part.rows.cols;
        const int64_t row_bytes = static_cast<int64_t>(ElementBytes(step.dispatch.precision));
        if (wire) {
          EXPECT_GE(stats.bytes_sent, cells * row_bytes) << "rank " << part.rank;
          EXPECT_LT(stats.bytes_sent, cells * row_bytes + part.rows.rows * 64 + 1024);
          EXPECT_GE(stats.bytes_received, cells * 8) << "rank " << part.rank;
          EXPECT_LT(stats.bytes_received, cells * 8 + 1024);
        } else {
          EXPECT_EQ(stats.bytes_sent, 0);
          EXPECT_EQ(stats.bytes_received, 0);
        }
        const auto want = ranks.Expected(step.dispatch.layer, part.rank, part.rows,
                                         *part.assignments, step.dispatch.precision);
        std::vector<double> got(partial.rows * partial.cols);
        for (int64_t r = 0; r < partial.rows; ++r)
          for (int64_t c = 0; c < partial.cols; ++c)
            got[r * partial.cols + c] = partial.data[r * partial.stride + c];
        EXPECT_EQ(got, want) << "step " << step.dispatch.step_id << " rank " << part.rank;
        return absl::OkStatus();
      });
  if (!s.ok()) {
    transport.Abandon(step.dispatch.step_id);
    return s;
  }
  std::vector<int> want_order;
  for (const RankPart& part : step.dispatch.parts) want_order.push_back(part.rank);
  EXPECT_EQ(seen, want_order) << "partials must come in ascending rank order";
  return absl::OkStatus();
}

class TransportContract : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (GetParam() == "loopback") harness_ = std::make_unique<LoopbackHarness>(ranks_);
    if (GetParam() == "grpc") harness_ = std::make_unique<GrpcHarness>(ranks_);
#ifdef MOE_CONFORMANCE_NCCL
    if (GetParam() == "nccl") harness_ = std::make_unique<NcclHarness>(ranks_);
#endif
    ASSERT_NE(harness_, nullptr) << GetParam();
  }
  void TearDown() override { harness_.reset(); }
  GatewayTransport& transport() { return harness_->gateway(); }

  Ranks ranks_;
  std::unique_ptr<Harness> harness_;
};

TEST_P(TransportContract, StepsOfEveryLayerInFlightAtOnce) {
  // One caller per served layer, as the batcher runs them; both precisions.
  std::vector<std::thread> callers;
  std::atomic<int> failures{0};
  for (int layer : ranks_.layers())
    callers.emplace_back([&, layer] {
      for (int i = 0; i < 8; ++i) {
        const Precision p = i % 2 ? Precision::kFP32 : Precision::kBF16;
        auto step = MakeStep(ranks_, layer, {0, 1, 2}, static_cast<uint32_t>(layer * 100 + i), p);
        const absl::Status s = RunStep(transport(), ranks_, *step);
        if (!s.ok()) {
          ADD_FAILURE() << "layer " << layer << " step " << i << ": " << s;
          ++failures;
        }
      }
    });
  for (auto& c : callers) c.join();
  EXPECT_EQ(failures.load(), 0);
  // Ranks with no rows get no part; a step to one rank only.
  auto single = MakeStep(ranks_, ranks_.layers().front(), {2}, 7);
  EXPECT_TRUE(RunStep(transport(), ranks_, *single).ok());
}

TEST_P(TransportContract, RankFailuresMapToTheSameCallerCodes) {
  const int layer = ranks_.layers().front();
  const std::pair<absl::StatusCode, absl::StatusCode> cases[] = {
      {absl::StatusCode::kInternal, absl::StatusCode::kUnavailable},
      {absl::StatusCode::kDataLoss, absl::StatusCode::kUnavailable},
      {absl::StatusCode::kNotFound, absl::StatusCode::kNotFound},
      {absl::StatusCode::kResourceExhausted, absl::StatusCode::kResourceExhausted},
  };
  for (const auto& [rank_code, caller_code] : cases) {
    ranks_.behavior(1).fail_code = static_cast<int>(rank_code);
    auto step = MakeStep(ranks_, layer, {0, 1, 2}, 11);
    const absl::Status s = RunStep(transport(), ranks_, *step);
    EXPECT_EQ(s.code(), caller_code) << s;
    EXPECT_NE(s.message().find("rank 1"), absl::string_view::npos) << s;
  }
  ranks_.behavior(1).fail_code = 0;
  auto step = MakeStep(ranks_, layer, {0, 1, 2}, 12);
  EXPECT_TRUE(RunStep(transport(), ranks_, *step).ok()) << "a failed step leaves no trace";
}

TEST_P(TransportContract, RowsNotStoredInTheStepsPrecisionAreRefusedBeforeAnythingMoves) {
  const int layer = ranks_.layers().front();
  auto bf16_rows = MakeStep(ranks_, layer, {0, 2}, 13, Precision::kBF16);
  bf16_rows->dispatch.precision = Precision::kFP32;
  auto fp32_rows = MakeStep(ranks_, layer, {1}, 14, Precision::kFP32);
  fp32_rows->dispatch.precision = Precision::kBF16;
  for (const StepData* step : {bf16_rows.get(), fp32_rows.get()}) {
    const absl::Status s = transport().Send(step->dispatch);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find("rows are"), absl::string_view::npos) << s;
  }
  auto step = MakeStep(ranks_, layer, {0, 1, 2}, 15);
  EXPECT_TRUE(RunStep(transport(), ranks_, *step).ok()) << "a refused step leaves no trace";
}

TEST_P(TransportContract, ADeadlinePassedFailsTheStepAndItsLateResultIsDropped) {
  const int layer = ranks_.layers().front();
  ranks_.behavior(0).delay_ms = 600;
  auto slow = MakeStep(ranks_, layer, {0, 1}, 21);
  const absl::Time t0 = absl::Now();
  const absl::Status s = RunStep(transport(), ranks_, *slow, absl::Milliseconds(150));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_LT(absl::Now() - t0, absl::Milliseconds(600 + 1000));
  ranks_.behavior(0).delay_ms = 0;
  absl::SleepFor(absl::Milliseconds(700));  // the abandoned step's result arrives, unwanted
  auto next = MakeStep(ranks_, layer, {0, 1}, 22);
  const absl::Status after = RunStep(transport(), ranks_, *next);
  if (harness_->survives_faults()) {
    EXPECT_TRUE(after.ok()) << after;
  } else {
    EXPECT_EQ(after.code(), absl::StatusCode::kUnavailable) << "the communicator is aborted";
  }
}

TEST_P(TransportContract, ARankGoneMidStepFailsItWithUnavailable) {
  const int layer = ranks_.layers().back();
  ranks_.behavior(2).delay_ms = 500;
  auto step = MakeStep(ranks_, layer, {0, 1, 2}, 31);
  ASSERT_TRUE(transport().Send(step->dispatch).ok());
  std::thread killer([&] {
    absl::SleepFor(absl::Milliseconds(100));
    harness_->KillRank(2);
  });
  const absl::Time t0 = absl::Now();
  const absl::Status s = transport().Collect(
      step->dispatch, absl::Now() + absl::Seconds(20),
      [](size_t, ConstPartialView, const RankStepStats&) { return absl::OkStatus(); });
  killer.join();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_NE(s.message().find("rank 2"), absl::string_view::npos) << s;
  EXPECT_LT(absl::Now() - t0, absl::Seconds(3)) << "not the 20 s deadline";
  transport().Abandon(step->dispatch.step_id);
  ranks_.behavior(2).delay_ms = 0;
  // The other ranks still serve (a stream transport), or the group must form again (NCCL).
  auto rest = MakeStep(ranks_, layer, {0, 1}, 32);
  const absl::Status after = RunStep(transport(), ranks_, *rest);
  if (harness_->survives_faults()) {
    EXPECT_TRUE(after.ok()) << after;
  } else {
    EXPECT_EQ(after.code(), absl::StatusCode::kUnavailable) << after;
  }
}

TEST_P(TransportContract, ARankToldDownFailsItsStepsAndOneToldUpIsServedAgain) {
  // The control plane alone decides who is up (server/control): a hung rank is marked down
  // when its liveness times out, a returning one up when its exchange opens. The data plane is
  // told, and must act on it at once: the steps waiting on the rank fail now, not at their
  // deadline, and once the rank is up again it gets steps as before.
  const int layer = ranks_.layers().front();
  ranks_.behavior(2).delay_ms = 400;  // the step is still at rank 2 when it is told down
  auto step = MakeStep(ranks_, layer, {0, 1, 2}, 51);
  ASSERT_TRUE(transport().Send(step->dispatch).ok());
  std::thread control([&] {
    absl::SleepFor(absl::Milliseconds(100));
    transport().RankDown(2, "sent nothing for 3000 ms (test)");
  });
  const absl::Time t0 = absl::Now();
  const absl::Status s = transport().Collect(
      step->dispatch, absl::Now() + absl::Seconds(20),
      [](size_t, ConstPartialView, const RankStepStats&) { return absl::OkStatus(); });
  control.join();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_NE(s.message().find("rank 2"), absl::string_view::npos) << s;
  EXPECT_LT(absl::Now() - t0, absl::Seconds(3)) << "not the 20 s deadline";
  transport().Abandon(step->dispatch.step_id);
  ranks_.behavior(2).delay_ms = 0;
  absl::SleepFor(absl::Milliseconds(500));  // the step's late answer comes, and is dropped
  // While it is down, a step that needs it fails; one that does not is served (stream
  // transports) or finds the group gone (NCCL).
  auto needs_it = MakeStep(ranks_, layer, {0, 2}, 52);
  EXPECT_EQ(RunStep(transport(), ranks_, *needs_it).code(), absl::StatusCode::kUnavailable);
  auto without_it = MakeStep(ranks_, layer, {0, 1}, 53);
  const absl::Status others = RunStep(transport(), ranks_, *without_it);
  transport().RankUp(2);
  auto all = MakeStep(ranks_, layer, {0, 1, 2}, 54);
  const absl::Status back = RunStep(transport(), ranks_, *all);
  if (harness_->survives_faults()) {
    EXPECT_TRUE(others.ok()) << others;
    EXPECT_TRUE(back.ok()) << "a rank told up is served again, bit for bit: " << back;
  } else {
    EXPECT_EQ(others.code(), absl::StatusCode::kUnavailable) << "the communicator is aborted";
    EXPECT_EQ(back.code(), absl::StatusCode::kUnavailable) << "it needs a new group";
  }
}

#ifndef MOE_CONFORMANCE_NCCL
// gRPC only: what a rank sends is only kept when the gateway awaits it.
TEST(GrpcTransportTest, ResultsForStepsNotAwaitedAreDroppedAndCounted) {
  Ranks ranks;
  GrpcHarness harness(ranks);
  const int layer = ranks.layers().front();
  std::atomic<int> reported[3] = {0, 0, 0};  // what the gateway's metrics hear, per rank
  harness.grpc_gateway().SetDroppedResultCallback([&](int rank) { reported[rank]++; });
  for (uint64_t stray = 1'000'000; stray < 1'000'100; ++stray) harness.SendStrayResult(1, stray);
  // An abandoned step's late result is dropped the same way.
  ranks.behavior(0).delay_ms = 300;
  auto slow = MakeStep(ranks, layer, {0}, 41);
  EXPECT_EQ(RunStep(harness.gateway(), ranks, *slow, absl::Milliseconds(50)).code(),
            absl::StatusCode::kDeadlineExceeded);
  ranks.behavior(0).delay_ms = 0;
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  auto all_reported = [&] { return reported[0] + reported[1] + reported[2] >= 101; };
  while ((harness.grpc_gateway().dropped_results() < 101 || !all_reported()) &&
         absl::Now() < deadline)
    absl::SleepFor(absl::Milliseconds(10));
  EXPECT_EQ(harness.grpc_gateway().dropped_results(), 101);
  EXPECT_EQ(reported[0].load(), 1);  // the abandoned step's late result
  EXPECT_EQ(reported[1].load(), 100);
  EXPECT_EQ(reported[2].load(), 0);
  auto next = MakeStep(ranks, layer, {0, 1, 2}, 42);
  EXPECT_TRUE(RunStep(harness.gateway(), ranks, *next).ok()) << "the stream is unharmed";
}
#endif

#ifdef MOE_CONFORMANCE_NCCL
// Several gateways over one rank pool under NCCL: one communicator per gateway, each with every
// rank. A rank waiting in two communicators at once can deadlock (NCCL's kernels of different
// communicators on one device need not run concurrently; the emulator, which runs a device's
// streams in order, deadlocked within a few steps), so under NCCL a rank serves one gateway at a
// time (RankWorker) and the others stand by: here gateway A serves, goes, and gateway B's
// communicator forms with the same ranks and serves bit for bit; a rank that dies, told down by
// the control plane, fails B's steps that need it at once.
TEST(NcclTwoGatewaysTest, AStandbyGatewayTakesTheRanksOver) {
  setenv("MOE_EMU_DEVICES", "4", 1);  // the gateway's device 0 and one per rank
  Ranks ranks;
  for (int g = 0; g < 2; ++g) {
    auto id = NewNcclUniqueId();
    ASSERT_TRUE(id.ok()) << id.status();
    std::mutex mu;
    NcclRankTransport* members[kRanks] = {};  // guarded by mu
    std::vector<std::thread> rank_threads;
    for (int r = 0; r < kRanks; ++r)
      rank_threads.emplace_back([&, r] {
        CudaBackendOptions device;
        device.device = 1 + r;
        auto backend = CudaBackend::Create(device);
        ASSERT_TRUE(backend.ok()) << backend.status();
        NcclRankOptions options;
        options.rank = r;
        options.num_ranks = kRanks;
        options.unique_id = *id;
        options.backend = backend->get();
        options.init_timeout = absl::Seconds(30);
        auto created = NcclRankTransport::Create(options);
        ASSERT_TRUE(created.ok()) << created.status();
        {
          std::lock_guard<std::mutex> lock(mu);
          members[r] = created->get();
        }
        ranks.Serve(r, **created);
        std::lock_guard<std::mutex> lock(mu);
        members[r] = nullptr;
      });
    auto backend = CudaBackend::Create(CudaBackendOptions{});
    ASSERT_TRUE(backend.ok()) << backend.status();
    NcclGatewayOptions options;
    options.num_ranks = kRanks;
    options.unique_id = *id;
    options.backend = backend->get();
    options.init_timeout = absl::Seconds(30);
    options.drain_timeout = absl::Seconds(5);
    auto gateway = NcclGatewayTransport::Create(options);
    ASSERT_TRUE(gateway.ok()) << gateway.status();
    for (int i = 0; i < 4; ++i) {
      const int layer = ranks.layers()[i % ranks.layers().size()];
      auto step = MakeStep(ranks, layer, {0, 1, 2}, static_cast<uint32_t>(900 + 10 * g + i));
      EXPECT_TRUE(RunStep(**gateway, ranks, *step).ok()) << "gateway " << g << " step " << i;
    }
    if (g == 1) {
      // Rank 2 dies under the second gateway: it leaves the communicator, and the control plane
      // tells the gateway, whose step waiting on it fails at once.
      {
        std::lock_guard<std::mutex> lock(mu);
        if (members[2] != nullptr) members[2]->Cancel();
      }
      (*gateway)->RankDown(2, "is gone (test)");
      auto step = MakeStep(ranks, ranks.layers().front(), {0, 2}, 950);
      const absl::Time t0 = absl::Now();
      EXPECT_EQ(RunStep(**gateway, ranks, *step, absl::Seconds(20)).code(),
                absl::StatusCode::kUnavailable);
      EXPECT_LT(absl::Now() - t0, absl::Seconds(3)) << "not the deadline";
    }
    // The gateway goes (shut down here; killed, its ranks' exchange streams end the same way).
    (void)(*gateway)->Shutdown();
    {
      std::lock_guard<std::mutex> lock(mu);
      for (auto* member : members)
        if (member != nullptr) member->Cancel();
    }
    for (auto& t : rank_threads) t.join();
  }
}

INSTANTIATE_TEST_SUITE_P(Transports, TransportContract, ::testing::Values("nccl"),
                         [](const auto& param_info) { return param_info.param; });
#else
INSTANTIATE_TEST_SUITE_P(Transports, TransportContract, ::testing::Values("loopback", "grpc"),
                         [](const auto& param_info) { return param_info.param; });
#endif

}  // namespace
}  // namespace moe
