// Load-balance observability end to end: a real Prometheus server scrapes a running cluster,
// Quantile Balancing diagnostics on a skewed router, and an EPLB placement that improves the
// measured balance while the outputs stay identical. And a rank's load progress: its gauge and
// its log lines.
#include <signal.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <regex>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kernels/cpu/tiers.h"
#include "model/dispatch.h"
#include "moe/v1/moe.grpc.pb.h"
#include "nlohmann/json.hpp"
#include "proto/tensor_codec.h"
#include "tests/testing/local_cluster.h"
#include "tests/testing/test_checkpoints.h"

namespace moe {
namespace {

using testing::ChildProcess;
using testing::ClusterOptions;
using testing::LocalCluster;
using testing::TestCheckpoint;

using testing::Shell;

int FreePort() {
  // Bind-and-release through the kernel's ephemeral allocator (Prometheus needs a fixed one).
  const std::string out = Shell(
      "/usr/bin/python3 -c \"import socket;s=socket.socket();s.bind(('127.0.0.1',0));"
      "print(s.getsockname()[1])\"");
  return std::atoi(out.c_str());
}

struct Workload {
  std::vector<std::vector<float>> inputs;
  std::vector<int64_t> tokens;
};

Workload MakeWorkload(int requests, int64_t max_tokens, uint32_t seed) {
  Workload w;
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int i = 0; i < requests; ++i) {
    const int64_t t = 1 + static_cast<int64_t>(rng() % max_tokens);
    std::vector<float> x(t * 640);
    for (float& v : x) v = normal(rng);
    w.inputs.push_back(std::move(x));
    w.tokens.push_back(t);
  }
  return w;
}

// Runs the workload on `layer`; returns the outputs and appends the routing ids.
std::vector<std::vector<float>> RunWorkload(LocalCluster& cluster, const Workload& w, int layer,
                                            std::vector<int32_t>* ids) {
  std::vector<std::vector<float>> outputs;
  for (size_t i = 0; i < w.inputs.size(); ++i) {
    moe::v1::ForwardRequest request;
    request.set_layer(layer);
    request.set_return_routing(true);
    EXPECT_TRUE(EncodeTensor(w.inputs[i].data(), {w.tokens[i], 640}, moe::v1::FP32,
                             request.mutable_hidden_states())
                    .ok());
    grpc::ClientContext context;
    moe::v1::ForwardResponse response;
    const grpc::Status s = cluster.stub().Forward(&context, request, &response);
    EXPECT_TRUE(s.ok()) << s.error_message();
    auto out = DecodeTensor(response.output());
    outputs.push_back(out.ok() ? out->values : std::vector<float>());
    if (ids != nullptr)
      ids->insert(ids->end(), response.routing().expert_ids().begin(),
                  response.routing().expert_ids().end());
  }
  return outputs;
}

class PrometheusServer {
 public:
  PrometheusServer(const std::map<std::string, std::vector<int>>& jobs) {
    dir_ = absl::StrCat(::testing::TempDir(), "/prometheus_", getpid());
    std::filesystem::create_directories(dir_);
    std::ofstream config(dir_ + "/prometheus.yml");
    config << "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n";
    for (const auto& [job, ports] : jobs) {
      config << "  - job_name: " << job << "\n    static_configs:\n      - targets: [";
      for (size_t i = 0; i < ports.size(); ++i)
        config << (i ? ", " : "") << "'127.0.0.1:" << ports[i] << "'";
      config << "]\n";
    }
    config.close();
    port_ = FreePort();
    process_ = std::make_unique<ChildProcess>(
        std::vector<std::string>{"/usr/bin/prometheus", "--config.file=" + dir_ + "/prometheus.yml",
                                 "--storage.tsdb.path=" + dir_ + "/data",
                                 absl::StrCat("--web.listen-address=127.0.0.1:", port_)},
        dir_ + "/prometheus.log");
  }
  ~PrometheusServer() {
    process_.reset();
    std::filesystem::remove_all(dir_);
  }
  // Instant query; returns the result vector (empty on failure).
  nlohmann::json Query(const std::string& promql) const {
    const std::string out =
        Shell(absl::StrCat("curl -s --max-time 5 -G http://127.0.0.1:", port_,
                           "/api/v1/query --data-urlencode 'query=", promql, "'"));
    auto j = nlohmann::json::parse(out, nullptr, false);
    if (j.is_discarded() || j.value("status", "") != "success") return nlohmann::json::array();
    return j["data"]["result"];
  }
  std::string Log() const { return process_->Log(); }

 private:
  std::string dir_;
  int port_ = 0;
  std::unique_ptr<ChildProcess> process_;
};

TEST(ObservabilityTest, PrometheusSeesExactlyTheTokensTheRoutingSent) {
  const std::string dir = TestCheckpoint("k3-mini");
  ClusterOptions options{dir, 3};
  options.metrics = true;
  LocalCluster cluster(options);
  ASSERT_TRUE(cluster.Start().ok()) << cluster.Logs();

  // Every endpoint passes promtool's lint.
  std::vector<int> rank_ports;
  for (int r = 0; r < 3; ++r) rank_ports.push_back(cluster.rank_metrics_port(r));
  for (int port : std::vector<int>{cluster.gateway_metrics_port(), rank_ports[0], rank_ports[1],
                                   rank_ports[2]}) {
    int rc = -1;
    const std::string out = Shell(
        absl::StrCat("curl -s http://127.0.0.1:", port, "/metrics | promtool check metrics 2>&1"),
        &rc);
    EXPECT_EQ(rc, 0) << "port " << port << ": " << out;
    // The probes beside /metrics: alive, and ready (every rank registered; the gateway serving).
    for (const char* path : {"/healthz", "/readyz"})
      EXPECT_EQ(Shell(absl::StrCat("curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:", port,
                                   path)),
                "200")
          << "port " << port << path;
  }
  // The images' rank probe reads the same answers.
  for (int port : rank_ports) {
    int rc = -1;
    const std::string out =
        Shell(absl::StrCat("bash ", MOE_SOURCE_DIR, "/docker/moe-rank-probe ", port, " 2>&1"), &rc);
    EXPECT_EQ(rc, 0) << out;
  }
  PrometheusServer prometheus(
      {{"moe-gateway", {cluster.gateway_metrics_port()}}, {"moe-rank", rank_ports}});

  // A known workload on both layers; the expected counts come from the routing the API returned.
  const ExpertPlacement placement = ExpertPlacement::Contiguous(64, 3);
  std::map<std::pair<int, int>, int64_t> expected;  // (layer, rank) -> token rows
  for (int layer : {1, 2}) {
    std::vector<int32_t> ids;
    RunWorkload(cluster, MakeWorkload(12, 40, 100 + layer), layer, &ids);
    for (size_t t = 0; t < ids.size() / 2; ++t) {
      std::set<int> ranks = {placement.replicas[ids[2 * t]][0].rank,
                             placement.replicas[ids[2 * t + 1]][0].rank};
      for (int r : ranks) expected[{layer, r}]++;
    }
  }
  // Wait until Prometheus has scraped the final values.
  std::map<std::pair<int, int>, int64_t> gateway_seen, rank_seen;
  for (int attempt = 0; attempt < 200; ++attempt) {
    gateway_seen.clear();
    rank_seen.clear();
    for (const auto& s : prometheus.Query("moe_rank_tokens_total"))
      gateway_seen[{std::stoi(s["metric"]["layer"].get<std::string>()),
                    std::stoi(s["metric"]["rank"].get<std::string>())}] =
          std::llround(std::stod(s["value"][1].get<std::string>()));
    // The ranks count what they received, under their own `rank` label; their scrape address
    // tells which rank they are, and the two must agree.
    for (const auto& s :
         prometheus.Query("sum by (layer, rank, instance) (moe_rank_received_tokens_total)")) {
      const std::string instance = s["metric"]["instance"].get<std::string>();
      const int port = std::stoi(instance.substr(instance.rfind(':') + 1));
      const int rank = static_cast<int>(std::find(rank_ports.begin(), rank_ports.end(), port) -
                                        rank_ports.begin());
      ASSERT_TRUE(s["metric"].contains("rank")) << s.dump();
      EXPECT_EQ(s["metric"]["rank"].get<std::string>(), std::to_string(rank)) << s.dump();
      rank_seen[{std::stoi(s["metric"]["layer"].get<std::string>()), rank}] =
          std::llround(std::stod(s["value"][1].get<std::string>()));
    }
    bool done = true;
    for (const auto& [key, count] : expected)
      done &= gateway_seen[key] == count && rank_seen[key] == count;
    if (done) break;
    absl::SleepFor(absl::Milliseconds(100));
  }
  for (const auto& [key, count] : expected) {
    EXPECT_EQ(gateway_seen[key], count)
        << "gateway view, layer " << key.first << " rank " << key.second << "\n"
        << prometheus.Log();
    EXPECT_EQ(rank_seen[key], count) << "rank view, layer " << key.first << " rank " << key.second;
  }
  // Every moe_* series a rank exports names its rank (process_* and moe_build_info describe the
  // process).
  for (const auto& s : prometheus.Query("{job=\"moe-rank\", __name__=~\"moe_.*\", "
                                        "__name__!=\"moe_build_info\"}"))
    EXPECT_TRUE(s["metric"].contains("rank")) << s.dump();
  EXPECT_EQ(prometheus.Query("{job=\"moe-rank\", __name__=~\"moe_.*\"}").size() > 10, true);
  // The rank-up gauge and balancedness are there too.
  EXPECT_EQ(prometheus.Query("sum(moe_rank_up)")[0]["value"][1].get<std::string>(), "3");
  EXPECT_FALSE(prometheus.Query("moe_load_balancedness{layer=\"1\"}").empty());

  // A rank gone (its experts have no other replica): the gateway's /readyz says so, with why.
  cluster.rank(0).Signal(SIGKILL);
  std::string readyz;
  const absl::Time until = absl::Now() + absl::Seconds(20);
  while (absl::Now() < until) {
    readyz = Shell(absl::StrCat("curl -s -i http://127.0.0.1:", cluster.gateway_metrics_port(),
                                "/readyz"));
    if (readyz.find("503") != std::string::npos) break;
    absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_NE(readyz.find("HTTP/1.1 503"), std::string::npos) << readyz;
  EXPECT_NE(readyz.find("not ready: 2 of 3 ranks up"), std::string::npos) << readyz;
}

double Report(LocalCluster& cluster, int layer, moe::v1::LoadBalanceReport* report) {
  auto diagnostics = moe::v1::MoeDiagnostics::NewStub(
      grpc::CreateChannel(cluster.target(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  moe::v1::GetLoadBalanceRequest request;
  request.set_layer(layer);
  EXPECT_TRUE(diagnostics->GetLoadBalance(&context, request, report).ok());
  return report->rank_balancedness();
}

TEST(ObservabilityTest, SkewedRouterQuantileBalancingAndEplbPlacement) {
  const std::string dir = TestCheckpoint("k3-mini-skewed");
  const Workload workload = MakeWorkload(24, 100, 7);
  std::vector<std::vector<float>> first_outputs;
  double observed, predicted, contiguous_rank_balance, placed_rank_balance, predicted_placement;
  std::string placement_text;
  std::vector<float> qb_bias;
  {
    LocalCluster cluster(
        ClusterOptions{dir, 4, {"--qb-window-tokens", "4096", "--allow-bias-override"}});
    ASSERT_TRUE(cluster.Start().ok()) << cluster.Logs();
    first_outputs = RunWorkload(cluster, workload, 1, nullptr);
    moe::v1::LoadBalanceReport report;
    contiguous_rank_balance = Report(cluster, 1, &report);
    const auto& qb = report.quantile_balancing();
    observed = qb.observed_balancedness();
    predicted = qb.predicted_balancedness();
    EXPECT_GT(qb.tokens(), 1000);
    EXPECT_GT(predicted, observed + 0.2)
        << "QB should predict a much better balance than the skewed router's";
    qb_bias.assign(qb.bias().begin(), qb.bias().end());

    auto diagnostics = moe::v1::MoeDiagnostics::NewStub(
        grpc::CreateChannel(cluster.target(), grpc::InsecureChannelCredentials()));
    {
      grpc::ClientContext context;
      moe::v1::GetPlacementAdviceRequest request;
      request.set_layer(1);
      request.set_redundant_experts(4);  // 68 slots over 4 ranks
      moe::v1::PlacementAdvice advice;
      ASSERT_TRUE(diagnostics->GetPlacementAdvice(&context, request, &advice).ok());
      placement_text = advice.placement();
      predicted_placement = advice.predicted_balancedness();
      EXPECT_GT(advice.predicted_balancedness(), advice.current_balancedness());
    }
    // Installing the QB bias is audited and improves the observed expert balance.
    {
      grpc::ClientContext context;
      moe::v1::SetRouterBiasRequest request;
      request.set_layer(1);
      request.mutable_bias()->Add(qb_bias.begin(), qb_bias.end());
      request.set_source("test: quantile-balancing");
      moe::v1::SetRouterBiasResponse response;
      ASSERT_TRUE(diagnostics->SetRouterBias(&context, request, &response).ok());
      EXPECT_EQ(response.override().layer(), 1);
      grpc::ClientContext info_context;
      moe::v1::ModelInfo info;
      ASSERT_TRUE(
          cluster.stub().GetModelInfo(&info_context, moe::v1::GetModelInfoRequest(), &info).ok());
      ASSERT_EQ(info.bias_overrides_size(), 1);
      EXPECT_EQ(info.bias_overrides(0).source(), "test: quantile-balancing");
      // The gateway and every rank name the CPU kernel tier they run (the best on this host).
      auto tier = cpu::DefaultCpuTier();
      ASSERT_TRUE(tier.ok()) << tier.status();
      const std::string expected = absl::StrCat("cpu(", (*tier)->name, ", ");
      EXPECT_EQ(info.gateway_backend().rfind(expected, 0), 0u) << info.gateway_backend();
      for (const moe::v1::RankInfo& r : info.ranks())
        EXPECT_EQ(r.backend().rfind(expected, 0), 0u) << r.backend();
      RunWorkload(cluster, workload, 1, nullptr);
      moe::v1::LoadBalanceReport after;
      Report(cluster, 1, &after);
      EXPECT_GT(after.quantile_balancing().observed_balancedness(), observed + 0.2)
          << "the installed QB bias balances the experts";
    }
  }
  // Restart with the advised placement: the measured rank balance improves, outputs are identical.
  const std::string placement_file =
      absl::StrCat(::testing::TempDir(), "/placement_", getpid(), ".txt");
  { std::ofstream(placement_file) << placement_text; }
  {
    LocalCluster cluster(ClusterOptions{dir, 4, {"--placement", placement_file}});
    ASSERT_TRUE(cluster.Start().ok()) << cluster.Logs();
    const auto outputs = RunWorkload(cluster, workload, 1, nullptr);
    for (size_t i = 0; i < outputs.size(); ++i)
      EXPECT_EQ(outputs[i], first_outputs[i]) << "request " << i;
    moe::v1::LoadBalanceReport report;
    placed_rank_balance = Report(cluster, 1, &report);
  }
  std::remove(placement_file.c_str());
  EXPECT_GT(placed_rank_balance, contiguous_rank_balance + 0.05);
  std::printf(
      "skewed router: expert balancedness observed %.3f, QB-predicted %.3f; rank balancedness "
      "contiguous %.3f, "
      "EPLB-placed %.3f (predicted %.3f)\n",
      observed, predicted, contiguous_rank_balance, placed_rank_balance, predicted_placement);
  RecordProperty("observed", absl::StrCat(observed));
  RecordProperty("qb_predicted", absl::StrCat(predicted));
  RecordProperty("eplb_placed", absl::StrCat(placed_rank_balance));
}

// The samples of `name` in Prometheus text: labels ("" or "{...}") -> value as written.
std::map<std::string, std::string> Samples(const std::string& text, const std::string& name) {
  std::map<std::string, std::string> samples;
  const std::regex sample("^" + name + R"((\{[^}]*\})? (\S+)$)");
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    std::smatch m;
    const std::string l(line);
    if (std::regex_match(l, m, sample)) samples[m[1]] = m[2];
  }
  return samples;
}

// A rank's load reports progress on a real process: moe_load_progress_ratio is 1 once it has
// loaded, under its own rank label (nothing left of the unlabeled series it had before it
// registered), and its log has the load's closing progress line before the ready line.
TEST(ObservabilityTest, RankLoadProgressGaugeAndLogLines) {
  ClusterOptions options{TestCheckpoint("k3-mini"), 2};
  options.metrics = true;
  LocalCluster cluster(options);
  ASSERT_TRUE(cluster.Start().ok()) << cluster.Logs();
  for (int r = 0; r < 2; ++r) {
    const std::string ready = cluster.rank(r).WaitForLog("ready in", absl::Seconds(30));
    ASSERT_FALSE(ready.empty()) << cluster.rank(r).Log();
    EXPECT_TRUE(std::regex_search(
        ready, std::regex(absl::StrCat("^moe-rank ", r,
                                       ": 2 layers, 32 experts each, [0-9.]+ GB of weights, "
                                       "backend .+, ready in [0-9.]+ s$"))))
        << ready;
    const std::string log = cluster.rank(r).Log();
    std::smatch loaded;
    ASSERT_TRUE(std::regex_search(
        log, loaded,
        std::regex(absl::StrCat(
            "(^|\n)moe-rank ", r,
            R"(: loading experts: [0-9.]+ (kB|MB|GB) in [0-9.]+ s \([0-9.]+ (kB|MB|GB)/s\)\n)"))))
        << log;
    EXPECT_LT(static_cast<size_t>(loaded.position(0)), log.find(ready)) << log;

    int rc = -1;
    const std::string metrics =
        Shell(absl::StrCat("curl -s --max-time 5 http://127.0.0.1:", cluster.rank_metrics_port(r),
                           "/metrics"),
              &rc);
    ASSERT_EQ(rc, 0) << metrics;
    EXPECT_NE(metrics.find("# TYPE moe_load_progress_ratio gauge"), std::string::npos) << metrics;
    const std::map<std::string, std::string> want = {{absl::StrCat("{rank=\"", r, "\"}"), "1"}};
    EXPECT_EQ(Samples(metrics, "moe_load_progress_ratio"), want) << metrics;
  }
}

}  // namespace
}  // namespace moe
