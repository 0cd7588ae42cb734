// What a caller of the public port can make the gateway do, on real processes: allocate (the
// message limit follows the model; nothing at all before it authenticated; bounded buffers for
// slow stream readers, all streams together), mint metrics series (no), write into its log
// (escaped), grow model info (bounded), or share its port (refused).
#include <sys/mman.h>
#include <sys/wait.h>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "gtest/gtest.h"
#include "proto/tensor_codec.h"
#include "security/tokens.h"
#include "tests/server/service_testing.h"
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

// Resident sizes say nothing under AddressSanitizer (its quarantine keeps freed memory, its
// shadow adds to the rest): the sanitizer stage checks what calls get, the release build's run
// also the memory bounds.
#if defined(__SANITIZE_ADDRESS__)
constexpr bool kResidentSizesMeaningful = false;
#else
constexpr bool kResidentSizesMeaningful = true;
#endif

// VmRSS of a process, in bytes (0 when unreadable).
int64_t ResidentBytes(pid_t pid) {
  std::ifstream status(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(status, line))
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6)) * 1024;  // "N kB"
  return 0;
}

// The peak of a process's resident size, sampled every 5 ms while `during` runs.
int64_t PeakResidentDuring(pid_t pid, const std::function<void()>& during) {
  std::atomic<bool> done{false};
  std::atomic<int64_t> peak{ResidentBytes(pid)};
  std::thread sampler([&] {
    while (!done) {
      peak = std::max(peak.load(), ResidentBytes(pid));
      absl::SleepFor(absl::Milliseconds(5));
    }
  });
  during();
  done = true;
  sampler.join();
  return std::max(peak.load(), ResidentBytes(pid));
}

// One unary call of a `bytes`-byte message to `method`, on a connection of its own, as a stranger
// would send it: the message lies in untouched anonymous memory (the zero page), so the sender
// holds none of it. Its status, and how long it took.
struct OversizedCall {
  grpc::Status status;
  absl::Duration took;
};

OversizedCall SendOversized(const std::string& target, const std::string& method, size_t bytes,
                            const std::string& token) {
  void* zeros = mmap(nullptr, bytes, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  EXPECT_NE(zeros, MAP_FAILED);
  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(-1);
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);  // a connection of its own
  grpc::GenericStub stub(
      grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args));
  grpc::Slice slice(zeros, bytes, grpc::Slice::STATIC_SLICE);
  grpc::ByteBuffer request(&slice, 1), response;
  grpc::ClientContext context;
  AddBearerToken(&context, token);
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
  grpc::CompletionQueue cq;
  OversizedCall out;
  const absl::Time t0 = absl::Now();
  auto call = stub.PrepareUnaryCall(&context, method, request, &cq);
  call->StartCall();
  call->Finish(&response, &out.status, reinterpret_cast<void*>(1));
  void* tag = nullptr;
  bool ok = false;
  EXPECT_TRUE(cq.Next(&tag, &ok));
  out.took = absl::Now() - t0;
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
  munmap(zeros, bytes);
  return out;
}

// `n` SendOversized calls at once.
std::vector<OversizedCall> SendOversizedTogether(int n, const std::string& target,
                                                 const std::string& method, size_t bytes,
                                                 const std::string& token) {
  std::vector<OversizedCall> calls(n);
  std::vector<std::thread> threads;
  for (int i = 0; i < n; ++i)
    threads.emplace_back([&, i] { calls[i] = SendOversized(target, method, bytes, token); });
  for (auto& t : threads) t.join();
  return calls;
}

TEST(BoundaryTest, OneGigabyteRequestsCostNoMemoryBeforeAuthenticationNorPastTheLimit) {
  const std::string dir = absl::StrCat(::testing::TempDir(), "/boundary_gib_", getpid());
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/api-token") << "caller-secret\n";
  LocalCluster cluster(ClusterOptions{
      testing::TestCheckpoint("k3-mini"), 2, {"--api-token-file", dir + "/api-token"}});
  ASSERT_TRUE(cluster.Start().ok()) << cluster.Logs();
  const pid_t gateway = cluster.gateway().pid();
  const int64_t idle = ResidentBytes(gateway);
  ASSERT_GT(idle, 0);
  constexpr size_t kGiB = size_t{1} << 30;
  constexpr int64_t kBound = int64_t{200} << 20;  // the target: idle + 200 MB

  // Without a token: refused on the metadata, the message never read.
  std::vector<OversizedCall> calls;
  int64_t peak = PeakResidentDuring(gateway, [&] {
    calls = SendOversizedTogether(4, cluster.target(), "/moe.v1.MoeService/Forward", kGiB, "");
  });
  for (const OversizedCall& call : calls) {
    EXPECT_EQ(call.status.error_code(), grpc::StatusCode::UNAUTHENTICATED)
        << call.status.error_message();
    std::printf("1 GiB Forward without a token: %s in %.2f s\n",
                call.status.error_message().c_str(), absl::ToDoubleSeconds(call.took));
  }
  std::printf("gateway resident: idle %.0f MB, peak %.0f MB\n", idle / 1e6, peak / 1e6);
  if (kResidentSizesMeaningful) {
    EXPECT_LT(peak - idle, kBound);
  }

  // With the token: refused past the message limit without holding the message (gRPC reads a
  // message whole before its length check; the transport quota resets the stream first).
  peak = PeakResidentDuring(gateway, [&] {
    calls = SendOversizedTogether(4, cluster.target(), "/moe.v1.MoeService/Forward", kGiB,
                                  "caller-secret");
  });
  for (const OversizedCall& call : calls) {
    EXPECT_EQ(call.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
        << call.status.error_message();
    std::printf("1 GiB Forward with the token: %s in %.2f s\n", call.status.error_message().c_str(),
                absl::ToDoubleSeconds(call.took));
    // The target is 1 s; a loaded 2-core CI host gets slack.
    EXPECT_LT(call.took, absl::Seconds(5));
  }
  std::printf("gateway resident: idle %.0f MB, peak %.0f MB\n", idle / 1e6, peak / 1e6);
  if (kResidentSizesMeaningful) {
    EXPECT_LT(peak - idle, kBound);
  }

  // The Open Inference Protocol's ModelInfer takes the same path.
  peak = PeakResidentDuring(gateway, [&] {
    calls = SendOversizedTogether(2, cluster.target(), "/inference.GRPCInferenceService/ModelInfer",
                                  kGiB, "");
  });
  for (const OversizedCall& call : calls)
    EXPECT_EQ(call.status.error_code(), grpc::StatusCode::UNAUTHENTICATED)
        << call.status.error_message();
  if (kResidentSizesMeaningful) {
    EXPECT_LT(peak - idle, kBound);
  }

  // Callers with the token are served, bit for bit, as before.
  InProcess reference(testing::TestCheckpoint("k3-mini"), 1);
  const std::vector<float> x = RandomInput(3, 640, 29);
  grpc::ClientContext context;
  AddBearerToken(&context, "caller-secret");
  CallResult served =
      Call(cluster.stub(), 1, x, {3, 640}, absl::Seconds(30), moe::v1::FP32, &context);
  ASSERT_TRUE(served.status.ok()) << served.status.error_message();
  EXPECT_EQ(served.output, reference.Forward(x));
  std::filesystem::remove_all(dir);
}

TEST(BoundaryTest, GarbageRequestsAreInvalidArgumentNamingTheMessage) {
  LocalCluster cluster(ClusterOptions{testing::TestCheckpoint("k3-mini"), 1});
  ASSERT_TRUE(cluster.Start().ok()) << cluster.Logs();
  for (const char* method :
       {"/moe.v1.MoeService/Forward", "/inference.GRPCInferenceService/ModelInfer",
        "/moe.v1.MoeService/GetModelInfo"}) {
    grpc::GenericStub stub(
        grpc::CreateChannel(cluster.target(), grpc::InsecureChannelCredentials()));
    // Field 1 as a length-delimited field claiming 100 bytes that are not there.
    const std::string garbage = "\x0a\x64garbage";
    grpc::Slice slice(garbage);
    grpc::ByteBuffer request(&slice, 1), response;
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    grpc::CompletionQueue cq;
    grpc::Status status;
    auto call = stub.PrepareUnaryCall(&context, method, request, &cq);
    call->StartCall();
    call->Finish(&response, &status, reinterpret_cast<void*>(1));
    void* tag = nullptr;
    bool ok = false;
    ASSERT_TRUE(cq.Next(&tag, &ok));
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << method;
    EXPECT_NE(status.error_message().find("is not a valid "), std::string::npos)
        << method << ": " << status.error_message();
    cq.Shutdown();
    while (cq.Next(&tag, &ok)) {
    }
  }
}

TEST(BoundaryTest, SlowStreamReadersAreBoundedInTotalAndTheirMemoryComesBack) {
  // 8 streams that never read, each allowed 64 MiB, all together 48 MiB; steps of one request
  // (256 tokens), so the gateway's step memory is the warm-up's.
  ClusterOptions options{testing::TestCheckpoint("k3-mini"),
                         2,
                         {"--stream-buffer-mb", "64", "--stream-buffer-total-mb", "48",
                          "--max-tokens-per-step", "256"}};
  options.metrics = true;
  LocalCluster cluster(options);
  ASSERT_TRUE(cluster.Start().ok()) << cluster.Logs();
  InProcess reference(testing::TestCheckpoint("k3-mini"), 1);
  const pid_t gateway = cluster.gateway().pid();
  const std::vector<float> x = RandomInput(256, 640, 41);  // responses of 640 KiB (fp32)
  const std::vector<float> expected = reference.Forward(x);
  ASSERT_TRUE(Call(cluster.stub(), 1, x, {256, 640}).status.ok());  // warm
  const int64_t idle = ResidentBytes(gateway);
  auto buffered = [&] {
    const std::string metrics = Shell(absl::StrCat(
        "curl -s --max-time 5 http://127.0.0.1:", cluster.gateway_metrics_port(), "/metrics"));
    const size_t at = metrics.find("\nmoe_stream_buffer_bytes ");
    return at == std::string::npos ? -1.0 : std::stod(metrics.substr(at + 25));
  };

  moe::v1::ForwardRequest request;
  request.set_layer(1);
  request.set_output_dtype(moe::v1::FP32);
  ASSERT_TRUE(
      EncodeTensor(x.data(), {256, 640}, moe::v1::FP32, request.mutable_hidden_states()).ok());
  constexpr int kStreams = 8, kRequests = 24;  // 8 x 24 x 640 KiB = 120 MiB asked for
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
  std::vector<
      std::unique_ptr<grpc::ClientReaderWriter<moe::v1::ForwardRequest, moe::v1::ForwardResponse>>>
      streams;
  double most_buffered = 0;
  const int64_t peak = PeakResidentDuring(gateway, [&] {
    for (int s = 0; s < kStreams; ++s) {
      contexts.push_back(std::make_unique<grpc::ClientContext>());
      streams.push_back(cluster.stub().ForwardStream(contexts.back().get()));
      for (int i = 0; i < kRequests; ++i) {
        request.set_request_id(absl::StrCat(s, "/", i));
        ASSERT_TRUE(streams.back()->Write(request));
      }
    }
    // Every request answered (computed or refused) and held for its reader.
    const absl::Time end = absl::Now() + absl::Seconds(60);
    double last = -1, now = buffered();
    while (absl::Now() < end && now != last) {
      most_buffered = std::max(most_buffered, now);
      absl::SleepFor(absl::Seconds(1));
      last = now;
      now = buffered();
    }
    most_buffered = std::max(most_buffered, now);
  });
  std::printf(
      "streams: %.1f MiB buffered at most (cap 48), gateway resident idle %.0f MB, "
      "peak %.0f MB\n",
      most_buffered / 1048576.0, idle / 1e6, peak / 1e6);
  EXPECT_GT(most_buffered, 24.0 * 1048576) << "the streams did buffer";
  EXPECT_LE(most_buffered, 48.0 * 1048576);
  if (kResidentSizesMeaningful) {
    EXPECT_LT(peak - idle, int64_t{48 + 150} << 20);
  }

  // The last stream reads now: every response is right or refused naming the total cap.
  auto& last = streams.back();
  ASSERT_TRUE(last->WritesDone());
  int ok = 0, refused = 0;
  moe::v1::ForwardResponse response;
  while (last->Read(&response)) {
    if (response.has_error()) {
      EXPECT_EQ(response.error().code(), static_cast<int>(grpc::StatusCode::RESOURCE_EXHAUSTED));
      EXPECT_NE(response.error().message().find("--stream-buffer-total-mb"), std::string::npos)
          << response.error().message();
      ++refused;
      continue;
    }
    auto decoded = DecodeTensor(response.output());
    ASSERT_TRUE(decoded.ok());
    EXPECT_EQ(decoded->values, expected) << response.request_id();
    ++ok;
  }
  EXPECT_EQ(ok + refused, kRequests);
  EXPECT_GT(refused, 0);
  EXPECT_TRUE(last->Finish().ok());

  // The others are cancelled: their buffers go, and the memory goes back to the system.
  for (int s = 0; s + 1 < kStreams; ++s) contexts[s]->TryCancel();
  for (int s = 0; s + 1 < kStreams; ++s) streams[s]->Finish();
  const absl::Time end = absl::Now() + absl::Seconds(10);
  while (absl::Now() < end && (buffered() != 0 || (kResidentSizesMeaningful &&
                                                   ResidentBytes(gateway) - idle > (100 << 20))))
    absl::SleepFor(absl::Milliseconds(200));
  EXPECT_EQ(buffered(), 0);
  const int64_t after = ResidentBytes(gateway);
  std::printf("gateway resident after the streams: %.0f MB (idle %.0f MB)\n", after / 1e6,
              idle / 1e6);
  if (kResidentSizesMeaningful) {
    EXPECT_LT(after - idle, int64_t{100} << 20);
  }
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
