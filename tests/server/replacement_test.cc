// Live re-placement (MoeDiagnostics/ApplyPlacement): real moe-gateway and moe-rank processes on
// loopback. Ranks load their new experts beside the serving ones, the gateway switches at a step
// boundary and the ranks drop what they lost: callers busy throughout see no failure, and every
// result equals the in-process layer bit for bit (a token's result does not depend on which rank
// computed each expert: fp64 combine).
#include <signal.h>

#include <fstream>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "model/dispatch.h"
#include "tests/server/service_testing.h"
#include "tests/testing/local_cluster.h"
#include "tests/testing/test_checkpoints.h"

namespace moe {
namespace {

using testing::ClusterOptions;
using testing::LocalCluster;

class Diagnostics {
 public:
  explicit Diagnostics(const LocalCluster& cluster, std::string token = "")
      : stub_(moe::v1::MoeDiagnostics::NewStub(
            grpc::CreateChannel(cluster.target(), grpc::InsecureChannelCredentials()))),
        token_(std::move(token)) {}

  grpc::Status Apply(const std::string& placement, moe::v1::ApplyPlacementResponse* response) {
    grpc::ClientContext context;
    if (!token_.empty()) context.AddMetadata("authorization", "Bearer " + token_);
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
    moe::v1::ApplyPlacementRequest request;
    request.set_placement(placement);
    request.set_source("replacement_test");
    return stub_->ApplyPlacement(&context, request, response);
  }
  moe::v1::PlacementAdvice Advice(int layer, int redundant) {
    grpc::ClientContext context;
    moe::v1::GetPlacementAdviceRequest request;
    request.set_layer(layer);
    request.set_redundant_experts(redundant);
    moe::v1::PlacementAdvice advice;
    EXPECT_TRUE(stub_->GetPlacementAdvice(&context, request, &advice).ok());
    return advice;
  }
  double RankBalance(int layer) {
    grpc::ClientContext context;
    moe::v1::GetLoadBalanceRequest request;
    request.set_layer(layer);
    moe::v1::LoadBalanceReport report;
    EXPECT_TRUE(stub_->GetLoadBalance(&context, request, &report).ok());
    return report.rank_balancedness();
  }

 private:
  std::unique_ptr<moe::v1::MoeDiagnostics::Stub> stub_;
  std::string token_;
};

moe::v1::ModelInfo Info(LocalCluster& cluster) {
  grpc::ClientContext context;
  moe::v1::ModelInfo info;
  EXPECT_TRUE(cluster.stub().GetModelInfo(&context, moe::v1::GetModelInfoRequest(), &info).ok());
  return info;
}

struct Traffic {
  std::vector<std::vector<float>> inputs, expected;
};

Traffic MakeTraffic(const std::string& checkpoint, int layer, int n, int64_t tokens) {
  InProcess reference(checkpoint, layer);
  Traffic t;
  for (int i = 0; i < n; ++i) {
    t.inputs.push_back(RandomInput(tokens, reference.config().hidden_size, 500 + i));
    t.expected.push_back(reference.Forward(t.inputs.back()));
  }
  return t;
}

// The skewed router sends most tokens to a few experts, which contiguous ranges put on one
// rank; the EPLB advice (4 redundant replicas) spreads them. Applied live under load.
TEST(ReplacementTest, TheEplbAdviceIsAppliedLiveWithoutAFailedCallBitIdentical) {
  const std::string checkpoint = testing::TestCheckpoint("k3-mini-skewed");
  constexpr int kLayer = 1;
  const Traffic traffic = MakeTraffic(checkpoint, kLayer, 8, 16);
  const int64_t H = static_cast<int64_t>(traffic.inputs[0].size() / 16);
  LocalCluster cluster(
      ClusterOptions{checkpoint, 4, {"--allow-placement-changes", "--balance-window-steps", "64"}});
  ASSERT_TRUE(cluster.Start().ok()) << cluster.Logs();
  Diagnostics diagnostics(cluster);
  EXPECT_EQ(Info(cluster).placement_generation(), 1u);

  double before = 0;
  {
    BusyCallers warm(cluster.stub(), kLayer, traffic.inputs, traffic.expected, 16, H, 1);
    const bool full = warm.WaitForOk(64, absl::Seconds(60));  // the balance window's 64 steps
    warm.Stop();
    ASSERT_EQ(warm.failed() + warm.wrong(), 0) << warm.first_error();
    ASSERT_TRUE(full) << "the balance window must be full";
    before = diagnostics.RankBalance(kLayer);
  }
  const moe::v1::PlacementAdvice advice = diagnostics.Advice(kLayer, 4);
  ASSERT_FALSE(advice.placement().empty());

  BusyCallers callers(cluster.stub(), kLayer, traffic.inputs, traffic.expected, 16, H, 4);
  ASSERT_TRUE(callers.WaitForOk(20, absl::Seconds(60)));
  moe::v1::ApplyPlacementResponse applied;
  const grpc::Status status = diagnostics.Apply(advice.placement(), &applied);
  const int before_change = callers.ok();
  ASSERT_TRUE(callers.WaitForOk(before_change + 20, absl::Seconds(60)));
  callers.Stop();
  ASSERT_TRUE(status.ok()) << status.error_message() << "\n" << cluster.Logs();
  EXPECT_EQ(applied.generation(), 2u);
  EXPECT_EQ(applied.ranks_loaded_size(), 4);
  EXPECT_EQ(applied.ranks_down_size(), 0);
  EXPECT_EQ(callers.failed(), 0) << callers.first_error() << "\n" << cluster.Logs();
  EXPECT_EQ(callers.wrong(), 0);

  // The gateway and every rank serve the advised placement now.
  const moe::v1::ModelInfo info = Info(cluster);
  EXPECT_EQ(info.placement_generation(), 2u);
  auto advised = ExpertPlacement::Parse(info.num_experts(), advice.placement());
  ASSERT_TRUE(advised.ok()) << advised.status();
  ASSERT_EQ(info.ranks_size(), 4);
  for (int r = 0; r < 4; ++r) {
    EXPECT_TRUE(info.ranks(r).ready()) << r;
    EXPECT_EQ(std::vector<int>(info.ranks(r).experts().begin(), info.ranks(r).experts().end()),
              advised->rank_experts[r])
        << "rank " << r;
    EXPECT_FALSE(
        cluster.rank(r).WaitForLog("serving placement generation 2", absl::Seconds(5)).empty())
        << "rank " << r << " dropped the experts it lost\n"
        << cluster.Logs();
  }

  // A window of steps planned with the new placement only: the ranks' load is balanced.
  BusyCallers after(cluster.stub(), kLayer, traffic.inputs, traffic.expected, 16, H, 1);
  const bool full = after.WaitForOk(64, absl::Seconds(60));
  after.Stop();
  ASSERT_EQ(after.failed() + after.wrong(), 0) << after.first_error();
  ASSERT_TRUE(full);
  const double balanced = diagnostics.RankBalance(kLayer);
  EXPECT_GT(balanced, before + 0.1) << "contiguous " << before << ", advised " << balanced;
  std::printf(
      "live re-placement: rank balancedness %.3f -> %.3f (predicted %.3f); %d calls during the "
      "change, none failed, all bit-identical; switched after %.3f s (slowest rank loaded in "
      "%.3f s); p99 of the calls beside it %.1f ms\n",
      before, balanced, advice.predicted_balancedness(), callers.ok(), applied.seconds(),
      applied.load_seconds(), absl::ToDoubleMilliseconds(callers.Latency(0.99)));
}

// --auto-rebalance: the skewed router's load stays unbalanced, so the gateway applies the advice
// by itself, once (the gap), without a failed call.
TEST(ReplacementTest, AutoRebalanceAppliesTheAdviceOnceWhenTheLoadStaysUnbalanced) {
  const std::string checkpoint = testing::TestCheckpoint("k3-mini-skewed");
  const Traffic traffic = MakeTraffic(checkpoint, 1, 8, 16);
  LocalCluster cluster(
      ClusterOptions{checkpoint,
                     4,
                     {"--auto-rebalance", "--auto-rebalance-interval-s", "0.2",
                      "--auto-rebalance-checks", "2", "--balance-window-steps", "32"}});
  ASSERT_TRUE(cluster.Start().ok()) << cluster.Logs();
  BusyCallers callers(cluster.stub(), 1, traffic.inputs, traffic.expected, 16, 640, 2);
  const std::string line =
      cluster.gateway().WaitForLog("serving placement generation 2", absl::Seconds(20));
  absl::SleepFor(absl::Seconds(1));  // more readings: no second change within the gap
  callers.Stop();
  ASSERT_FALSE(line.empty()) << cluster.Logs();
  EXPECT_EQ(callers.failed(), 0) << callers.first_error();
  EXPECT_EQ(callers.wrong(), 0);
  EXPECT_EQ(Info(cluster).placement_generation(), 2u);
  const std::string log = cluster.gateway().Log();
  EXPECT_NE(log.find("auto-rebalance: rank balancedness"), std::string::npos) << log;
  EXPECT_NE(log.find("requested by --auto-rebalance"), std::string::npos) << log;
}

TEST(ReplacementTest, ChangesNeedPermissionAndAPlacementThatFits) {
  const std::string checkpoint = testing::TestCheckpoint("k3-mini");
  moe::v1::ApplyPlacementResponse response;
  {
    LocalCluster cluster(ClusterOptions{checkpoint, 2});
    ASSERT_TRUE(cluster.Start().ok()) << cluster.Logs();
    const grpc::Status s = Diagnostics(cluster).Apply("0-63\n0-63\n", &response);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
    EXPECT_NE(s.error_message().find("--admin-token-file"), std::string::npos);
  }
  // With an admin token, the call must carry it.
  const std::string token_file = ::testing::TempDir() + "/replacement_admin_token";
  std::ofstream(token_file) << "admin-secret-for-the-test\n";
  LocalCluster cluster(ClusterOptions{checkpoint, 2, {"--admin-token-file", token_file}});
  ASSERT_TRUE(cluster.Start().ok()) << cluster.Logs();
  EXPECT_EQ(Diagnostics(cluster, "wrong").Apply("0-63\n0-63\n", &response).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  Diagnostics admin(cluster, "admin-secret-for-the-test");
  for (const char* bad :
       {"0-31\n", "0-31\n32-63\n0-63\n", "0-31\n32-62\n", "0-31\n32-64\n", "zero\n32-63\n"}) {
    const grpc::Status s = admin.Apply(bad, &response);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << absl::CEscape(bad) << ": " << s.error_message();
  }
  EXPECT_EQ(Info(cluster).placement_generation(), 1u) << "nothing changed";
  // Every expert on both ranks, then back: generations 2 and 3, bit-identical throughout.
  const Traffic traffic = MakeTraffic(checkpoint, 1, 2, 3);
  for (const char* placement : {"0-63\n0-63\n", "32-63\n0-31\n"}) {
    const grpc::Status s = admin.Apply(placement, &response);
    ASSERT_TRUE(s.ok()) << s.error_message();
    for (size_t i = 0; i < traffic.inputs.size(); ++i) {
      CallResult r = Call(cluster.stub(), 1, traffic.inputs[i], {3, 640});
      ASSERT_TRUE(r.status.ok()) << r.status.error_message();
      EXPECT_EQ(r.output, traffic.expected[i]);
    }
  }
  EXPECT_EQ(response.generation(), 3u);
  const moe::v1::ModelInfo info = Info(cluster);
  EXPECT_EQ(info.ranks(0).experts(0), 32);
  EXPECT_EQ(info.ranks(1).experts(0), 0);
  std::remove(token_file.c_str());
}

// k3-mini's 64 experts in 4 ranges of 16; rank r hosts ranges r and r - 1 (mod 4).
constexpr char kTwoReplicas[] = "0-15,48-63\n0-31\n16-47\n32-63\n";

TEST(ReplacementTest, ADownRankLoadsTheNewPlacementWhenItReturns) {
  const std::string checkpoint = testing::TestCheckpoint("k3-mini");
  const std::string placement = ::testing::TempDir() + "/replacement_two_replicas.txt";
  std::ofstream(placement) << kTwoReplicas;
  LocalCluster cluster(ClusterOptions{checkpoint,
                                      4,
                                      {"--placement", placement, "--allow-placement-changes",
                                       "--rank-timeout-ms", "1000", "--heartbeat-ms", "100"}});
  ASSERT_TRUE(cluster.Start().ok()) << cluster.Logs();
  cluster.rank(3).Signal(SIGKILL);
  ASSERT_FALSE(cluster.gateway().WaitForLog("rank 3 DOWN", absl::Seconds(10)).empty())
      << cluster.Logs();
  Diagnostics diagnostics(cluster);
  moe::v1::ApplyPlacementResponse response;
  // Contiguous ranges would leave 48-63 on the dead rank alone: refused, nothing changes.
  grpc::Status s = diagnostics.Apply("0-15\n16-31\n32-47\n48-63\n", &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
  EXPECT_NE(s.error_message().find("without a live replica: 48,"), std::string::npos)
      << s.error_message();
  EXPECT_EQ(Info(cluster).placement_generation(), 1u);
  // Ranks 0-2 cover every expert; rank 3 is down and gets its part when it returns.
  s = diagnostics.Apply("0-31\n16-47\n0-15,32-63\n48-63\n", &response);
  ASSERT_TRUE(s.ok()) << s.error_message() << "\n" << cluster.Logs();
  EXPECT_EQ(response.generation(), 2u);
  ASSERT_EQ(response.ranks_down_size(), 1);
  EXPECT_EQ(response.ranks_down(0), 3);

  cluster.RestartRank(3);
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  moe::v1::ModelInfo info;
  for (;;) {
    info = Info(cluster);
    if (info.ranks_size() == 4 && info.ranks(3).ready()) break;
    ASSERT_LT(absl::Now(), deadline) << cluster.Logs();
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_EQ(info.placement_generation(), 2u);
  EXPECT_EQ(info.experts_without_live_replica_size(), 0);
  EXPECT_TRUE(cluster.Serving());
  // Its part now: kill the three others' replicas of 48-63 and it serves them alone.
  const Traffic traffic = MakeTraffic(checkpoint, 1, 3, 8);
  cluster.rank(2).Signal(SIGKILL);
  ASSERT_FALSE(cluster.gateway().WaitForLog("rank 2 DOWN", absl::Seconds(10)).empty());
  for (size_t i = 0; i < traffic.inputs.size(); ++i) {
    CallResult r = Call(cluster.stub(), 1, traffic.inputs[i], {8, 640});
    ASSERT_TRUE(r.status.ok()) << r.status.error_message() << "\n" << cluster.Logs();
    EXPECT_EQ(r.output, traffic.expected[i]);
  }
  std::remove(placement.c_str());
}

}  // namespace
}  // namespace moe
