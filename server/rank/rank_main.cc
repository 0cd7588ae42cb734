// moe-rank: hosts a shard of the routed experts of every served layer and answers the
// gateway's steps. Registers with the gateway given by --gateway.
#include <atomic>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "core/flags.h"
#include "security/tokens.h"
#include "server/metrics/rank_metrics.h"
#include "server/rank/rank_worker.h"
#if MOE_RANK_FAULTS
#include "server/rank/rank_faults.h"
#endif

namespace {

std::atomic<bool> g_stop{false};
void OnSignal(int) { g_stop = true; }

}  // namespace

int main(int argc, char** argv) {
  moe::RankOptions options;
  int64_t connect_timeout_s = 600;
  bool exit_on_disconnect = false;
  int metrics_port = -1;
  std::string metrics_host = "127.0.0.1";
  moe::Flags flags(
      "usage: moe-rank --gateway HOST:CONTROL_PORT[,HOST:CONTROL_PORT...] [--rank R] [options]\n\n"
      "Registers with every moe-gateway given, loads its shard of the routed experts once\n"
      "(memory-mapped from the checkpoint, in their stored format) and serves the steps of all\n"
      "of them until stopped.");
  std::string gateways;
  flags.String("gateway", &gateways,
               "the gateways' control addresses HOST:PORT (their --control-port), comma "
               "separated: one session each (several need --rank)");
  moe::AddTlsFlags(flags, &options.tls, /*server=*/false);
  std::string cluster_token_file;
  flags.String("cluster-token-file", &cluster_token_file,
               "shared secret the gateway requires (its --cluster-token-file)");
  flags.Int("rank", &options.requested_rank, "rank id to claim (-1: the gateway assigns one)");
  flags.Range("rank", -1, 4095);
  flags.String("checkpoint", &options.checkpoint,
               "checkpoint directory, if mounted elsewhere than on the gateway");
  flags.Int("threads", &options.cpu.num_threads, "compute threads (0 = all cores)");
  flags.Range("threads", 0, 4096);
  flags.Choice("backend", &options.backend, moe::BackendChoices(), "compute backend");
  flags.Bool(
      "prefault", &options.prefault,
      "touch every page of the experts at load (--prefault=false: fault them in on first use)");
  flags.Bool("check-weights", &options.check_weights,
             "refuse experts holding NaN/Inf at load (reads every bf16/FP8 weight byte, MXFP4 "
             "scales only)");
  flags.Int("device", &options.device, "CUDA device (--backend cuda)");
  flags.Range("device", 0, 1023);
  flags.Int("connect-timeout-s", &connect_timeout_s,
            "how long to wait at start for a first registration with a gateway, then exit "
            "non-zero; once registered, a lost gateway is waited for without a limit "
            "(--exit-on-disconnect exits instead)");
  flags.Range("connect-timeout-s", 0, 86400);
  flags.Bool("exit-on-disconnect", &exit_on_disconnect,
             "exit when the gateway goes away instead of re-registering");
  flags.Int("metrics-port", &metrics_port,
            "serve Prometheus /metrics on this port (-1 = off, 0 = any free port)");
  flags.Range("metrics-port", -1, 65535);
  flags.String("metrics-host", &metrics_host,
               "metrics listen address (0.0.0.0 or the pod IP to let Prometheus in from outside)");
#if MOE_RANK_FAULTS
  moe::RankFaultFlags faults;
  moe::AddRankFaultFlags(flags, &faults);
#endif
  flags.Require("gateway");
  flags.ParseOrExit(argc, argv);
  if (!cluster_token_file.empty()) {
    auto token = moe::ReadTokenFile(cluster_token_file);
    if (!token.ok()) {
      std::fprintf(stderr, "moe-rank: %s\n", std::string(token.status().message()).c_str());
      return 2;
    }
    options.cluster_token = *token;
  }
  if (absl::Status s = moe::CheckTlsFiles(options.tls, /*server=*/false); !s.ok()) {
    std::fprintf(stderr, "moe-rank: %s\n", std::string(s.message()).c_str());
    return 2;
  }
  options.gateways = absl::StrSplit(gateways, ',', absl::SkipWhitespace());
  if (options.gateways.empty()) {
    std::fprintf(stderr, "moe-rank: --gateway names no address\n");
    return 2;
  }
  if (options.gateways.size() > 1 && options.requested_rank < 0) {
    std::fprintf(stderr,
                 "moe-rank: --rank is needed with several gateways (each must know this rank by "
                 "the same id)\n");
    return 2;
  }
  options.connect_timeout = absl::Seconds(connect_timeout_s);
  options.reconnect = !exit_on_disconnect;
#if MOE_RANK_FAULTS
  moe::InstallRankFaults(faults, &options);
#endif

  std::signal(SIGINT, OnSignal);
  std::signal(SIGTERM, OnSignal);
  moe::RankWorker worker(options);
  moe::RankMetrics metrics;
  metrics.SetBuildInfo(worker.backend_name());
  if (metrics_port >= 0) {
    if (absl::Status s = metrics.Serve(absl::StrCat(metrics_host, ":", metrics_port)); !s.ok()) {
      std::fprintf(stderr, "moe-rank: %s\n", s.ToString().c_str());
      return 1;
    }
    worker.SetObserver(&metrics);
    std::fprintf(stderr, "moe-rank: metrics on %s:%d/metrics\n", metrics_host.c_str(),
                 metrics.port());
  }
  std::atomic<bool> finished{false};
  absl::Status result;
  std::thread runner([&] {
    result = worker.Run();
    finished = true;
  });
  while (!g_stop && !finished) absl::SleepFor(absl::Milliseconds(50));
  if (!finished) {
    worker.Stop();
    // A registration still waiting for the gateway cannot be interrupted: do not wait on it.
    for (int i = 0; i < 40 && !finished; ++i) absl::SleepFor(absl::Milliseconds(50));
    if (!finished) {
      std::fprintf(stderr, "moe-rank: stopped\n");
      std::_Exit(0);
    }
  }
  runner.join();
  if (!result.ok()) {
    std::fprintf(stderr, "moe-rank %d: %s\n", worker.rank(), result.ToString().c_str());
    return 1;
  }
  std::fprintf(stderr, "moe-rank %d: stopped\n", worker.rank());
  return 0;
}
