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
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <map>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/moe_client.h"
#include "core/flags.h"
#include "core/npy.h"
#include "core/numerics.h"
#include "core/status.h"
#include "core/version.h"
#include "google/protobuf/util/json_util.h"
#include "nlohmann/json.hpp"
#include "proto/tensor_codec.h"
#include "security/credentials.h"
#include "security/tokens.h"

namespace moe {
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

int Fail(const absl::Status& status) {
  std::fprintf(stderr, "moe-client: %s\n", status.ToString().c_str());
  return 1;
}

int UsageError(const std::string& message) {
  std::fprintf(stderr, "moe-client: %s (see --help)\n", message.c_str());
  return 2;
}

// 0 or less: no deadline.
// How a command reaches the gateway: TLS files and a token file, the same flags everywhere.
struct Connection {
  ClientOptions options;
  std::string token_file;

  void AddFlags(Flags& flags) {
    AddTlsFlags(flags, &options.tls, /*server=*/false);
    flags.String("token-file", &token_file,
                 "send its token as `authorization: Bearer` (the gateway's --api-token-file, or "
                 "--admin-token-file for diagnostics)");
    flags.Int("max-message-bytes", &options.max_message_bytes,
              "largest message either way (0: what the server's GetModelInfo implies, at least "
              "4 MiB)");
    flags.Range("max-message-bytes", 0, INT32_MAX);
  }
  // The options, with the token read; errors are usage errors (exit 2).
  absl::StatusOr<ClientOptions> Resolve() const {
    ClientOptions resolved = options;
    if (absl::Status s = CheckTlsFiles(options.tls, /*server=*/false); !s.ok()) return s;
    if (!token_file.empty()) {
      ASSIGN_OR_RETURN(resolved.token, ReadTokenFile(token_file));
    }
    return resolved;
  }
};

// Connects as `connection` says; a bad flag value returns the usage error's exit code.
absl::StatusOr<std::unique_ptr<MoeClient>> ConnectOrExitCode(const std::string& target,
                                                             const Connection& connection,
                                                             int* exit_code) {
  absl::StatusOr<ClientOptions> options = connection.Resolve();
  if (!options.ok()) {
    *exit_code = UsageError(std::string(options.status().message()));
    return options.status();
  }
  absl::StatusOr<std::unique_ptr<MoeClient>> client = MoeClient::Connect(target, *options);
  if (!client.ok()) *exit_code = Fail(client.status());
  return client;
}

absl::Duration TimeoutFromMs(int64_t ms) {
  return ms > 0 ? absl::Milliseconds(ms) : absl::InfiniteDuration();
}

// "1..92", "0..447, 500": id lists as ascending runs.
std::string Ranges(std::vector<int32_t> ids) {
  std::sort(ids.begin(), ids.end());
  std::vector<std::string> parts;
  for (size_t i = 0; i < ids.size();) {
    size_t j = i;
    while (j + 1 < ids.size() && ids[j + 1] == ids[j] + 1) ++j;
    parts.push_back(j > i ? absl::StrCat(ids[i], "..", ids[j]) : absl::StrCat(ids[i]));
    i = j + 1;
  }
  return parts.empty() ? "none" : absl::StrJoin(parts, ", ");
}

std::string Bytes(int64_t bytes) {
  if (bytes >= (int64_t{1} << 30)) return absl::StrFormat("%.2f GiB", bytes / 1073741824.0);
  if (bytes >= (int64_t{1} << 20)) return absl::StrFormat("%.1f MiB", bytes / 1048576.0);
  return absl::StrCat(bytes, " B");
}

// Reads an input batch: float16/float32/float64 .npy (float64, numpy's default, is rounded to
// float32 as read, then to the wire dtype), or with `bf16` the bf16 bit patterns of a uint16 or
// 2-byte void array (ml_dtypes.bfloat16 saves as 'V2', which the file cannot tell from any
// other 2-byte type: the caller says so); [T, H] or [B, T, H].
absl::StatusOr<NpyArray> ReadInput(const std::string& path, bool bf16 = false) {
  ASSIGN_OR_RETURN(NpyArray x, ReadNpy(path));
  const bool bits = x.descr == "<u2" || x.descr == "<V2" || x.descr == "|V2";
  const bool floats = x.descr == "<f4" || x.descr == "<f2" || x.descr == "<f8";
  if (bf16 ? !bits : !floats)
    return absl::InvalidArgumentError(
        bf16 ? absl::StrCat(path, ": --input-bf16 needs a uint16 or bfloat16 (V2) array, got ",
                            x.descr)
             : absl::StrCat(path, ": input must be float16, float32 or float64, got ", x.descr,
                            bits ? " (bf16 bit patterns? give --input-bf16)" : ""));
  if (bits) {
    x.data.resize(x.ints.size());
    for (size_t i = 0; i < x.ints.size(); ++i)
      x.data[i] = Bf16BitsToFloat(static_cast<uint16_t>(x.ints[i]));
    x.ints.clear();
  }
  if (x.shape.size() != 2 && x.shape.size() != 3)
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": input must be [T, H] or [B, T, H], got ", x.shape.size(), " dimensions"));
  return x;
}

// `tokens` x H of N(0,1) values from `seed`, H from the server's GetModelInfo.
absl::StatusOr<NpyArray> RandomInput(MoeClient& client, int64_t tokens, int64_t seed) {
  absl::StatusOr<moe::v1::ModelInfo> info = client.GetModelInfo();
  if (!info.ok()) return Annotate(info.status(), "GetModelInfo");
  NpyArray x;
  x.descr = "<f4";
  x.shape = {tokens, info->hidden_size()};
  x.data.resize(tokens * info->hidden_size());
  std::mt19937_64 rng(static_cast<uint64_t>(seed));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (float& v : x.data) v = normal(rng);
  return x;
}

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

// ---- load ------------------------------------------------------------------------------------

struct LoadConfig {
  std::string target, input, dtype = "fp32", output_dtype;
  int layer = -1, concurrency = 1, warmup = 2;
  int64_t tokens = 1, requests = 0, seed = 0, timeout_ms = 60000;
  double duration_s = 0;
  bool stream = false, json = false, routing = false;
};

// What one caller saw; merged after the run.
struct CallerTally {
  std::vector<double> latency_ms;  // successful requests only
  std::map<absl::StatusCode, int64_t> errors;
  std::map<absl::StatusCode, std::string> first_message;
  double queue_us = 0, step_us = 0, step_tokens = 0;  // sums over successful requests

  void Merge(const CallerTally& other) {
    latency_ms.insert(latency_ms.end(), other.latency_ms.begin(), other.latency_ms.end());
    for (const auto& [code, n] : other.errors) errors[code] += n;
    for (const auto& [code, m] : other.first_message) first_message.emplace(code, m);
    queue_us += other.queue_us;
    step_us += other.step_us;
    step_tokens += other.step_tokens;
  }
};

// Releases every caller at once, after the last one finished its warm-up.
class StartLine {
 public:
  explicit StartLine(int parties) : waiting_(parties) {}
  std::chrono::steady_clock::time_point Arrive() {
    std::unique_lock<std::mutex> lock(mu_);
    if (--waiting_ == 0) {
      start_ = std::chrono::steady_clock::now();
      cv_.notify_all();
    }
    cv_.wait(lock, [this] { return waiting_ == 0; });
    return start_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int waiting_;
  std::chrono::steady_clock::time_point start_;
};

double Percentile(const std::vector<double>& sorted, double p) {
  if (sorted.empty()) return 0;
  const size_t rank = static_cast<size_t>(std::ceil(p / 100.0 * sorted.size()));
  return sorted[std::min(sorted.size() - 1, rank == 0 ? 0 : rank - 1)];
}

constexpr char kLoadUsage[] =
    "usage: moe-client load --target HOST:PORT [--layer L] --concurrency N --tokens T\n"
    "         [--duration-s D | --requests N] [--input x.npy] [--dtype bf16|fp16|fp32]\n"
    "         [--stream] [--seed S] [--warmup W] [--json]\n\n"
    "N callers send requests back to back, each with its own N(0,1) input [T, H] (H from\n"
    "GetModelInfo) or the --input batch. Layers go round-robin over the served ones unless\n"
    "--layer is given. --stream sends every caller's requests on one shared ForwardStream.\n"
    "Warm-up requests are not measured. Exit 1 when no measured request succeeded.";

void DefineLoadFlags(Flags& flags, LoadConfig& cfg, Connection& connection) {
  flags.String("target", &cfg.target, "server address HOST:PORT");
  connection.AddFlags(flags);
  flags.Int("layer", &cfg.layer, "only this layer; without it, every served layer round-robin");
  flags.Int("concurrency", &cfg.concurrency, "concurrent callers");
  flags.Int("tokens", &cfg.tokens, "tokens per request (random inputs)");
  flags.Double("duration-s", &cfg.duration_s,
               "run this long; 10 s when neither this nor --requests is given");
  flags.Int("requests", &cfg.requests,
            "measured requests in total, over all callers; 0: see --duration-s");
  flags.Int("warmup", &cfg.warmup, "unmeasured requests per caller first");
  flags.String("input", &cfg.input, "send this .npy batch instead of random inputs");
  flags.String("dtype", &cfg.dtype, "wire dtype of the input: bf16, fp16 or fp32");
  flags.String("output-dtype", &cfg.output_dtype, "wire dtype of the output; empty: as --dtype");
  flags.Bool("routing", &cfg.routing, "ask for the routing too");
  flags.Bool("stream", &cfg.stream, "use one ForwardStream for all callers instead of unary calls");
  flags.Int("seed", &cfg.seed, "seed of the random inputs (caller i uses seed, i)");
  flags.Int("timeout-ms", &cfg.timeout_ms, "deadline of each request (0: none)");
  flags.Bool("json", &cfg.json, "print one JSON object instead of the table");
  flags.Require("target");
}

// The combinations the flags alone do not check.
absl::Status CheckLoadConfig(const Flags& flags, LoadConfig& cfg) {
  if (cfg.concurrency < 1) return absl::InvalidArgumentError("--concurrency must be >= 1");
  if (cfg.warmup < 0) return absl::InvalidArgumentError("--warmup must be >= 0");
  if (flags.WasSet("duration-s") && flags.WasSet("requests"))
    return absl::InvalidArgumentError("give --duration-s or --requests, not both");
  if (flags.WasSet("requests") && cfg.requests < 1)
    return absl::InvalidArgumentError("--requests must be >= 1");
  if (flags.WasSet("duration-s") && !(cfg.duration_s > 0))
    return absl::InvalidArgumentError("--duration-s must be > 0");
  if (!flags.WasSet("requests") && !flags.WasSet("duration-s")) cfg.duration_s = 10;
  if (!cfg.input.empty() && flags.WasSet("tokens"))
    return absl::InvalidArgumentError("--tokens comes from the --input file; give one of them");
  if (cfg.input.empty() && cfg.tokens < 1)
    return absl::InvalidArgumentError("--tokens must be >= 1");
  return absl::OkStatus();
}

// While it lives, a line on stderr every second with the counts of `ok` and `errors`.
class ProgressLine {
 public:
  ProgressLine(const std::atomic<int64_t>& ok, const std::atomic<int64_t>& errors)
      : thread_([this, &ok, &errors] {
          const auto t0 = std::chrono::steady_clock::now();
          std::unique_lock<std::mutex> lock(mu_);
          int64_t last_ok = 0;
          while (!cv_.wait_for(lock, std::chrono::seconds(1), [this] { return done_; })) {
            const int64_t ok_now = ok.load();
            std::fprintf(
                stderr, "moe-client load: %.0f s, %lld ok (%lld in the last second), %lld errors\n",
                std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
                static_cast<long long>(ok_now), static_cast<long long>(ok_now - last_ok),
                static_cast<long long>(errors.load()));
            last_ok = ok_now;
          }
        }) {}
  ~ProgressLine() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;   // guarded by mu_
  std::thread thread_;  // last: started once the members above exist
};

// The run's table (or with --json one JSON object) on stdout; returns the requests that succeeded.
int64_t PrintLoadReport(const LoadConfig& cfg, const std::vector<int>& layers,
                        const std::vector<int64_t>& shape, int64_t tokens_per_request,
                        double elapsed_s, CallerTally& total) {
  std::vector<double>& lat = total.latency_ms;
  std::sort(lat.begin(), lat.end());
  const int64_t ok = lat.size();
  int64_t errors = 0;
  for (const auto& [code, n] : total.errors) errors += n;
  double mean_ms = 0;
  for (double v : lat) mean_ms += v;
  mean_ms = ok > 0 ? mean_ms / ok : 0;
  const double rps = elapsed_s > 0 ? ok / elapsed_s : 0;
  const double tps = rps * tokens_per_request;
  const double per_ok = ok > 0 ? 1.0 / ok : 0;

  if (cfg.json) {
    nlohmann::json j;
    j["target"] = cfg.target;
    j["layers"] = layers;
    j["concurrency"] = cfg.concurrency;
    j["tokens_per_request"] = tokens_per_request;
    j["shape"] = shape;
    j["dtype"] = cfg.dtype;
    j["stream"] = cfg.stream;
    j["warmup_per_caller"] = cfg.warmup;
    j["requests"] = ok + errors;
    j["ok"] = ok;
    nlohmann::json errs = nlohmann::json::object();
    for (const auto& [code, n] : total.errors) errs[absl::StatusCodeToString(code)] = n;
    j["errors"] = errs;
    j["duration_s"] = elapsed_s;
    j["latency_ms"] = {{"p50", Percentile(lat, 50)},
                       {"p90", Percentile(lat, 90)},
                       {"p99", Percentile(lat, 99)},
                       {"max", lat.empty() ? 0.0 : lat.back()},
                       {"mean", mean_ms}};
    j["requests_per_s"] = rps;
    j["tokens_per_s"] = tps;
    j["gateway"] = {{"queue_us_mean", total.queue_us * per_ok},
                    {"step_us_mean", total.step_us * per_ok},
                    {"step_tokens_mean", total.step_tokens * per_ok}};
    std::puts(j.dump().c_str());
  } else {
    std::printf("moe-client load: %s, layers %s, %d callers, [%s] %s, %s\n", cfg.target.c_str(),
                Ranges({layers.begin(), layers.end()}).c_str(), cfg.concurrency,
                absl::StrJoin(shape, ", ").c_str(), cfg.dtype.c_str(),
                cfg.stream ? "one ForwardStream" : "unary");
    std::printf("  %-14s %lld (ok %lld, errors %lld)\n", "requests",
                static_cast<long long>(ok + errors), static_cast<long long>(ok),
                static_cast<long long>(errors));
    for (const auto& [code, n] : total.errors)
      std::printf("  %-14s %lld %s: %s\n", "", static_cast<long long>(n),
                  absl::StatusCodeToString(code).c_str(), total.first_message[code].c_str());
    std::printf("  %-14s p50 %.3f  p90 %.3f  p99 %.3f  max %.3f  (mean %.3f)\n", "latency ms",
                Percentile(lat, 50), Percentile(lat, 90), Percentile(lat, 99),
                lat.empty() ? 0.0 : lat.back(), mean_ms);
    std::printf("  %-14s %.1f requests/s, %.0f tokens/s over %.2f s\n", "throughput", rps, tps,
                elapsed_s);
    std::printf("  %-14s queue %.0f us, step %.0f us, %.1f tokens per step (means)\n", "gateway",
                total.queue_us * per_ok, total.step_us * per_ok, total.step_tokens * per_ok);
  }
  return ok;
}

// Caller `index`'s request, encoded once: the --input batch, or N(0, 1) values of `shape` from
// the seed (cfg.seed, index).
absl::StatusOr<moe::v1::ForwardRequest> CallerRequest(const LoadConfig& cfg,
                                                      const std::vector<int64_t>& shape,
                                                      const NpyArray* file_input,
                                                      const ForwardOptions& options, int index) {
  if (file_input != nullptr) return MakeForwardRequest(0, shape, file_input->data.data(), options);
  int64_t elements = 1;
  for (int64_t d : shape) elements *= d;
  std::seed_seq seq{static_cast<uint64_t>(cfg.seed), static_cast<uint64_t>(index)};
  std::mt19937_64 rng(seq);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(elements);
  for (float& v : x) v = normal(rng);
  return MakeForwardRequest(0, shape, x.data(), options);
}

int RunLoad(int argc, char** argv) {
  LoadConfig cfg;
  Flags flags(kLoadUsage);
  Connection connection;
  DefineLoadFlags(flags, cfg, connection);
  flags.ParseOrExit(argc, argv, 2);
  if (absl::Status s = CheckLoadConfig(flags, cfg); !s.ok())
    return UsageError(std::string(s.message()));
  ForwardOptions options;
  {
    absl::StatusOr<moe::v1::DType> wire = ParseWireDType(cfg.dtype);
    if (!wire.ok()) return UsageError(absl::StrCat("--dtype: ", wire.status().message()));
    options.dtype = *wire;
    if (!cfg.output_dtype.empty()) {
      absl::StatusOr<moe::v1::DType> out = ParseWireDType(cfg.output_dtype);
      if (!out.ok()) return UsageError(absl::StrCat("--output-dtype: ", out.status().message()));
      options.output_dtype = *out;
    }
  }
  options.return_routing = cfg.routing;
  const absl::Duration timeout = TimeoutFromMs(cfg.timeout_ms);

  int exit_code = 0;
  absl::StatusOr<std::unique_ptr<MoeClient>> connected =
      ConnectOrExitCode(cfg.target, connection, &exit_code);
  if (!connected.ok()) return exit_code;
  MoeClient& client = **connected;

  // The batch: from the file, or a shape for the callers' random inputs.
  NpyArray file_input;
  std::vector<int64_t> shape;
  if (!cfg.input.empty()) {
    absl::StatusOr<NpyArray> x = ReadInput(cfg.input);
    if (!x.ok()) return Fail(x.status());
    file_input = *std::move(x);
    shape = file_input.shape;
  }
  std::vector<int> layers;
  if (flags.WasSet("layer")) layers.push_back(cfg.layer);
  if (layers.empty() || cfg.input.empty()) {
    absl::StatusOr<moe::v1::ModelInfo> info = client.GetModelInfo();
    if (!info.ok()) return Fail(Annotate(info.status(), "GetModelInfo"));
    if (layers.empty()) layers.assign(info->layers().begin(), info->layers().end());
    if (layers.empty()) return Fail(absl::FailedPreconditionError("the server serves no layers"));
    if (cfg.input.empty()) shape = {cfg.tokens, info->hidden_size()};
  }
  const int64_t hidden = shape.back();
  int64_t elements = 1;
  for (int64_t d : shape) elements *= d;
  const int64_t tokens_per_request = hidden > 0 ? elements / hidden : 0;

  std::unique_ptr<ForwardStreamSession> session;
  if (cfg.stream) {
    absl::StatusOr<std::unique_ptr<ForwardStreamSession>> opened = client.OpenStream();
    if (!opened.ok()) return Fail(opened.status());
    session = *std::move(opened);
  }

  std::vector<CallerTally> tallies(cfg.concurrency);
  std::vector<std::chrono::steady_clock::time_point> finished(cfg.concurrency);
  std::vector<absl::Status> setup(cfg.concurrency);
  std::atomic<int64_t> tickets{0}, round_robin{0}, progress_ok{0}, progress_errors{0};
  std::atomic<bool> stop{false};
  StartLine start_line(cfg.concurrency);
  std::chrono::steady_clock::time_point start;
  const auto run_for = std::chrono::duration_cast<std::chrono::steady_clock::duration>(
      std::chrono::duration<double>(cfg.duration_s));

  auto caller = [&](int index) {
    CallerTally& tally = tallies[index];
    absl::StatusOr<moe::v1::ForwardRequest> prepared =
        CallerRequest(cfg, shape, cfg.input.empty() ? nullptr : &file_input, options, index);
    if (!prepared.ok()) {
      setup[index] = prepared.status();
      stop = true;
    }
    moe::v1::ForwardRequest request =
        prepared.ok() ? *std::move(prepared) : moe::v1::ForwardRequest();
    int64_t sequence = 0;
    // One request; OK responses fill `response`.
    auto call = [&](moe::v1::ForwardResponse* response) -> absl::Status {
      request.set_layer(layers[round_robin.fetch_add(1) % layers.size()]);
      if (!session) {
        ASSIGN_OR_RETURN(*response, client.ForwardRaw(request, timeout));
        return absl::OkStatus();
      }
      request.set_request_id(absl::StrCat(index, "-", sequence++));
      ASSIGN_OR_RETURN(const std::string id, session->Send(request));
      ASSIGN_OR_RETURN(*response, session->ReceiveRaw(id, timeout));
      return absl::OkStatus();
    };

    moe::v1::ForwardResponse response;
    for (int w = 0; w < cfg.warmup && !stop; ++w) call(&response).IgnoreError();
    const auto t_start = start_line.Arrive();
    if (index == 0) start = t_start;
    const auto end = t_start + run_for;
    for (;;) {
      if (stop) break;
      if (cfg.requests > 0) {
        if (tickets.fetch_add(1) >= cfg.requests) break;
      } else if (std::chrono::steady_clock::now() >= end) {
        break;
      }
      const auto t0 = std::chrono::steady_clock::now();
      const absl::Status status = call(&response);
      const auto t1 = std::chrono::steady_clock::now();
      (status.ok() ? progress_ok : progress_errors).fetch_add(1);
      if (status.ok()) {
        tally.latency_ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
        tally.queue_us += response.timing().queue_us();
        tally.step_us += response.timing().step_us();
        tally.step_tokens += response.timing().step_tokens();
      } else {
        tally.errors[status.code()]++;
        tally.first_message.emplace(status.code(), std::string(status.message()));
        // A dead stream fails every later request at once: stop rather than spin.
        if (session && session->ended()) stop = true;
      }
    }
    finished[index] = std::chrono::steady_clock::now();
  };

  std::vector<std::thread> threads;
  for (int i = 0; i < cfg.concurrency; ++i) threads.emplace_back(caller, i);
  {
    // A line on stderr every second (warm-up included), so a long run is never silent.
    ProgressLine progress(progress_ok, progress_errors);
    for (std::thread& t : threads) t.join();
  }
  for (const absl::Status& s : setup)
    if (!s.ok()) return Fail(s);
  if (session) {
    if (absl::Status s = session->Finish(); !s.ok())
      std::fprintf(stderr, "moe-client: ForwardStream ended with %s\n", s.ToString().c_str());
  }

  CallerTally total;
  for (const CallerTally& t : tallies) total.Merge(t);
  const double elapsed_s =
      std::chrono::duration<double>(*std::max_element(finished.begin(), finished.end()) - start)
          .count();
  const int64_t ok = PrintLoadReport(cfg, layers, shape, tokens_per_request, elapsed_s, total);
  if (ok == 0) {
    std::fprintf(stderr, "moe-client: no request succeeded\n");
    return 1;
  }
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
}  // namespace moe

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fputs(moe::kUsage, stderr);
    return 2;
  }
  const std::string command = argv[1];
  if (command == "--help" || command == "-h" || command == "help") {
    std::fputs(moe::kUsage, stdout);
    return 0;
  }
  if (command == "--version") {
    std::printf("moe-client %s (commit %s)\n", moe::Version(), moe::GitCommit());
    return 0;
  }
  if (command == "forward") return moe::RunForward(argc, argv);
  if (command == "health") return moe::RunHealth(argc, argv);
  if (command == "info") return moe::RunInfo(argc, argv);
  if (command == "load") return moe::RunLoad(argc, argv);
  if (command == "placement") return moe::RunPlacement(argc, argv);
  if (command == "balance") return moe::RunBalance(argc, argv);
  if (command == "set-bias") return moe::RunSetBias(argc, argv);
  std::fprintf(stderr, "moe-client: unknown command '%s'\n\n%s", command.c_str(), moe::kUsage);
  return 2;
}
