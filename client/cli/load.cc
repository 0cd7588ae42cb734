// moe-client load: N callers send requests back to back for a time or a count; latency,
// throughput and the gateway's own timing of them.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <map>
#include <mutex>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/cli/common.h"
#include "nlohmann/json.hpp"

namespace moe::cli {
namespace {

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

}  // namespace

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

}  // namespace moe::cli
