// The moe-client binary against real moe-gateway and moe-rank processes on loopback: the
// commands that reach MoeDiagnostics (balance, set-bias, placement --out / --from --apply) and
// forward --random / float64 inputs, with outputs checked against the in-process layer bit for
// bit. (tests/client/moe_client_cli_test.cc covers flags and formats against a fake server.)
#include <sys/wait.h>

#include <cstdlib>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "core/npy.h"
#include "core/numerics.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/server/service_testing.h"
#include "tests/testing/child_process.h"
#include "tests/testing/local_cluster.h"
#include "tests/testing/test_checkpoints.h"

namespace moe {
namespace {

using testing::ClusterOptions;
using testing::LocalCluster;
using testing::TestCheckpoint;

struct CliRun {
  int exit_code = -1;
  std::string out, err;
};

std::string ReadText(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

class ClientCliServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    checkpoint_ = TestCheckpoint("k3-mini");
    layer_ = (*Checkpoint::Open(checkpoint_))->layers().back();
    reference_ = std::make_unique<InProcess>(checkpoint_, layer_);
  }

  // `moe-client <args>` against `cluster`, stdout and stderr captured.
  CliRun Cli(const LocalCluster& cluster, const std::string& args) {
    const std::string out = Path("stdout.txt"), err = Path("stderr.txt");
    CliRun run;
    const int status =
        std::system(absl::StrCat(testing::BinaryPath("moe-client"), " ", args, " --target ",
                                 cluster.target(), " >", out, " 2>", err)
                        .c_str());
    run.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    run.out = ReadText(out);
    run.err = ReadText(err);
    return run;
  }
  std::string Path(const std::string& name) const {
    return absl::StrCat(::testing::TempDir(), "client_cli_service_", getpid(), "_", name);
  }
  std::string L() const { return absl::StrCat(" --layer ", layer_); }

  std::string checkpoint_;
  int layer_ = 0;
  std::unique_ptr<InProcess> reference_;
};

TEST_F(ClientCliServiceTest, ForwardRandomAndFloat64InputsMatchTheInProcessLayer) {
  LocalCluster cluster(ClusterOptions{checkpoint_, 2});
  ASSERT_TRUE(cluster.Start().ok()) << cluster.Logs();
  const int64_t hidden = reference_->config().hidden_size;
  for (int tokens : {1, 3, 257}) {
    SCOPED_TRACE(tokens);
    const CliRun run =
        Cli(cluster, absl::StrCat("forward", L(), " --random ", tokens, " --seed 9 --save-input ",
                                  Path("x.npy"), " --output ", Path("y.npy")));
    ASSERT_EQ(run.exit_code, 0) << run.err;
    absl::StatusOr<NpyArray> x = ReadNpy(Path("x.npy"));
    absl::StatusOr<NpyArray> y = ReadNpy(Path("y.npy"));
    ASSERT_TRUE(x.ok() && y.ok());
    ASSERT_EQ(x->shape, (std::vector<int64_t>{tokens, hidden}));
    EXPECT_EQ(y->data, reference_->Forward(x->data));
  }
  // numpy's default dtype: float64 values are rounded to float32 as read.
  std::vector<double> x64(3 * hidden);
  std::vector<float> x32(x64.size());
  const std::vector<float> seed = RandomInput(3, hidden, 4);
  for (size_t i = 0; i < x64.size(); ++i) {
    x64[i] = static_cast<double>(seed[i]) * (1.0 + 1e-9);  // not a float32 value
    x32[i] = static_cast<float>(x64[i]);
  }
  std::ofstream(Path("x64.npy"), std::ios::binary)
      << EncodeNpy("<f8", {3, hidden}, x64.data(), x64.size() * sizeof(double));
  const CliRun run = Cli(cluster, absl::StrCat("forward", L(), " --input ", Path("x64.npy"),
                                               " --output ", Path("y64.npy")));
  ASSERT_EQ(run.exit_code, 0) << run.err;
  EXPECT_EQ(ReadNpy(Path("y64.npy"))->data, reference_->Forward(x32));
  // bf16 bit patterns, as uint16 or as ml_dtypes.bfloat16 saves them ('V2'), with --input-bf16.
  std::vector<uint16_t> bits(x32.size());
  std::vector<float> x_bf16(x32.size());
  for (size_t i = 0; i < bits.size(); ++i) {
    bits[i] = FloatToBf16Bits(x32[i]);
    x_bf16[i] = Bf16BitsToFloat(bits[i]);
  }
  const std::vector<float> want_bf16 = reference_->Forward(x_bf16);
  for (const char* descr : {"<u2", "<V2"}) {
    SCOPED_TRACE(descr);
    std::ofstream(Path("xb.npy"), std::ios::binary)
        << EncodeNpy(descr, {3, hidden}, bits.data(), bits.size() * sizeof(uint16_t));
    CliRun bf16 =
        Cli(cluster, absl::StrCat("forward", L(), " --input ", Path("xb.npy"),
                                  " --input-bf16 --dtype bf16 --output ", Path("yb.npy")));
    ASSERT_EQ(bf16.exit_code, 0) << bf16.err;
    EXPECT_EQ(ReadNpy(Path("yb.npy"))->data, want_bf16);
    bf16 = Cli(cluster, absl::StrCat("forward", L(), " --input ", Path("xb.npy"), " --output ",
                                     Path("yb.npy")));
    EXPECT_EQ(bf16.exit_code, 1);
    EXPECT_NE(bf16.err.find("give --input-bf16"), std::string::npos) << bf16.err;
  }
  EXPECT_EQ(Cli(cluster, absl::StrCat("forward", L(), " --output ", Path("y.npy"))).exit_code, 2);
  EXPECT_EQ(Cli(cluster, absl::StrCat("forward", L(), " --random 2 --input ", Path("x64.npy"),
                                      " --output ", Path("y.npy")))
                .exit_code,
            2);
}

TEST_F(ClientCliServiceTest, BalanceSetBiasAndPlacementFilesThroughTheCli) {
  ClusterOptions options{checkpoint_, 2};
  options.gateway_args = {"--allow-bias-override", "--allow-placement-changes"};
  LocalCluster cluster(options);
  ASSERT_TRUE(cluster.Start().ok()) << cluster.Logs();

  // Traffic, with the load generator's progress line every second.
  CliRun run =
      Cli(cluster, absl::StrCat("load", L(), " --tokens 16 --concurrency 2 --duration-s 2.5"));
  ASSERT_EQ(run.exit_code, 0) << run.err;
  EXPECT_NE(run.err.find("moe-client load: 1 s, "), std::string::npos) << run.err;
  EXPECT_NE(run.err.find("moe-client load: 2 s, "), std::string::npos) << run.err;

  run = Cli(cluster, absl::StrCat("balance", L(), " --json"));
  ASSERT_EQ(run.exit_code, 0) << run.err;
  const nlohmann::json report = nlohmann::json::parse(run.out);
  const int64_t window_tokens = std::stoll(report["windowTokens"].get<std::string>());
  EXPECT_GT(window_tokens, 0);
  int64_t rank_tokens = 0;
  for (const auto& t : report["rankTokens"]) rank_tokens += std::stoll(t.get<std::string>());
  EXPECT_GE(rank_tokens, window_tokens);  // each token goes to at least one rank
  int64_t assignments = 0;
  for (const auto& t : report["expertTokens"]) assignments += std::stoll(t.get<std::string>());
  EXPECT_EQ(assignments, window_tokens * reference_->config().routing.top_k);
  run = Cli(cluster, absl::StrCat("balance", L()));
  ASSERT_EQ(run.exit_code, 0) << run.err;
  EXPECT_NE(run.out.find("rank balancedness"), std::string::npos) << run.out;

  // QB's suggestion installed: model info shows the override, then --reset restores the bias.
  run = Cli(cluster, absl::StrCat("set-bias", L(), " --from-qb --source cli-test"));
  ASSERT_EQ(run.exit_code, 0) << run.err;
  run = Cli(cluster, "info --json");
  ASSERT_EQ(run.exit_code, 0) << run.err;
  EXPECT_NE(run.out.find("cli-test"), std::string::npos) << run.out;
  run = Cli(cluster, absl::StrCat("balance", L(), " --json"));
  const nlohmann::json after = nlohmann::json::parse(run.out);
  ASSERT_EQ(after["currentBias"].size(), report["quantileBalancing"]["bias"].size());
  EXPECT_EQ(after["currentBias"], report["quantileBalancing"]["bias"]);
  ASSERT_EQ(Cli(cluster, absl::StrCat("set-bias", L(), " --reset")).exit_code, 0);
  EXPECT_EQ(Cli(cluster, absl::StrCat("set-bias", L(), " --reset --from-qb")).exit_code, 2);
  run = Cli(cluster, absl::StrCat("set-bias --layer 99 --reset"));
  EXPECT_EQ(run.exit_code, 1);
  EXPECT_NE(run.err.find("NOT_FOUND"), std::string::npos) << run.err;

  // A placement file from the advice, then applied from the file.
  run = Cli(cluster, absl::StrCat("placement --redundant 2 --out ", Path("placement.txt")));
  ASSERT_EQ(run.exit_code, 0) << run.err;
  EXPECT_FALSE(ReadText(Path("placement.txt")).empty());
  run = Cli(cluster, absl::StrCat("placement --from ", Path("placement.txt"), " --apply"));
  ASSERT_EQ(run.exit_code, 0) << run.err;
  EXPECT_NE(run.out.find("placement generation 2 serving"), std::string::npos) << run.out;
  // Still the same bits after the change.
  const std::vector<float> x = RandomInput(3, reference_->config().hidden_size, 8);
  std::ofstream(Path("x.npy"), std::ios::binary)
      << EncodeNpy("<f4", {3, reference_->config().hidden_size}, x.data(), x.size() * 4);
  run = Cli(cluster,
            absl::StrCat("forward", L(), " --input ", Path("x.npy"), " --output ", Path("y.npy")));
  ASSERT_EQ(run.exit_code, 0) << run.err;
  EXPECT_EQ(ReadNpy(Path("y.npy"))->data, reference_->Forward(x));
}

}  // namespace
}  // namespace moe
