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
#include "core/status.h"
#include "security/tokens.h"
#include "server/gateway/gateway.h"

namespace {

std::atomic<int> g_signals{0};  // SIGTERM/SIGINT received: the first drains, a second cuts it short
void OnSignal(int) { ++g_signals; }

// What the flags give: GatewayOptions, and values in the flags' own units that Resolve checks
// and converts into it.
struct CommandLine {
  moe::GatewayOptions options;
  std::string layers, metrics_host, cluster_token_file, api_token_file, admin_token_file;
  int64_t max_wait_us = 0, balance_window_s = 60, step_timeout_ms = 60000, heartbeat_ms = 500,
          rank_timeout_ms = 3000, stream_buffer_mb = 64, stream_buffer_total_mb = 256,
          transport_memory_mb = 0, qb_refresh_s = 10;
  double drain_timeout_s = 30, placement_load_timeout_s = 600, rebalance_interval_s = 60,
         rebalance_gap_s = 600;
};

constexpr char kUsage[] =
    "usage: moe-gateway --checkpoint DIR --ranks N [--port P] [options]\n\n"
    "Serves moe.v1.MoeService (Forward, ForwardStream, GetModelInfo), MoeDiagnostics, the\n"
    "Open Inference Protocol (inference.GRPCInferenceService: KServe v2 and Triton's stream,\n"
    "config, statistics and repository extensions; model moe-layer-L), grpc.health.v1 and\n"
    "server reflection on --port, and the ranks' control plane on --control-port; ready\n"
    "(SERVING) once every rank has registered and loaded its experts. --http-port serves the\n"
    "Open Inference Protocol over HTTP/REST (/v2/...; JSON and binary tensors), --metrics-port\n"
    "/metrics, /healthz and /readyz.";

void DefineFlags(moe::Flags& flags, CommandLine& c) {
  flags.String("checkpoint", &c.options.checkpoint, "checkpoint directory");
  flags.Int("ranks", &c.options.num_ranks, "number of expert ranks");
  flags.Range("ranks", 1, 4096);
  flags.String("host", &c.options.host, "listen address");
  flags.Int("port", &c.options.port, "listen port (0 = any free port, printed at start)");
  flags.Range("port", 0, 65535);
  flags.String("control-host", &c.options.control_host,
               "listen address of the control port (default: the --host value)");
  flags.Int("control-port", &c.options.control_port,
            "port the ranks register on (moe-rank --gateway HOST:PORT); keep it off published "
            "ports (0 = any free port, printed at start)");
  flags.Range("control-port", 0, 65535);
  moe::AddTlsFlags(flags, &c.options.tls, /*server=*/true);
  flags.String("rank-ca", &c.options.rank_ca,
               "PEM CA bundle for rank certificates on the control port (default: --tls-ca); "
               "makes the control port mTLS");
  flags.String("rank-identity", &c.options.access.rank_identity,
               "URI SAN a rank's client certificate must carry on an mTLS control port "
               "(scripts/make-certs.sh puts it in rank.pem only)");
  flags.String("cluster-token-file", &c.cluster_token_file,
               "shared secret the ranks must present (their --cluster-token-file)");
  flags.Bool("insecure-cluster", &c.options.access.insecure_cluster,
             "accept ranks without a token or client certificate (only where nothing untrusted "
             "can reach the control port)");
  flags.String("api-token-file", &c.api_token_file,
               "require `authorization: Bearer <token>` on MoeService calls");
  flags.String("admin-token-file", &c.admin_token_file,
               "require this token on MoeDiagnostics calls (PERMISSION_DENIED otherwise)");
  flags.Int("max-request-bytes", &c.options.max_request_bytes,
            "largest message on the public port, refused on arrival (0 = --max-request-tokens "
            "fp32 rows + 1 MiB)");
  flags.Int("max-concurrent-requests", &c.options.max_concurrent_requests,
            "requests in flight at once (RESOURCE_EXHAUSTED beyond)");
  flags.Range("max-concurrent-requests", 1, 1 << 20);
  flags.String("layers", &c.layers,
               "served MoE layers, comma separated (default: all in the checkpoint)");
  flags.Choice("dtype", &c.options.precision, moe::PrecisionChoices(),
               "precision: bf16 is the numerics contract, fp32 rounds nothing in between");
  flags.Choice("transport", &c.options.transport, moe::TransportChoices(),
               "how steps reach the ranks: grpc on CPU hosts, nccl on GPUs (needs --backend cuda)");
  flags.Choice("backend", &c.options.backend, moe::BackendChoices(), "compute backend");
  flags.Int("device", &c.options.device, "CUDA device of the gateway (--backend cuda)");
  flags.Range("device", 0, 1023);
  flags.String("placement", &c.options.placement_file,
               "expert placement file (one line of expert ids per rank)");
  flags.Int("max-tokens-per-step", &c.options.batcher.max_tokens_per_step,
            "tokens in one step, larger requests split: a small call waits behind about one step "
            "of a large one (lower: shorter waits; higher: expert weights read once for more "
            "tokens, which memory-bound GPUs want)");
  flags.Range("max-tokens-per-step", 1, 1 << 24);
  flags.Int("max-wait-us", &c.max_wait_us,
            "how long an idle layer waits for more requests before a step (0: none; requests that "
            "arrive while a step runs join the next one anyway)");
  flags.Int("max-request-tokens", &c.options.max_request_tokens,
            "largest request (RESOURCE_EXHAUSTED beyond)");
  flags.Range("max-request-tokens", 1, 1 << 24);
  flags.Int("max-queued-tokens", &c.options.batcher.max_queued_tokens,
            "queue limit (RESOURCE_EXHAUSTED beyond)");
  flags.Int("step-timeout-ms", &c.step_timeout_ms, "bound on one step's exchange with the ranks");
  flags.Int("heartbeat-ms", &c.heartbeat_ms,
            "heartbeat interval on each rank's exchange stream (ranks use the same)");
  flags.Range("heartbeat-ms", 1, 600000);
  flags.Int("rank-timeout-ms", &c.rank_timeout_ms,
            "a rank that sends nothing for this long (hung, cut off) is marked down; ranks give "
            "up on a gateway as silent as long");
  flags.Range("rank-timeout-ms", 1, 3600000);
  flags.Int("stream-buffer-mb", &c.stream_buffer_mb,
            "responses buffered per ForwardStream for a slow reader; beyond, its new requests get "
            "RESOURCE_EXHAUSTED");
  flags.Int("stream-buffer-total-mb", &c.stream_buffer_total_mb,
            "responses buffered for slow readers by all ForwardStreams together; beyond, new "
            "stream requests get RESOURCE_EXHAUSTED");
  flags.Range("stream-buffer-total-mb", 1, int64_t{1} << 20);
  flags.Int("transport-memory-mb", &c.transport_memory_mb,
            "what gRPC may hold of messages still arriving, per port (past it gRPC resets a "
            "stream of a connection holding memory: RESOURCE_EXHAUSTED); 0 = 4 of the largest "
            "requests, at least 64");
  flags.Range("transport-memory-mb", 0, int64_t{1} << 20);
  flags.Double("drain-timeout-s", &c.drain_timeout_s,
               "on SIGTERM/SIGINT: NOT_SERVING and new calls UNAVAILABLE at once, then up to this "
               "long for the calls in flight before exiting");
  flags.Int("threads", &c.options.cpu.num_threads, "compute threads (0 = all cores)");
  flags.Range("threads", 0, 4096);
  flags.Int("http-port", &c.options.http_port,
            "the Open Inference Protocol over HTTP/REST (KServe v2; -1 = off, 0 = any free port)");
  flags.Range("http-port", -1, 65535);
  flags.String("http-host", &c.options.http_host,
               "REST listen address (default: the --host value; loopback only under TLS)");
  flags.Int("http-threads", &c.options.http_threads, "REST connections served at once");
  flags.Range("http-threads", 1, 1024);
  flags.Int("metrics-port", &c.options.metrics_port,
            "Prometheus /metrics port (-1 = off, 0 = any free port)");
  flags.Range("metrics-port", -1, 65535);
  flags.String("metrics-host", &c.metrics_host,
               "metrics listen address (default: the --host value)");
  flags.Bool("per-expert-metrics", &c.options.metrics.per_expert,
             "export per-expert series (experts x layers of them)");
  flags.Int("balance-window-s", &c.balance_window_s,
            "seconds of steps in the load-balance window (balancedness gauges, load reports, "
            "placement advice)");
  flags.Range("balance-window-s", 1, 86400);
  flags.Int("balance-window-steps", &c.options.metrics.window_steps,
            "at most this many steps in the load-balance window");
  flags.Int("qb-window-tokens", &c.options.balance.window_tokens,
            "router-score window per layer for Quantile Balancing diagnostics (0 = off)");
  flags.Int("qb-refresh-s", &c.qb_refresh_s,
            "how often the Quantile Balancing gauges are recomputed");
  flags.Bool(
      "allow-bias-override", &c.options.balance.allow_bias_override,
      "allow MoeDiagnostics/SetRouterBias to install router biases (logged, shown in model info)");
  flags.Bool("allow-placement-changes", &c.options.allow_placement_changes,
             "allow MoeDiagnostics/ApplyPlacement without an admin token (a trusted network)");
  flags.Double("placement-load-timeout-s", &c.placement_load_timeout_s,
               "how long ranks may take to load their experts of a new placement");
  flags.Bool("auto-rebalance", &c.options.auto_rebalance.enabled,
             "apply the EPLB placement advice live when the ranks' load stays unbalanced");
  flags.Double("auto-rebalance-threshold", &c.options.auto_rebalance.threshold,
               "rank balancedness (mean/max, worst layer) below which to act");
  flags.Int("auto-rebalance-checks", &c.options.auto_rebalance.checks,
            "readings in a row below the threshold before acting");
  flags.Double("auto-rebalance-interval-s", &c.rebalance_interval_s, "seconds between readings");
  flags.Double("auto-rebalance-min-gap-s", &c.rebalance_gap_s,
               "at most one automatic change per this many seconds");
  flags.Int("auto-rebalance-redundant", &c.options.auto_rebalance.redundant,
            "extra expert replicas the advice places (-1: the fewest >= ranks that divide "
            "evenly over the ranks)");
}

// Checks what the flags gave together and converts it into c.options: INVALID_ARGUMENT with a
// message for the user.
absl::Status Resolve(const moe::Flags& flags, CommandLine& c) {
  moe::GatewayOptions& options = c.options;
  moe::AutoRebalanceOptions& rebalance = options.auto_rebalance;
  if (!(rebalance.threshold > 0 && rebalance.threshold <= 1) || rebalance.checks < 1 ||
      !(c.rebalance_interval_s > 0) || !(c.rebalance_gap_s >= 0) || rebalance.redundant < -1)
    return absl::InvalidArgumentError(
        "--auto-rebalance-threshold must be in (0, 1], -checks >= 1, -interval-s > 0, "
        "-min-gap-s >= 0, -redundant >= -1");
  rebalance.interval = absl::Seconds(c.rebalance_interval_s);
  rebalance.min_gap = absl::Seconds(c.rebalance_gap_s);
  if (!(c.placement_load_timeout_s > 0))
    return absl::InvalidArgumentError("--placement-load-timeout-s must be > 0");
  options.placement_load_timeout = absl::Seconds(c.placement_load_timeout_s);
  for (absl::string_view part : absl::StrSplit(c.layers, ',', absl::SkipEmpty())) {
    int layer;
    if (!absl::SimpleAtoi(part, &layer))
      return absl::InvalidArgumentError(absl::StrCat("bad --layers entry '", part, "'"));
    options.layers.push_back(layer);
  }
  // A gateway on any free port (tests, several on one host) takes any free control port too.
  if (options.port == 0 && !flags.WasSet("control-port")) options.control_port = 0;
  // /metrics is as reachable as the API unless asked otherwise: a loopback gateway does not
  // publish its traffic figures to the network.
  options.metrics_host = c.metrics_host.empty() ? options.host : c.metrics_host;
  options.batcher.max_wait = absl::Microseconds(c.max_wait_us);
  options.metrics.window = absl::Seconds(c.balance_window_s);
  options.balance.refresh = absl::Seconds(c.qb_refresh_s);
  options.batcher.step_timeout = absl::Milliseconds(c.step_timeout_ms);
  if (c.stream_buffer_mb < 1 || c.stream_buffer_mb > (int64_t{1} << 20))
    return absl::InvalidArgumentError("--stream-buffer-mb must be in 1..1048576");
  options.max_stream_buffer_bytes = c.stream_buffer_mb << 20;
  options.max_stream_buffer_total_bytes = c.stream_buffer_total_mb << 20;
  options.transport_memory_bytes = c.transport_memory_mb << 20;
  if (!(c.drain_timeout_s >= 0))
    return absl::InvalidArgumentError("--drain-timeout-s must be >= 0");
  if (c.heartbeat_ms <= 0 || c.rank_timeout_ms <= c.heartbeat_ms)
    return absl::InvalidArgumentError(
        absl::StrCat("need 0 < --heartbeat-ms < --rank-timeout-ms (got ", c.heartbeat_ms, ", ",
                     c.rank_timeout_ms, ")"));
  options.liveness.heartbeat = absl::Milliseconds(c.heartbeat_ms);
  options.liveness.peer_timeout = absl::Milliseconds(c.rank_timeout_ms);
  for (auto [file, token] : {std::pair{&c.cluster_token_file, &options.access.cluster_token},
                             std::pair{&c.api_token_file, &options.access.api_token},
                             std::pair{&c.admin_token_file, &options.access.admin_token}}) {
    if (file->empty()) continue;
    ASSIGN_OR_RETURN(*token, moe::ReadTokenFile(*file));
  }
  if (options.balance.allow_bias_override && options.access.admin_token.empty())
    std::fprintf(stderr,
                 "moe-gateway: warning: --allow-bias-override without --admin-token-file: anyone "
                 "who reaches the API can steer the router\n");
  return absl::OkStatus();
}

// Where everything listens, and how the control port is protected.
void LogServing(const moe::GatewayOptions& options, moe::Gateway& gateway) {
  const bool control_mtls = options.tls.mutual() || !options.rank_ca.empty();
  const std::string control_host =
      options.control_host.empty() ? options.host : options.control_host;
  std::fprintf(stderr, "moe-gateway: control plane on %s:%d (%s%s)\n", control_host.c_str(),
               gateway.control_port(),
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
      options.checkpoint.c_str(), options.host.c_str(), gateway.port(),
      absl::StrJoin(gateway.engine().layers(), ",").c_str(), gateway.backend_name().c_str(),
      options.tls.server_enabled() ? (options.tls.mutual() ? "mTLS" : "TLS") : "plaintext",
      options.num_ranks);
  if (options.http_port >= 0)
    std::fprintf(stderr, "moe-gateway: REST (Open Inference Protocol) on %s:%d/v2\n",
                 (options.http_host.empty() ? options.host : options.http_host).c_str(),
                 gateway.http_port());
  if (options.metrics_port >= 0)
    std::fprintf(stderr, "moe-gateway: metrics on %s:%d/metrics\n", options.metrics_host.c_str(),
                 gateway.metrics_port());
  std::fflush(stderr);
}

// After the first signal: drain up to `drain_timeout_s` (a second signal cuts it short), then
// stop.
void DrainAndStop(moe::Gateway& gateway, double drain_timeout_s) {
  std::fprintf(stderr, "moe-gateway: draining (up to %g s; a second signal stops at once)\n",
               drain_timeout_s);
  std::fflush(stderr);
  const absl::Time drain_start = absl::Now();
  const absl::Time drain_end = drain_start + absl::Seconds(drain_timeout_s);
  int64_t left;
  do {
    left = gateway.Drain(std::min(absl::Milliseconds(50), drain_end - absl::Now()));
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
  gateway.Shutdown(left > 0 ? absl::ZeroDuration() : absl::Milliseconds(500));
}

}  // namespace

int main(int argc, char** argv) {
  CommandLine c;
  moe::Flags flags(kUsage);
  DefineFlags(flags, c);
  flags.Require("checkpoint");
  flags.ParseOrExit(argc, argv);
  if (absl::Status s = Resolve(flags, c); !s.ok()) {
    std::fprintf(stderr, "moe-gateway: %s\n", std::string(s.message()).c_str());
    return 2;
  }
  auto gateway = moe::Gateway::Create(c.options);
  if (!gateway.ok()) {
    std::fprintf(stderr, "moe-gateway: %s\n", gateway.status().ToString().c_str());
    return 1;
  }
  if (absl::Status s = (*gateway)->Start(); !s.ok()) {
    std::fprintf(stderr, "moe-gateway: %s\n", s.ToString().c_str());
    return 1;
  }
  LogServing(c.options, **gateway);
  std::signal(SIGINT, OnSignal);
  std::signal(SIGTERM, OnSignal);
  while (g_signals == 0) absl::SleepFor(absl::Milliseconds(10));
  DrainAndStop(**gateway, c.drain_timeout_s);
  return 0;
}
