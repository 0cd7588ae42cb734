// What a caller of the public port can make the gateway do, on real processes: allocate (the
// message limit follows the model), mint metrics series (no), write into its log (escaped),
// grow model info (bounded), or share its port (refused).
#include <sys/wait.h>

#include <cstdio>
#include <fstream>
#include <random>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "proto/tensor_codec.h"
#include "tests/testing/child_process.h"
#include "tests/testing/local_cluster.h"
#include "tests/testing/test_checkpoints.h"

namespace moe {
namespace {

using testing::ClusterOptions;
using testing::LocalCluster;

// A channel that allows 64 MiB messages, so the server's limit is the one tested.
std::unique_ptr<moe::v1::MoeService::Stub> BigStub(const LocalCluster& cluster) {
  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(64 << 20);
  args.SetMaxReceiveMessageSize(64 << 20);
  return moe::v1::MoeService::NewStub(
      grpc::CreateCustomChannel(cluster.target(), grpc::InsecureChannelCredentials(), args));
}

grpc::Status Forward(moe::v1::MoeService::Stub& stub, int layer, int64_t tokens,
                     moe::v1::DType dtype = moe::v1::FP32) {
  std::mt19937 rng(static_cast<uint32_t>(tokens));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(tokens * 640);
  for (float& v : x) v = normal(rng);
  moe::v1::ForwardRequest request;
  request.set_layer(layer);
  EXPECT_TRUE(EncodeTensor(x.data(), {tokens, 640}, dtype, request.mutable_hidden_states()).ok());
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
  moe::v1::ForwardResponse response;
  return stub.Forward(&context, request, &response);
}

using testing::Shell;

// VmRSS of a process, in bytes (0 when unreadable).
int64_t ResidentBytes(pid_t pid) {
  std::ifstream status(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(status, line))
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6)) * 1024;  // "N kB"
  return 0;
}

TEST(BoundaryTest, TheMessageLimitFollowsTheModelNotOneGibibyte) {
  // 64 tokens of k3-mini: 160 KiB requests; 64-token steps: small rank results. The limit is
  // then about 1.2 MiB: a 2.6 MB request is refused by gRPC before the gateway allocates it.
  LocalCluster cluster(
      ClusterOptions{testing::TestCheckpoint("k3-mini"),
                     2,
                     {"--max-request-tokens", "64", "--max-tokens-per-step", "64"}});
  ASSERT_TRUE(cluster.Start().ok()) << cluster.Logs();
  auto stub = BigStub(cluster);
  EXPECT_TRUE(Forward(*stub, 1, 64).ok());
  const grpc::Status big = Forward(*stub, 1, 1024);
  EXPECT_EQ(big.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << big.error_message();
  // Refused by gRPC on arrival, not by request validation after the gateway took it in.
  EXPECT_NE(big.error_message().find("larger than max"), std::string::npos) << big.error_message();
  EXPECT_TRUE(Forward(*stub, 1, 3).ok()) << "the gateway serves on";

  // A 42 MB request (16384 tokens): refused before the gateway decodes it; its resident size
  // grows by less than twice the request (it was +2.6 GB for a 1 GB request).
  const int64_t before = ResidentBytes(cluster.gateway().pid());
  const grpc::Status huge = Forward(*stub, 1, 16384);
  EXPECT_EQ(huge.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << huge.error_message();
  const int64_t after = ResidentBytes(cluster.gateway().pid());
  ASSERT_GT(before, 0);
  // (gRPC may buffer what HTTP/2 flow control let in before it reads the length: ~22 MB here.)
  EXPECT_LT(after - before, 2 * int64_t{16384} * 640 * 4) << before << " -> " << after;
}

TEST(BoundaryTest, MaxRequestBytesLowersThePublicLimitOnly) {
  // 30 kB on the public port: 16 fp32 tokens (41 kB) are refused on arrival, 23 bf16 tokens
  // (29 kB) pass, and each rank's result for them (about 20 of the 23 rows, fp64 on 320
  // columns: some 50 kB) still arrives, on the control port and its own limit.
  LocalCluster cluster(
      ClusterOptions{testing::TestCheckpoint("k3-mini"), 2, {"--max-request-bytes", "30000"}});
  ASSERT_TRUE(cluster.Start().ok()) << cluster.Logs();
  auto stub = BigStub(cluster);
  const grpc::Status big = Forward(*stub, 1, 16);
  EXPECT_EQ(big.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << big.error_message();
  EXPECT_NE(big.error_message().find("larger than max"), std::string::npos) << big.error_message();
  const grpc::Status fits = Forward(*stub, 1, 23, moe::v1::BF16);
  EXPECT_TRUE(fits.ok()) << fits.error_message();
}

TEST(BoundaryTest, UnservedLayersMintNoMetricsSeries) {
  ClusterOptions options{testing::TestCheckpoint("k3-mini"), 2};
  options.metrics = true;
  LocalCluster cluster(options);
  ASSERT_TRUE(cluster.Start().ok()) << cluster.Logs();
  for (int layer : {77, 1234567, -5})
    EXPECT_EQ(Forward(cluster.stub(), layer, 1).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_TRUE(Forward(cluster.stub(), 1, 1).ok());
  const std::string metrics = Shell(absl::StrCat(
      "curl -s --max-time 5 http://127.0.0.1:", cluster.gateway_metrics_port(), "/metrics"));
  ASSERT_NE(metrics.find("moe_requests_total"), std::string::npos) << metrics.substr(0, 500);
  EXPECT_EQ(metrics.find("layer=\"77\""), std::string::npos);
  EXPECT_EQ(metrics.find("layer=\"1234567\""), std::string::npos);
  EXPECT_EQ(metrics.find("layer=\"-5\""), std::string::npos);
  EXPECT_NE(metrics.find("layer=\"invalid\""), std::string::npos);
  EXPECT_NE(metrics.find("layer=\"1\""), std::string::npos);
  // Prometheus conventions: code names, the build, the process, requests in flight.
  EXPECT_NE(metrics.find("moe_requests_total{code=\"NOT_FOUND\",layer=\"invalid\"} 3"),
            std::string::npos)
      << metrics;
  EXPECT_NE(metrics.find("moe_requests_total{code=\"OK\",layer=\"1\"} 1"), std::string::npos);
  EXPECT_NE(metrics.find("moe_build_info{backend=\"cpu("), std::string::npos);
  EXPECT_NE(metrics.find("moe_requests_in_flight 0"), std::string::npos);
  EXPECT_NE(metrics.find("moe_queue_tokens 0"), std::string::npos);
  // Results for steps the gateway did not await are counted per rank (none here).
  EXPECT_NE(metrics.find("moe_transport_dropped_results_total{rank=\"1\"} 0"), std::string::npos);
  for (const char* family : {"process_cpu_seconds_total", "process_resident_memory_bytes",
                             "process_open_fds", "process_start_time_seconds"})
    EXPECT_NE(metrics.find(absl::StrCat("\n", family, " ")), std::string::npos) << family;
  const std::string rank_metrics = Shell(absl::StrCat(
      "curl -s --max-time 5 http://127.0.0.1:", cluster.rank_metrics_port(0), "/metrics"));
  EXPECT_NE(rank_metrics.find("moe_transport_gateway_to_rank_bytes_total"), std::string::npos);
  EXPECT_NE(rank_metrics.find("moe_build_info{"), std::string::npos);
  EXPECT_NE(rank_metrics.find("\nprocess_resident_memory_bytes "), std::string::npos);
}

TEST(BoundaryTest, BiasOverrideSourcesAreEscapedAndTheHistoryIsBounded) {
  LocalCluster cluster(
      ClusterOptions{testing::TestCheckpoint("k3-mini"), 2, {"--allow-bias-override"}});
  ASSERT_TRUE(cluster.Start().ok()) << cluster.Logs();
  auto diagnostics = moe::v1::MoeDiagnostics::NewStub(
      grpc::CreateChannel(cluster.target(), grpc::InsecureChannelCredentials()));
  for (int i = 0; i < 70; ++i) {
    moe::v1::SetRouterBiasRequest request;
    request.set_layer(1);
    request.set_source(i == 0 ? "evil\nmoe-gateway: rank 0 DOWN (forged)\x1b[2J"
                              : std::string(1000, 'x'));
    grpc::ClientContext context;
    moe::v1::SetRouterBiasResponse response;
    ASSERT_TRUE(diagnostics->SetRouterBias(&context, request, &response).ok());
    const std::string& source = response.override().source();
    EXPECT_EQ(source.find('\n'), std::string::npos);
    EXPECT_LE(source.size(), 4u * 256) << "at most 256 bytes, escaped";
  }
  const std::string log = cluster.gateway().Log();
  EXPECT_EQ(log.find("\nmoe-gateway: rank 0 DOWN (forged)"), std::string::npos) << log;
  EXPECT_NE(log.find("evil\\nmoe-gateway: rank 0 DOWN (forged)\\x1b[2J"), std::string::npos) << log;
  grpc::ClientContext context;
  moe::v1::ModelInfo info;
  ASSERT_TRUE(cluster.stub().GetModelInfo(&context, moe::v1::GetModelInfoRequest(), &info).ok());
  EXPECT_EQ(info.bias_overrides_size(), 64) << "the newest 64 of 70";
}

TEST(BoundaryTest, ASecondGatewayOnABusyPortRefusesToStart) {
  LocalCluster cluster(ClusterOptions{testing::TestCheckpoint("k3-mini"), 1});
  ASSERT_TRUE(cluster.Start().ok()) << cluster.Logs();
  const std::string log = absl::StrCat(::testing::TempDir(), "/second_gateway.log");
  testing::ChildProcess second(
      {testing::BinaryPath("moe-gateway"), "--checkpoint", testing::TestCheckpoint("k3-mini"),
       "--ranks", "1", "--host", "127.0.0.1", "--port", std::to_string(cluster.port()),
       "--control-port", "0", "--insecure-cluster"},
      log);
  const int status = second.Wait(absl::Seconds(20));
  ASSERT_NE(status, -1) << "the second gateway is still running: it shares the port";
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) != 0) << status;
  EXPECT_NE(second.Log().find("cannot listen"), std::string::npos) << second.Log();
  EXPECT_TRUE(cluster.Serving());
}

}  // namespace
}  // namespace moe
