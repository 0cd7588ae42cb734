// The NCCL transport between two processes: this test process is the gateway (NCCL rank 1),
// a child process (this executable again, main() running RunRankProcess) is expert
// rank 0. Payloads say where they came from (DeepEP style): the rank answers
// partial[i][c] = 2 * row[i][c] + sum of row i's gates + step_id, which the gateway checks
// exactly, element by element.
//
// One GPU: NCCL refuses two members on one device ("Duplicate GPU detected") unless they
// claim different hosts, so on one-GPU machines each process gets its own NCCL_HOSTID and
// they talk through NCCL's socket transport on the loopback interface. If NCCL still refuses
// (ncclInvalidUsage), the test says so and skips. Two or more GPUs: gateway on device 0,
// rank on device 1, no tricks.
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "core/status.h"
#include "gtest/gtest.h"
#include "kernels/cuda/cuda_backend.h"
#include "tests/cuda/cuda_test_util.h"
#include "transport/nccl_transport.h"

extern char** environ;

namespace moe {
namespace {

using testing::DeviceArray;

constexpr int kErrorLayer = 99;  // the rank answers NOT_FOUND
constexpr int kSlowLayer = 98;   // the rank answers after 3 s

bool SingleGpu() { return CudaDeviceCount() < 2; }

// NCCL reads its environment at its first call: set it before anything else touches NCCL.
void SetGatewayEnvironment() {
  setenv("NCCL_SOCKET_IFNAME", getenv("NCCL_SOCKET_IFNAME") ? getenv("NCCL_SOCKET_IFNAME") : "lo",
         1);
  if (SingleGpu()) setenv("NCCL_HOSTID", "moe-nccl-test-gateway", 1);
}

// Starts this executable as the rank process of `scenario`.
pid_t SpawnRank(const std::string& scenario, const std::string& unique_id) {
  char exe[4096];
  const ssize_t len = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  if (len <= 0) return -1;
  exe[len] = '\0';
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    const absl::string_view kv(*e);
    if (absl::StartsWith(kv, "NCCL_HOSTID=") || absl::StartsWith(kv, "MOE_NCCL_TEST_")) continue;
    env.emplace_back(kv);
  }
  env.push_back("MOE_NCCL_TEST_ROLE=rank");
  env.push_back("MOE_NCCL_TEST_SCENARIO=" + scenario);
  env.push_back("MOE_NCCL_TEST_ID=" + absl::BytesToHexString(unique_id));
  env.push_back(absl::StrCat("MOE_NCCL_TEST_DEVICE=", SingleGpu() ? 0 : 1));
  if (SingleGpu()) env.push_back("NCCL_HOSTID=moe-nccl-test-rank");
  std::vector<char*> envp;
  for (auto& s : env) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::vector<char*> argv = {exe, nullptr};
  pid_t pid = -1;
  if (posix_spawn(&pid, exe, nullptr, nullptr, argv.data(), envp.data()) != 0) return -1;
  return pid;
}

// The child's exit code, or -1 if it had to be killed after `timeout`.
int WaitChild(pid_t pid, std::chrono::seconds timeout) {
  const auto end = std::chrono::steady_clock::now() + timeout;
  int status = 0;
  while (std::chrono::steady_clock::now() < end) {
    const pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid) return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  kill(pid, SIGKILL);
  waitpid(pid, &status, 0);
  return -1;
}

// The gateway's view of a step for rank 0: rows in device memory (strided) + assignments.
struct StepData {
  std::vector<float> rows;  // [n, stride] host copy, the values sent
  int64_t n = 0, width = 0, stride = 0;
  Precision precision = Precision::kBF16;
  RowAssignments assignments;
  // On the device as a gateway's gather stores them: bf16 bits in a bf16 step, else fp32.
  std::unique_ptr<DeviceArray<float>> device32;
  std::unique_ptr<DeviceArray<uint16_t>> device16;
  ActivationView Rows() const {
    return precision == Precision::kBF16
               ? ActivationView(device16->data(), precision, n, width, stride)
               : ActivationView(device32->data(), precision, n, width, stride);
  }
};

// bf16 steps get bf16 values; fp32 steps values bf16 cannot hold.
StepData MakeStep(CudaBackend* backend, int64_t n, int64_t width, Precision p) {
  StepData s;
  s.n = n;
  s.width = width;
  s.stride = width + 5;
  s.precision = p;
  const bool bf16 = p == Precision::kBF16;
  s.rows.assign(n * s.stride, -1.0f);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t c = 0; c < width; ++c)
      s.rows[i * s.stride + c] = bf16 ? static_cast<float>((i * 7 + c) % 251 - 125)
                                      : static_cast<float>(i) + 1.0f / 3.0f + c * 1e-3f;
  for (int64_t i = 0; i < n; ++i) {
    const int k = static_cast<int>(i % 3) + 1;
    for (int j = 0; j < k; ++j) {
      s.assignments.local_experts.push_back(static_cast<int32_t>((i + j) % 4));
      s.assignments.gates.push_back(0.25f * (j + 1));
    }
    s.assignments.offsets.push_back(static_cast<int32_t>(s.assignments.local_experts.size()));
  }
  if (bf16) {
    std::vector<uint16_t> bits(s.rows.size());
    for (size_t i = 0; i < bits.size(); ++i) bits[i] = FloatToBf16Bits(s.rows[i]);
    s.device16 = std::make_unique<DeviceArray<uint16_t>>(backend, bits);
  } else {
    s.device32 = std::make_unique<DeviceArray<float>>(backend, s.rows);
  }
  return s;
}

double GateSum(const RowAssignments& a, int64_t i) {
  double sum = 0;
  for (int32_t j = a.offsets[i]; j < a.offsets[i + 1]; ++j) sum += a.gates[j];
  return sum;
}

class NcclTransportTest : public ::testing::Test {
 protected:
  // Creates the backend, the id and the rank process, then joins as the gateway. Skips when
  // NCCL refuses the setup.
  void Start(const std::string& scenario) {
    MOE_SKIP_WITHOUT_CUDA();
    SetGatewayEnvironment();
    auto backend = CudaBackend::Create(CudaBackendOptions{});
    ASSERT_TRUE(backend.ok()) << backend.status();
    backend_ = std::move(*backend);
    auto id = NewNcclUniqueId();
    ASSERT_TRUE(id.ok()) << id.status();
    child_ = SpawnRank(scenario, *id);
    ASSERT_GT(child_, 0) << "cannot start the rank process";
    NcclGatewayOptions options;
    options.num_ranks = 1;
    options.unique_id = *id;
    options.backend = backend_.get();
    options.init_timeout = absl::Seconds(60);
    options.drain_timeout = absl::Seconds(10);
    auto gateway = NcclGatewayTransport::Create(options);
    if (!gateway.ok()) {
      WaitChild(child_, std::chrono::seconds(1));
      child_ = -1;
      if (gateway.status().code() == absl::StatusCode::kFailedPrecondition)
        GTEST_SKIP() << "NCCL rejects the gateway and a rank on "
                     << (SingleGpu() ? "one GPU (even with distinct NCCL_HOSTIDs)" : "two GPUs")
                     << ": " << gateway.status();
      FAIL() << gateway.status();
    }
    gateway_ = std::move(*gateway);
  }

  void TearDown() override {
    gateway_.reset();
    if (child_ > 0) {
      const int code = WaitChild(child_, std::chrono::seconds(30));
      EXPECT_EQ(code, 0) << "rank process exit code (-1: killed after 30 s)";
    }
  }

  // Step 1 on the layer the rank answers only after 3 s.
  static StepDispatch SlowStep(StepData& a) {
    StepDispatch d;
    d.step_id = 1;
    d.layer = kSlowLayer;
    d.precision = Precision::kBF16;
    d.parts.push_back({0, a.Rows(), &a.assignments});
    return d;
  }

  // Sends one step to rank 0 and checks every element of its answer.
  void ExchangeAndCheck(uint64_t step_id, Precision p, StepData& s) {
    StepDispatch d;
    d.step_id = step_id;
    d.layer = 1;
    d.precision = p;
    d.parts.push_back({0, s.Rows(), &s.assignments});
    ASSERT_TRUE(gateway_->Send(d).ok());
    int calls = 0;
    const absl::Status st = gateway_->Collect(
        d, absl::Now() + absl::Seconds(30),
        [&](size_t part, ConstPartialView partial, const RankStepStats& stats) -> absl::Status {
          ++calls;
          EXPECT_EQ(part, 0u);
          EXPECT_EQ(partial.rows, s.n);
          EXPECT_EQ(partial.cols, s.width);
          std::vector<double> host(s.n * s.width);
          RETURN_IF_ERROR(
              backend_->CopyToHost(host.data(), partial.data, host.size() * sizeof(double)));
          for (int64_t i = 0; i < s.n; ++i)
            for (int64_t c = 0; c < s.width; ++c) {
              const double want = 2.0 * s.rows[i * s.stride + c] + GateSum(s.assignments, i) +
                                  static_cast<double>(step_id);
              EXPECT_EQ(host[i * s.width + c], want)
                  << "step " << step_id << " (" << i << ", " << c << ")";
            }
          std::set<int32_t> experts(s.assignments.local_experts.begin(),
                                    s.assignments.local_experts.end());
          EXPECT_EQ(stats.active_experts, static_cast<int>(experts.size()));
          EXPECT_EQ(stats.compute_us, 7);
          return absl::OkStatus();
        });
    ASSERT_TRUE(st.ok()) << st;
    EXPECT_EQ(calls, 1);
  }

  std::unique_ptr<CudaBackend> backend_;
  std::unique_ptr<NcclGatewayTransport> gateway_;
  pid_t child_ = -1;
};

TEST(NcclUniqueIdTest, HasTheSizeOfAnNcclUniqueId) {
  SetGatewayEnvironment();
  auto id = NewNcclUniqueId();
  if (!id.ok()) GTEST_SKIP() << "NCCL cannot create a unique id here: " << id.status();
  EXPECT_EQ(id->size(), 128u);
}

TEST_F(NcclTransportTest, StepsErrorsEmptyStepsAndShutdown) {
  Start("steps");
  if (gateway_ == nullptr) return;  // skipped or failed in Start
  EXPECT_EQ(gateway_->name(), "nccl");
  // bf16 rows, strided, a width that is not a multiple of 8.
  StepData a = MakeStep(backend_.get(), 5, 136, Precision::kBF16);
  ExchangeAndCheck(1, Precision::kBF16, a);
  // fp32 rows with values bf16 cannot hold, odd width, one row.
  StepData b = MakeStep(backend_.get(), 1, 77, Precision::kFP32);
  ExchangeAndCheck(2, Precision::kFP32, b);
  StepData c = MakeStep(backend_.get(), 257, 33, Precision::kFP32);
  ExchangeAndCheck(3, Precision::kFP32, c);

  // A step in which the rank gets nothing: headers only, no consume.
  {
    StepDispatch d;
    d.step_id = 4;
    d.layer = 1;
    ASSERT_TRUE(gateway_->Send(d).ok());
    int calls = 0;
    ASSERT_TRUE(gateway_
                    ->Collect(d, absl::Now() + absl::Seconds(30),
                              [&](size_t, ConstPartialView, const RankStepStats&) {
                                ++calls;
                                return absl::OkStatus();
                              })
                    .ok());
    EXPECT_EQ(calls, 0);
  }
  // The rank fails a step: its error comes back, nothing is consumed, the exchange goes on.
  {
    StepDispatch d;
    d.step_id = 5;
    d.layer = kErrorLayer;
    d.parts.push_back({0, a.Rows(), &a.assignments});
    ASSERT_TRUE(gateway_->Send(d).ok());
    int calls = 0;
    const absl::Status st = gateway_->Collect(d, absl::Now() + absl::Seconds(30),
                                              [&](size_t, ConstPartialView, const RankStepStats&) {
                                                ++calls;
                                                return absl::OkStatus();
                                              });
    EXPECT_EQ(st.code(), absl::StatusCode::kNotFound) << st;
    EXPECT_NE(st.message().find("rank 0"), absl::string_view::npos) << st;
    EXPECT_NE(st.message().find("layer 99"), absl::string_view::npos) << st;
    EXPECT_EQ(calls, 0);
  }
  // A second step (another layer's, from another thread) waits for the one in flight instead
  // of failing, and goes once that one is abandoned (or collected).
  {
    StepData e = MakeStep(backend_.get(), 3, 64, Precision::kBF16);
    StepDispatch d;
    d.step_id = 6;
    d.layer = 1;
    d.precision = Precision::kBF16;
    d.parts.push_back({0, e.Rows(), &e.assignments});
    ASSERT_TRUE(gateway_->Send(d).ok());
    StepDispatch next = d;
    next.step_id = 7;
    std::atomic<bool> returned{false};
    absl::Status second;
    std::thread other([&] {
      second = gateway_->Send(next);
      returned = true;
    });
    absl::SleepFor(absl::Milliseconds(200));
    EXPECT_FALSE(returned.load()) << "the second step must wait for the first";
    gateway_->Abandon(6);  // drains the step
    other.join();
    EXPECT_TRUE(second.ok()) << second;
    gateway_->Abandon(7);
    EXPECT_FALSE(gateway_->broken());
  }
  ExchangeAndCheck(9, Precision::kBF16, a);  // odd step: the rank replies from a strided view
  ExchangeAndCheck(10, Precision::kBF16, a);
  EXPECT_TRUE(gateway_->Shutdown().ok());
}

TEST_F(NcclTransportTest, DeadlineAbortsTheCommunicator) {
  Start("deadline");
  if (gateway_ == nullptr) return;
  StepData a = MakeStep(backend_.get(), 2, 64, Precision::kBF16);
  StepDispatch d = SlowStep(a);
  ASSERT_TRUE(gateway_->Send(d).ok());
  const absl::Status st = gateway_->Collect(
      d, absl::Now() + absl::Milliseconds(500),
      [](size_t, ConstPartialView, const RankStepStats&) { return absl::OkStatus(); });
  EXPECT_EQ(st.code(), absl::StatusCode::kDeadlineExceeded) << st;
  EXPECT_TRUE(gateway_->broken());
  d.step_id = 2;
  const absl::Status again = gateway_->Send(d);
  EXPECT_EQ(again.code(), absl::StatusCode::kUnavailable) << again;
  EXPECT_NE(again.message().find("build a new one"), absl::string_view::npos) << again;
}

// The exchange stream's liveness marks the rank down while it computes (3 s): the step fails
// UNAVAILABLE at once, not at its deadline, and the communicator is aborted.
TEST_F(NcclTransportTest, ARankMarkedDownFailsTheStepInFlightAtOnce) {
  Start("deadline");
  if (gateway_ == nullptr) return;
  StepData a = MakeStep(backend_.get(), 2, 64, Precision::kBF16);
  StepDispatch d = SlowStep(a);
  ASSERT_TRUE(gateway_->Send(d).ok());
  std::thread liveness([&] {
    absl::SleepFor(absl::Milliseconds(200));
    gateway_->RankDown(0, "sent nothing for 3000 ms");
  });
  const absl::Time t0 = absl::Now();
  const absl::Status st = gateway_->Collect(
      d, absl::Now() + absl::Seconds(20),
      [](size_t, ConstPartialView, const RankStepStats&) { return absl::OkStatus(); });
  liveness.join();
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << st;
  EXPECT_NE(st.message().find("rank 0 sent nothing for 3000 ms"), absl::string_view::npos) << st;
  EXPECT_LT(absl::Now() - t0, absl::Seconds(2)) << "not the 20 s deadline";
  EXPECT_TRUE(gateway_->broken());
  d.step_id = 2;
  EXPECT_EQ(gateway_->Send(d).code(), absl::StatusCode::kUnavailable);
}

// The rank process (this executable started again by the tests above, with
// MOE_NCCL_TEST_ROLE=rank): not a test, main() runs it instead of the tests. Exits the process
// with 0 on the expected end of its scenario.
[[noreturn]] void RunRankProcess() {
  const std::string scenario = getenv("MOE_NCCL_TEST_SCENARIO");
  const char* hex = getenv("MOE_NCCL_TEST_ID");
  if (hex == nullptr) std::_Exit(10);
  const std::string id = absl::HexStringToBytes(hex);
  CudaBackendOptions bo;
  bo.device = std::atoi(getenv("MOE_NCCL_TEST_DEVICE"));
  auto backend = CudaBackend::Create(bo);
  if (!backend.ok()) {
    std::fprintf(stderr, "rank: %s\n", backend.status().ToString().c_str());
    std::_Exit(11);
  }
  NcclRankOptions options;
  options.rank = 0;
  options.num_ranks = 1;
  options.unique_id = id;
  options.backend = backend->get();
  options.init_timeout = absl::Seconds(60);
  options.step_timeout = absl::Seconds(10);
  auto rank = NcclRankTransport::Create(options);
  if (!rank.ok()) {
    std::fprintf(stderr, "rank: %s\n", rank.status().ToString().c_str());
    std::_Exit(absl::IsFailedPrecondition(rank.status()) ? 0 : 12);  // the gateway skips too
  }
  while (true) {
    auto step = (*rank)->Receive();
    if (absl::IsCancelled(step.status())) std::_Exit(0);  // the gateway shut down
    if (!step.ok()) {
      std::fprintf(stderr, "rank: Receive: %s\n", step.status().ToString().c_str());
      std::_Exit(13);
    }
    if (step->layer == kErrorLayer) {
      const absl::Status s = (*rank)->Reply(
          step->step_id, absl::NotFoundError(absl::StrCat("layer ", kErrorLayer, " not served")),
          {});
      if (!s.ok()) std::_Exit(14);
      continue;
    }
    if (step->layer == kSlowLayer) {
      std::this_thread::sleep_for(std::chrono::seconds(3));
      // The gateway gave up and aborted: any outcome of this reply is fine.
      (*rank)->Reply(step->step_id, ConstPartialView(nullptr, 0, 0, 0), {}).IgnoreError();
      std::_Exit(0);
    }
    const int64_t n = step->rows.rows, width = step->rows.cols;
    // The rows arrive as the gateway sent them: bf16 bits in a bf16 step, else fp32.
    if (step->rows.dtype != step->precision) std::_Exit(17);
    std::vector<float> rows(n * width);
    std::vector<uint16_t> bits(step->rows.dtype == Precision::kBF16 ? n * width : 0);
    void* host = bits.empty() ? static_cast<void*>(rows.data()) : bits.data();
    if (!(*backend)->CopyToHost(host, step->rows.data, n * width * step->rows.element_bytes()).ok())
      std::_Exit(15);
    for (size_t i = 0; i < bits.size(); ++i) rows[i] = Bf16BitsToFloat(bits[i]);
    const int64_t stride = step->step_id % 2 ? width + 3 : width;
    std::vector<double> partial(n * stride, -1.0);
    std::set<int32_t> experts;
    for (int64_t i = 0; i < n; ++i) {
      const double g = GateSum(step->assignments, i);
      for (int64_t c = 0; c < width; ++c)
        partial[i * stride + c] =
            2.0 * rows[i * width + c] + g + static_cast<double>(step->step_id);
    }
    for (int32_t e : step->assignments.local_experts) experts.insert(e);
    DeviceArray<double> device(backend->get(), partial);
    RankStepStats stats;
    stats.compute_us = 7;
    stats.active_experts = static_cast<int>(experts.size());
    const absl::Status s =
        (*rank)->Reply(step->step_id, ConstPartialView(device.data(), n, width, stride), stats);
    if (!s.ok()) {
      std::fprintf(stderr, "rank: Reply: %s\n", s.ToString().c_str());
      std::_Exit(16);
    }
  }
}

}  // namespace
}  // namespace moe

int main(int argc, char** argv) {
  const char* role = getenv("MOE_NCCL_TEST_ROLE");
  if (role != nullptr && std::string(role) == "rank") moe::RunRankProcess();
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
