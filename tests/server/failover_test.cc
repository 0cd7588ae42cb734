// Serving through rank failures with redundant experts: real moe-gateway and moe-rank
// processes on loopback, every expert on two ranks, callers busy while one rank is killed and
// another hung. No request may fail, and every result must equal the in-process layer bit for
// bit (the fp64 combine makes a token's result independent of which replica ran each expert).
#include <signal.h>

#include <atomic>
#include <fstream>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/server/service_testing.h"
#include "tests/testing/local_cluster.h"
#include "tests/testing/test_checkpoints.h"

namespace moe {
namespace {

using testing::ClusterOptions;
using testing::LocalCluster;

// k3-mini's 64 experts in 4 ranges of 16; rank r hosts ranges r and r - 1 (mod 4), so range k
// lives on ranks k and k + 1: any one rank, or two ranks not adjacent, may go.
constexpr char kTwoReplicas[] = "0-15,48-63\n0-31\n16-47\n32-63\n";

TEST(FailoverTest, RedundantExpertsServeThroughAKilledAndAHungRankBitIdentical) {
  const std::string checkpoint = testing::TestCheckpoint("k3-mini");
  const int layer = (*Checkpoint::Open(checkpoint))->layers().front();
  InProcess reference(checkpoint, layer);
  const int64_t H = reference.config().hidden_size;
  constexpr int kInputs = 12;
  std::vector<std::vector<float>> inputs, expected;
  for (int i = 0; i < kInputs; ++i) {
    inputs.push_back(RandomInput(8, H, 100 + i));
    expected.push_back(reference.Forward(inputs.back()));
  }

  ClusterOptions options{checkpoint, 4};
  const std::string placement = ::testing::TempDir() + "/two_replicas.txt";
  std::ofstream(placement) << kTwoReplicas;
  options.gateway_args = {"--placement", placement,        "--rank-timeout-ms",
                          "1000",        "--heartbeat-ms", "100"};
  LocalCluster cluster(options);
  ASSERT_TRUE(cluster.Start().ok()) << cluster.Logs();

  BusyCallers callers(cluster.stub(), layer, inputs, expected, 8, H, 6);
  absl::SleepFor(absl::Milliseconds(1500));
  cluster.rank(1).Signal(SIGKILL);  // dead: its stream breaks at once
  absl::SleepFor(absl::Milliseconds(1500));
  cluster.rank(3).Signal(SIGSTOP);  // hung: found by liveness within 1 s
  absl::SleepFor(absl::Milliseconds(3000));
  const bool serving = cluster.Serving();
  callers.Stop();
  cluster.rank(3).Signal(SIGKILL);

  EXPECT_EQ(callers.failed(), 0) << callers.first_error() << "\n" << cluster.gateway().Log();
  EXPECT_EQ(callers.wrong(), 0);
  EXPECT_GT(callers.ok(), 60);
  EXPECT_TRUE(serving) << "every expert still has a live replica";
  const std::string log = cluster.gateway().Log();
  EXPECT_NE(log.find("serving degraded"), std::string::npos) << log;
  std::printf("failover: %d calls ok, slowest %.0f ms (a hung rank's steps wait for liveness)\n",
              callers.ok(), absl::ToDoubleMilliseconds(callers.Latency(1.0)));
}

// Ranks 1 and 2 gone: range 1 (experts 16-31) has no live replica. Only the calls whose tokens
// choose one of those fail (UNAVAILABLE naming them), in the same steps as calls that succeed;
// when the ranks come back, everything is served again.
TEST(FailoverTest, WithoutALiveReplicaOnlyTheCallsChoosingThoseExpertsFail) {
  const std::string checkpoint = testing::TestCheckpoint("k3-mini");
  const int layer = (*Checkpoint::Open(checkpoint))->layers().front();
  InProcess reference(checkpoint, layer);
  // One-token inputs that choose an expert of range 1 (hits) and that do not (misses).
  std::vector<std::vector<float>> hits, misses, hit_expected, miss_expected;
  std::vector<int> hit_expert;
  for (uint32_t seed = 1; seed < 2000 && (hits.size() < 3 || misses.size() < 3); ++seed) {
    std::vector<float> x = RandomInput(1, 640, 7000 + seed);
    Routing routing;
    std::vector<float> y = reference.Forward(x, &routing);
    int in_range = -1;
    for (int32_t e : routing.ids)
      if (e >= 16 && e < 32) in_range = e;
    auto& group = in_range >= 0 ? hits : misses;
    if (group.size() >= 3) continue;
    group.push_back(x);
    (in_range >= 0 ? hit_expected : miss_expected).push_back(y);
    if (in_range >= 0) hit_expert.push_back(in_range);
  }
  ASSERT_EQ(hits.size(), 3u);
  ASSERT_EQ(misses.size(), 3u);

  ClusterOptions options{checkpoint, 4};
  const std::string placement = ::testing::TempDir() + "/two_replicas_b.txt";
  std::ofstream(placement) << kTwoReplicas;
  options.gateway_args = {"--placement", placement};
  LocalCluster cluster(options);
  ASSERT_TRUE(cluster.Start().ok()) << cluster.Logs();
  cluster.rank(1).Signal(SIGKILL);
  cluster.rank(2).Signal(SIGKILL);
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (cluster.Serving() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(20));
  EXPECT_FALSE(cluster.Serving()) << "health: some experts have no live replica";

  // All six at once, so that steps hold calls of both kinds.
  std::vector<CallResult> hit_results(3), miss_results(3);
  std::vector<std::thread> threads;
  for (int i = 0; i < 3; ++i) {
    threads.emplace_back([&, i] {
      hit_results[i] = Call(cluster.stub(), layer, hits[i], {1, 640});
    });
    threads.emplace_back([&, i] {
      miss_results[i] = Call(cluster.stub(), layer, misses[i], {1, 640});
    });
  }
  for (auto& t : threads) t.join();
  for (int i = 0; i < 3; ++i) {
    EXPECT_TRUE(miss_results[i].status.ok()) << miss_results[i].status.error_message();
    EXPECT_EQ(miss_results[i].output, miss_expected[i]) << "miss " << i;
    const grpc::Status& s = hit_results[i].status;
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
    EXPECT_NE(s.error_message().find("no live replica of expert"), std::string::npos)
        << s.error_message();
    EXPECT_NE(s.error_message().find(absl::StrCat(hit_expert[i])), std::string::npos)
        << "names expert " << hit_expert[i] << ": " << s.error_message();
  }
  {
    grpc::ClientContext context;
    moe::v1::ModelInfo info;
    ASSERT_TRUE(cluster.stub().GetModelInfo(&context, moe::v1::GetModelInfoRequest(), &info).ok());
    // Range 1 at least; whole ranges only (a starved survivor may miss heartbeats too).
    EXPECT_GE(info.experts_without_live_replica_size(), 16);
    EXPECT_EQ(info.experts_without_live_replica_size() % 16, 0);
  }

  // The ranks return: served again, bit-identical.
  cluster.RestartRank(1);
  cluster.RestartRank(2);
  const absl::Time back = absl::Now() + absl::Seconds(30);
  while (!cluster.Serving() && absl::Now() < back) absl::SleepFor(absl::Milliseconds(20));
  ASSERT_TRUE(cluster.Serving()) << cluster.Logs();
  for (int i = 0; i < 3; ++i) {
    CallResult r = Call(cluster.stub(), layer, hits[i], {1, 640});
    ASSERT_TRUE(r.status.ok()) << r.status.error_message();
    EXPECT_EQ(r.output, hit_expected[i]);
  }
}

}  // namespace
}  // namespace moe
