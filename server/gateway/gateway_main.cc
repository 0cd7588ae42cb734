// moe-gateway: the public gRPC API of the MoE-layer service, the router, the shared experts
// and the latent projections; expert ranks (moe-rank) register with it.
#include <atomic>
#include <csignal>
#include <cstdio>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "core/flags.h"
#include "core/host_port.h"
#include "security/tokens.h"
#include "server/gateway/gateway.h"

namespace {

std::atomic<int> g_signals{0};  // SIGTERM/SIGINT received: the first drains, a second cuts it short
void OnSignal(int) { ++g_signals; }

}  // namespace

int main(int argc, char** argv) {
  moe::GatewayOptions options;
  std::string layers;
  int64_t max_wait_us = 0;
  int64_t balance_window_s = 60;
  int64_t step_timeout_ms = 60000;
  int64_t heartbeat_ms = 500, rank_timeout_ms = 3000;
  moe::Flags flags(
      "usage: moe-gateway --checkpoint DIR --ranks N [--port P] [options]\n\n"
      "Serves moe.v1.MoeService (Forward, ForwardStream, GetModelInfo), MoeDiagnostics, the\n"
      "Open Inference Protocol (inference.GRPCInferenceService: KServe v2 and Triton's stream,\n"
      "config, statistics and repository extensions; model moe-layer-L), grpc.health.v1 and\n"
      "server reflection on --port, and the ranks' control plane on --control-port; ready\n"
      "(SERVING) once every rank has registered and loaded its experts. --http-port serves the\n"
      "Open Inference Protocol over HTTP/REST (/v2/...; JSON and binary tensors), --metrics-port\n"
      "/metrics, /healthz and /readyz.");
  flags.String("checkpoint", &options.checkpoint, "checkpoint directory");
  flags.Int("ranks", &options.num_ranks, "number of expert ranks");
  flags.Range("ranks", 1, 4096);
  flags.String("host", &options.host, "listen address");
  flags.Int("port", &options.port, "listen port (0 = any free port, printed at start)");
  flags.Range("port", 0, 65535);
  flags.String("control-host", &options.control_host,
               "listen address of the control port (default: the --host value)");
  flags.Int("control-port", &options.control_port,
            "port the ranks register on (moe-rank --gateway HOST:PORT); keep it off published "
            "ports (0 = any free port, printed at start)");
  flags.Range("control-port", 0, 65535);
  moe::AddTlsFlags(flags, &options.tls, /*server=*/true);
  flags.String("rank-ca", &options.rank_ca,
               "PEM CA bundle for rank certificates on the control port (default: --tls-ca); "
               "makes the control port mTLS");
  flags.String("rank-identity", &options.access.rank_identity,
               "URI SAN a rank's client certificate must carry on an mTLS control port "
               "(scripts/make-certs.sh puts it in rank.pem only)");
  std::string cluster_token_file, api_token_file, admin_token_file;
  flags.String("cluster-token-file", &cluster_token_file,
               "shared secret the ranks must present (their --cluster-token-file)");
  flags.Bool("insecure-cluster", &options.access.insecure_cluster,
             "accept ranks without a token or client certificate (only where nothing untrusted "
             "can reach the control port)");
  flags.String("api-token-file", &api_token_file,
               "require `authorization: Bearer <token>` on MoeService calls");
  flags.String("admin-token-file", &admin_token_file,
               "require this token on MoeDiagnostics calls (PERMISSION_DENIED otherwise)");
  flags.Int("max-request-bytes", &options.max_request_bytes,
            "largest message on the public port, refused on arrival (0 = --max-request-tokens "
            "fp32 rows + 1 MiB)");
  flags.Int("max-concurrent-requests", &options.max_concurrent_requests,
            "requests in flight at once (RESOURCE_EXHAUSTED beyond)");
  flags.Range("max-concurrent-requests", 1, 1 << 20);
  flags.String("layers", &layers,
               "served MoE layers, comma separated (default: all in the checkpoint)");
  flags.Choice("dtype", &options.precision, moe::PrecisionChoices(),
               "precision: bf16 is the numerics contract, fp32 rounds nothing in between");
  flags.Choice("transport", &options.transport, moe::TransportChoices(),
               "how steps reach the ranks: grpc on CPU hosts, nccl on GPUs (needs --backend cuda)");
  flags.Choice("backend", &options.backend, moe::BackendChoices(), "compute backend");
  flags.Int("device", &options.device, "CUDA device of the gateway (--backend cuda)");
  flags.Range("device", 0, 1023);
  flags.String("placement", &options.placement_file,
               "expert placement file (one line of expert ids per rank)");
  flags.Int("max-tokens-per-step", &options.batcher.max_tokens_per_step,
            "tokens in one step, larger requests split: a small call waits behind about one step "
            "of a large one (lower: shorter waits; higher: expert weights read once for more "
            "tokens, which memory-bound GPUs want)");
  flags.Range("max-tokens-per-step", 1, 1 << 24);
  flags.Int("max-wait-us", &max_wait_us,
            "how long an idle layer waits for more requests before a step (0: none; requests that "
            "arrive while a step runs join the next one anyway)");
  flags.Int("max-request-tokens", &options.max_request_tokens,
            "largest request (RESOURCE_EXHAUSTED beyond)");
  flags.Range("max-request-tokens", 1, 1 << 24);
  flags.Int("max-queued-tokens", &options.batcher.max_queued_tokens,
            "queue limit (RESOURCE_EXHAUSTED beyond)");
  flags.Int("step-timeout-ms", &step_timeout_ms, "bound on one step's exchange with the ranks");
  flags.Int("heartbeat-ms", &heartbeat_ms,
            "heartbeat interval on each rank's exchange stream (ranks use the same)");
  flags.Range("heartbeat-ms", 1, 600000);
  flags.Int("rank-timeout-ms", &rank_timeout_ms,
            "a rank that sends nothing for this long (hung, cut off) is marked down; ranks give "
            "up on a gateway as silent as long");
  flags.Range("rank-timeout-ms", 1, 3600000);
  int64_t stream_buffer_mb = 64;
  flags.Int("stream-buffer-mb", &stream_buffer_mb,
            "responses buffered per ForwardStream for a slow reader; beyond, its new requests get "
            "RESOURCE_EXHAUSTED");
  int64_t stream_buffer_total_mb = 256;
  flags.Int("stream-buffer-total-mb", &stream_buffer_total_mb,
            "responses buffered for slow readers by all ForwardStreams together; beyond, new "
            "stream requests get RESOURCE_EXHAUSTED");
  flags.Range("stream-buffer-total-mb", 1, int64_t{1} << 20);
  int64_t transport_memory_mb = 0;
  flags.Int("transport-memory-mb", &transport_memory_mb,
            "what gRPC may hold of messages still arriving, per port (past it gRPC resets a "
            "stream of a connection holding memory: RESOURCE_EXHAUSTED); 0 = 4 of the largest "
            "requests, at least 64");
  flags.Range("transport-memory-mb", 0, int64_t{1} << 20);
  double drain_timeout_s = 30;
  flags.Double("drain-timeout-s", &drain_timeout_s,
               "on SIGTERM/SIGINT: NOT_SERVING and new calls UNAVAILABLE at once, then up to this "
               "long for the calls in flight before exiting");
  flags.Int("threads", &options.cpu.num_threads, "compute threads (0 = all cores)");
  flags.Range("threads", 0, 4096);
  flags.Int("http-port", &options.http_port,
            "the Open Inference Protocol over HTTP/REST (KServe v2; -1 = off, 0 = any free port)");
  flags.Range("http-port", -1, 65535);
  flags.String("http-host", &options.http_host,
               "REST listen address (default: the --host value; loopback only under TLS)");
  flags.Int("http-threads", &options.http_threads, "REST connections served at once");
  flags.Range("http-threads", 1, 1024);
  flags.Int("metrics-port", &options.metrics_port,
            "Prometheus /metrics port (-1 = off, 0 = any free port)");
  flags.Range("metrics-port", -1, 65535);
  std::string metrics_host;
  flags.String("metrics-host", &metrics_host, "metrics listen address (default: the --host value)");
  flags.Bool("per-expert-metrics", &options.metrics.per_expert,
             "export per-expert series (experts x layers of them)");
  flags.Int("balance-window-s", &balance_window_s,
            "seconds of steps in the load-balance window (balancedness gauges, load reports, "
            "placement advice)");
  flags.Range("balance-window-s", 1, 86400);
  flags.Int("balance-window-steps", &options.metrics.window_steps,
            "at most this many steps in the load-balance window");
  flags.Int("qb-window-tokens", &options.balance.window_tokens,
            "router-score window per layer for Quantile Balancing diagnostics (0 = off)");
  int64_t qb_refresh_s = 10;
  flags.Int("qb-refresh-s", &qb_refresh_s,
            "how often the Quantile Balancing gauges are recomputed");
  flags.Bool(
      "allow-bias-override", &options.balance.allow_bias_override,
      "allow MoeDiagnostics/SetRouterBias to install router biases (logged, shown in model info)");
  flags.Bool("allow-placement-changes", &options.allow_placement_changes,
             "allow MoeDiagnostics/ApplyPlacement without an admin token (a trusted network)");
  double placement_load_timeout_s = 600;
  flags.Double("placement-load-timeout-s", &placement_load_timeout_s,
               "how long ranks may take to load their experts of a new placement");
  moe::AutoRebalanceOptions& rebalance = options.auto_rebalance;
  flags.Bool("auto-rebalance", &rebalance.enabled,
             "apply the EPLB placement advice live when the ranks' load stays unbalanced");
  flags.Double("auto-rebalance-threshold", &rebalance.threshold,
               "rank balancedness (mean/max, worst layer) below which to act");
  flags.Int("auto-rebalance-checks", &rebalance.checks,
            "readings in a row below the threshold before acting");
  double rebalance_interval_s = 60, rebalance_gap_s = 600;
  flags.Double("auto-rebalance-interval-s", &rebalance_interval_s, "seconds between readings");
  flags.Double("auto-rebalance-min-gap-s", &rebalance_gap_s,
               "at most one automatic change per this many seconds");
  flags.Int("auto-rebalance-redundant", &rebalance.redundant,
            "extra expert replicas the advice places (-1: the fewest >= ranks that divide "
            "evenly over the ranks)");
  flags.Require("checkpoint");
  flags.ParseOrExit(argc, argv);
  if (!(rebalance.threshold > 0 && rebalance.threshold <= 1) || rebalance.checks < 1 ||
      !(rebalance_interval_s > 0) || !(rebalance_gap_s >= 0) || rebalance.redundant < -1) {
    std::fprintf(stderr,
                 "moe-gateway: --auto-rebalance-threshold must be in (0, 1], -checks >= 1, "
                 "-interval-s > 0, -min-gap-s >= 0, -redundant >= -1\n");
    return 2;
  }
  rebalance.interval = absl::Seconds(rebalance_interval_s);
  rebalance.min_gap = absl::Seconds(rebalance_gap_s);
  if (!(placement_load_timeout_s > 0)) {
    std::fprintf(stderr, "moe-gateway: --placement-load-timeout-s must be > 0\n");
    return 2;
  }
  options.placement_load_timeout = absl::Seconds(placement_load_timeout_s);
  for (absl::string_view part : absl::StrSplit(layers, ',', absl::SkipEmpty())) {
    int layer;
    if (!absl::SimpleAtoi(part, &layer)) {
      std::fprintf(stderr, "moe-gateway: bad --layers entry '%s'\n", std::string(part).c_str());
      return 2;
    }
    options.layers.push_back(layer);
  }
  // A gateway on any free port (tests, several on one host) takes any free control port too.
  if (options.port == 0 && !flags.WasSet("control-port")) options.control_port = 0;
  // /metrics is as reachable as the API unless asked otherwise: a loopback gateway does not
  // publish its traffic figures to the network.
  options.metrics_host = metrics_host.empty() ? options.host : metrics_host;
  options.batcher.max_wait = absl::Microseconds(max_wait_us);
  options.metrics.window = absl::Seconds(balance_window_s);
  options.balance.refresh = absl::Seconds(qb_refresh_s);
  options.batcher.step_timeout = absl::Milliseconds(step_timeout_ms);
  if (stream_buffer_mb < 1 || stream_buffer_mb > (int64_t{1} << 20)) {
    std::fprintf(stderr, "moe-gateway: --stream-buffer-mb must be in 1..1048576\n");
    return 2;
  }
  options.max_stream_buffer_bytes = stream_buffer_mb << 20;
  options.max_stream_buffer_total_bytes = stream_buffer_total_mb << 20;
  options.transport_memory_bytes = transport_memory_mb << 20;
  if (!(drain_timeout_s >= 0)) {
    std::fprintf(stderr, "moe-gateway: --drain-timeout-s must be >= 0\n");
    return 2;
  }
  if (heartbeat_ms <= 0 || rank_timeout_ms <= heartbeat_ms) {
    std::fprintf(stderr,
                 "moe-gateway: need 0 < --heartbeat-ms < --rank-timeout-ms (got %lld, %lld)\n",
                 static_cast<long long>(heartbeat_ms), static_cast<long long>(rank_timeout_ms));
    return 2;
  }
  options.liveness.heartbeat = absl::Milliseconds(heartbeat_ms);
  options.liveness.peer_timeout = absl::Milliseconds(rank_timeout_ms);
  for (auto [file, token] : {std::pair{&cluster_token_file, &options.access.cluster_token},
                             std::pair{&api_token_file, &options.access.api_token},
                             std::pair{&admin_token_file, &options.access.admin_token}}) {
    if (file->empty()) continue;
    auto read = moe::ReadTokenFile(*file);
    if (!read.ok()) {
      std::fprintf(stderr, "moe-gateway: %s\n", std::string(read.status().message()).c_str());
      return 2;
    }
    *token = *read;
  }
  if (options.balance.allow_bias_override && options.access.admin_token.empty())
    std::fprintf(stderr,
                 "moe-gateway: warning: --allow-bias-override without --admin-token-file: anyone "
                 "who reaches the API can steer the router\n");

  auto gateway = moe::Gateway::Create(options);
  if (!gateway.ok()) {
    std::fprintf(stderr, "moe-gateway: %s\n", gateway.status().ToString().c_str());
    return 1;
  }
  if (absl::Status s = (*gateway)->Start(); !s.ok()) {
    std::fprintf(stderr, "moe-gateway: %s\n", s.ToString().c_str());
    return 1;
  }
  const bool control_mtls = options.tls.mutual() || !options.rank_ca.empty();
  const std::string control_host =
      options.control_host.empty() ? options.host : options.control_host;
  std::fprintf(stderr, "moe-gateway: control plane on %s:%d (%s%s)\n", control_host.c_str(),
               (*gateway)->control_port(),
               control_mtls ? absl::StrCat("mTLS, ", options.access.rank_identity).c_str() : "",
               options.access.cluster_token.empty()
                   ? (control_mtls ? "" : "unauthenticated: --insecure-cluster")
                   : (control_mtls ? " + cluster token proof" : "cluster token proof"));
  if (!options.tls.server_enabled() && !moe::IsLoopback(control_host))
    std::fprintf(stderr,
                 "moe-gateway: warning: the control port listens on %s in plaintext: ranks prove "
                 "the cluster token without sending it, but the hidden states they receive cross "
                 "the network unencrypted (give --tls-cert/--tls-key, or --control-host "
                 "127.0.0.1 where ranks are local)\n",
                 control_host.c_str());
  std::fprintf(
      stderr, "moe-gateway: serving %s on %s:%d, layers %s, backend %s, %s; waiting for %d ranks\n",
      options.checkpoint.c_str(), options.host.c_str(), (*gateway)->port(),
      absl::StrJoin((*gateway)->engine().layers(), ",").c_str(), (*gateway)->backend_name().c_str(),
      options.tls.server_enabled() ? (options.tls.mutual() ? "mTLS" : "TLS") : "plaintext",
      options.num_ranks);
  if (options.http_port >= 0)
    std::fprintf(stderr, "moe-gateway: REST (Open Inference Protocol) on %s:%d/v2\n",
                 (options.http_host.empty() ? options.host : options.http_host).c_str(),
                 (*gateway)->http_port());
  if (options.metrics_port >= 0)
    std::fprintf(stderr, "moe-gateway: metrics on %s:%d/metrics\n", options.metrics_host.c_str(),
                 (*gateway)->metrics_port());
  std::fflush(stderr);
  std::signal(SIGINT, OnSignal);
  std::signal(SIGTERM, OnSignal);
  while (g_signals == 0) absl::SleepFor(absl::Milliseconds(10));
  std::fprintf(stderr, "moe-gateway: draining (up to %g s; a second signal stops at once)\n",
               drain_timeout_s);
  std::fflush(stderr);
  const absl::Time drain_start = absl::Now();
  const absl::Time drain_end = drain_start + absl::Seconds(drain_timeout_s);
  int64_t left;
  do {
    left = (*gateway)->Drain(std::min(absl::Milliseconds(50), drain_end - absl::Now()));
  } while (left > 0 && absl::Now() < drain_end && g_signals < 2);
  const double drained_s = absl::ToDoubleSeconds(absl::Now() - drain_start);
  if (left > 0)
    std::fprintf(stderr,
                 "moe-gateway: %lld requests still in flight after %.2f s: cancelling them\n",
                 static_cast<long long>(left), drained_s);
  else
    std::fprintf(stderr, "moe-gateway: drained in %.2f s; shutting down\n", drained_s);
  std::fflush(stderr);
  // Answered calls may still be sending their responses: a short grace (which only open
  // streams, idle ForwardStreams or health watches, wait out in full) unless the drain timed out.
  (*gateway)->Shutdown(left > 0 ? absl::ZeroDuration() : absl::Milliseconds(500));
  return 0;
}
