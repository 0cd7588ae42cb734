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

TEST(FailoverTest, WithoutALiveReplicaRequestsFailNamingTheExperts) {
  const std::string checkpoint = testing::TestCheckpoint("k3-mini");
  const int layer = (*Checkpoint::Open(checkpoint))->layers().front();
  ClusterOptions options{checkpoint, 4};
  const std::string placement = ::testing::TempDir() + "/two_replicas_b.txt";
  std::ofstream(placement) << kTwoReplicas;
  options.gateway_args = {"--placement", placement};
  LocalCluster cluster(options);
  ASSERT_TRUE(cluster.Start().ok()) << cluster.Logs();
  // Ranks 1 and 2 both gone: range 1 (experts 16-31) has no replica left.
  cluster.rank(1).Signal(SIGKILL);
  cluster.rank(2).Signal(SIGKILL);
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (cluster.Serving() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(20));
  EXPECT_FALSE(cluster.Serving());
  CallResult r = Call(cluster.stub(), layer, RandomInput(64, 640, 3), {64, 640});
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  // At least range 1's 16 experts; more if a starved survivor missed its heartbeats meanwhile
  // on a loaded host (its range then has no replica either), which is no less precise.
  const std::string& message = r.status.error_message();
  const size_t at = message.find(" experts without a live replica");
  ASSERT_NE(at, std::string::npos) << message;
  const size_t start = message.rfind(' ', at - 1) + 1;
  int missing = 0;
  ASSERT_TRUE(absl::SimpleAtoi(message.substr(start, at - start), &missing)) << message;
  EXPECT_GE(missing, 16) << message;
  EXPECT_EQ(missing % 16, 0) << "whole ranges go: " << message;
}

}  // namespace
}  // namespace moe
