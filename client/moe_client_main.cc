// moe-client: the command-line client of the moe.v1 service.
//
//   moe-client forward --target HOST:PORT --layer L --input x.npy --output y.npy [...]
//   moe-client health  --target HOST:PORT [--wait-s N]
//   moe-client info    --target HOST:PORT [--json]
//   moe-client load    --target HOST:PORT --concurrency N --tokens T [--duration-s D | ...]
//   moe-client placement | balance | set-bias   (MoeDiagnostics)
//
// Exit codes: 0 ok, 1 RPC or runtime failure (message on stderr), 2 usage error.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/cli/common.h"
#include "client/moe_client.h"
#include "core/flags.h"
#include "core/npy.h"
#include "core/status.h"
#include "core/version.h"
#include "google/protobuf/util/json_util.h"
#include "nlohmann/json.hpp"
#include "proto/tensor_codec.h"
#include "security/credentials.h"
#include "security/tokens.h"

namespace moe::cli {
namespace {

constexpr char kUsage[] =
    "usage: moe-client <command> --target HOST:PORT [flags]\n"
    "\n"
    "commands:\n"
    "  forward   run one MoE layer on a .npy batch, write the output .npy\n"
    "  health    grpc.health.v1 check: prints SERVING / NOT_SERVING, exit 0 only when serving\n"
    "  info      the served model (layers, sizes, formats, ranks)\n"
    "  load      concurrent callers, latency percentiles and throughput\n"
    "  placement EPLB placement advice from the traffic so far; --apply changes it live\n"
    "  balance   a layer's load balance: tokens per rank and expert, the Quantile Balancing bias\n"
    "  set-bias  install a router selection bias (QB's suggestion, a .npy, or the checkpoint's)\n"
    "\n"
    "`moe-client <command> --help` lists the command's flags. Exit codes: 0 ok, 1 RPC or\n"
    "runtime failure (message on stderr), 2 usage error.\n";

// ---- forward ---------------------------------------------------------------------------------

int RunForward(int argc, char** argv) {
  std::string target, input, output, routing_out, weights_out, dtype = "fp32", output_dtype;
  std::string save_input;
  bool input_bf16 = false;
  int layer = 0;
  int64_t timeout_ms = 60000, random_tokens = 0, seed = 1;
  Flags flags(
      "usage: moe-client forward --target HOST:PORT --layer L (--input x.npy | --random T)\n"
      "         --output y.npy [--routing-out ids.npy] [--routing-weights-out w.npy]\n"
      "         [--dtype bf16|fp16|fp32] [--timeout-ms N]\n\n"
      "Input .npy: float16, float32 or float64 (bf16: --input-bf16), [T, H] or [B, T, H]; or\n"
      "--random T: T tokens of N(0,1) values (H from GetModelInfo; --save-input keeps them).\n"
      "Output: float32 of the\n"
      "same shape. Routing outputs are [tokens, top_k] (int32 ids, float32 weights).");
  flags.String("target", &target, "server address HOST:PORT");
  Connection connection;
  connection.AddFlags(flags);
  flags.Int("layer", &layer, "MoE layer index (the checkpoint's numbering)");
  flags.String("input", &input, "input .npy");
  flags.Bool("input-bf16", &input_bf16,
             "--input holds bf16 bit patterns (uint16, or ml_dtypes.bfloat16 saved as 'V2')");
  flags.Int("random", &random_tokens, "instead of --input: this many tokens of N(0,1) values");
  flags.Int("seed", &seed, "seed of --random");
  flags.String("save-input", &save_input, "write the --random input here (float32 .npy)");
  flags.String("output", &output, "output .npy (float32)");
  flags.String("routing-out", &routing_out, "write the chosen expert ids (int32 .npy)");
  flags.String("routing-weights-out", &weights_out, "write the routing weights (float32 .npy)");
  flags.String("dtype", &dtype, "wire dtype of the input: bf16, fp16 or fp32");
  flags.String("output-dtype", &output_dtype, "wire dtype of the output; empty: as --dtype");
  flags.Int("timeout-ms", &timeout_ms, "deadline of the call (0: none)");
  for (const char* name : {"target", "layer", "output"}) flags.Require(name);
  flags.ParseOrExit(argc, argv, 2);
  if (input.empty() == !flags.WasSet("random")) return UsageError("give --input or --random");
  if (flags.WasSet("random") && random_tokens < 1) return UsageError("--random must be >= 1");
  if (!save_input.empty() && !input.empty()) return UsageError("--save-input goes with --random");
  if (input_bf16 && input.empty()) return UsageError("--input-bf16 goes with --input");

  ForwardOptions options;
  absl::StatusOr<moe::v1::DType> wire = ParseWireDType(dtype);
  if (!wire.ok()) return UsageError(absl::StrCat("--dtype: ", wire.status().message()));
  options.dtype = *wire;
  if (!output_dtype.empty()) {
    absl::StatusOr<moe::v1::DType> out = ParseWireDType(output_dtype);
    if (!out.ok()) return UsageError(absl::StrCat("--output-dtype: ", out.status().message()));
    options.output_dtype = *out;
  }
  options.return_routing = !routing_out.empty() || !weights_out.empty();
  options.timeout = TimeoutFromMs(timeout_ms);

  int exit_code = 0;
  absl::StatusOr<std::unique_ptr<MoeClient>> client =
      ConnectOrExitCode(target, connection, &exit_code);
  if (!client.ok()) return exit_code;
  absl::StatusOr<NpyArray> x =
      input.empty() ? RandomInput(**client, random_tokens, seed) : ReadInput(input, input_bf16);
  if (!x.ok()) return Fail(x.status());
  if (!save_input.empty()) {
    if (absl::Status s = WriteNpyFloat32(save_input, x->shape, x->data.data()); !s.ok())
      return Fail(s);
  }

  const auto t0 = std::chrono::steady_clock::now();
  absl::StatusOr<ForwardResult> y = (*client)->Forward(layer, x->shape, x->data.data(), options);
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  if (!y.ok()) return Fail(y.status());
  if (y->shape != x->shape)
    return Fail(
        absl::InternalError(absl::StrCat("server answered shape [", absl::StrJoin(y->shape, ", "),
                                         "] for input [", absl::StrJoin(x->shape, ", "), "]")));
  if (absl::Status s = WriteNpyFloat32(output, y->shape, y->values.data()); !s.ok()) return Fail(s);
  const int64_t tokens = x->shape.back() > 0 ? x->num_elements() / x->shape.back() : 0;
  if (options.return_routing) {
    const int k = y->routing.top_k;
    if (k <= 0 || static_cast<int64_t>(y->routing.expert_ids.size()) != tokens * k)
      return Fail(absl::InternalError(
          absl::StrCat("server returned routing for ", y->routing.expert_ids.size(),
                       " choices, expected ", tokens, " tokens x top_k ", k)));
    if (!routing_out.empty()) {
      if (absl::Status s = WriteNpyInt32(routing_out, {tokens, k}, y->routing.expert_ids.data());
          !s.ok())
        return Fail(s);
    }
    if (!weights_out.empty()) {
      if (absl::Status s = WriteNpyFloat32(weights_out, {tokens, k}, y->routing.weights.data());
          !s.ok())
        return Fail(s);
    }
  }
  std::fprintf(stderr,
               "moe-client: layer %d, %lld tokens, %s: %.2f ms (gateway: queue %lld us, step %lld "
               "us, %d tokens in the step)\n",
               layer, static_cast<long long>(tokens), DTypeName(options.dtype), ms,
               static_cast<long long>(y->timing.queue_us),
               static_cast<long long>(y->timing.step_us), y->timing.step_tokens);
  return 0;
}

// ---- health ----------------------------------------------------------------------------------

int RunHealth(int argc, char** argv) {
  std::string target, service;
  double wait_s = 0;
  int64_t timeout_ms = 2000;
  Flags flags(
      "usage: moe-client health --target HOST:PORT [--wait-s N]\n\n"
      "Prints SERVING or NOT_SERVING (or the error on stderr); exit 0 only when serving.");
  flags.String("target", &target, "server address HOST:PORT");
  Connection connection;
  connection.AddFlags(flags);
  flags.String("service", &service, "service name to check (empty: the server as a whole)");
  flags.Double("wait-s", &wait_s, "wait up to this long for SERVING (0: check once)");
  flags.Int("timeout-ms", &timeout_ms, "deadline of a single check");
  flags.Require("target");
  flags.ParseOrExit(argc, argv, 2);
  if (wait_s < 0) return UsageError("--wait-s must be >= 0");

  int exit_code = 0;
  absl::StatusOr<std::unique_ptr<MoeClient>> client =
      ConnectOrExitCode(target, connection, &exit_code);
  if (!client.ok()) return exit_code;
  if (wait_s > 0) {
    absl::Status s = (*client)->WaitUntilServing(absl::Seconds(wait_s), service);
    if (!s.ok()) return Fail(s);
    std::puts("SERVING");
    return 0;
  }
  absl::StatusOr<bool> serving = (*client)->IsServing(service, TimeoutFromMs(timeout_ms));
  if (!serving.ok()) return Fail(serving.status());
  std::puts(*serving ? "SERVING" : "NOT_SERVING");
  return *serving ? 0 : 1;
}

// ---- info ------------------------------------------------------------------------------------

std::string InfoText(const moe::v1::ModelInfo& info) {
  std::string out;
  auto line = [&](const char* key, const std::string& value) {
    absl::StrAppendFormat(&out, "%-16s %s\n", key, value);
  };
  line("family", absl::StrCat(info.family(), " (model_type ", info.model_type(), ")"));
  if (!info.checkpoint().empty()) line("checkpoint", info.checkpoint());
  line("layers", absl::StrCat(Ranges({info.layers().begin(), info.layers().end()}), " (",
                              info.layers_size(), ")"));
  line("hidden size", absl::StrCat(info.hidden_size()));
  line("latent size", info.latent_size() > 0 ? absl::StrCat(info.latent_size()) : "none");
  line("expert hidden", absl::StrCat(info.expert_hidden_size()));
  line("experts", absl::StrCat(info.num_experts(), " routed, top-", info.top_k(), ", ",
                               info.num_shared_experts(), " shared"));
  line("formats", absl::StrCat("experts ", info.expert_format(), ", dense ", info.dense_format()));
  line("precision", info.precision());
  line("transport", info.transport());
  if (!info.gateway_backend().empty()) line("gateway backend", info.gateway_backend());
  line("max tokens", absl::StrCat(info.max_tokens_per_step(), " per step, ",
                                  info.max_request_tokens(), " per request"));
  line("ranks", absl::StrCat(info.ranks_size()));
  for (const moe::v1::RankInfo& r : info.ranks())
    absl::StrAppendFormat(&out, "  rank %-3d %-9s %-20s %-34s %10s  experts %s\n", r.rank(),
                          r.ready() ? "ready" : "not-ready", r.address(), r.backend(),
                          Bytes(r.weight_bytes()),
                          Ranges({r.experts().begin(), r.experts().end()}));
  if (info.bias_overrides_size() > 0) {
    line("bias overrides", absl::StrCat(info.bias_overrides_size()));
    for (const moe::v1::BiasOverride& b : info.bias_overrides())
      absl::StrAppendFormat(&out, "  layer %-4d %s, %s\n", b.layer(), b.source(), b.installed_at());
  }
  return out;
}

int RunInfo(int argc, char** argv) {
  std::string target;
  bool json = false;
  int64_t timeout_ms = 10000;
  Flags flags("usage: moe-client info --target HOST:PORT [--json]");
  flags.String("target", &target, "server address HOST:PORT");
  Connection connection;
  connection.AddFlags(flags);
  flags.Bool("json", &json, "print moe.v1.ModelInfo as JSON (proto field names)");
  flags.Int("timeout-ms", &timeout_ms, "deadline of the call (0: none)");
  flags.Require("target");
  flags.ParseOrExit(argc, argv, 2);

  int exit_code = 0;
  absl::StatusOr<std::unique_ptr<MoeClient>> client =
      ConnectOrExitCode(target, connection, &exit_code);
  if (!client.ok()) return exit_code;
  absl::StatusOr<moe::v1::ModelInfo> info = (*client)->GetModelInfo(TimeoutFromMs(timeout_ms));
  if (!info.ok()) return Fail(info.status());
  if (!json) {
    std::fputs(InfoText(*info).c_str(), stdout);
    return 0;
  }
  google::protobuf::util::JsonPrintOptions options;
  options.add_whitespace = true;
  options.always_print_primitive_fields = true;
  options.preserve_proto_field_names = true;
  std::string text;
  if (auto s = google::protobuf::util::MessageToJsonString(*info, &text, options); !s.ok())
    return Fail(absl::InternalError(s.ToString()));
  std::fputs(text.c_str(), stdout);
  if (text.empty() || text.back() != '\n') std::fputc('\n', stdout);
  return 0;
}

// ---- placement -------------------------------------------------------------------------------

int RunPlacement(int argc, char** argv) {
  std::string target, out, from;
  int64_t layer = -1, redundant = 0, timeout_s = 1800;
  bool apply = false;
  Flags flags(
      "usage: moe-client placement --target HOST:PORT [--layer L] [--redundant N] [--out FILE]\n"
      "       [--apply] | --from FILE --apply\n\n"
      "Asks the gateway for the EPLB placement that balances the traffic so far over the\n"
      "ranks (N extra replicas), prints its predicted balancedness and the placement (or writes\n"
      "it to --out: a moe-gateway --placement file). --apply installs it live, as does\n"
      "--from FILE with a placement file of your own. Needs the gateway's admin token\n"
      "(--token-file) or a gateway started with --allow-placement-changes.");
  flags.String("target", &target, "server address HOST:PORT");
  Connection connection;
  connection.AddFlags(flags);
  flags.Int("layer", &layer,
            "balance this layer's traffic (default: every served layer's, summed; one "
            "placement serves all layers)");
  flags.Int("redundant", &redundant, "extra expert replicas to place (DeepSeek EPLB)");
  flags.String("out", &out, "write the placement file here instead of printing it");
  flags.String("from", &from, "apply this placement file instead of asking for advice");
  flags.Bool("apply", &apply, "install the placement on the running gateway");
  flags.Int("timeout-s", &timeout_s, "deadline of --apply (ranks load their new experts)");
  flags.Require("target");
  flags.ParseOrExit(argc, argv, 2);
  if (redundant < 0) return UsageError("--redundant must be >= 0");
  if (timeout_s <= 0) return UsageError("--timeout-s must be > 0");
  if (!from.empty() && !apply) return UsageError("--from needs --apply");
  if (!from.empty() && (flags.WasSet("layer") || flags.WasSet("redundant") || !out.empty()))
    return UsageError("--from takes no --layer, --redundant or --out");

  int exit_code = 0;
  absl::StatusOr<std::unique_ptr<MoeClient>> client =
      ConnectOrExitCode(target, connection, &exit_code);
  if (!client.ok()) return exit_code;
  std::string placement;
  if (!from.empty()) {
    std::ifstream in(from);
    if (!in) return UsageError(absl::StrCat("cannot read ", from));
    std::stringstream text;
    text << in.rdbuf();
    placement = text.str();
  } else {
    absl::StatusOr<moe::v1::PlacementAdvice> advice =
        (*client)->GetPlacementAdvice(static_cast<int>(layer), static_cast<int>(redundant));
    if (!advice.ok()) return Fail(advice.status());
    std::fprintf(stderr,
                 "layer %d: rank balancedness %.3f now, %.3f predicted with %lld extra "
                 "replicas\n",
                 advice->layer(), advice->current_balancedness(), advice->predicted_balancedness(),
                 static_cast<long long>(redundant));
    placement = advice->placement();
    if (!out.empty()) {
      std::ofstream file(out);
      file << placement;
      if (!file.good()) return Fail(absl::InternalError(absl::StrCat("cannot write ", out)));
    } else if (!apply) {
      std::fputs(placement.c_str(), stdout);
    }
  }
  if (!apply) return 0;
  absl::StatusOr<moe::v1::ApplyPlacementResponse> applied = (*client)->ApplyPlacement(
      placement,
      from.empty() ? "moe-client placement --apply" : absl::StrCat("moe-client --from ", from),
      absl::Seconds(timeout_s));
  if (!applied.ok()) return Fail(applied.status());
  std::vector<int32_t> loaded(applied->ranks_loaded().begin(), applied->ranks_loaded().end());
  std::vector<int32_t> down(applied->ranks_down().begin(), applied->ranks_down().end());
  std::printf(
      "placement generation %llu serving after %.3f s (slowest rank loaded in %.3f s); ranks "
      "loaded: %s; down (load on return): %s\n",
      static_cast<unsigned long long>(applied->generation()), applied->seconds(),
      applied->load_seconds(), Ranges(loaded).c_str(), Ranges(down).c_str());
  return 0;
}

// ---- balance, set-bias ------------------------------------------------------------------------

// The `n` experts with the most assignments, "id:count" hottest first.
std::string Hottest(const google::protobuf::RepeatedField<int64_t>& counts, size_t n) {
  std::vector<int> ids(counts.size());
  for (int e = 0; e < counts.size(); ++e) ids[e] = e;
  n = std::min(n, ids.size());
  std::partial_sort(ids.begin(), ids.begin() + n, ids.end(), [&](int a, int b) {
    return counts[a] > counts[b] || (counts[a] == counts[b] && a < b);
  });
  std::vector<std::string> parts;
  for (size_t i = 0; i < n; ++i) parts.push_back(absl::StrCat(ids[i], ":", counts[ids[i]]));
  return absl::StrJoin(parts, " ");
}

int RunBalance(int argc, char** argv) {
  std::string target;
  int64_t layer = 0;
  bool json = false;
  Flags flags(
      "usage: moe-client balance --target HOST:PORT --layer L [--json]\n\n"
      "The layer's load over the gateway's window: token rows per rank, assignments per expert\n"
      "(hottest first), rank and expert balancedness (mean/max), and what Quantile Balancing\n"
      "predicts (moe-client set-bias --from-qb installs its bias). Needs the admin token when\n"
      "the gateway has one.");
  flags.String("target", &target, "server address HOST:PORT");
  Connection connection;
  connection.AddFlags(flags);
  flags.Int("layer", &layer, "MoE layer index");
  flags.Bool("json", &json, "print the report as JSON (moe.v1.LoadBalanceReport)");
  for (const char* name : {"target", "layer"}) flags.Require(name);
  flags.ParseOrExit(argc, argv, 2);
  int exit_code = 0;
  absl::StatusOr<std::unique_ptr<MoeClient>> client =
      ConnectOrExitCode(target, connection, &exit_code);
  if (!client.ok()) return exit_code;
  absl::StatusOr<moe::v1::LoadBalanceReport> report =
      (*client)->GetLoadBalance(static_cast<int>(layer));
  if (!report.ok()) return Fail(report.status());
  if (json) {
    std::string text;
    google::protobuf::util::JsonPrintOptions print;
    print.always_print_primitive_fields = true;
    if (!google::protobuf::util::MessageToJsonString(*report, &text, print).ok())
      return Fail(absl::InternalError("cannot print the report as JSON"));
    std::puts(text.c_str());
    return 0;
  }
  const auto& qb = report->quantile_balancing();
  std::printf("layer %d: %lld steps, %lld tokens in the window\n", report->layer(),
              static_cast<long long>(report->window_steps()),
              static_cast<long long>(report->window_tokens()));
  std::printf("  %-22s %s\n", "rank tokens", absl::StrJoin(report->rank_tokens(), " ").c_str());
  std::printf("  %-22s %.3f\n", "rank balancedness", report->rank_balancedness());
  std::printf("  %-22s %.3f (hottest experts id:count: %s)\n", "expert balancedness",
              report->expert_balancedness(), Hottest(report->expert_tokens(), 8).c_str());
  std::printf("  %-22s %.3f over %lld tokens, %.3f predicted with its bias\n", "quantile balancing",
              qb.observed_balancedness(), static_cast<long long>(qb.tokens()),
              qb.predicted_balancedness());
  return 0;
}

int RunSetBias(int argc, char** argv) {
  std::string target, bias_file, source = "moe-client set-bias";
  int64_t layer = 0;
  bool from_qb = false, reset = false;
  Flags flags(
      "usage: moe-client set-bias --target HOST:PORT --layer L (--from-qb | --bias b.npy |\n"
      "       --reset) [--source TEXT]\n\n"
      "Installs the layer's router selection bias: Quantile Balancing's suggestion from the\n"
      "current window (--from-qb), an [E] float .npy (--bias), or the checkpoint's own\n"
      "(--reset). The gateway needs --allow-bias-override (and the admin token when it has one).");
  flags.String("target", &target, "server address HOST:PORT");
  Connection connection;
  connection.AddFlags(flags);
  flags.Int("layer", &layer, "MoE layer index");
  flags.Bool("from-qb", &from_qb, "install the bias Quantile Balancing suggests now");
  flags.String("bias", &bias_file, "install this [E] float .npy");
  flags.Bool("reset", &reset, "restore the checkpoint's bias");
  flags.String("source", &source, "who asks and why (logged and shown in model info)");
  for (const char* name : {"target", "layer"}) flags.Require(name);
  flags.ParseOrExit(argc, argv, 2);
  if (int(from_qb) + int(reset) + int(!bias_file.empty()) != 1)
    return UsageError("give one of --from-qb, --bias FILE and --reset");
  std::vector<float> bias;
  if (!bias_file.empty()) {
    absl::StatusOr<NpyArray> b = ReadNpy(bias_file);
    if (!b.ok()) return Fail(b.status());
    if (b->shape.size() != 1 || b->data.empty())
      return Fail(absl::InvalidArgumentError(
          absl::StrCat(bias_file, ": the bias must be a 1-D float array [E]")));
    bias = b->data;
  }
  int exit_code = 0;
  absl::StatusOr<std::unique_ptr<MoeClient>> client =
      ConnectOrExitCode(target, connection, &exit_code);
  if (!client.ok()) return exit_code;
  if (from_qb) {
    absl::StatusOr<moe::v1::LoadBalanceReport> report =
        (*client)->GetLoadBalance(static_cast<int>(layer));
    if (!report.ok()) return Fail(report.status());
    const auto& qb = report->quantile_balancing();
    if (qb.bias().empty())
      return Fail(absl::FailedPreconditionError(
          "no Quantile Balancing suggestion yet: the layer has seen no traffic in its window"));
    bias.assign(qb.bias().begin(), qb.bias().end());
    std::fprintf(stderr, "quantile balancing: expert balancedness %.3f now, %.3f predicted\n",
                 qb.observed_balancedness(), qb.predicted_balancedness());
  }
  absl::StatusOr<moe::v1::SetRouterBiasResponse> set =
      (*client)->SetRouterBias(static_cast<int>(layer), bias, source);
  if (!set.ok()) return Fail(set.status());
  std::printf("layer %d: %s bias installed at %s (source \"%s\")\n", set->override().layer(),
              bias.empty() ? "the checkpoint's" : absl::StrCat(bias.size(), "-expert").c_str(),
              set->override().installed_at().c_str(), set->override().source().c_str());
  return 0;
}

}  // namespace
}  // namespace moe::cli

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fputs(moe::cli::kUsage, stderr);
    return 2;
  }
  const std::string command = argv[1];
  if (command == "--help" || command == "-h" || command == "help") {
    std::fputs(moe::cli::kUsage, stdout);
    return 0;
  }
  if (command == "--version") {
    std::printf("moe-client %s (commit %s)\n", moe::Version(), moe::GitCommit());
    return 0;
  }
  if (command == "forward") return moe::cli::RunForward(argc, argv);
  if (command == "health") return moe::cli::RunHealth(argc, argv);
  if (command == "info") return moe::cli::RunInfo(argc, argv);
  if (command == "load") return moe::cli::RunLoad(argc, argv);
  if (command == "placement") return moe::cli::RunPlacement(argc, argv);
  if (command == "balance") return moe::cli::RunBalance(argc, argv);
  if (command == "set-bias") return moe::cli::RunSetBias(argc, argv);
  std::fprintf(stderr, "moe-client: unknown command '%s'\n\n%s", command.c_str(), moe::cli::kUsage);
  return 2;
}
