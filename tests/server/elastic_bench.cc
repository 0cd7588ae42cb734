// Elastic expert parallelism under load, as a benchmark with assertions: real moe-gateway and
// moe-rank processes on loopback, k3-mini, 16 callers.
//
//   Failover: every expert on two of 4 ranks; SIGKILL one rank at 25% of the run, SIGSTOP another
//   at 50%, and at 70% the killed one is started again and the stopped one continued. No call
//   may fail, every result must equal the in-process layer (LocalMoeLayer: moe-forward's code
//   path) bit for bit; printed: throughput, p50/p99 overall and beside each fault, and the time
//   from the ranks' return to every rank serving again.
//   Re-placement: contiguous ranges on a skewed router, the EPLB advice applied live at 25%.
//
// MOE_ELASTIC_BENCH_S sets the length of each run (default 8 s, the CI sample; scripts/
// bench-elastic.sh runs the 20 s and keeps what it printed in docs/bench/).
#include <signal.h>

#include <cstdlib>
#include <fstream>

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

constexpr int kCallers = 16;
constexpr int64_t kTokens = 8;

absl::Duration RunLength() {
  double seconds = 8;
  const char* env = std::getenv("MOE_ELASTIC_BENCH_S");
  if (env != nullptr && (!absl::SimpleAtod(env, &seconds) || seconds < 4)) seconds = 8;
  return absl::Seconds(seconds);
}

struct Traffic {
  std::vector<std::vector<float>> inputs, expected;
  int64_t hidden = 0;
};

Traffic MakeTraffic(const std::string& checkpoint, int layer) {
  InProcess reference(checkpoint, layer);
  Traffic t;
  t.hidden = reference.config().hidden_size;
  for (int i = 0; i < 32; ++i) {
    t.inputs.push_back(RandomInput(kTokens, t.hidden, 900 + i));
    t.expected.push_back(reference.Forward(t.inputs.back()));
  }
  return t;
}

void SleepUntil(absl::Time when) {
  const absl::Duration left = when - absl::Now();
  if (left > absl::ZeroDuration()) absl::SleepFor(left);
}

double Ms(absl::Duration d) { return absl::ToDoubleMilliseconds(d); }

moe::v1::ModelInfo Info(LocalCluster& cluster) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  moe::v1::ModelInfo info;
  (void)cluster.stub().GetModelInfo(&context, moe::v1::GetModelInfoRequest(), &info);
  return info;
}

int ReadyRanks(LocalCluster& cluster) {
  int n = 0;
  const moe::v1::ModelInfo info = Info(cluster);
  for (const auto& rank : info.ranks()) n += rank.ready();
  return n;
}

// Range k of 16 experts lives on ranks k and k + 1 (mod 4): ranks 1 and 3 may both go.
constexpr char kTwoReplicas[] = "0-15,48-63\n0-31\n16-47\n32-63\n";

TEST(ElasticBench, FailoverThroughAKilledAndAHungRankThenRecovery) {
  const std::string checkpoint = testing::TestCheckpoint("k3-mini");
  constexpr int kLayer = 1;
  const Traffic traffic = MakeTraffic(checkpoint, kLayer);
  const std::string placement = ::testing::TempDir() + "/elastic_two_replicas.txt";
  std::ofstream(placement) << kTwoReplicas;
  ClusterOptions options{checkpoint, 4};
  options.gateway_args = {"--placement", placement,        "--rank-timeout-ms",
                          "1000",        "--heartbeat-ms", "100"};
  options.ranks_reconnect = true;  // the continued rank registers again on its own
  LocalCluster cluster(options);
  ASSERT_TRUE(cluster.Start().ok()) << cluster.Logs();

  const absl::Duration length = RunLength();
  BusyCallers callers(cluster.stub(), kLayer, traffic.inputs, traffic.expected, kTokens,
                      traffic.hidden, kCallers);
  const absl::Time t0 = absl::Now();
  SleepUntil(t0 + length * 0.25);
  const absl::Time killed = absl::Now();
  cluster.rank(1).Signal(SIGKILL);
  SleepUntil(t0 + length * 0.5);
  const absl::Time stopped = absl::Now();
  cluster.rank(3).Signal(SIGSTOP);
  SleepUntil(t0 + length * 0.7);
  const bool degraded_serving = cluster.Serving();
  const absl::Time returned = absl::Now();
  cluster.rank(3).Signal(SIGCONT);
  cluster.RestartRank(1);
  absl::Time recovered = absl::InfiniteFuture();
  while (absl::Now() < returned + absl::Seconds(60)) {
    if (ReadyRanks(cluster) == 4) {
      recovered = absl::Now();
      break;
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  SleepUntil(std::max(t0 + length, absl::Now() + absl::Seconds(1)));
  callers.Stop();
  const absl::Time end = absl::Now();

  EXPECT_EQ(callers.failed(), 0) << callers.first_error() << "\n" << cluster.Logs();
  EXPECT_EQ(callers.wrong(), 0);
  EXPECT_TRUE(degraded_serving) << "every expert kept a live replica";
  ASSERT_NE(recovered, absl::InfiniteFuture()) << "ranks did not come back\n" << cluster.Logs();
  const absl::Duration fault_window = absl::Milliseconds(2000);
  std::printf(
      "elastic failover (k3-mini, 4 ranks, every expert on 2, %d callers x %lld tokens, %.0f s):\n"
      "  calls %d ok, %d failed, %d wrong; %.0f calls/s\n"
      "  latency p50 %.1f ms, p99 %.1f ms, slowest %.1f ms\n"
      "  p99 of calls started within 2 s after SIGKILL of rank 1: %.1f ms (%lld calls)\n"
      "  p99 of calls started within 2 s after SIGSTOP of rank 3: %.1f ms (%lld calls; "
      "liveness 1 s)\n"
      "  full recovery (all 4 ranks serving) %.2f s after rank 1 was restarted and rank 3 "
      "continued\n",
      kCallers, static_cast<long long>(kTokens), absl::ToDoubleSeconds(end - t0), callers.ok(),
      callers.failed(), callers.wrong(), callers.ok() / absl::ToDoubleSeconds(end - t0),
      Ms(callers.Latency(0.5)), Ms(callers.Latency(0.99)), Ms(callers.Latency(1.0)),
      Ms(callers.Latency(0.99, killed, killed + fault_window)),
      static_cast<long long>(callers.Calls(killed, killed + fault_window)),
      Ms(callers.Latency(0.99, stopped, stopped + fault_window)),
      static_cast<long long>(callers.Calls(stopped, stopped + fault_window)),
      absl::ToDoubleSeconds(recovered - returned));
  std::remove(placement.c_str());
}

double RankBalance(moe::v1::MoeDiagnostics::Stub& diagnostics, int layer) {
  grpc::ClientContext context;
  moe::v1::GetLoadBalanceRequest request;
  request.set_layer(layer);
  moe::v1::LoadBalanceReport report;
  EXPECT_TRUE(diagnostics.GetLoadBalance(&context, request, &report).ok());
  return report.rank_balancedness();
}

TEST(ElasticBench, LiveReplacementToTheEplbAdviceUnderLoad) {
  const std::string checkpoint = testing::TestCheckpoint("k3-mini-skewed");
  constexpr int kLayer = 1;
  const Traffic traffic = MakeTraffic(checkpoint, kLayer);
  LocalCluster cluster(
      ClusterOptions{checkpoint, 4, {"--allow-placement-changes", "--balance-window-steps", "64"}});
  ASSERT_TRUE(cluster.Start().ok()) << cluster.Logs();
  auto diagnostics = moe::v1::MoeDiagnostics::NewStub(
      grpc::CreateChannel(cluster.target(), grpc::InsecureChannelCredentials()));

  const absl::Duration length = RunLength();
  BusyCallers callers(cluster.stub(), kLayer, traffic.inputs, traffic.expected, kTokens,
                      traffic.hidden, kCallers);
  const absl::Time t0 = absl::Now();
  SleepUntil(t0 + length * 0.25);
  const double before = RankBalance(*diagnostics, kLayer);
  moe::v1::PlacementAdvice advice;
  {
    grpc::ClientContext context;
    moe::v1::GetPlacementAdviceRequest request;
    request.set_layer(kLayer);
    request.set_redundant_experts(4);
    ASSERT_TRUE(diagnostics->GetPlacementAdvice(&context, request, &advice).ok());
  }
  const absl::Time asked = absl::Now();
  moe::v1::ApplyPlacementResponse applied;
  {
    grpc::ClientContext context;
    moe::v1::ApplyPlacementRequest request;
    request.set_placement(advice.placement());
    request.set_source("elastic_bench");
    const grpc::Status s = diagnostics->ApplyPlacement(&context, request, &applied);
    ASSERT_TRUE(s.ok()) << s.error_message() << "\n" << cluster.Logs();
  }
  const absl::Time switched = absl::Now();
  SleepUntil(t0 + length);
  const double after = RankBalance(*diagnostics, kLayer);
  callers.Stop();
  const absl::Time end = absl::Now();

  EXPECT_EQ(callers.failed(), 0) << callers.first_error() << "\n" << cluster.Logs();
  EXPECT_EQ(callers.wrong(), 0);
  EXPECT_GT(after, before + 0.1);
  std::printf(
      "live re-placement (k3-mini-skewed, 4 ranks, contiguous -> EPLB advice with 4 redundant "
      "experts, %d callers x %lld tokens, %.0f s):\n"
      "  calls %d ok, %d failed, %d wrong; %.0f calls/s\n"
      "  rank balancedness %.3f before, %.3f after (predicted %.3f)\n"
      "  ApplyPlacement took %.3f s (slowest rank loaded in %.3f s); p99 of the calls started "
      "during it %.1f ms, p99 overall %.1f ms\n",
      kCallers, static_cast<long long>(kTokens), absl::ToDoubleSeconds(end - t0), callers.ok(),
      callers.failed(), callers.wrong(), callers.ok() / absl::ToDoubleSeconds(end - t0), before,
      after, advice.predicted_balancedness(), applied.seconds(), applied.load_seconds(),
      Ms(callers.Latency(0.99, asked, switched + absl::Milliseconds(100))),
      Ms(callers.Latency(0.99)));
}

}  // namespace
}  // namespace moe
