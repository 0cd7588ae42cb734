// moe-bench: performance of the MoE layer next to this machine's roofline, measured in the
// same run.
//
//   moe-bench roofline                      streaming read bandwidth and compute peaks
//   moe-bench layer --checkpoint DIR        the layer at 1, 4, 16, 64, 256, 1024 tokens
//
// Figure of merit: time / max(bytes / read bandwidth, FLOPs / compute peak), where bytes are the
// weights a step must read (distinct experts touched + router, projections, shared experts) and
// the compute peak is that of the multiply-add instruction the CPU kernel tier computes with.
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "core/flags.h"
#include "core/status.h"
#include "core/version.h"
#include "engine/local_layer.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/tiers.h"
#include "model/checkpoint.h"
#include "tools/bench/probes.h"
#include "tools/bench/roofline.h"

namespace moe {
namespace {

struct LayerOptions {
  std::string checkpoint, tokens = "1,4,16,64,256,1024", json, plot, label, kernels;
  Precision precision = Precision::kBF16;
  int layer = -1, repeat = 5, threads = 0;
  double max_seconds = 30;  // per token count, after the warm-up
  double buffer_gb = 2.0;
  bool gemm = true;
};

struct Row {
  int64_t tokens;
  double median_ms, min_ms;
  int runs;
  int experts_touched;
  double read_gbps;    // the best of the probes just before and just after this row's runs
  double peak_gflops;  // the same for the compute peak
  double weight_bytes, flops, bw_ms, flop_ms, roofline_ms;
  double route_ms, experts_ms, shared_ms, finish_ms;  // stage split of the median run
  double stage_bytes[4], stage_flops[4];              // route, experts, shared, finish
};

constexpr const char* kStageNames[4] = {"route", "experts", "shared", "finish"};

double StageMs(const Row& r, int stage) {
  const double ms[4] = {r.route_ms, r.experts_ms, r.shared_ms, r.finish_ms};
  return ms[stage];
}

// Weight bytes and FLOPs per token of one dense stage (activations are a rounding error at
// decode: 1 token of K3 is 14 KB against 380 MB of dense weights).
struct StageCost {
  double bytes = 0;
  double flops_per_token = 0;
  void Add(const WeightMatrix& m) {
    bytes += static_cast<double>(m.TotalBytes());
    flops_per_token += 2.0 * static_cast<double>(m.rows) * static_cast<double>(m.cols);
  }
};

// The gateway's stages as GatewayLayer runs them: route = router + latent down-projection,
// shared = the shared experts, finish = latent up-projection (RMSNorm and the combine read no
// weights).
struct DenseCost {
  StageCost route, shared, finish;
  double bytes() const { return route.bytes + shared.bytes + finish.bytes; }
  double flops_per_token() const {
    return route.flops_per_token + shared.flops_per_token + finish.flops_per_token;
  }
};

DenseCost DenseParts(const GatewayLayerWeights& w) {
  DenseCost d;
  d.route.Add(w.router);
  if (w.has_latent) {
    d.route.Add(w.latent_down);
    d.finish.Add(w.latent_up);
  }
  if (w.has_shared) {
    d.shared.Add(w.shared.gate);
    d.shared.Add(w.shared.up);
    d.shared.Add(w.shared.down);
  }
  return d;
}

// The per-stage figures of a row as JSON objects (for the table's columns).
std::string StagesJson(const Row& r) {
  std::string out;
  for (int stage = 0; stage < 4; ++stage) {
    const double ms = std::max(StageMs(r, stage), 1e-6);
    const double gbps = r.stage_bytes[stage] / (ms * 1e6);
    const double gflops = r.stage_flops[stage] / (ms * 1e6);
    absl::StrAppend(
        &out, stage ? ", " : "",
        absl::StrFormat("{\"stage\": \"%s\", \"ms\": %.6f, \"weight_bytes\": %.0f, \"flops\": "
                        "%.0f, \"gbps\": %.3f, \"read_share\": %.4f, \"gflops\": %.3f, "
                        "\"peak_share\": %.4f}",
                        kStageNames[stage], StageMs(r, stage), r.stage_bytes[stage],
                        r.stage_flops[stage], gbps, gbps / r.read_gbps, gflops,
                        r.peak_gflops > 0 ? gflops / r.peak_gflops : 0));
  }
  return out;
}

// Runs `gnuplot script` without a shell (the path may hold any character); true if it
// exited 0.
bool RunGnuplot(const std::string& script) {
  char* argv[] = {const_cast<char*>("gnuplot"), const_cast<char*>(script.c_str()), nullptr};
  pid_t pid;
  if (posix_spawnp(&pid, "gnuplot", nullptr, nullptr, argv, environ) != 0) return false;
  int status = 0;
  while (waitpid(pid, &status, 0) < 0)
    if (errno != EINTR) return false;
  return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

// What the reports of a layer run say besides its rows.
struct LayerRun {
  std::string name, tier, backend;
  int threads = 0;
  double load_s = 0;
  bench::Roofline roof;
  bench::HostCpu host;
};

// The rows against the roofline, each stage against the machine, and the M2N cost model.
void PrintLayerRun(const LayerRun& run, const MoeConfig& config, Precision precision,
                   const std::vector<Row>& rows) {
  std::printf("moe-bench layer: %s (%d experts, top-%d, experts %s), %s, %s, load %.1f s\n",
              run.name.c_str(), config.routing.num_experts, config.routing.top_k,
              WeightFormatName(config.expert_format), PrecisionName(precision), run.backend.c_str(),
              run.load_s);
  std::printf("host: %s, %s (%s)\n", run.host.model.c_str(), run.host.vendor.c_str(),
              run.host.flags.c_str());
  std::printf(
      "machine: streaming read %.1f GB/s at start (%s loads); compute peak %.0f GFLOP/s at start "
      "(%s, the %s tier's multiply-add, %d threads); each row: the best probes around its runs; "
      "GEMM library %.0f GFLOP/s bf16, %.0f fp32 (%s, for reference)\n",
      run.roof.read_gbps, run.roof.read_kernel.c_str(), run.roof.peak_gflops,
      run.roof.peak_source.c_str(), run.tier.c_str(), run.threads, run.roof.bf16_gflops,
      run.roof.fp32_gflops, run.roof.gemm_source.c_str());
  std::printf("%7s %12s %10s %10s %8s %10s %9s %9s %9s %10s %10s %11s %9s   %s\n", "tokens", "tier",
              "median ms", "tokens/s", "experts", "weights GB", "GFLOP", "read GB/s", "peak GF/s",
              "bw ms", "flop ms", "roofline ms", "x roof", "route / experts / shared / finish ms");
  for (const Row& r : rows)
    std::printf(
        "%7lld %12s %10.2f %10.0f %8d %10.3f %9.2f %9.1f %9.0f %10.2f %10.2f %11.2f %9.2f   %.1f / "
        "%.1f / %.1f / %.1f\n",
        static_cast<long long>(r.tokens), run.tier.c_str(), r.median_ms,
        r.tokens / (r.median_ms / 1e3), r.experts_touched, r.weight_bytes / 1e9, r.flops / 1e9,
        r.read_gbps, r.peak_gflops, r.bw_ms, r.flop_ms, r.roofline_ms, r.median_ms / r.roofline_ms,
        r.route_ms, r.experts_ms, r.shared_ms, r.finish_ms);

  // Each stage against the machine: the weight bytes it read, at what share of the row's read
  // probe, and its FLOP rate as a share of the compute peak (what bounds it at large batches).
  std::printf(
      "stages (median run; GB/s = the stage's weight bytes / its time; %% = of the row's read "
      "probe and compute peak):\n%7s",
      "tokens");
  for (const char* stage : kStageNames)
    std::printf(" %27s", absl::StrCat(stage, ": MB, GB/s (%), GF/s (%)").c_str());
  std::printf("\n");
  for (const Row& r : rows) {
    std::printf("%7lld", static_cast<long long>(r.tokens));
    for (int stage = 0; stage < 4; ++stage) {
      const double ms = std::max(StageMs(r, stage), 1e-6);
      const double gbps = r.stage_bytes[stage] / (ms * 1e6);
      const double gflops = r.stage_flops[stage] / (ms * 1e6);
      std::printf(" %27s",
                  absl::StrFormat("%.1f, %.1f (%.0f%%), %.0f (%.0f%%)", r.stage_bytes[stage] / 1e6,
                                  gbps, 100 * gbps / r.read_gbps, gflops,
                                  r.peak_gflops > 0 ? 100 * gflops / r.peak_gflops : 0)
                      .c_str());
    }
    std::printf("\n");
  }

  // Several gateways over one rank pool: what a gateway and the ranks spend per token. The
  // gateway runs route + shared + finish for every token; the experts divide across the ranks.
  const int threads = run.threads;
  std::printf(
      "M2N cost model (%d threads per process, from the stage split; a rank is a process like "
      "this one):\n%7s %16s %16s %13s %s\n",
      threads, "tokens", "gateway cpu-ms/t", "ranks cpu-ms/t", "ranks/gateway",
      "tokens/s one gateway feeds with R = 1 / 2 / 4 / 8 / 16 ranks (G: gateway-bound)");
  for (const Row& r : rows) {
    const double gateway_ms = r.route_ms + r.shared_ms + r.finish_ms;
    const double per_token = 1.0 / static_cast<double>(r.tokens);
    std::string rates;
    for (int ranks : {1, 2, 4, 8, 16}) {
      const double gateway_rate = r.tokens / (gateway_ms / 1e3);
      const double pool_rate = ranks * r.tokens / (r.experts_ms / 1e3);
      absl::StrAppend(&rates, ranks == 1 ? "" : " / ",
                      absl::StrFormat("%.0f%s", std::min(gateway_rate, pool_rate),
                                      gateway_rate < pool_rate ? "G" : ""));
    }
    std::printf("%7lld %16.3f %16.3f %13.2f %s\n", static_cast<long long>(r.tokens),
                gateway_ms * threads * per_token, r.experts_ms * threads * per_token,
                r.experts_ms / gateway_ms, rates.c_str());
  }
}

// A JSON string literal of `s` (quotes and escapes by the JSON library): names such as --label
// and the CPU's model name are free text.
std::string JsonString(const std::string& s) { return nlohmann::json(s).dump(); }

void WriteLayerJson(const std::string& path, const LayerRun& run, const MoeConfig& config,
                    Precision precision, const std::vector<Row>& rows) {
  std::ofstream out(path);
  out << absl::StrFormat(
      "{\"model\": %s, \"experts\": %d, \"top_k\": %d, \"expert_format\": \"%s\", \"dtype\": "
      "\"%s\", \"backend\": %s, \"tier\": %s, \"read_gbps\": %.3f, \"read_kernel\": %s, "
      "\"peak_gflops\": %.3f, \"peak_source\": %s, \"bf16_gflops\": %.3f, "
      "\"fp32_gflops\": %.3f, \"gemm\": %s, \"host\": {\"cpu\": %s, \"vendor\": %s, "
      "\"flags\": %s}, \"rows\": [",
      JsonString(run.name), config.routing.num_experts, config.routing.top_k,
      WeightFormatName(config.expert_format), PrecisionName(precision), JsonString(run.backend),
      JsonString(run.tier), run.roof.read_gbps, JsonString(run.roof.read_kernel),
      run.roof.peak_gflops, JsonString(run.roof.peak_source), run.roof.bf16_gflops,
      run.roof.fp32_gflops, JsonString(run.roof.gemm_source), JsonString(run.host.model),
      JsonString(run.host.vendor), JsonString(run.host.flags));
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    out << absl::StrFormat(
        "%s{\"tokens\": %d, \"tier\": %s, \"median_ms\": %.4f, \"min_ms\": %.4f, \"runs\": "
        "%d, "
        "\"experts_touched\": %d, \"read_gbps\": %.3f, \"peak_gflops\": %.3f, "
        "\"weight_bytes\": %.0f, \"flops\": %.0f, \"bw_ms\": %.4f, \"flop_ms\": %.4f, "
        "\"roofline_ms\": %.4f, "
        "\"x_roofline\": %.4f, \"route_ms\": %.3f, \"experts_ms\": %.3f, \"shared_ms\": %.3f, "
        "\"finish_ms\": %.3f, \"gateway_cpu_ms_per_token\": %.4f, "
        "\"ranks_cpu_ms_per_token\": %.4f, \"stages\": [%s]}",
        i ? ", " : "", r.tokens, JsonString(run.tier), r.median_ms, r.min_ms, r.runs,
        r.experts_touched, r.read_gbps, r.peak_gflops, r.weight_bytes, r.flops, r.bw_ms, r.flop_ms,
        r.roofline_ms, r.median_ms / r.roofline_ms, r.route_ms, r.experts_ms, r.shared_ms,
        r.finish_ms, (r.route_ms + r.shared_ms + r.finish_ms) * run.threads / r.tokens,
        r.experts_ms * run.threads / r.tokens, StagesJson(r));
  }
  out << "]}\n";
}

// A gnuplot chart of time against the roofline (PNG at `plot`, its data and script beside it).
void WriteLayerPlot(const std::string& plot, const LayerRun& run, const std::vector<Row>& rows) {
  const std::string data = plot + ".dat", script = plot + ".gp";
  {
    std::ofstream d(data);
    for (const Row& r : rows)
      d << r.tokens << " " << r.median_ms << " " << r.roofline_ms << " " << r.bw_ms << " "
        << r.flop_ms << "\n";
  }
  std::ofstream g(script);
  // gnuplot's single-quoted strings take a quote as two; paths and the label may hold one.
  auto quoted = [](const std::string& s) {
    return absl::StrCat("'", absl::StrReplaceAll(s, {{"'", "''"}}), "'");
  };
  // noenhanced: "kimi_k3" is a name, not k3 as a subscript.
  g << "set terminal pngcairo size 900,560 font ',11'\nset termoption noenhanced\n"
    << "set output " << quoted(plot) << "\n"
    << "set title " << quoted(absl::StrCat(run.name, ": time vs roofline (", run.backend, ")"))
    << "\n"
    << "set logscale xy\nset xlabel 'tokens per step'\nset ylabel 'ms'\nset grid\nset key top "
       "left\n"
    << "plot " << quoted(data) << " u 1:2 w lp lw 2 pt 7 t 'measured (median)', " << quoted(data)
    << " u 1:3 w l lw 2 dt 2 t 'roofline max(bytes/BW, FLOPs/peak)', " << quoted(data)
    << " u 1:4 w l lw 1 dt 3 t 'weights / read BW', " << quoted(data)
    << " u 1:5 w l lw 1 dt 4 t 'FLOPs / compute peak'\n";
  g.close();
  if (!RunGnuplot(script))
    std::fprintf(stderr, "moe-bench: gnuplot failed; data in %s\n", data.c_str());
}

absl::Status RunLayer(const LayerOptions& opt) {
  const Precision precision = opt.precision;
  ASSIGN_OR_RETURN(auto checkpoint, Checkpoint::Open(opt.checkpoint));
  const MoeConfig& config = checkpoint->config();
  const int layer = opt.layer >= 0 ? opt.layer : checkpoint->layers().front();
  std::vector<int64_t> token_counts;
  for (absl::string_view t : absl::StrSplit(opt.tokens, ',', absl::SkipEmpty())) {
    int64_t v;
    if (!absl::SimpleAtoi(t, &v) || v <= 0)
      return absl::InvalidArgumentError(absl::StrCat("bad --tokens ", t));
    token_counts.push_back(v);
  }

  ASSIGN_OR_RETURN(std::unique_ptr<CpuBackend> owned_backend,
                   CpuBackend::Create(CpuBackendOptions{opt.threads, opt.kernels}));
  CpuBackend& backend = *owned_backend;
  std::fprintf(stderr, "moe-bench: measuring the roofline (%.1f GB read buffer, GEMM)...\n",
               opt.buffer_gb);
  const std::string tier = backend.kernels().name;
  const bench::Roofline roof = bench::MeasureRoofline(backend.num_threads(), opt.buffer_gb, tier,
                                                      precision == Precision::kBF16, opt.gemm);

  std::fprintf(stderr, "moe-bench: loading layer %d of %s...\n", layer, opt.checkpoint.c_str());
  const auto t_load = std::chrono::steady_clock::now();
  ASSIGN_OR_RETURN(
      auto local,
      LocalMoeLayer::Load(*checkpoint, layer,
                          ExpertPlacement::Contiguous(config.routing.num_experts, 1), &backend));
  ASSIGN_OR_RETURN(GatewayLayerWeights gw, checkpoint->LoadGatewayLayer(layer));
  const DenseCost dense = DenseParts(gw);
  ASSIGN_OR_RETURN(ExpertShardWeights probe, checkpoint->LoadExperts(layer, {0}));
  const double expert_bytes = static_cast<double>(probe.experts[0].TotalBytes());
  const double expert_flops_per_assignment = 2.0 * 3.0 *
                                             static_cast<double>(config.expert_hidden_size) *
                                             static_cast<double>(config.expert_input_size());
  const double load_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t_load).count();

  // The host's bandwidth and compute peak change from minute to minute (on a 2-vCPU guest the
  // FMA peak of two threads was seen to halve while the hypervisor shared one core between the
  // vCPUs), so each row is compared with both measured right around its own runs.
  bench::ReadProbe read_probe(backend.num_threads(),
                              static_cast<size_t>(opt.buffer_gb * (1 << 30)));
  double gbps_before = read_probe.Measure(3);
  auto measure_peak = [&] {
    return bench::MeasureComputePeak(backend.num_threads(), tier, precision == Precision::kBF16,
                                     nullptr);
  };
  double peak_before = measure_peak();
  std::vector<Row> rows;
  std::mt19937 rng(1234);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int64_t T : token_counts) {
    std::vector<float> x(T * config.hidden_size), y(x.size());
    for (float& v : x) v = normal(rng);
    Routing routing;
    RETURN_IF_ERROR(
        local->Forward(x.data(), T, precision, y.data(), &routing));  // warm-up (and page-in)
    std::vector<std::pair<double, LayerTimings>> runs;
    double spent = 0;
    while (static_cast<int>(runs.size()) < opt.repeat &&
           (runs.size() < 3 || spent < opt.max_seconds)) {
      LayerTimings timings;
      bench::FlushCaches();  // no weight may still be cached from the previous run
      const auto t0 = std::chrono::steady_clock::now();
      RETURN_IF_ERROR(local->Forward(x.data(), T, precision, y.data(), nullptr, &timings));
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      runs.push_back({1e3 * s, timings});
      spent += s;
    }
    std::sort(runs.begin(), runs.end(),
              [](const auto& a, const auto& b) { return a.first < b.first; });
    std::vector<double> ms;
    for (const auto& run : runs) ms.push_back(run.first);
    const LayerTimings& median = runs[runs.size() / 2].second;
    Row r;
    const double gbps_after = read_probe.Measure(3);  // also the next row's "before"
    r.read_gbps = std::max(gbps_before, gbps_after);
    gbps_before = gbps_after;
    const double peak_after = measure_peak();
    r.peak_gflops = std::max(peak_before, peak_after);
    peak_before = peak_after;
    r.tokens = T;
    r.median_ms = ms[ms.size() / 2];
    r.min_ms = ms.front();
    r.runs = static_cast<int>(ms.size());
    r.route_ms = absl::ToDoubleMilliseconds(median.route);
    r.experts_ms = absl::ToDoubleMilliseconds(median.experts);
    r.shared_ms = absl::ToDoubleMilliseconds(median.shared);
    r.finish_ms = absl::ToDoubleMilliseconds(median.finish);
    r.experts_touched =
        static_cast<int>(std::set<int32_t>(routing.ids.begin(), routing.ids.end()).size());
    r.weight_bytes = dense.bytes() + r.experts_touched * expert_bytes;
    r.flops = static_cast<double>(T) * dense.flops_per_token() +
              static_cast<double>(routing.ids.size()) * expert_flops_per_assignment;
    const StageCost* dense_stage[4] = {&dense.route, nullptr, &dense.shared, &dense.finish};
    for (int stage = 0; stage < 4; ++stage) {
      r.stage_bytes[stage] = dense_stage[stage] != nullptr ? dense_stage[stage]->bytes
                                                           : r.experts_touched * expert_bytes;
      r.stage_flops[stage] =
          dense_stage[stage] != nullptr
              ? static_cast<double>(T) * dense_stage[stage]->flops_per_token
              : static_cast<double>(routing.ids.size()) * expert_flops_per_assignment;
    }
    r.bw_ms = 1e3 * r.weight_bytes / (r.read_gbps * 1e9);
    r.flop_ms = r.peak_gflops > 0 ? 1e3 * r.flops / (r.peak_gflops * 1e9) : 0;
    r.roofline_ms = std::max(r.bw_ms, r.flop_ms);
    // No run can do more FLOPs per second than the machine; one that did shows that the probe
    // did not measure the peak (as the zmm probes once did, their accumulators on the stack).
    if (r.min_ms < r.flop_ms)
      std::fprintf(stderr,
                   "moe-bench: warning: %lld tokens ran at %.0f GFLOP/s, above the probed peak of "
                   "%.0f: the probe is wrong and this row's roofline ms overstated\n",
                   static_cast<long long>(T), r.flops / (r.min_ms * 1e6), r.peak_gflops);
    rows.push_back(r);
    std::fprintf(stderr, "  %5lld tokens: %.2f ms (median of %d)\n", static_cast<long long>(T),
                 r.median_ms, r.runs);
  }

  LayerRun run;
  run.name = opt.label.empty() ? absl::StrCat(config.model_type, " layer ", layer) : opt.label;
  run.tier = tier;
  run.backend = backend.name();
  run.threads = backend.num_threads();
  run.load_s = load_s;
  run.roof = roof;
  run.host = bench::DescribeHostCpu();
  PrintLayerRun(run, config, precision, rows);
  if (!opt.json.empty()) WriteLayerJson(opt.json, run, config, precision, rows);
  if (!opt.plot.empty()) WriteLayerPlot(opt.plot, run, rows);
  return absl::OkStatus();
}

// Single-kernel throughput: y = x W^T for one weight matrix in each format, weights resident
// in cache (compute bound) or streamed from memory (a set of matrices much larger than L3).
absl::Status RunKernels(int64_t rows, int64_t cols, const std::string& m_list, int threads,
                        bool stream, const std::string& kernels, Precision precision) {
  std::vector<int64_t> ms;
  for (absl::string_view t : absl::StrSplit(m_list, ',', absl::SkipEmpty())) {
    int64_t v;
    if (!absl::SimpleAtoi(t, &v) || v <= 0)
      return absl::InvalidArgumentError(absl::StrCat("bad --m ", t));
    ms.push_back(v);
  }
  ASSIGN_OR_RETURN(std::unique_ptr<CpuBackend> owned_backend,
                   CpuBackend::Create(CpuBackendOptions{threads, kernels}));
  CpuBackend& backend = *owned_backend;
  std::mt19937 rng(7);
  std::printf("kernel throughput, %s, %s mode, W [%lld, %lld], weights %s\n",
              backend.name().c_str(), PrecisionName(precision), static_cast<long long>(rows),
              static_cast<long long>(cols), stream ? "streamed from memory" : "in cache");
  std::printf("%6s %3s %10s %12s %12s\n", "format", "M", "us/matrix", "weight GB/s", "GFLOP/s");
  for (WeightFormat f : {WeightFormat::kBF16, WeightFormat::kMXFP4, WeightFormat::kFP8Block128}) {
    WeightMatrix proto;
    proto.format = f;
    proto.rows = rows;
    proto.cols = cols;
    const int64_t data_bytes = proto.DataBytes(), scale_bytes = proto.ScaleBytes();
    const int copies = stream ? static_cast<int>(std::max<int64_t>(
                                    1, (int64_t{1} << 30) / (data_bytes + scale_bytes)))
                              : 1;
    std::vector<std::vector<uint8_t>> data(copies), scales(copies);
    std::vector<WeightMatrix> mats;
    for (int c = 0; c < copies; ++c) {
      data[c].resize(data_bytes);
      scales[c].resize(scale_bytes);
      if (f == WeightFormat::kBF16) {
        // Normal values: the FMA-emulating tiers slow down on denormal inputs, which trained
        // weights do not have (the bytes below would give bf16 denormals).
        auto* bits = reinterpret_cast<uint16_t*>(data[c].data());
        for (int64_t i = 0; i < data_bytes / 2; ++i)
          bits[i] =
              FloatToBf16Bits(static_cast<float>(static_cast<int>(rng() % 2001) - 1000) * 1e-4f);
      } else {
        for (auto& b : data[c]) b = static_cast<uint8_t>(rng() & 0x77);  // finite MXFP4 / FP8
      }
      if (f == WeightFormat::kMXFP4) {
        for (auto& b : scales[c]) b = 120;
      } else if (f == WeightFormat::kFP8Block128) {
        float* s = reinterpret_cast<float*>(scales[c].data());
        for (int64_t i = 0; i < scale_bytes / 4; ++i) s[i] = 0.01f;
      }
      WeightMatrix w = proto;
      w.data = data[c].data();
      w.scales = scales[c].data();
      ASSIGN_OR_RETURN(w, backend.PrepareWeight(w));
      mats.push_back(w);
    }
    for (int64_t m : ms) {
      std::vector<float> x(m * cols), y(m * rows);
      for (float& v : x) v = RoundToBf16(static_cast<float>(rng() % 1000) / 500.0f - 1.0f);
      const ConstMatrixView xv(x.data(), m, cols, cols);
      const MatrixView yv(y.data(), m, rows, rows);
      RETURN_IF_ERROR(backend.Linear(xv, mats[0], yv, precision));
      std::vector<double> us;
      for (int rep = 0; rep < 5; ++rep) {
        const auto t0 = std::chrono::steady_clock::now();
        for (const WeightMatrix& w : mats) RETURN_IF_ERROR(backend.Linear(xv, w, yv, precision));
        us.push_back(1e6 *
                     std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() /
                     copies);
      }
      std::sort(us.begin(), us.end());
      const double t = us[us.size() / 2];
      std::printf("%6s %3lld %10.1f %12.2f %12.1f\n", WeightFormatName(f),
                  static_cast<long long>(m), t, (data_bytes + scale_bytes) / t / 1e3,
                  2.0 * m * rows * cols / t / 1e3);
    }
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace moe

int main(int argc, char** argv) {
  const std::string command = argc > 1 ? argv[1] : "";
  if (command == "roofline") {
    int threads = 0;
    double gb = 2.0;
    bool gemm = true;
    moe::Flags flags("usage: moe-bench roofline [--threads N] [--buffer-gb G] [--gemm=false]");
    flags.Int("threads", &threads, "threads for the bandwidth run (0 = all)");
    flags.Double("buffer-gb", &gb, "read buffer size");
    flags.Bool("gemm", &gemm, "also time the GEMM library, for reference");
    flags.ParseOrExit(argc, argv, 2);
    moe::ThreadPool probe(threads);
    std::string read_kernel;
    moe::bench::StreamReadKernel(&read_kernel);
    const double gbps = moe::bench::MeasureReadBandwidth(probe.num_threads(),
                                                         static_cast<size_t>(gb * (1 << 30)), 7);
    std::printf("streaming read: %.1f GB/s (%d threads, %s loads)\n", gbps, probe.num_threads(),
                read_kernel.c_str());
    // The compute peak of every tier this host runs, as moe-bench layer uses it.
    for (const moe::cpu::CpuTier& tier : moe::cpu::CpuTiers()) {
      if (!tier.host_supports()) {
        std::printf("tier %-12s not on this host (needs %s)\n", tier.name, tier.features);
        continue;
      }
      for (const bool bf16 : {true, false}) {
        std::string what;
        const double peak =
            moe::bench::MeasureComputePeak(probe.num_threads(), tier.name, bf16, &what);
        std::printf("tier %-12s %s mode: %.1f GFLOP/s (%s)\n", tier.name, bf16 ? "bf16" : "fp32",
                    peak, what.c_str());
      }
    }
    if (gemm) {
      std::string source;
      const double gemm_bf16 = moe::bench::MeasureGemmGflops(true, &source);
      const double gemm_fp32 = moe::bench::MeasureGemmGflops(false, nullptr);
      std::printf("GEMM library: %.0f GFLOP/s bf16, %.0f fp32 (%s)\n", gemm_bf16, gemm_fp32,
                  source.c_str());
    }
    return 0;
  }
  if (command == "kernels") {
    int64_t rows = 3072, cols = 3584;
    std::string m = "1,2,4,8,16,64";
    int threads = 0;
    bool stream = false;
    std::string kernels;
    moe::Precision precision = moe::Precision::kBF16;
    moe::Flags flags(
        "usage: moe-bench kernels [--rows R] [--cols K] [--m 1,4,16] [--stream] [--kernels T] "
        "[--dtype bf16|fp32]");
    flags.Int("rows", &rows, "weight rows (output features)");
    flags.Int("cols", &cols, "weight columns (input features)");
    flags.String("m", &m, "operand rows (tokens), comma separated");
    flags.Int("threads", &threads, "threads (0 = all)");
    flags.Bool("stream", &stream, "stream weights from memory (1 GB of matrices) instead of cache");
    flags.String("kernels", &kernels, "CPU kernel tier (default: MOE_CPU_KERNELS, else the best)");
    flags.Choice("dtype", &precision, moe::PrecisionChoices(),
                 "the dot products' precision (fp32: the router's mode)");
    flags.ParseOrExit(argc, argv, 2);
    if (absl::Status s = moe::RunKernels(rows, cols, m, threads, stream, kernels, precision);
        !s.ok()) {
      std::fprintf(stderr, "moe-bench: %s\n", s.ToString().c_str());
      return 1;
    }
    return 0;
  }
  if (command == "--version") {  // as every binary's flags answer it
    std::printf("moe-bench %s (commit %s)\n", moe::Version(), moe::GitCommit());
    return 0;
  }
  if (command != "layer") {
    std::fprintf(
        stderr,
        "usage: moe-bench layer --checkpoint DIR [flags]   the layer next to the roofline\n"
        "       moe-bench kernels [--stream]             dot kernels per weight format\n"
        "       moe-bench roofline                       the machine's limits\n");
    return command == "--help" ? 0 : 2;
  }
  moe::LayerOptions opt;
  moe::Flags flags(
      "usage: moe-bench layer --checkpoint DIR [--tokens 1,4,16,64,256,1024] [--json F] [--plot "
      "F.png]");
  flags.String("checkpoint", &opt.checkpoint, "checkpoint directory");
  flags.Int("layer", &opt.layer, "MoE layer (default: the first)");
  flags.String("tokens", &opt.tokens, "token counts, comma separated");
  flags.Int("repeat", &opt.repeat, "timed runs per token count (median reported)");
  flags.Double("max-seconds", &opt.max_seconds,
               "stop repeating a token count after this long (>= 3 runs)");
  flags.Int("threads", &opt.threads, "CPU threads (0 = all)");
  flags.Choice("dtype", &opt.precision, moe::PrecisionChoices(), "the forward pass's precision");
  flags.String("kernels", &opt.kernels,
               "CPU kernel tier: best, avx512-bf16, avx512, avx2 or portable (default: "
               "MOE_CPU_KERNELS, else the best this CPU runs)");
  flags.String("json", &opt.json, "also write the results as JSON to this file");
  flags.String("plot", &opt.plot,
               "also plot time and roofline against tokens to this PNG (gnuplot)");
  flags.String("label", &opt.label, "name of the run in the output");
  flags.Double("buffer-gb", &opt.buffer_gb, "bandwidth buffer size (much larger than the caches)");
  flags.Bool("gemm", &opt.gemm, "also time the GEMM library, for reference (--gemm=false: skip)");
  flags.Require("checkpoint");
  flags.ParseOrExit(argc, argv, 2);
  if (absl::Status s = moe::RunLayer(opt); !s.ok()) {
    std::fprintf(stderr, "moe-bench: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}
