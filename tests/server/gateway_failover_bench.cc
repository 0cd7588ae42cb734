// Several gateways over one rank pool (M2N), as a benchmark with assertions: two moe-gateway and
// four moe-rank processes on loopback, k3-mini, 16 callers given both gateways (the failover
// client: gRPC round_robin over the gateways that take requests, UNAVAILABLE retried on the next,
// client/gateway_targets.h).
//
//   SIGKILL gateway 1 at 25% of the run, start it again at 50%: no call may fail, every result
//   equals the in-process layer bit for bit; printed: the p99 around the kill, and the time from
//   the restart until gateway 1 answers calls again.
//   SIGSTOP gateway 1 at 75% while callers of gateway 0 alone keep going: their p99 while
//   gateway 1 hangs against before (a hung gateway holds none of the others' steps).
//   A live re-placement applied through gateway 0 while gateway 1 serves: no call fails, and
//   gateway 1 follows to the new generation (printed: how long after the change returned).
//
// MOE_FAILOVER_BENCH_S sets the length of the run (default 8 s, the CI sample).
#include <signal.h>

#include <cstdlib>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "client/gateway_targets.h"
#include "gtest/gtest.h"
#include "tests/server/service_testing.h"
#include "tests/testing/child_process.h"
#include "tests/testing/local_cluster.h"
#include "tests/testing/test_checkpoints.h"

namespace moe {
namespace {

using testing::ClusterOptions;
using testing::LocalCluster;

constexpr int kCallers = 16;
constexpr int64_t kTokens = 8;
constexpr int kLayer = 1;

absl::Duration RunLength() {
  double seconds = 8;
  const char* env = std::getenv("MOE_FAILOVER_BENCH_S");
  if (env != nullptr && (!absl::SimpleAtod(env, &seconds) || seconds < 4)) seconds = 8;
  return absl::Seconds(seconds);
}

void SleepUntil(absl::Time when) {
  const absl::Duration left = when - absl::Now();
  if (left > absl::ZeroDuration()) absl::SleepFor(left);
}

double Ms(absl::Duration d) { return absl::ToDoubleMilliseconds(d); }

// A stub on a channel as the failover client makes it: every gateway of `targets`.
std::unique_ptr<moe::v1::MoeService::Stub> FailoverStub(const std::string& targets) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  args.SetMaxSendMessageSize(64 << 20);
  AddGatewayFailoverArgs(64 << 20, /*health_checked=*/true, &args);
  return moe::v1::MoeService::NewStub(grpc::CreateCustomChannel(
      *GatewayChannelTarget(targets), grpc::InsecureChannelCredentials(), args));
}

// Calls gateway `gateway` has answered OK (its moe_requests_total), -1 when unreachable.
double AnsweredCalls(const LocalCluster& cluster, int gateway) {
  const std::string metrics = testing::Shell(absl::StrCat(
      "curl -s --max-time 1 http://127.0.0.1:", cluster.gateway_metrics_port(gateway), "/metrics"));
  const std::string series =
      absl::StrCat("moe_requests_total{code=\"OK\",layer=\"", kLayer, "\"} ");
  const size_t at = metrics.find(series);
  return at == std::string::npos ? -1 : std::stod(metrics.substr(at + series.size()));
}

TEST(GatewayFailoverBench, AGatewayKilledRestartedAndHungUnderLoad) {
  const std::string checkpoint = testing::TestCheckpoint("k3-mini");
  InProcess reference(checkpoint, kLayer);
  std::vector<std::vector<float>> inputs, expected;
  const int64_t hidden = reference.config().hidden_size;
  for (int i = 0; i < 32; ++i) {
    inputs.push_back(RandomInput(kTokens, hidden, 700 + i));
    expected.push_back(reference.Forward(inputs.back()));
  }
  ClusterOptions options{checkpoint, 4};
  options.gateways = 2;
  options.metrics = true;
  options.ranks_reconnect = true;  // a rank whose gateway goes away registers with it again
  options.gateway_args = {"--rank-timeout-ms", "1000", "--heartbeat-ms", "100"};
  LocalCluster cluster(options);
  ASSERT_TRUE(cluster.Start().ok()) << cluster.Logs();
  for (int r = 0; r < 4; ++r)
    EXPECT_EQ(cluster.rank(r).Log().find("loading experts"),
              cluster.rank(r).Log().rfind("loading experts"))
        << "rank " << r << " loaded its experts once for both gateways";

  const absl::Duration length = RunLength();
  auto failover = FailoverStub(cluster.targets());
  BusyCallers callers(*failover, kLayer, inputs, expected, kTokens, hidden, kCallers);
  const absl::Time t0 = absl::Now();
  SleepUntil(t0 + length * 0.25);
  const absl::Time killed = absl::Now();
  cluster.gateway(1).Signal(SIGKILL);
  cluster.gateway(1).Wait(absl::Seconds(5));
  SleepUntil(t0 + length * 0.5);
  const absl::Time restarted = absl::Now();
  cluster.RestartGateway(1);
  absl::Time answering = absl::InfiniteFuture();
  while (absl::Now() < restarted + absl::Seconds(30)) {
    if (AnsweredCalls(cluster, 1) > 0) {
      answering = absl::Now();
      break;
    }
    absl::SleepFor(absl::Milliseconds(20));
  }

  // Callers of gateway 0 alone, before and while gateway 1 hangs.
  SleepUntil(std::max(t0 + length * 0.6, absl::Now()));
  BusyCallers direct(cluster.stub(), kLayer, inputs, expected, kTokens, hidden, 4);
  const absl::Time direct_start = absl::Now();
  SleepUntil(std::max(t0 + length * 0.75, direct_start + absl::Seconds(1)));
  const absl::Time stopped = absl::Now();
  cluster.gateway(1).Signal(SIGSTOP);
  SleepUntil(std::max(t0 + length, stopped + absl::Seconds(2)));
  direct.Stop();
  callers.Stop();
  const absl::Time end = absl::Now();
  cluster.gateway(1).Signal(SIGCONT);

  EXPECT_EQ(callers.failed(), 0) << "first error: " << callers.first_error() << "\n"
                                 << cluster.Logs();
  EXPECT_EQ(callers.wrong(), 0);
  EXPECT_EQ(direct.failed(), 0) << direct.first_error();
  EXPECT_EQ(direct.wrong(), 0);
  ASSERT_NE(answering, absl::InfiniteFuture()) << "gateway 1 took no calls\n" << cluster.Logs();
  const absl::Duration window = absl::Seconds(2);
  const absl::Duration p99_before = direct.Latency(0.99, direct_start, stopped);
  const absl::Duration p99_hung = direct.Latency(0.99, stopped, end);
  std::printf(
      "M2N failover (k3-mini, 2 gateways x 4 ranks, %d callers x %lld tokens given both "
      "gateways, %.0f s):\n"
      "  calls %d ok, %d failed, %d wrong; %.0f calls/s\n"
      "  latency p50 %.1f ms, p99 %.1f ms, slowest %.1f ms\n"
      "  p99 of calls started within 2 s after SIGKILL of gateway 1: %.1f ms (%lld calls)\n"
      "  gateway 1 restarted: answering calls again after %.2f s\n"
      "  4 callers of gateway 0 alone: p99 %.1f ms before, %.1f ms while gateway 1 was stopped "
      "(%d calls, %d failed)\n",
      kCallers, static_cast<long long>(kTokens), absl::ToDoubleSeconds(end - t0), callers.ok(),
      callers.failed(), callers.wrong(), callers.ok() / absl::ToDoubleSeconds(end - t0),
      Ms(callers.Latency(0.5)), Ms(callers.Latency(0.99)), Ms(callers.Latency(1.0)),
      Ms(callers.Latency(0.99, killed, killed + window)),
      static_cast<long long>(callers.Calls(killed, killed + window)),
      absl::ToDoubleSeconds(answering - restarted), Ms(p99_before), Ms(p99_hung), direct.ok(),
      direct.failed());
  // Loose bounds for a loaded 2-core CI host; the figures above are the measurement.
  EXPECT_LT(answering - restarted, absl::Seconds(10));
  EXPECT_LT(p99_hung, 4 * p99_before + absl::Milliseconds(50));
}

uint64_t Generation(LocalCluster& cluster, int gateway) {
  auto stub = moe::v1::MoeService::NewStub(
      grpc::CreateChannel(cluster.target(gateway), grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  moe::v1::ModelInfo info;
  return stub->GetModelInfo(&context, moe::v1::GetModelInfoRequest(), &info).ok()
             ? info.placement_generation()
             : 0;
}

TEST(GatewayFailoverBench, APlacementChangeThroughOneGatewayReachesTheOther) {
  const std::string checkpoint = testing::TestCheckpoint("k3-mini");
  InProcess reference(checkpoint, kLayer);
  std::vector<std::vector<float>> inputs, expected;
  const int64_t hidden = reference.config().hidden_size;
  for (int i = 0; i < 32; ++i) {
    inputs.push_back(RandomInput(kTokens, hidden, 800 + i));
    expected.push_back(reference.Forward(inputs.back()));
  }
  ClusterOptions options{checkpoint, 4};
  options.gateways = 2;
  options.ranks_reconnect = true;
  options.gateway_args = {"--allow-placement-changes"};
  LocalCluster cluster(options);
  ASSERT_TRUE(cluster.Start().ok()) << cluster.Logs();
  ASSERT_EQ(Generation(cluster, 0), 1u);
  ASSERT_EQ(Generation(cluster, 1), 1u);

  const absl::Duration length = RunLength();
  auto failover = FailoverStub(cluster.targets());
  BusyCallers callers(*failover, kLayer, inputs, expected, kTokens, hidden, kCallers / 2);
  auto gateway1 = moe::v1::MoeService::NewStub(
      grpc::CreateChannel(cluster.target(1), grpc::InsecureChannelCredentials()));
  BusyCallers beside(*gateway1, kLayer, inputs, expected, kTokens, hidden, kCallers / 2);
  const absl::Time t0 = absl::Now();
  SleepUntil(t0 + length * 0.3);
  // Every expert on two ranks (range k on ranks k and k + 1), applied through gateway 0.
  auto diagnostics = moe::v1::MoeDiagnostics::NewStub(
      grpc::CreateChannel(cluster.target(0), grpc::InsecureChannelCredentials()));
  moe::v1::ApplyPlacementResponse applied;
  {
    grpc::ClientContext context;
    moe::v1::ApplyPlacementRequest request;
    request.set_placement("0-15,48-63\n0-31\n16-47\n32-63\n");
    request.set_source("gateway_failover_bench");
    const grpc::Status s = diagnostics->ApplyPlacement(&context, request, &applied);
    ASSERT_TRUE(s.ok()) << s.error_message() << "\n" << cluster.Logs();
  }
  const absl::Time committed = absl::Now();
  absl::Time followed = absl::InfiniteFuture();
  while (absl::Now() < committed + absl::Seconds(10)) {
    if (Generation(cluster, 1) == applied.generation()) {
      followed = absl::Now();
      break;
    }
    absl::SleepFor(absl::Milliseconds(5));
  }
  SleepUntil(t0 + length);
  callers.Stop();
  beside.Stop();
  const absl::Time end = absl::Now();

  EXPECT_EQ(callers.failed(), 0) << "first error: " << callers.first_error() << "\n"
                                 << cluster.Logs();
  EXPECT_EQ(beside.failed(), 0) << "first error: " << beside.first_error();
  EXPECT_EQ(callers.wrong() + beside.wrong(), 0);
  EXPECT_EQ(applied.generation(), 2u);
  ASSERT_NE(followed, absl::InfiniteFuture()) << "gateway 1 did not follow\n" << cluster.Logs();
  EXPECT_EQ(Generation(cluster, 0), applied.generation());
  std::printf(
      "M2N live re-placement (k3-mini, 2 gateways x 4 ranks, contiguous -> every expert on 2 "
      "ranks, through gateway 0; %d callers of both, %d of gateway 1 alone, %.0f s):\n"
      "  calls %d ok, %d failed, %d wrong\n"
      "  ApplyPlacement took %.3f s; gateway 1 on generation %llu %.0f ms after it returned\n",
      kCallers / 2, kCallers / 2, absl::ToDoubleSeconds(end - t0), callers.ok() + beside.ok(),
      callers.failed() + beside.failed(), callers.wrong() + beside.wrong(), applied.seconds(),
      static_cast<unsigned long long>(applied.generation()), Ms(followed - committed));
  // One heartbeat (500 ms) is the target; a loaded CI host gets slack.
  EXPECT_LT(followed - committed, absl::Seconds(3));
}

}  // namespace
}  // namespace moe
