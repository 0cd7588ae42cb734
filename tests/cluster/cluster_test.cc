// moe-cluster end to end, with stand-ins: `moe-gateway` is a script that records its argv and
// execs cluster_fake_gateway (a real grpc.health.v1 server), `moe-rank` is a script that
// records its argv and pid and sleeps.
#include <errno.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "server/cluster/process_group.h"

namespace moe {
namespace {

const std::string kBinDir = MOE_BINARY_DIR "/bin";
const std::string kSourceDir = MOE_SOURCE_DIR;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

std::vector<std::string> ReadLines(const std::string& path) {
  return absl::StrSplit(ReadFile(path), '\n', absl::SkipEmpty());
}

void WriteExecutable(const std::string& path, const std::string& text) {
  std::ofstream(path) << text;
  chmod(path.c_str(), 0755);
}

bool WaitForFile(const std::string& path, absl::Duration timeout = absl::Seconds(20)) {
  const absl::Time deadline = absl::Now() + timeout;
  while (access(path.c_str(), F_OK) != 0) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return true;
}

pid_t ReadPid(const std::string& path) {
  int pid = -1;
  if (!WaitForFile(path) || !absl::SimpleAtoi(absl::StripAsciiWhitespace(ReadFile(path)), &pid))
    return -1;
  return pid;
}

// True once `pid` is gone (exited and reaped).
bool Gone(pid_t pid) { return pid > 0 && kill(pid, 0) == -1 && errno == ESRCH; }

// A running child of `parent` whose NUL-separated command line (NULs read as newlines)
// contains `args`; -1 if none.
pid_t ChildRunning(pid_t parent, const std::string& args) {
  for (const auto& entry : std::filesystem::directory_iterator("/proc")) {
    int pid;
    if (!absl::SimpleAtoi(entry.path().filename().string(), &pid)) continue;
    const std::string stat = ReadFile(entry.path().string() + "/stat");
    const size_t close_paren = stat.rfind(')');
    if (close_paren == std::string::npos) continue;
    std::vector<std::string> fields = absl::StrSplit(stat.substr(close_paren + 2), ' ');
    int ppid;
    if (fields.size() < 2 || fields[0] == "Z" || !absl::SimpleAtoi(fields[1], &ppid) ||
        ppid != parent)
      continue;
    std::string cmdline = ReadFile(entry.path().string() + "/cmdline");
    std::replace(cmdline.begin(), cmdline.end(), '\0', '\n');
    if (cmdline.find(args) != std::string::npos) return pid;
  }
  return -1;
}

// A TCP port nobody listens on right now.
int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  socklen_t len = sizeof addr;
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

// One moe-cluster run: stdout lines are collected, stderr goes to a file.
class ClusterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/cluster_test_XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    WriteExecutable(dir_ + "/moe-gateway",
                    absl::StrCat("#!/bin/sh\n"
                                 "dir=$(dirname \"$0\")\n"
                                 "port=unknown; prev=\n"
                                 "for a in \"$@\"; do [ \"$prev\" = --port ] && port=$a; prev=$a; done\n"
                                 "printf '%s\\n' \"$@\" > \"$dir/gateway.argv\"\n"
                                 "printf '%s\\n' \"$@\" > \"$dir/gateway-$port.argv\"\n"
                                 "echo $$ > \"$dir/gateway.pid\"\n"
                                 "exec ",
                                 kBinDir, "/cluster_fake_gateway \"$@\"\n"));
    WriteExecutable(dir_ + "/moe-rank",
                    "#!/bin/sh\n"
                    "dir=$(dirname \"$0\")\n"
                    "rank=unknown; prev=\n"
                    "for a in \"$@\"; do [ \"$prev\" = --rank ] && rank=$a; prev=$a; done\n"
                    "printf '%s\\n' \"$@\" > \"$dir/rank-$rank.argv\"\n"
                    "echo $$ > \"$dir/rank-$rank.pid.tmp\" && "
                    "mv \"$dir/rank-$rank.pid.tmp\" \"$dir/rank-$rank.pid\"\n"
                    "echo \"fake rank $rank up\"\n"
                    "exec sleep 600\n");
    port_ = FreePort();
    ProcessGroup::Options options;
    options.on_line = [this](const std::string&, absl::string_view line) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        stdout_.emplace_back(line);
      }
      cv_.notify_all();
    };
    group_ = std::make_unique<ProcessGroup>(options);
  }

  void TearDown() override {
    group_.reset();
    std::error_code ignored;
    std::filesystem::remove_all(dir_, ignored);
  }

  void StartCluster(const std::vector<std::string>& args) {
    // Under ThreadSanitizer, moe-cluster and the fake gateway run gRPC, which TSan cannot see
    // into (tsan.supp); elsewhere the variable is ignored.
    std::vector<std::string> argv = {
        "/bin/sh", "-c",
        absl::StrCat("TSAN_OPTIONS=\"${TSAN_OPTIONS:-} ignore_noninstrumented_modules=1 "
                     "suppressions=",
                     kSourceDir, "/tests/cluster/tsan.supp\" exec \"$0\" \"$@\" 2>", dir_,
                     "/stderr"),
        kBinDir + "/moe-cluster"};
    argv.insert(argv.end(), args.begin(), args.end());
    absl::StatusOr<pid_t> pid = group_->Start("moe-cluster", argv);
    ASSERT_TRUE(pid.ok()) << pid.status();
    pid_ = *pid;
  }

  // The standard flags plus `more`.
  std::vector<std::string> Args(int ranks, std::vector<std::string> more = {}) {
    std::vector<std::string> args = {
        "--checkpoint", "/ckpt/k3-mini",       "--ranks",   std::to_string(ranks),
        "--port",       std::to_string(port_), "--bin-dir", dir_};
    args.insert(args.end(), more.begin(), more.end());
    return args;
  }

  std::string ReadyLine(int ranks) const {
    return absl::StrCat("moe-cluster: ready on 127.0.0.1:", port_, " (", ranks,
                        ranks == 1 ? " rank)" : " ranks)");
  }

  bool WaitForStdout(const std::string& line, absl::Duration timeout = absl::Seconds(30)) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, absl::ToChronoMilliseconds(timeout), [&] {
      for (const auto& l : stdout_)
        if (l == line) return true;
      return false;
    });
  }

  std::vector<std::string> Stdout() {
    std::lock_guard<std::mutex> lock(mu_);
    return stdout_;
  }

  // moe-cluster's exit, within `timeout`.
  ChildExit WaitExit(absl::Duration timeout = absl::Seconds(30)) {
    absl::optional<ChildExit> exit = group_->WaitForExit(pid_, absl::Now() + timeout);
    EXPECT_TRUE(exit.has_value()) << "moe-cluster still running; stderr:\n" << Stderr();
    return exit.value_or(ChildExit());
  }

  std::string Stderr() const { return ReadFile(dir_ + "/stderr"); }
  bool WaitForStderr(const std::string& text, absl::Duration timeout = absl::Seconds(10)) {
    const absl::Time deadline = absl::Now() + timeout;
    while (Stderr().find(text) == std::string::npos) {
      if (absl::Now() > deadline) return false;
      absl::SleepFor(absl::Milliseconds(20));
    }
    return true;
  }

  std::string dir_;
  int port_ = 0;
  pid_t pid_ = -1;
  std::unique_ptr<ProcessGroup> group_;
  // std::mutex: TSan cannot see into Debian's uninstrumented absl::Mutex.
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::string> stdout_;  // moe-cluster's stdout lines; guarded by mu_
};

TEST_F(ClusterTest, StartsGatewayAndRanksReportsReadyAndStopsOnSigterm) {
  const int metrics = port_ > 30000 ? port_ - 1000 : port_ + 1000;
  StartCluster(Args(2, {"--metrics-port", std::to_string(metrics), "--threads-per-rank", "3", "--",
                        "--serve-after-ms", "300"}));
  ASSERT_TRUE(WaitForStdout(ReadyLine(2))) << Stderr();

  // No --cluster-token-file: moe-cluster made one for the run, private to this user.
  const std::vector<std::string> gateway_argv = ReadLines(dir_ + "/gateway.argv");
  ASSERT_EQ(gateway_argv.size(), 18u) << Stderr();
  const std::string token_file = gateway_argv[15];
  EXPECT_EQ(gateway_argv,
            (std::vector<std::string>{
                "--checkpoint", "/ckpt/k3-mini", "--port", std::to_string(port_), "--ranks", "2",
                "--metrics-port", std::to_string(metrics), "--host", "127.0.0.1",
                "--drain-timeout-s", "30", "--control-port", std::to_string(port_ + 1),
                "--cluster-token-file", token_file, "--serve-after-ms", "300"}));
  struct stat file_stat, dir_stat;
  ASSERT_EQ(stat(token_file.c_str(), &file_stat), 0) << token_file;
  ASSERT_EQ(stat(token_file.substr(0, token_file.rfind('/')).c_str(), &dir_stat), 0);
  EXPECT_EQ(file_stat.st_mode & 0777, 0600u);
  EXPECT_EQ(dir_stat.st_mode & 0777, 0700u);
  EXPECT_EQ(ReadFile(token_file).size(), 64u) << "32 random bytes in hex";
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(WaitForFile(absl::StrCat(dir_, "/rank-", i, ".pid")));
    EXPECT_EQ(ReadLines(absl::StrCat(dir_, "/rank-", i, ".argv")),
              (std::vector<std::string>{
                  "--gateway", absl::StrCat("127.0.0.1:", port_ + 1), "--rank", std::to_string(i),
                  "--cluster-token-file", token_file, "--threads", "3", "--metrics-port",
                  std::to_string(metrics + 1 + i), "--metrics-host", "127.0.0.1"}));
  }
  const pid_t gateway = ReadPid(dir_ + "/gateway.pid");
  const pid_t rank0 = ReadPid(dir_ + "/rank-0.pid");
  const pid_t rank1 = ReadPid(dir_ + "/rank-1.pid");
  ASSERT_FALSE(Gone(gateway) || Gone(rank0) || Gone(rank1));

  ASSERT_EQ(kill(pid_, SIGTERM), 0);
  const ChildExit exit = WaitExit();
  EXPECT_TRUE(exit.success()) << exit.Describe() << "\n" << Stderr();
  EXPECT_TRUE(Gone(gateway) && Gone(rank0) && Gone(rank1));
  EXPECT_EQ(Stdout(), std::vector<std::string>{ReadyLine(2)});
  EXPECT_NE(stat(token_file.c_str(), &file_stat), 0) << "the run's token is removed at exit";

  // Child output reached stderr whole and prefixed.
  const std::string err = Stderr();
  EXPECT_NE(err.find("\n[gateway] fake gateway argv: --checkpoint /ckpt/k3-mini"),
            std::string::npos)
      << err;
  EXPECT_NE(err.find("\n[gateway] fake gateway: SERVING\n"), std::string::npos) << err;
  EXPECT_NE(err.find("\n[rank 0] fake rank 0 up\n"), std::string::npos) << err;
  EXPECT_NE(err.find("\n[rank 1] fake rank 1 up\n"), std::string::npos) << err;
}

TEST_F(ClusterTest, NoMetricsFlagsWithoutMetricsPort) {
  StartCluster(Args(1, {"--control-port", std::to_string(port_ + 7), "--cluster-token-file",
                        dir_ + "/token", "--", "--serve-after-ms", "0"}));
  ASSERT_TRUE(WaitForStdout(ReadyLine(1))) << Stderr();
  ASSERT_TRUE(WaitForFile(dir_ + "/rank-0.pid"));
  EXPECT_EQ(ReadLines(dir_ + "/rank-0.argv"),
            (std::vector<std::string>{"--gateway", absl::StrCat("127.0.0.1:", port_ + 7), "--rank",
                                      "0", "--cluster-token-file", dir_ + "/token"}));
  EXPECT_EQ(ReadFile(dir_ + "/gateway.argv").find("metrics"), std::string::npos);
  ASSERT_EQ(kill(pid_, SIGINT), 0);
  EXPECT_TRUE(WaitExit().success()) << Stderr();
}

TEST_F(ClusterTest, MetricsPortZeroMeansAnyFreePortForEveryProcess) {
  // As moe-gateway and moe-rank read --metrics-port 0 (not "off", which is -1, the default).
  StartCluster(Args(1, {"--control-port", std::to_string(port_ + 7), "--cluster-token-file",
                        dir_ + "/token", "--metrics-port", "0", "--", "--serve-after-ms", "0"}));
  ASSERT_TRUE(WaitForStdout(ReadyLine(1))) << Stderr();
  ASSERT_TRUE(WaitForFile(dir_ + "/rank-0.pid"));
  const std::vector<std::string> rank = ReadLines(dir_ + "/rank-0.argv");
  const auto at = std::find(rank.begin(), rank.end(), "--metrics-port");
  ASSERT_NE(at, rank.end());
  ASSERT_NE(at + 1, rank.end());
  EXPECT_EQ(*(at + 1), "0");
  EXPECT_NE(ReadFile(dir_ + "/gateway.argv").find("--metrics-port\n0\n"), std::string::npos)
      << ReadFile(dir_ + "/gateway.argv");
  ASSERT_EQ(kill(pid_, SIGINT), 0);
  EXPECT_TRUE(WaitExit().success()) << Stderr();
}

TEST_F(ClusterTest, RankDeathStopsTheClusterWithFailure) {
  StartCluster(Args(2, {"--", "--serve-after-ms", "100"}));
  ASSERT_TRUE(WaitForStdout(ReadyLine(2))) << Stderr();
  const pid_t gateway = ReadPid(dir_ + "/gateway.pid");
  const pid_t rank0 = ReadPid(dir_ + "/rank-0.pid");
  const pid_t rank1 = ReadPid(dir_ + "/rank-1.pid");
  ASSERT_GT(rank1, 0);

  ASSERT_EQ(kill(rank1, SIGKILL), 0);
  const ChildExit exit = WaitExit();
  EXPECT_TRUE(exit.exited() && exit.exit_code() == 1) << exit.Describe();
  EXPECT_TRUE(Gone(gateway) && Gone(rank0) && Gone(rank1));
  const std::string err = Stderr();
  EXPECT_NE(err.find(absl::StrCat("moe-cluster: rank 1 (pid ", rank1,
                                  ") killed by signal 9 (SIGKILL) unexpectedly")),
            std::string::npos)
      << err;
  EXPECT_NE(err.find("[gateway] fake gateway: signal 15, shutting down"), std::string::npos) << err;
}

TEST_F(ClusterTest, StopsTheGatewayFirstAndTheRanksOnlyOnceItHasDrained) {
  StartCluster(Args(2, {"--", "--serve-after-ms", "0", "--drain-ms", "1000"}));
  ASSERT_TRUE(WaitForStdout(ReadyLine(2))) << Stderr();
  const pid_t rank0 = ReadPid(dir_ + "/rank-0.pid");
  const pid_t rank1 = ReadPid(dir_ + "/rank-1.pid");
  ASSERT_EQ(kill(pid_, SIGTERM), 0);
  absl::SleepFor(absl::Milliseconds(500));  // the gateway is draining: it needs the ranks
  EXPECT_FALSE(Gone(rank0) || Gone(rank1)) << Stderr();
  const ChildExit exit = WaitExit();
  EXPECT_TRUE(exit.success()) << exit.Describe() << "\n" << Stderr();
  EXPECT_TRUE(Gone(rank0) && Gone(rank1));
  const std::string err = Stderr();
  const size_t drained = err.find("[gateway] fake gateway: drained");
  const size_t rank_stopped = err.find("moe-cluster: rank 0 (pid ");
  ASSERT_NE(drained, std::string::npos) << err;
  ASSERT_NE(rank_stopped, std::string::npos) << err;
  EXPECT_LT(drained, rank_stopped) << err;
}

TEST_F(ClusterTest, RestartRanksStartsADeadRankAgainWithBackoff) {
  StartCluster(Args(2, {"--restart-ranks", "--", "--serve-after-ms", "0"}));
  ASSERT_TRUE(WaitForStdout(ReadyLine(2))) << Stderr();
  const pid_t gateway = ReadPid(dir_ + "/gateway.pid");
  const pid_t first = ReadPid(dir_ + "/rank-1.pid");
  ASSERT_GT(first, 0);
  ASSERT_EQ(kill(first, SIGKILL), 0);
  // A new rank 1 within the first backoff (1 s) and some slack; the rest runs on.
  pid_t second = first;
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (second == first && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(50));
    second = ReadPid(dir_ + "/rank-1.pid");
  }
  ASSERT_NE(second, first) << Stderr();
  EXPECT_FALSE(Gone(gateway));
  EXPECT_NE(Stderr().find(absl::StrCat("moe-cluster: rank 1 (pid ", first,
                                       ") killed by signal 9 (SIGKILL); restarting in 1s")),
            std::string::npos)
      << Stderr();
  // Killed again at once: the backoff has doubled.
  ASSERT_EQ(kill(second, SIGKILL), 0);
  ASSERT_TRUE(WaitForStderr("restarting in 2s"));

  ASSERT_EQ(kill(pid_, SIGTERM), 0);
  const ChildExit exit = WaitExit();
  EXPECT_TRUE(exit.success()) << exit.Describe() << "\n" << Stderr();
  EXPECT_TRUE(Gone(gateway));
}

TEST_F(ClusterTest, GatewayExitBeforeListeningFails) {
  StartCluster(Args(2, {"--", "--exit-code", "3"}));
  const ChildExit exit = WaitExit();
  EXPECT_TRUE(exit.exited() && exit.exit_code() == 1) << exit.Describe();
  const std::string err = Stderr();
  EXPECT_NE(err.find("[gateway] fake gateway: exiting with code 3"), std::string::npos) << err;
  EXPECT_NE(err.find("exited with code 3 unexpectedly"), std::string::npos) << err;
  EXPECT_EQ(access((dir_ + "/rank-0.argv").c_str(), F_OK), -1);  // no rank was started
  EXPECT_TRUE(Stdout().empty());
}

TEST_F(ClusterTest, ReadyTimeoutExitsOneAndStopsEverything) {
  StartCluster(Args(1, {"--ready-timeout-s", "1.5", "--", "--never-serve"}));
  const ChildExit exit = WaitExit();
  EXPECT_TRUE(exit.exited() && exit.exit_code() == 1) << exit.Describe();
  const std::string err = Stderr();
  EXPECT_NE(err.find("moe-cluster: not ready after 1.5 s (--ready-timeout-s): gateway health "
                     "check: NOT_SERVING; stopping"),
            std::string::npos)
      << err;
  EXPECT_TRUE(Stdout().empty());
  EXPECT_TRUE(Gone(ReadPid(dir_ + "/gateway.pid")));
  EXPECT_TRUE(Gone(ReadPid(dir_ + "/rank-0.pid")));
}

TEST_F(ClusterTest, StragglerIsKilledAfterStopTimeout) {
  StartCluster(Args(1, {"--stop-timeout-s", "0.5", "--drain-timeout-s", "0", "--", "--ignore-term",
                        "--serve-after-ms", "0"}));
  ASSERT_TRUE(WaitForStdout(ReadyLine(1))) << Stderr();
  const pid_t gateway = ReadPid(dir_ + "/gateway.pid");
  ASSERT_EQ(kill(pid_, SIGTERM), 0);
  const ChildExit exit = WaitExit();
  EXPECT_TRUE(exit.success()) << exit.Describe();
  EXPECT_TRUE(Gone(gateway));
  const std::string err = Stderr();
  EXPECT_NE(err.find("moe-cluster: sending SIGKILL to gateway"), std::string::npos) << err;
  EXPECT_NE(err.find("gateway (pid "), std::string::npos) << err;
}

TEST_F(ClusterTest, MissingBinariesAndBadFlags) {
  StartCluster({"--checkpoint", "x", "--ranks", "1", "--bin-dir", "/nonexistent"});
  ChildExit exit = WaitExit();
  EXPECT_EQ(exit.exit_code(), 1);
  EXPECT_NE(Stderr().find("no executable /nonexistent/moe-gateway"), std::string::npos);

  for (const std::vector<std::string>& bad :
       {std::vector<std::string>{"--ranks", "1"}, Args(0), Args(1, {"stray"}),
        Args(1, {"--metrics-port", std::to_string(port_ - 1)}), Args(1, {"--port", "70000"})}) {
    StartCluster(bad);
    exit = WaitExit();
    EXPECT_EQ(exit.exit_code(), 2) << Stderr();
  }
  EXPECT_TRUE(Stdout().empty());
}

// The real moe-gateway and moe-rank (found next to moe-cluster, no --bin-dir) on a small
// synthetic k3-mini checkpoint. Skips when they are not built.
TEST_F(ClusterTest, SeveralGatewaysShareTheRanks) {
  const int metrics = port_ > 30000 ? port_ - 1000 : port_ + 1000;
  StartCluster(Args(2, {"--gateways", "2", "--metrics-port", std::to_string(metrics),
                        "--cluster-token-file", dir_ + "/token", "--", "--serve-after-ms", "100"}));
  const std::string ready = absl::StrCat("moe-cluster: ready on 127.0.0.1:", port_, ",127.0.0.1:",
                                         port_ + 1, " (2 ranks, 2 gateways)");
  ASSERT_TRUE(WaitForStdout(ready)) << Stderr();
  // Gateway g: public port + g, control port (--port + 2) + g, metrics M + g; rank i: M + 2 + i.
  for (int g = 0; g < 2; ++g) {
    const std::vector<std::string> argv =
        ReadLines(absl::StrCat(dir_, "/gateway-", port_ + g, ".argv"));
    EXPECT_EQ(argv, (std::vector<std::string>{
                        "--checkpoint", "/ckpt/k3-mini", "--port", std::to_string(port_ + g),
                        "--ranks", "2", "--metrics-port", std::to_string(metrics + g), "--host",
                        "127.0.0.1", "--drain-timeout-s", "30", "--control-port",
                        std::to_string(port_ + 2 + g), "--cluster-token-file", dir_ + "/token",
                        "--serve-after-ms", "100"}))
        << Stderr();
  }
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(WaitForFile(absl::StrCat(dir_, "/rank-", i, ".pid")));
    EXPECT_EQ(ReadLines(absl::StrCat(dir_, "/rank-", i, ".argv")),
              (std::vector<std::string>{
                  "--gateway", absl::StrCat("127.0.0.1:", port_ + 2, ",127.0.0.1:", port_ + 3),
                  "--rank", std::to_string(i), "--cluster-token-file", dir_ + "/token",
                  "--metrics-port", std::to_string(metrics + 2 + i), "--metrics-host",
                  "127.0.0.1"}));
  }
  const std::string err = Stderr();
  EXPECT_NE(err.find("\n[gateway 0] fake gateway: SERVING\n"), std::string::npos) << err;
  EXPECT_NE(err.find("\n[gateway 1] fake gateway: SERVING\n"), std::string::npos) << err;
  ASSERT_EQ(kill(pid_, SIGTERM), 0);
  EXPECT_TRUE(WaitExit().success()) << Stderr();
}

TEST_F(ClusterTest, PortsOfSeveralGatewaysMustNotOverlap) {
  // Gateways on P, P+1 and control ports from P+1: refused before anything starts.
  StartCluster(Args(1, {"--gateways", "2", "--control-port", std::to_string(port_ + 1)}));
  const ChildExit exit = WaitExit();
  EXPECT_TRUE(exit.exited() && exit.exit_code() == 2) << exit.Describe() << "\n" << Stderr();
  EXPECT_NE(Stderr().find("overlap --port"), std::string::npos) << Stderr();
}

TEST_F(ClusterTest, RealGatewaysOverOneRankPoolAndARestartedGateway) {
  for (const char* program : {"moe-gateway", "moe-rank", "moe-ckpt"}) {
    if (access((kBinDir + "/" + program).c_str(), X_OK) != 0) {
      GTEST_SKIP() << program << " not built";
    }
  }
  const std::string checkpoint = dir_ + "/k3-mini";
  ASSERT_EQ(std::system((kBinDir + "/moe-ckpt --preset k3-mini --layers 1 --quiet --out " +
                         checkpoint + " > /dev/null")
                            .c_str()),
            0);
  StartCluster({"--checkpoint", checkpoint, "--ranks", "2", "--gateways", "2", "--port",
                std::to_string(port_), "--threads-per-rank", "1", "--restart-gateways"});
  const std::string ready = absl::StrCat("moe-cluster: ready on 127.0.0.1:", port_, ",127.0.0.1:",
                                         port_ + 1, " (2 ranks, 2 gateways)");
  ASSERT_TRUE(WaitForStdout(ready, absl::Seconds(120))) << Stderr();
  const pid_t gateway1 = ChildRunning(pid_, absl::StrCat("--port\n", port_ + 1, "\n"));
  ASSERT_GT(gateway1, 0) << Stderr();
  ASSERT_EQ(kill(gateway1, SIGKILL), 0);
  // Started again; the ranks, still serving gateway 0, register with it anew.
  auto count = [&](const std::string& text) {
    const std::string err = Stderr();
    size_t n = 0;
    for (size_t at = err.find(text); at != std::string::npos; at = err.find(text, at + 1)) ++n;
    return n;
  };
  const std::string gateway1_ready = "[gateway 1] moe-gateway: ready (2 ranks)";
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (count(gateway1_ready) < 2 && absl::Now() < deadline)
    absl::SleepFor(absl::Milliseconds(50));
  EXPECT_EQ(count(gateway1_ready), 2u) << Stderr();
  EXPECT_EQ(count("[gateway 0] moe-gateway: ready (2 ranks)"), 1u) << "gateway 0 never lost them";
  EXPECT_NE(Stderr().find("restarting in 1s (--restart-gateways)"), std::string::npos);
  ASSERT_EQ(kill(pid_, SIGTERM), 0);
  const ChildExit exit = WaitExit();
  EXPECT_TRUE(exit.success()) << exit.Describe() << "\n" << Stderr();
}

TEST_F(ClusterTest, RealGatewayAndRanks) {
  for (const char* program : {"moe-gateway", "moe-rank", "moe-ckpt"}) {
    if (access((kBinDir + "/" + program).c_str(), X_OK) != 0) {
      GTEST_SKIP() << program << " not built";
    }
  }
  const std::string checkpoint = dir_ + "/k3-mini";
  ASSERT_EQ(std::system((kBinDir + "/moe-ckpt --preset k3-mini --layers 1 --quiet --out " +
                         checkpoint + " > /dev/null")
                            .c_str()),
            0);
  StartCluster({"--checkpoint", checkpoint, "--ranks", "2", "--port", std::to_string(port_),
                "--threads-per-rank", "1", "--restart-ranks"});
  ASSERT_TRUE(WaitForStdout(ReadyLine(2), absl::Seconds(120))) << Stderr();
  // A real rank killed is started again and registers: the gateway is ready once more.
  const pid_t rank1 = ChildRunning(pid_, "--rank\n1\n");
  ASSERT_GT(rank1, 0) << Stderr();
  ASSERT_EQ(kill(rank1, SIGKILL), 0);
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  auto ready_lines = [&] {
    const std::string err = Stderr();
    size_t n = 0;
    for (size_t at = err.find("moe-gateway: ready (2 ranks)"); at != std::string::npos;
         at = err.find("moe-gateway: ready (2 ranks)", at + 1))
      ++n;
    return n;
  };
  while (ready_lines() < 2 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(50));
  EXPECT_EQ(ready_lines(), 2u) << "rank 1 did not rejoin\n" << Stderr();
  EXPECT_NE(ChildRunning(pid_, "--rank\n1\n"), rank1);
  ASSERT_EQ(kill(pid_, SIGTERM), 0);
  const ChildExit exit = WaitExit();
  EXPECT_TRUE(exit.success()) << exit.Describe() << "\n" << Stderr();
  const std::string err = Stderr();
  EXPECT_NE(err.find("\n[gateway] "), std::string::npos) << err;
  EXPECT_NE(err.find("\n[rank 1] "), std::string::npos) << err;
  EXPECT_EQ(Stdout(), std::vector<std::string>{ReadyLine(2)});
}

}  // namespace
}  // namespace moe
