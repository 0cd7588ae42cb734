// The moe-client binary against the fake moe.v1 server: forward (.npy in and out), health,
// info, load; exit codes 0 / 1 / 2.
#include <sys/wait.h>

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/npy.h"
#include "core/numerics.h"
#include "core/version.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/client/fake_moe_service.h"

namespace moe {
namespace {

using fake::FakeMoeServer;

struct CliRun {
  int exit_code = -1;
  std::string out, err;
};

std::string ReadText(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

class MoeClientCliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    server_ = FakeMoeServer::Start();
    ASSERT_NE(server_, nullptr);
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = absl::StrCat(::testing::TempDir(), "moe_client_cli_", info->name(), "_", getpid());
    ASSERT_EQ(std::system(absl::StrCat("mkdir -p '", dir_, "'").c_str()), 0);
  }
  void TearDown() override { std::system(absl::StrCat("rm -rf '", dir_, "'").c_str()); }

  std::string Path(const std::string& name) const { return absl::StrCat(dir_, "/", name); }

  // Runs `moe-client <args>` (args already shell-quoted where needed).
  CliRun Cli(const std::string& args) const {
    const std::string out = Path("stdout.txt"), err = Path("stderr.txt");
    // Under TSan the child needs what tsan_defaults.cc gives this process (no effect otherwise).
    const std::string command =
        absl::StrCat("TSAN_OPTIONS=\"$TSAN_OPTIONS ignore_noninstrumented_modules=1 suppressions=",
                     MOE_SOURCE_DIR, "/tests/client/tsan.supp\" ", MOE_BINARY_DIR,
                     "/bin/moe-client ", args, " >", out, " 2>", err);
    CliRun run;
    const int status = std::system(command.c_str());
    run.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    run.out = ReadText(out);
    run.err = ReadText(err);
    return run;
  }

  std::string Target() const { return absl::StrCat("--target ", server_->target()); }

  std::unique_ptr<FakeMoeServer> server_;
  std::string dir_;
};

std::vector<float> Input(int64_t n) {
  std::vector<float> x(n);
  for (int64_t i = 0; i < n; ++i) x[i] = 0.3712593f * static_cast<float>(i + 1) - 2.1f;
  return x;
}

TEST_F(MoeClientCliTest, ForwardNpyRoundTripWithRouting) {
  const std::vector<int64_t> shape = {2, 3, FakeMoeServer::kHidden};
  const std::vector<float> x = Input(2 * 3 * FakeMoeServer::kHidden);
  ASSERT_TRUE(WriteNpyFloat32(Path("x.npy"), shape, x.data()).ok());
  const CliRun run = Cli(absl::StrCat("forward ", Target(), " --layer 3 --input ", Path("x.npy"),
                                      " --output ", Path("y.npy"), " --routing-out ",
                                      Path("ids.npy"), " --routing-weights-out ", Path("w.npy")));
  ASSERT_EQ(run.exit_code, 0) << run.err;
  auto y = ReadNpy(Path("y.npy"));
  ASSERT_TRUE(y.ok()) << y.status();
  EXPECT_EQ(y->descr, "<f4");
  EXPECT_EQ(y->shape, shape);
  for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(y->data[i], 2.0f * x[i] + 3.0f) << i;
  auto ids = ReadNpy(Path("ids.npy"));
  ASSERT_TRUE(ids.ok()) << ids.status();
  EXPECT_EQ(ids->shape, (std::vector<int64_t>{6, FakeMoeServer::kTopK}));
  for (int t = 0; t < 6; ++t) {
    EXPECT_EQ(ids->ints[2 * t], 3 + t);
    EXPECT_EQ(ids->ints[2 * t + 1], 3 + t + 17);
  }
  auto w = ReadNpy(Path("w.npy"));
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(w->shape, (std::vector<int64_t>{6, FakeMoeServer::kTopK}));
  EXPECT_EQ(w->data[0], 0.75f);
  EXPECT_EQ(w->data[1], 0.25f);
}

TEST_F(MoeClientCliTest, ForwardFloat16InputOverBf16) {
  const std::vector<int64_t> shape = {4, FakeMoeServer::kHidden};
  std::vector<uint16_t> halves(4 * FakeMoeServer::kHidden);
  const std::vector<float> x = Input(halves.size());
  for (size_t i = 0; i < x.size(); ++i) halves[i] = FloatToHalfBits(x[i]);
  {
    const std::string bytes = EncodeNpy("<f2", shape, halves.data(), halves.size() * 2);
    std::ofstream(Path("x16.npy"), std::ios::binary).write(bytes.data(), bytes.size());
  }
  const CliRun run = Cli(absl::StrCat("forward ", Target(), " --layer 1 --dtype bf16 --input ",
                                      Path("x16.npy"), " --output ", Path("y.npy")));
  ASSERT_EQ(run.exit_code, 0) << run.err;
  auto y = ReadNpy(Path("y.npy"));
  ASSERT_TRUE(y.ok()) << y.status();
  EXPECT_EQ(y->descr, "<f4");
  EXPECT_EQ(y->shape, shape);
  for (size_t i = 0; i < x.size(); ++i) {
    const float wire = RoundToBf16(HalfBitsToFloat(halves[i]));
    ASSERT_EQ(y->data[i], RoundToBf16(2.0f * wire + 1.0f)) << i;
  }
}

// A response over gRPC's default 4 MiB to a request under it: moe-client takes it, sized from
// the server's GetModelInfo, unless --max-message-bytes holds it to 4 MiB.
TEST_F(MoeClientCliTest, ForwardReceiveLimitFollowsTheServer) {
  server_->SetMaxRequestTokens(int64_t{1} << 18);
  const std::string args =
      absl::StrCat("forward ", Target(), " --layer 1 --random 160000 --dtype bf16 ",
                   "--output-dtype fp32 --output ", Path("y.npy"));
  CliRun run = Cli(args);
  ASSERT_EQ(run.exit_code, 0) << run.err;
  auto y = ReadNpy(Path("y.npy"));
  ASSERT_TRUE(y.ok()) << y.status();
  EXPECT_EQ(y->shape, (std::vector<int64_t>{160000, FakeMoeServer::kHidden}));
  run = Cli(args + " --max-message-bytes 4194304");
  EXPECT_EQ(run.exit_code, 1);
  EXPECT_NE(run.err.find("RESOURCE_EXHAUSTED"), std::string::npos) << run.err;
  EXPECT_EQ(server_->calls(1), 2);  // the server answered both
  EXPECT_EQ(Cli(args + " --max-message-bytes -1").exit_code, 2);
}

TEST_F(MoeClientCliTest, ForwardErrorsAndUsage) {
  const std::vector<float> x = Input(FakeMoeServer::kHidden);
  ASSERT_TRUE(WriteNpyFloat32(Path("x.npy"), {1, FakeMoeServer::kHidden}, x.data()).ok());
  const std::string io = absl::StrCat(" --input ", Path("x.npy"), " --output ", Path("y.npy"));

  CliRun run = Cli(absl::StrCat("forward ", Target(), " --layer 404", io));
  EXPECT_EQ(run.exit_code, 1);
  EXPECT_NE(run.err.find("NOT_FOUND: layer 404 is not served (served: 1, 2, 3)"), std::string::npos)
      << run.err;
  run = Cli(absl::StrCat("forward ", Target(), " --layer 1 --input ", Path("missing.npy"),
                         " --output ", Path("y.npy")));
  EXPECT_EQ(run.exit_code, 1);
  EXPECT_NE(run.err.find("missing.npy"), std::string::npos) << run.err;

  EXPECT_EQ(Cli(absl::StrCat("forward ", Target(), " --layer 1 --input ", Path("x.npy"))).exit_code,
            2);  // no --output
  EXPECT_EQ(Cli(absl::StrCat("forward ", Target(), " --layer 1 --dtype int8", io)).exit_code, 2);
  EXPECT_EQ(Cli(absl::StrCat("forward ", Target(), " --layer x", io)).exit_code, 2);
  EXPECT_EQ(Cli("").exit_code, 2);
  EXPECT_EQ(Cli("frobnicate").exit_code, 2);
  EXPECT_EQ(Cli("--help").exit_code, 0);
  EXPECT_EQ(Cli("forward --help").exit_code, 0);
  const CliRun version = Cli("--version");
  EXPECT_EQ(version.exit_code, 0);
  EXPECT_EQ(version.out, absl::StrCat("moe-client ", Version(), " (commit ", GitCommit(), ")\n"));
  EXPECT_EQ(Cli("info --version").exit_code, 0);
  EXPECT_EQ(server_->total_calls(), 1);  // only the NOT_FOUND call reached the server
}

TEST_F(MoeClientCliTest, Health) {
  CliRun run = Cli(absl::StrCat("health ", Target()));
  EXPECT_EQ(run.exit_code, 0) << run.err;
  EXPECT_EQ(run.out, "SERVING\n");
  EXPECT_EQ(run.err, "");

  server_->SetServing(false);
  run = Cli(absl::StrCat("health ", Target()));
  EXPECT_EQ(run.exit_code, 1);
  EXPECT_EQ(run.out, "NOT_SERVING\n");
  run = Cli(absl::StrCat("health ", Target(), " --wait-s 0.3"));
  EXPECT_EQ(run.exit_code, 1);
  EXPECT_NE(run.err.find("DEADLINE_EXCEEDED"), std::string::npos) << run.err;

  server_->SetServing(true);
  run = Cli(absl::StrCat("health ", Target(), " --wait-s 5"));
  EXPECT_EQ(run.exit_code, 0) << run.err;
  EXPECT_EQ(run.out, "SERVING\n");

  EXPECT_EQ(Cli("health").exit_code, 2);  // no --target
  const std::string dead_target = server_->target();
  server_.reset();
  run = Cli(absl::StrCat("health --target ", dead_target));
  EXPECT_EQ(run.exit_code, 1);
  EXPECT_EQ(run.out, "");
  EXPECT_NE(run.err.find("UNAVAILABLE"), std::string::npos) << run.err;
}

TEST_F(MoeClientCliTest, Info) {
  CliRun run = Cli(absl::StrCat("info ", Target()));
  ASSERT_EQ(run.exit_code, 0) << run.err;
  EXPECT_NE(run.out.find("kimi_k3"), std::string::npos) << run.out;
  EXPECT_NE(run.out.find("1..3 (3)"), std::string::npos) << run.out;
  EXPECT_NE(run.out.find("experts 0..31"), std::string::npos) << run.out;
  EXPECT_NE(run.out.find("quantile-balancing"), std::string::npos) << run.out;

  run = Cli(absl::StrCat("info ", Target(), " --json"));
  ASSERT_EQ(run.exit_code, 0) << run.err;
  const nlohmann::json j = nlohmann::json::parse(run.out, nullptr, /*allow_exceptions=*/false);
  ASSERT_FALSE(j.is_discarded()) << run.out;
  EXPECT_EQ(j["family"], "kimi_k3");
  EXPECT_EQ(j["layers"], nlohmann::json::array({1, 2, 3}));
  EXPECT_EQ(j["hidden_size"], "8");  // proto3 JSON writes int64 as a string
  EXPECT_EQ(j["ranks"].size(), 2u);
}

// Parses the one JSON object `load --json` prints.
nlohmann::json LoadJson(const CliRun& run) {
  nlohmann::json j = nlohmann::json::parse(run.out, nullptr, /*allow_exceptions=*/false);
  EXPECT_FALSE(j.is_discarded()) << run.out << run.err;
  return j;
}

TEST_F(MoeClientCliTest, LoadCountsRequestsRoundRobinOverLayers) {
  const CliRun run = Cli(absl::StrCat(
      "load ", Target(), " --concurrency 4 --tokens 3 --requests 30 --warmup 1 --json"));
  ASSERT_EQ(run.exit_code, 0) << run.err;
  const nlohmann::json j = LoadJson(run);
  EXPECT_EQ(j["requests"], 30);
  EXPECT_EQ(j["ok"], 30);
  EXPECT_TRUE(j["errors"].empty()) << j.dump();
  EXPECT_EQ(j["tokens_per_request"], 3);
  EXPECT_EQ(j["concurrency"], 4);
  EXPECT_EQ(j["layers"], nlohmann::json::array({1, 2, 3}));
  EXPECT_GT(j["requests_per_s"].get<double>(), 0);
  EXPECT_GT(j["latency_ms"]["p99"].get<double>(), 0);
  EXPECT_LE(j["latency_ms"]["p50"].get<double>(), j["latency_ms"]["max"].get<double>());
  EXPECT_EQ(j["gateway"]["queue_us_mean"], 7.0);
  EXPECT_EQ(j["gateway"]["step_tokens_mean"], 3.0);
  // 30 measured + 1 warm-up per caller; the round-robin spreads them evenly.
  EXPECT_EQ(server_->total_calls(), 34);
  for (int layer : {1, 2, 3}) EXPECT_GE(server_->calls(layer), 11) << layer;
}

TEST_F(MoeClientCliTest, LoadOverOneStreamWithFileInput) {
  const std::vector<float> x = Input(2 * FakeMoeServer::kHidden);
  ASSERT_TRUE(WriteNpyFloat32(Path("x.npy"), {2, FakeMoeServer::kHidden}, x.data()).ok());
  const CliRun run = Cli(absl::StrCat("load ", Target(), " --layer 2 --input ", Path("x.npy"),
                                      " --concurrency 3 --requests 12 --warmup 0 --stream --json"));
  ASSERT_EQ(run.exit_code, 0) << run.err;
  const nlohmann::json j = LoadJson(run);
  EXPECT_EQ(j["ok"], 12);
  EXPECT_EQ(j["stream"], true);
  EXPECT_EQ(j["tokens_per_request"], 2);
  EXPECT_EQ(server_->calls(2), 12);
}

TEST_F(MoeClientCliTest, LoadCountsErrorsByCode) {
  const CliRun run = Cli(absl::StrCat(
      "load ", Target(), " --layer -1 --concurrency 2 --tokens 1 --requests 10 --json"));
  EXPECT_EQ(run.exit_code, 1);  // nothing succeeded
  const nlohmann::json j = LoadJson(run);
  EXPECT_EQ(j["ok"], 0);
  EXPECT_EQ(j["requests"], 10);
  EXPECT_EQ(j["errors"]["INVALID_ARGUMENT"], 10);
}

TEST_F(MoeClientCliTest, LoadTableAndUsage) {
  const CliRun run =
      Cli(absl::StrCat("load ", Target(), " --concurrency 2 --tokens 2 --duration-s 0.3"));
  ASSERT_EQ(run.exit_code, 0) << run.err;
  for (const char* word :
       {"requests", "latency ms", "p50", "p99", "requests/s", "tokens/s", "queue 7 us"})
    EXPECT_NE(run.out.find(word), std::string::npos) << word << "\n" << run.out;
  EXPECT_EQ(Cli(absl::StrCat("load ", Target(), " --requests 5 --duration-s 1")).exit_code, 2);
  EXPECT_EQ(Cli(absl::StrCat("load ", Target(), " --concurrency 0 --requests 5")).exit_code, 2);
}

}  // namespace
}  // namespace moe
