// The trust boundaries end to end: real moe-gateway and moe-rank processes on loopback, TLS
// and mTLS with certificates made by scripts/make-certs.sh (openssl) at test time, cluster /
// API / admin tokens, a rogue rank, certificate rotation, the concurrency limit.
//
// Every served result is compared bit for bit with the in-process layer: authentication must
// never change what a caller gets back.
#include <sys/wait.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "inference/grpc_service.grpc.pb.h"
#include "moe/v1/internal.grpc.pb.h"
#include "security/credentials.h"
#include "security/rank_handshake.h"
#include "security/tokens.h"
#include "tests/server/service_testing.h"
#include "tests/testing/child_process.h"
#include "tests/testing/local_cluster.h"
#include "tests/testing/recording_relay.h"
#include "tests/testing/test_checkpoints.h"

namespace moe {
namespace {

using testing::ClusterOptions;
using testing::LocalCluster;
using testing::TestCheckpoint;

std::string Dir() { return absl::StrCat(::testing::TempDir(), "/security_test_", getpid()); }

class SecurityTest : public ::testing::Test {
 protected:
  // Two independent CAs: `certs` (trusted) and `other` (a stranger's).
  static void SetUpTestSuite() {
    for (const char* name : {"certs", "other"}) {
      int code = 0;
      const std::string out =
          testing::Shell(absl::StrCat("bash ", MOE_SOURCE_DIR, "/scripts/make-certs.sh ", Dir(),
                                      "/", name, " 2>&1"),
                         &code);
      ASSERT_EQ(code, 0) << out;
    }
  }
  static void TearDownTestSuite() { std::filesystem::remove_all(Dir()); }

  static std::string Cert(const std::string& ca, const std::string& file) {
    return absl::StrCat(Dir(), "/", ca, "/", file);
  }
  static TlsFiles ClientTls(const std::string& ca, const std::string& identity = "") {
    TlsFiles tls;
    tls.ca = Cert(ca, "ca.pem");
    if (!identity.empty()) {
      tls.cert = Cert(ca, identity + ".pem");
      tls.key = Cert(ca, identity + ".key");
    }
    return tls;
  }

  void SetUp() override {
    checkpoint_ = TestCheckpoint("k3-mini");
    layer_ = (*Checkpoint::Open(checkpoint_))->layers().front();
    reference_ = std::make_unique<InProcess>(checkpoint_, layer_);
    x_ = RandomInput(5, reference_->config().hidden_size, 11);
    expected_ = reference_->Forward(x_);
  }

  ClusterOptions Options(int ranks = 2) {
    ClusterOptions options{checkpoint_, ranks};
    return options;
  }

  // mTLS on both ports with `certs`; the ranks' client certificate is their only credential.
  ClusterOptions MutualTlsOptions() {
    ClusterOptions options = Options();
    options.cluster_token = false;
    options.gateway_args = {"--tls-cert", Cert("certs", "gateway.pem"),
                            "--tls-key",  Cert("certs", "gateway.key"),
                            "--tls-ca",   Cert("certs", "ca.pem")};
    options.rank_args = {"--tls-ca",   Cert("certs", "ca.pem"),
                         "--tls-cert", Cert("certs", "rank.pem"),
                         "--tls-key",  Cert("certs", "rank.key")};
    options.client_tls = ClientTls("certs", "client");
    return options;
  }

  // A Forward of x_ over `channel`, as a caller holding `token` would make it.
  CallResult Forward(const std::shared_ptr<grpc::Channel>& channel, const std::string& token = "") {
    auto stub = moe::v1::MoeService::NewStub(channel);
    grpc::ClientContext context;
    AddBearerToken(&context, token);
    return Call(*stub, layer_, x_, {5, reference_->config().hidden_size}, absl::Seconds(30),
                moe::v1::FP32, &context);
  }

  static std::shared_ptr<grpc::Channel> Channel(const std::string& target, const TlsFiles& tls) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(64 << 20);
    AddTlsChannelArgs(tls, &args);
    auto credentials = ChannelCredentials(tls);
    EXPECT_TRUE(credentials.ok()) << credentials.status();
    return grpc::CreateCustomChannel(target, *credentials, args);
  }

  // grpc.health.v1 over a fresh channel (a new connection, so a new handshake).
  static grpc::Status Health(const std::string& target, const TlsFiles& tls) {
    auto stub = grpc::health::v1::Health::NewStub(Channel(target, tls));
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(3)));
    grpc::health::v1::HealthCheckResponse response;
    return stub->Check(&context, grpc::health::v1::HealthCheckRequest(), &response);
  }

  // A moe-rank process with the given extra flags, its log in the cluster's directory.
  // `once`: --exit-on-disconnect (a refusal ends it) and a 3 s connect timeout.
  std::unique_ptr<testing::ChildProcess> StartRank(LocalCluster& cluster, int rank,
                                                   std::vector<std::string> flags,
                                                   const std::string& log_name, bool once = true,
                                                   const std::string& binary = "moe-rank") {
    std::vector<std::string> argv = {testing::BinaryPath(binary),
                                     "--gateway",
                                     cluster.control_target(),
                                     "--rank",
                                     std::to_string(rank),
                                     "--threads",
                                     "1"};
    if (once) argv.insert(argv.end(), {"--exit-on-disconnect", "--connect-timeout-s", "3"});
    argv.insert(argv.end(), flags.begin(), flags.end());
    return std::make_unique<testing::ChildProcess>(argv,
                                                   absl::StrCat(cluster.dir(), "/", log_name));
  }

  std::string checkpoint_;
  int layer_ = 0;
  std::unique_ptr<InProcess> reference_;
  std::vector<float> x_, expected_;
};

TEST_F(SecurityTest, ATlsGatewayRefusesPlaintextAndServesTlsBitIdentical) {
  ClusterOptions options = Options();
  options.gateway_args = {"--tls-cert", Cert("certs", "gateway.pem"), "--tls-key",
                          Cert("certs", "gateway.key")};
  options.rank_args = {"--tls-ca", Cert("certs", "ca.pem")};
  options.client_tls = ClientTls("certs");
  LocalCluster cluster(options);
  ASSERT_TRUE(cluster.Start().ok()) << cluster.Logs();

  CallResult result = Forward(Channel(cluster.target(), ClientTls("certs")));
  ASSERT_TRUE(result.status.ok()) << result.status.error_message();
  EXPECT_EQ(result.output, expected_);
  // Plaintext to a TLS port: no handshake, no answer (health included).
  EXPECT_EQ(Health(cluster.target(), TlsFiles{}).error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_FALSE(Forward(Channel(cluster.target(), TlsFiles{})).status.ok());
  // A client that trusts another CA refuses the gateway's certificate.
  EXPECT_EQ(Health(cluster.target(), ClientTls("other")).error_code(),
            grpc::StatusCode::UNAVAILABLE);
  EXPECT_NE(cluster.gateway().Log().find(", TLS; waiting for"), std::string::npos);
}

TEST_F(SecurityTest, MutualTlsAdmitsOnlyCaSignedClientsAndRanks) {
  LocalCluster cluster(MutualTlsOptions());
  ASSERT_TRUE(cluster.Start().ok()) << cluster.Logs();

  CallResult result = Forward(Channel(cluster.target(), ClientTls("certs", "client")));
  ASSERT_TRUE(result.status.ok()) << result.status.error_message();
  EXPECT_EQ(result.output, expected_);
  EXPECT_EQ(Health(cluster.target(), ClientTls("certs")).error_code(),
            grpc::StatusCode::UNAVAILABLE)
      << "no client certificate";
  TlsFiles stranger = ClientTls("certs");
  stranger.cert = Cert("other", "client.pem");
  stranger.key = Cert("other", "client.key");
  EXPECT_EQ(Health(cluster.target(), stranger).error_code(), grpc::StatusCode::UNAVAILABLE)
      << "a certificate of another CA";

  // A rank with a stranger's certificate cannot register; the real ranks keep serving.
  auto rogue = StartRank(cluster, 1,
                         {"--tls-ca", Cert("certs", "ca.pem"), "--tls-cert",
                          Cert("other", "rank.pem"), "--tls-key", Cert("other", "rank.key")},
                         "rogue.log");
  const int status = rogue->Wait(absl::Seconds(20));
  ASSERT_NE(status, -1) << rogue->Log();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) != 0) << rogue->Log();
  EXPECT_TRUE(cluster.Serving());
  result = Forward(Channel(cluster.target(), ClientTls("certs", "client")));
  ASSERT_TRUE(result.status.ok()) << result.status.error_message();
  EXPECT_EQ(result.output, expected_);
}

TEST_F(SecurityTest, ARogueRankIsRefusedAndTheRealRankTakesItsSlotBack) {
  LocalCluster cluster(Options());
  ASSERT_TRUE(cluster.Start().ok()) << cluster.Logs();
  auto control = moe::v1::internal::RankControl::NewStub(
      grpc::CreateChannel(cluster.control_target(), grpc::InsecureChannelCredentials()));
  // A registration as moe-rank makes it, with `token` in place of the cluster token (or no
  // proof at all when it is empty).
  auto register_as = [&](int rank, const std::string& token) {
    moe::v1::internal::ChallengeResponse challenge;
    {
      grpc::ClientContext context;
      context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
      EXPECT_TRUE(
          control->Challenge(&context, moe::v1::internal::ChallengeRequest(), &challenge).ok());
      EXPECT_TRUE(challenge.token_required());
    }
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    context.AddMetadata(kRankIdKey, std::to_string(rank));
    context.AddMetadata(kRankNonceKey, challenge.nonce());
    if (!token.empty())
      context.AddMetadata(kRankProofKey, RegistrationProof(token, challenge.nonce(), rank));
    moe::v1::internal::RegisterRequest request;
    request.set_requested_rank(rank);
    moe::v1::internal::RegisterResponse response;
    grpc::Status status = control->Register(&context, request, &response);
    EXPECT_TRUE(response.checkpoint().empty()) << "a refused caller learns nothing";
    return status;
  };

  // The rank dies; its slot is free, and a process without the token tries to take it.
  cluster.rank(1).Signal(SIGKILL);
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (cluster.Serving() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(20));
  ASSERT_FALSE(cluster.Serving());
  grpc::Status refused = register_as(1, "");
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::UNAUTHENTICATED) << refused.error_message();
  EXPECT_NE(refused.error_message().find("no registration proof"), std::string::npos)
      << refused.error_message();
  refused = register_as(1, "guessed-token");
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(refused.error_message(), "wrong cluster token (registration proof does not match)");
  // The bearer token itself opens nothing: the control plane never takes it.
  {
    grpc::ClientContext context;
    AddBearerToken(&context, *ReadTokenFile(cluster.token_file()));
    context.AddMetadata(kRankIdKey, "1");
    moe::v1::internal::RegisterRequest request;
    request.set_requested_rank(1);
    moe::v1::internal::RegisterResponse response;
    EXPECT_EQ(control->Register(&context, request, &response).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
  }
  // A rank process with a wrong token file exits with the refusal.
  const std::string wrong = cluster.dir() + "/wrong-token";
  std::ofstream(wrong) << "not-the-token\n";
  auto rogue = StartRank(cluster, 1, {"--cluster-token-file", wrong}, "rogue.log");
  const int status = rogue->Wait(absl::Seconds(20));
  ASSERT_NE(status, -1) << rogue->Log();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 1) << rogue->Log();
  EXPECT_NE(rogue->Log().find("UNAUTHENTICATED: registering with"), std::string::npos)
      << rogue->Log();
  EXPECT_NE(rogue->Log().find("wrong cluster token"), std::string::npos) << rogue->Log();
  EXPECT_FALSE(cluster.Serving()) << "no rogue made the gateway ready";
  EXPECT_NE(cluster.gateway().Log().find("refused control call Register from "), std::string::npos)
      << cluster.gateway().Log();

  // The real rank returns (with the token) and the results are bit-identical again.
  auto returning =
      StartRank(cluster, 1, {"--cluster-token-file", cluster.token_file()}, "rank1-again.log");
  const absl::Time ready_by = absl::Now() + absl::Seconds(30);
  while (!cluster.Serving() && absl::Now() < ready_by) absl::SleepFor(absl::Milliseconds(50));
  ASSERT_TRUE(cluster.Serving()) << returning->Log() << cluster.Logs();
  CallResult result = Call(cluster.stub(), layer_, x_, {5, reference_->config().hidden_size});
  ASSERT_TRUE(result.status.ok()) << result.status.error_message();
  EXPECT_EQ(result.output, expected_);
}

// The control plane's refusals counted by the gateway (moe_auth_failures_total{plane="control"}).
double ControlAuthFailures(const LocalCluster& cluster) {
  const std::string metrics = testing::Shell(absl::StrCat(
      "curl -s --max-time 5 http://127.0.0.1:", cluster.gateway_metrics_port(), "/metrics"));
  const std::string series = "moe_auth_failures_total{plane=\"control\"} ";
  const size_t at = metrics.find(series);
  return at == std::string::npos ? -1 : std::stod(metrics.substr(at + series.size()));
}

TEST_F(SecurityTest, UnderMutualTlsOnlyARankCertificateRegisters) {
  ClusterOptions options = MutualTlsOptions();
  options.metrics = true;
  LocalCluster cluster(options);
  ASSERT_TRUE(cluster.Start().ok()) << cluster.Logs();
  EXPECT_NE(cluster.gateway().Log().find("mTLS, spiffe://moe-serve/rank"), std::string::npos);
  auto caller = Channel(cluster.target(), ClientTls("certs", "client"));
  cluster.rank(1).Signal(SIGKILL);
  const absl::Time down_by = absl::Now() + absl::Seconds(10);
  while (cluster.Serving() && absl::Now() < down_by) absl::SleepFor(absl::Milliseconds(20));
  ASSERT_FALSE(cluster.Serving());
  const double before = ControlAuthFailures(cluster);

  // The callers' and the gateway's certificates come from the same CA, and are refused.
  for (const char* identity : {"client", "gateway"}) {
    auto rogue = StartRank(cluster, 1,
                           {"--tls-ca", Cert("certs", "ca.pem"), "--tls-cert",
                            Cert("certs", absl::StrCat(identity, ".pem")), "--tls-key",
                            Cert("certs", absl::StrCat(identity, ".key"))},
                           absl::StrCat("rogue-", identity, ".log"));
    const int status = rogue->Wait(absl::Seconds(20));
    ASSERT_NE(status, -1) << rogue->Log();
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) != 0) << rogue->Log();
    EXPECT_NE(rogue->Log().find("PERMISSION_DENIED"), std::string::npos) << rogue->Log();
    EXPECT_NE(rogue->Log().find("not a rank's: it carries no URI SAN spiffe://moe-serve/rank"),
              std::string::npos)
        << rogue->Log();
    // No caller gets an answer meanwhile, right or wrong: rank 1's experts have no replica.
    CallResult result = Forward(caller);
    EXPECT_EQ(result.status.error_code(), grpc::StatusCode::UNAVAILABLE)
        << result.status.error_message();
  }
  EXPECT_FALSE(cluster.Serving());
  EXPECT_GE(ControlAuthFailures(cluster), before + 2);
  EXPECT_NE(cluster.gateway().Log().find("refused control call Challenge"), std::string::npos)
      << cluster.gateway().Log();

  // The real rank's certificate still registers, and the results are the reference's again.
  auto returning = StartRank(cluster, 1,
                             {"--tls-ca", Cert("certs", "ca.pem"), "--tls-cert",
                              Cert("certs", "rank.pem"), "--tls-key", Cert("certs", "rank.key")},
                             "rank1-again.log");
  const absl::Time ready_by = absl::Now() + absl::Seconds(30);
  while (!cluster.Serving() && absl::Now() < ready_by) absl::SleepFor(absl::Milliseconds(50));
  ASSERT_TRUE(cluster.Serving()) << returning->Log() << cluster.Logs();
  CallResult result = Forward(caller);
  ASSERT_TRUE(result.status.ok()) << result.status.error_message();
  EXPECT_EQ(result.output, expected_);
}

TEST_F(SecurityTest, ARankCaOfItsOwnKeepsEveryOtherCertificateOffTheControlPort) {
  // Callers and the gateway's identity from `certs`; ranks from `other`, through --rank-ca.
  ClusterOptions options = Options();
  options.cluster_token = false;
  options.gateway_args = {
      "--tls-cert", Cert("certs", "gateway.pem"), "--tls-key", Cert("certs", "gateway.key"),
      "--tls-ca",   Cert("certs", "ca.pem"),      "--rank-ca", Cert("other", "ca.pem")};
  options.rank_args = {"--tls-ca",   Cert("certs", "ca.pem"),
                       "--tls-cert", Cert("other", "rank.pem"),
                       "--tls-key",  Cert("other", "rank.key")};
  options.client_tls = ClientTls("certs", "client");
  LocalCluster cluster(options);
  ASSERT_TRUE(cluster.Start().ok()) << cluster.Logs();
  CallResult result = Forward(Channel(cluster.target(), ClientTls("certs", "client")));
  ASSERT_TRUE(result.status.ok()) << result.status.error_message();
  EXPECT_EQ(result.output, expected_);
  // A rank certificate of the callers' CA, identity and all, fails the handshake.
  cluster.rank(1).Signal(SIGKILL);
  auto rogue = StartRank(cluster, 1,
                         {"--tls-ca", Cert("certs", "ca.pem"), "--tls-cert",
                          Cert("certs", "rank.pem"), "--tls-key", Cert("certs", "rank.key")},
                         "rogue.log");
  const int status = rogue->Wait(absl::Seconds(20));
  ASSERT_NE(status, -1) << rogue->Log();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) != 0) << rogue->Log();
  EXPECT_FALSE(cluster.Serving());
}

TEST_F(SecurityTest, ARecordedRegistrationHoldsNoTokenAndCannotBeReplayed) {
  ClusterOptions options = Options();
  options.metrics = true;
  LocalCluster cluster(options);
  ASSERT_TRUE(cluster.Start().ok()) << cluster.Logs();
  const std::string token = *ReadTokenFile(cluster.token_file());
  cluster.rank(1).Signal(SIGKILL);
  const absl::Time down_by = absl::Now() + absl::Seconds(10);
  while (cluster.Serving() && absl::Now() < down_by) absl::SleepFor(absl::Milliseconds(20));
  ASSERT_FALSE(cluster.Serving());

  // Rank 1 comes back through a proxy that records everything it sends to the control port.
  testing::RecordingRelay relay(cluster.control_port());
  std::vector<std::string> argv = {testing::BinaryPath("moe-rank"),
                                   "--gateway",
                                   absl::StrCat("127.0.0.1:", relay.port()),
                                   "--rank",
                                   "1",
                                   "--threads",
                                   "1",
                                   "--exit-on-disconnect",
                                   "--cluster-token-file",
                                   cluster.token_file()};
  auto recorded_rank =
      std::make_unique<testing::ChildProcess>(argv, cluster.dir() + "/rank1-relayed.log");
  const absl::Time ready_by = absl::Now() + absl::Seconds(30);
  while (!cluster.Serving() && absl::Now() < ready_by) absl::SleepFor(absl::Milliseconds(50));
  ASSERT_TRUE(cluster.Serving()) << recorded_rank->Log() << cluster.Logs();
  CallResult result = Call(cluster.stub(), layer_, x_, {5, reference_->config().hidden_size});
  ASSERT_TRUE(result.status.ok()) << result.status.error_message();
  EXPECT_EQ(result.output, expected_);
  recorded_rank->Signal(SIGKILL);
  recorded_rank->Wait(absl::Seconds(10));
  const absl::Time gone_by = absl::Now() + absl::Seconds(10);
  while (cluster.Serving() && absl::Now() < gone_by) absl::SleepFor(absl::Milliseconds(20));
  ASSERT_FALSE(cluster.Serving());

  const std::vector<std::string> recorded = relay.client_bytes();
  ASSERT_FALSE(recorded.empty());
  ASSERT_NE(recorded[0].find("moe-rank-proof"), std::string::npos) << "the recording is real";
  for (const std::string& bytes : recorded)
    EXPECT_EQ(bytes.find(token), std::string::npos) << "the token crossed the wire";

  // The whole recorded connection, replayed verbatim: its registration and its exchange are
  // both refused and counted; the slot stays free. The log shows whichever refusal came first
  // (one line a second; the two streams of the connection are served concurrently).
  const double before = ControlAuthFailures(cluster);
  testing::Replay(cluster.control_port(), recorded[0], absl::Seconds(2));
  EXPECT_GE(ControlAuthFailures(cluster), before + 2) << cluster.gateway().Log();
  const std::string log = cluster.gateway().Log();
  EXPECT_TRUE(
      log.find("registration nonce already used (a replayed registration)") != std::string::npos ||
      log.find("session already used by an exchange (a replayed exchange") != std::string::npos)
      << log;
  EXPECT_FALSE(cluster.Serving());
  result = Call(cluster.stub(), layer_, x_, {5, reference_->config().hidden_size});
  EXPECT_EQ(result.status.error_code(), grpc::StatusCode::UNAVAILABLE)
      << result.status.error_message();

  // The real rank, with the token, takes the slot and serves the reference's results.
  auto returning =
      StartRank(cluster, 1, {"--cluster-token-file", cluster.token_file()}, "rank1-again.log");
  const absl::Time back_by = absl::Now() + absl::Seconds(30);
  while (!cluster.Serving() && absl::Now() < back_by) absl::SleepFor(absl::Milliseconds(50));
  ASSERT_TRUE(cluster.Serving()) << returning->Log() << cluster.Logs();
  result = Call(cluster.stub(), layer_, x_, {5, reference_->config().hidden_size});
  ASSERT_TRUE(result.status.ok()) << result.status.error_message();
  EXPECT_EQ(result.output, expected_);
}

TEST_F(SecurityTest, AReplacementRankWaitsOutAHungPredecessorAndTakesItsSlot) {
  ClusterOptions options = Options();
  options.gateway_args = {"--rank-timeout-ms", "1000", "--heartbeat-ms", "100"};
  LocalCluster cluster(options);
  ASSERT_TRUE(cluster.Start().ok()) << cluster.Logs();
  // Rank 1 hangs (still registered and counted up), and its replacement starts at once.
  cluster.rank(1).Signal(SIGSTOP);
  auto replacement = StartRank(cluster, 1, {"--cluster-token-file", cluster.token_file()},
                               "replacement.log", /*once=*/false);
  ASSERT_FALSE(replacement->WaitForLog("is already registered and up", absl::Seconds(10)).empty())
      << replacement->Log();
  // Liveness marks the hung one down within its timeout; the replacement registers.
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (absl::Now() < deadline && replacement->Log().find("ready in") == std::string::npos)
    absl::SleepFor(absl::Milliseconds(50));
  while (absl::Now() < deadline && !cluster.Serving()) absl::SleepFor(absl::Milliseconds(50));
  ASSERT_TRUE(cluster.Serving()) << replacement->Log() << cluster.Logs();
  EXPECT_TRUE(replacement->running()) << "it retried instead of exiting";
  CallResult result = Call(cluster.stub(), layer_, x_, {5, reference_->config().hidden_size});
  ASSERT_TRUE(result.status.ok()) << result.status.error_message();
  EXPECT_EQ(result.output, expected_);
  cluster.rank(1).Signal(SIGKILL);
}

TEST_F(SecurityTest, RankControlIsNotServedOnThePublicPort) {
  LocalCluster cluster(Options(1));
  ASSERT_TRUE(cluster.Start().ok()) << cluster.Logs();
  ASSERT_NE(cluster.control_port(), cluster.port());
  auto control = moe::v1::internal::RankControl::NewStub(
      grpc::CreateChannel(cluster.target(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  AddBearerToken(&context, *ReadTokenFile(cluster.token_file()));
  moe::v1::internal::RegisterResponse response;
  const grpc::Status s =
      control->Register(&context, moe::v1::internal::RegisterRequest(), &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNIMPLEMENTED) << s.error_message();
}

TEST_F(SecurityTest, ApiAndAdminTokensAreEnforcedAndHealthStaysOpen) {
  const std::string dir = Dir();
  std::ofstream(dir + "/api-token") << "api-secret-1\n";
  std::ofstream(dir + "/admin-token") << "admin-secret-2\n";
  ClusterOptions options = Options();
  options.gateway_args = {"--api-token-file", dir + "/api-token", "--admin-token-file",
                          dir + "/admin-token", "--allow-bias-override"};
  LocalCluster cluster(options);
  ASSERT_TRUE(cluster.Start().ok()) << cluster.Logs();  // health answers without a token
  auto channel = grpc::CreateChannel(cluster.target(), grpc::InsecureChannelCredentials());

  CallResult result = Forward(channel);
  EXPECT_EQ(result.status.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(Forward(channel, "api-secret-0").status.error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  result = Forward(channel, "api-secret-1");
  ASSERT_TRUE(result.status.ok()) << result.status.error_message();
  EXPECT_EQ(result.output, expected_);

  auto diagnostics = moe::v1::MoeDiagnostics::NewStub(channel);
  auto load_balance = [&](const std::string& token) {
    grpc::ClientContext context;
    AddBearerToken(&context, token);
    moe::v1::GetLoadBalanceRequest request;
    request.set_layer(layer_);
    moe::v1::LoadBalanceReport report;
    return diagnostics->GetLoadBalance(&context, request, &report);
  };
  EXPECT_EQ(load_balance("api-secret-1").error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(load_balance("").error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_TRUE(load_balance("admin-secret-2").ok());
  // Steering the router needs the admin token even with --allow-bias-override.
  auto set_bias = [&](const std::string& token) {
    grpc::ClientContext context;
    AddBearerToken(&context, token);
    moe::v1::SetRouterBiasRequest request;
    request.set_layer(layer_);
    request.mutable_bias()->Resize(reference_->config().routing.num_experts, 0.25f);
    request.set_source("security_test");
    moe::v1::SetRouterBiasResponse response;
    return diagnostics->SetRouterBias(&context, request, &response);
  };
  EXPECT_EQ(set_bias("").error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(set_bias("api-secret-1").error_code(), grpc::StatusCode::PERMISSION_DENIED);
  const grpc::Status biased = set_bias("admin-secret-2");
  EXPECT_TRUE(biased.ok()) << biased.error_message();
  {  // back to the checkpoint's bias, so the outputs below are the reference's
    grpc::ClientContext context;
    AddBearerToken(&context, "admin-secret-2");
    moe::v1::SetRouterBiasRequest request;
    request.set_layer(layer_);
    moe::v1::SetRouterBiasResponse response;
    ASSERT_TRUE(diagnostics->SetRouterBias(&context, request, &response).ok());
  }

  // The Open Inference Protocol: the same caller token for inference and metadata; its
  // liveness and readiness probes stay open, as health does.
  auto kserve = inference::GRPCInferenceService::NewStub(channel);
  inference::ModelInferResponse inferred;
  auto infer = [&](const std::string& token) {
    grpc::ClientContext context;
    AddBearerToken(&context, token);
    inference::ModelInferRequest request;
    request.set_model_name(absl::StrCat("moe-layer-", layer_));
    auto* input = request.add_inputs();
    input->set_name("hidden_states");
    input->set_datatype("FP32");
    input->add_shape(5);
    input->add_shape(reference_->config().hidden_size);
    request.add_raw_input_contents(
        std::string(reinterpret_cast<const char*>(x_.data()), x_.size() * sizeof(float)));
    inferred.Clear();
    return kserve->ModelInfer(&context, request, &inferred);
  };
  EXPECT_EQ(infer("").error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(infer("api-secret-0").error_code(), grpc::StatusCode::UNAUTHENTICATED);
  ASSERT_TRUE(infer("api-secret-1").ok());
  ASSERT_EQ(inferred.raw_output_contents_size(), 1);
  std::vector<float> output(expected_.size());
  ASSERT_EQ(inferred.raw_output_contents(0).size(), output.size() * sizeof(float));
  std::memcpy(output.data(), inferred.raw_output_contents(0).data(), output.size() * sizeof(float));
  EXPECT_EQ(output, expected_);  // bit for bit, as Forward
  {
    grpc::ClientContext context;
    inference::ModelMetadataRequest request;
    request.set_name(absl::StrCat("moe-layer-", layer_));
    inference::ModelMetadataResponse response;
    EXPECT_EQ(kserve->ModelMetadata(&context, request, &response).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
  }
  {
    grpc::ClientContext context;
    inference::ModelReadyRequest request;
    request.set_name(absl::StrCat("moe-layer-", layer_));
    inference::ModelReadyResponse response;
    ASSERT_TRUE(kserve->ModelReady(&context, request, &response).ok());
    EXPECT_TRUE(response.ready());
  }
}

TEST_F(SecurityTest, RotatedCertificatesServeNewConnectionsWhileRankStreamsStay) {
  // The gateway's files live in a directory of their own, replaced by rename (atomically).
  const std::string live = Dir() + "/live";
  std::filesystem::create_directories(live);
  for (const char* file : {"gateway.pem", "gateway.key"})
    std::filesystem::copy_file(Cert("certs", file), live + "/" + file,
                               std::filesystem::copy_options::overwrite_existing);
  ClusterOptions options = Options();
  options.gateway_args = {"--tls-cert",          live + "/gateway.pem", "--tls-key",
                          live + "/gateway.key", "--tls-reload-s",      "1"};
  options.rank_args = {"--tls-ca", Cert("certs", "ca.pem")};
  options.client_tls = ClientTls("certs");
  LocalCluster cluster(options);
  ASSERT_TRUE(cluster.Start().ok()) << cluster.Logs();
  ASSERT_TRUE(Health(cluster.target(), ClientTls("certs")).ok());

  for (const char* file : {"gateway.pem", "gateway.key"}) {
    std::filesystem::copy_file(Cert("other", file), live + "/" + file + ".new");
    std::filesystem::rename(live + "/" + file + ".new", live + "/" + file);
  }
  // Within a few reload periods new handshakes present the new certificate...
  const absl::Time deadline = absl::Now() + absl::Seconds(15);
  while (!Health(cluster.target(), ClientTls("other")).ok() && absl::Now() < deadline)
    absl::SleepFor(absl::Milliseconds(200));
  ASSERT_TRUE(Health(cluster.target(), ClientTls("other")).ok()) << cluster.Logs();
  EXPECT_FALSE(Health(cluster.target(), ClientTls("certs")).ok());
  // ...and the ranks, connected under the old one, still serve: nothing was dropped.
  CallResult result = Forward(Channel(cluster.target(), ClientTls("other")));
  ASSERT_TRUE(result.status.ok()) << result.status.error_message();
  EXPECT_EQ(result.output, expected_);
  EXPECT_EQ(cluster.gateway().Log().find("DOWN"), std::string::npos) << cluster.Logs();
}

TEST_F(SecurityTest, RequestsBeyondTheConcurrencyLimitAreRefusedAtOnce) {
  ClusterOptions options = Options(1);
  options.gateway_args = {"--max-concurrent-requests", "1"};
  options.rank_args = {"--debug-step-delay-ms", "1500"};
  options.rank_binary = "moe-rank-faults";
  LocalCluster cluster(options);
  ASSERT_TRUE(cluster.Start().ok()) << cluster.Logs();
  CallResult slow;
  const int64_t hidden = reference_->config().hidden_size;
  std::thread first([&] { slow = Call(cluster.stub(), layer_, x_, {5, hidden}); });
  absl::SleepFor(absl::Milliseconds(500));  // the first call is inside the step now
  const absl::Time t0 = absl::Now();
  CallResult second = Call(cluster.stub(), layer_, x_, {5, hidden});
  const absl::Duration waited = absl::Now() - t0;
  first.join();
  ASSERT_TRUE(slow.status.ok()) << slow.status.error_message();
  EXPECT_EQ(slow.output, expected_);
  EXPECT_EQ(second.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(second.status.error_message().find("--max-concurrent-requests"), std::string::npos)
      << second.status.error_message();
  EXPECT_LT(waited, absl::Milliseconds(500)) << "refused at once, not queued";
}

TEST_F(SecurityTest, AStepWithNonFiniteOutputFailsNamingTheRankNeverOk) {
  ClusterOptions options = Options(2);
  LocalCluster cluster(options);
  ASSERT_TRUE(cluster.Start().ok()) << cluster.Logs();
  // Rank 1 is replaced by a faulty one (it answers NaN partial sums).
  cluster.rank(1).Signal(SIGKILL);
  auto faulty =
      StartRank(cluster, 1, {"--cluster-token-file", cluster.token_file(), "--debug-nan-partials"},
                "faulty.log", /*once=*/true, "moe-rank-faults");
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (absl::Now() < deadline && cluster.gateway().Log().find("ready (2 ranks)") ==
                                       cluster.gateway().Log().rfind("ready (2 ranks)"))
    absl::SleepFor(absl::Milliseconds(50));
  ASSERT_TRUE(cluster.Serving()) << cluster.Logs();
  // 64 tokens choose experts on both ranks (top-2 of 64, split 32 / 32).
  const std::vector<float> x = RandomInput(64, reference_->config().hidden_size, 5);
  CallResult result = Call(cluster.stub(), layer_, x, {64, reference_->config().hidden_size});
  EXPECT_EQ(result.status.error_code(), grpc::StatusCode::INTERNAL)
      << result.status.error_message();
  EXPECT_NE(result.status.error_message().find("rank 1 returned non-finite partial sums"),
            std::string::npos)
      << result.status.error_message();
  const std::string log = cluster.gateway().Log();
  EXPECT_NE(log.find(absl::StrCat("moe: layer ", layer_, " step ")), std::string::npos) << log;
  EXPECT_NE(log.find("non-finite output"), std::string::npos) << log;
}

}  // namespace
}  // namespace moe
