// moe-bench-gpu: one MoE layer of a checkpoint on one GPU (LocalMoeLayer, CUDA backend, all
// experts on the device), timed at several batch sizes next to the two ceilings measured in
// the same run (docs/DESIGN.md "Performance model"):
//   * weight bandwidth: bytes of the weights a forward must read (distinct routed experts
//     touched + router + latent projections + shared experts) over its time, against the
//     device-to-device copy bandwidth (bytes read + written, 2 GiB buffers);
//   * arithmetic: the forward's FLOPs over its time, against a cuBLAS bf16 GEMM (8192^3 on
//     random data).
//
//   moe-bench-gpu --checkpoint DIR [--tokens 1,16,64,256,1024,4096] [--layer L]
//                 [--dtype bf16|fp32] [--warmup 3] [--repeat 10] [--gemv-max-rows N[,N...]]
//                 [--json]
//
// --gemv-max-rows with several values times every token count once per value (the largest
// per-expert batch that takes the fused GEMV path instead of dequantize + cuBLAS; 0 = cuBLAS
// only), on the same uploaded weights.
//
// Times are CUDA events around LocalMoeLayer::Forward on the backend's stream (host input
// upload, routing round trip and output download included, as served), median of --repeat
// after --warmup runs. The table goes to stdout (stderr with --json, which prints JSON).
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "core/flags.h"
#include "core/numerics.h"
#include "core/status.h"
#include "engine/local_layer.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_status.h"
#include "model/checkpoint.h"

namespace moe {
namespace {

struct Options {
  std::string checkpoint, tokens = "1,16,64,256,1024,4096", gemv_max_rows;
  Precision precision = Precision::kBF16;
  int layer = -1, warmup = 3, repeat = 10, device = 0, gemm_size = 8192, copy_mib = 2048;
  bool json = false;
};

struct Row {
  int gemv_max_rows = 0;
  int64_t tokens = 0;
  double median_ms = 0, min_ms = 0;
  int experts = 0;
  int64_t weight_bytes = 0;
  double weight_gbps = 0, weight_pct = 0, tflops = 0, tflops_pct = 0;
};

// A JSON number (null when not finite: JSON has no inf or NaN).
std::string Num(double v, int decimals) {
  return std::isfinite(v) ? absl::StrFormat("%.*f", decimals, v) : "null";
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// Elapsed ms of `body` between two events on `stream`, median of `repeat` after `warmup`.
template <typename Body>
absl::StatusOr<std::vector<double>> TimeOnStream(cudaStream_t stream, int warmup, int repeat,
                                                 Body body) {
  cudaEvent_t start, stop;
  CUDA_RETURN_IF_ERROR(cudaEventCreate(&start));
  CUDA_RETURN_IF_ERROR(cudaEventCreate(&stop));
  std::vector<double> ms;
  absl::Status status;
  for (int i = 0; i < warmup + repeat && status.ok(); ++i) {
    status = [&]() -> absl::Status {
      CUDA_RETURN_IF_ERROR(cudaEventRecord(start, stream));
      RETURN_IF_ERROR(body());
      CUDA_RETURN_IF_ERROR(cudaEventRecord(stop, stream));
      CUDA_RETURN_IF_ERROR(cudaEventSynchronize(stop));
      float t = 0;
      CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&t, start, stop));
      if (i >= warmup) ms.push_back(t);
      return absl::OkStatus();
    }();
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  RETURN_IF_ERROR(status);
  return ms;
}

// Device-to-device copy bandwidth in GB/s, counting bytes read + written.
absl::StatusOr<double> MeasureCopyBandwidth(cudaStream_t stream, size_t bytes) {
  void *a = nullptr, *b = nullptr;
  CUDA_RETURN_IF_ERROR(cudaMalloc(&a, bytes));
  CUDA_RETURN_IF_ERROR(cudaMalloc(&b, bytes));
  CUDA_RETURN_IF_ERROR(cudaMemsetAsync(a, 0x5a, bytes, stream));
  auto ms = TimeOnStream(stream, 3, 10, [&]() -> absl::Status {
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, stream));
    return absl::OkStatus();
  });
  cudaFree(a);
  cudaFree(b);
  RETURN_IF_ERROR(ms.status());
  return 2.0 * static_cast<double>(bytes) / (Median(*ms) * 1e-3) / 1e9;
}

// cuBLAS bf16 x bf16 -> fp32-accumulated GEMM rate in TFLOP/s (n^3, random operands).
absl::StatusOr<double> MeasureGemmPeak(cudaStream_t stream, int n) {
  const size_t elems = static_cast<size_t>(n) * n;
  std::vector<uint16_t> host(elems);
  uint32_t state = 12345;
  for (auto& v : host) {  // values in [-1, 1): never zeros (zeros run faster than real data)
    state = state * 1664525u + 1013904223u;
    v = FloatToBf16Bits(static_cast<float>(static_cast<int32_t>(state >> 8) - (1 << 23)) /
                        static_cast<float>(1 << 23));
  }
  void *a = nullptr, *b = nullptr, *c = nullptr;
  CUDA_RETURN_IF_ERROR(cudaMalloc(&a, elems * 2));
  CUDA_RETURN_IF_ERROR(cudaMalloc(&b, elems * 2));
  CUDA_RETURN_IF_ERROR(cudaMalloc(&c, elems * 2));
  CUDA_RETURN_IF_ERROR(cudaMemcpy(a, host.data(), elems * 2, cudaMemcpyHostToDevice));
  CUDA_RETURN_IF_ERROR(cudaMemcpy(b, host.data(), elems * 2, cudaMemcpyHostToDevice));
  cublasHandle_t handle;
  CUBLAS_RETURN_IF_ERROR(cublasCreate(&handle));
  CUBLAS_RETURN_IF_ERROR(cublasSetStream(handle, stream));
  const float alpha = 1.0f, beta = 0.0f;
  auto ms = TimeOnStream(stream, 3, 10, [&]() -> absl::Status {
    CUBLAS_RETURN_IF_ERROR(cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, n, n, n, &alpha, a,
                                        CUDA_R_16BF, n, b, CUDA_R_16BF, n, &beta, c, CUDA_R_16BF, n,
                                        CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    return absl::OkStatus();
  });
  cublasDestroy(handle);
  cudaFree(a);
  cudaFree(b);
  cudaFree(c);
  RETURN_IF_ERROR(ms.status());
  return 2.0 * n * static_cast<double>(n) * n / (Median(*ms) * 1e-3) / 1e12;
}

absl::Status Run(const Options& opt) {
  const Precision precision = opt.precision;
  std::vector<int64_t> token_counts;
  for (absl::string_view t : absl::StrSplit(opt.tokens, ',', absl::SkipEmpty())) {
    int64_t v;
    if (!absl::SimpleAtoi(t, &v) || v <= 0)
      return absl::InvalidArgumentError(absl::StrCat("--tokens: bad count '", t, "'"));
    token_counts.push_back(v);
  }
  CudaBackendOptions bo;
  bo.device = opt.device;
  ASSIGN_OR_RETURN(std::unique_ptr<CudaBackend> backend, CudaBackend::Create(bo));
  std::vector<int> gemv_variants;
  for (absl::string_view t : absl::StrSplit(opt.gemv_max_rows, ',', absl::SkipEmpty())) {
    int v;
    if (!absl::SimpleAtoi(t, &v) || v < 0)
      return absl::InvalidArgumentError(absl::StrCat("--gemv-max-rows: bad value '", t, "'"));
    gemv_variants.push_back(v);
  }
  if (gemv_variants.empty()) gemv_variants.push_back(backend->options().gemv_max_rows);
  cudaStream_t stream = backend->stream();
  FILE* table = opt.json ? stderr : stdout;

  ASSIGN_OR_RETURN(auto checkpoint, Checkpoint::Open(opt.checkpoint));
  const MoeConfig& config = checkpoint->config();
  const int layer = opt.layer >= 0 ? opt.layer : checkpoint->layers().front();
  const int E = config.routing.num_experts;
  // Bytes per routed expert and of the gateway's weights, from the checkpoint's own tensors.
  ASSIGN_OR_RETURN(GatewayLayerWeights gw, checkpoint->LoadGatewayLayer(layer));
  ASSIGN_OR_RETURN(ExpertShardWeights one, checkpoint->LoadExperts(layer, {0}));
  const int64_t gateway_bytes = gw.TotalBytes();
  const int64_t expert_bytes = one.TotalBytes();

  const auto t_load = std::chrono::steady_clock::now();
  ASSIGN_OR_RETURN(
      auto local,
      LocalMoeLayer::Load(*checkpoint, layer, ExpertPlacement::Contiguous(E, 1), backend.get()));
  const double load_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t_load).count();
  std::fprintf(table, "moe-bench-gpu: %s layer %d (%d experts, top-%d, %s experts), %s, %s\n",
               ModelFamilyName(config.family), layer, E, config.routing.top_k,
               WeightFormatName(config.expert_format), PrecisionName(opt.precision),
               backend->name().c_str());
  std::fprintf(table, "  weights on device: %.2f GB, loaded in %.1f s\n",
               backend->weight_bytes() / 1e9, load_s);

  ASSIGN_OR_RETURN(const double copy_gbps,
                   MeasureCopyBandwidth(stream, static_cast<size_t>(opt.copy_mib) << 20));
  ASSIGN_OR_RETURN(const double gemm_tflops, MeasureGemmPeak(stream, opt.gemm_size));
  std::fprintf(table,
               "  ceilings: device copy %.0f GB/s (read + write, %d MiB), cuBLAS bf16 GEMM %.0f "
               "TFLOP/s (%d^3, random data)\n",
               copy_gbps, opt.copy_mib, gemm_tflops, opt.gemm_size);

  // FLOPs per token: router, latent projections, shared MLP, top_k routed experts.
  const double H = static_cast<double>(config.hidden_size);
  const double D = static_cast<double>(config.expert_input_size());
  const double F = static_cast<double>(config.expert_hidden_size);
  double flops_per_token = 2.0 * H * E + 2.0 * config.routing.top_k * 3.0 * D * F;
  if (config.has_latent()) flops_per_token += 2.0 * 2.0 * H * D;
  flops_per_token += 2.0 * 3.0 * H * static_cast<double>(config.shared_hidden_size());

  std::vector<Row> rows;
  for (int gemv : gemv_variants) {
    backend->set_gemv_max_rows(gemv);
    std::fprintf(table, "\nGEMV path up to %d rows per expert%s\n", gemv,
                 gemv == 0 ? " (off: dequantize + cuBLAS only)" : "");
    std::fprintf(table, "%8s %10s %10s %8s %12s %10s %8s %9s %8s\n", "tokens", "median_ms",
                 "min_ms", "experts", "weights_MB", "GB/s", "%copy", "TFLOP/s", "%gemm");
    for (int64_t T : token_counts) {
      std::mt19937 rng(static_cast<uint32_t>(T));
      std::normal_distribution<float> normal(0, 1);
      std::vector<float> x(T * config.hidden_size), y(x.size());
      for (auto& v : x) v = normal(rng);
      Routing routing;
      ASSIGN_OR_RETURN(std::vector<double> ms, TimeOnStream(stream, opt.warmup, opt.repeat, [&]() {
                         return local->Forward(x.data(), T, precision, y.data(), &routing);
                       }));
      Row r;
      r.gemv_max_rows = gemv;
      r.tokens = T;
      r.median_ms = Median(ms);
      r.min_ms = *std::min_element(ms.begin(), ms.end());
      r.experts =
          static_cast<int>(std::set<int32_t>(routing.ids.begin(), routing.ids.end()).size());
      r.weight_bytes = gateway_bytes + r.experts * expert_bytes;
      r.weight_gbps = r.weight_bytes / (r.median_ms * 1e-3) / 1e9;
      r.weight_pct = 100.0 * r.weight_gbps / copy_gbps;
      r.tflops = flops_per_token * T / (r.median_ms * 1e-3) / 1e12;
      r.tflops_pct = 100.0 * r.tflops / gemm_tflops;
      rows.push_back(r);
      std::fprintf(table, "%8lld %10.3f %10.3f %8d %12.1f %10.0f %7.1f%% %9.1f %7.1f%%\n",
                   static_cast<long long>(T), r.median_ms, r.min_ms, r.experts,
                   r.weight_bytes / 1e6, r.weight_gbps, r.weight_pct, r.tflops, r.tflops_pct);
      std::fflush(table);
    }
  }
  if (opt.json) {
    std::string out = absl::StrFormat(
        "{\n  \"device\": \"%s\",\n  \"model\": \"%s\",\n  \"layer\": %d,\n  \"dtype\": \"%s\",\n"
        "  \"experts\": %d,\n  \"top_k\": %d,\n  \"expert_format\": \"%s\",\n"
        "  \"load_seconds\": %s,\n  \"copy_gbps\": %s,\n  \"gemm_tflops\": %s,\n"
        "  \"expert_bytes\": %lld,\n  \"gateway_bytes\": %lld,\n  \"rows\": [",
        backend->name(), ModelFamilyName(config.family), layer, PrecisionName(opt.precision), E,
        config.routing.top_k, WeightFormatName(config.expert_format), Num(load_s, 3),
        Num(copy_gbps, 1), Num(gemm_tflops, 1), static_cast<long long>(expert_bytes),
        static_cast<long long>(gateway_bytes));
    for (size_t i = 0; i < rows.size(); ++i) {
      const Row& r = rows[i];
      absl::StrAppendFormat(
          &out,
          "%s\n    {\"gemv_max_rows\": %d, \"tokens\": %lld, \"median_ms\": %s, "
          "\"min_ms\": %s, \"experts\": %d, \"weight_bytes\": %lld, \"weight_gbps\": %s, "
          "\"weight_pct_of_copy\": %s, \"tflops\": %s, \"tflops_pct_of_gemm\": %s}",
          i ? "," : "", r.gemv_max_rows, static_cast<long long>(r.tokens), Num(r.median_ms, 4),
          Num(r.min_ms, 4), r.experts, static_cast<long long>(r.weight_bytes),
          Num(r.weight_gbps, 1), Num(r.weight_pct, 2), Num(r.tflops, 2), Num(r.tflops_pct, 2));
    }
    out += "\n  ]\n}\n";
    std::fputs(out.c_str(), stdout);
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace moe

int main(int argc, char** argv) {
  moe::Options opt;
  moe::Flags flags(
      "usage: moe-bench-gpu --checkpoint DIR [--tokens 1,16,64,256,1024,4096] [--json]\n\n"
      "Times one MoE layer on one GPU (all experts on the device) at each token count and\n"
      "prints it next to the device copy bandwidth and cuBLAS bf16 GEMM rate measured in the\n"
      "same run.");
  flags.String("checkpoint", &opt.checkpoint, "checkpoint directory (config.json + safetensors)");
  flags.String("tokens", &opt.tokens, "comma-separated token counts");
  flags.Int("layer", &opt.layer, "MoE layer index (default: the first in the checkpoint)");
  flags.Choice("dtype", &opt.precision, moe::PrecisionChoices(), "the forward pass's precision");
  flags.Int("warmup", &opt.warmup, "untimed forwards per token count");
  flags.Int("repeat", &opt.repeat, "timed forwards per token count (the median is reported)");
  flags.Int("device", &opt.device, "CUDA device");
  flags.String("gemv-max-rows", &opt.gemv_max_rows,
               "largest per-expert batch for the fused GEMV path; a list times each (default: "
               "the backend's, 8; 0: dequantize + cuBLAS only)");
  flags.Int("gemm-size", &opt.gemm_size, "n of the n^3 bf16 GEMM that measures the peak");
  flags.Int("copy-mib", &opt.copy_mib, "buffer size of the copy-bandwidth measurement");
  flags.Bool("json", &opt.json, "print JSON on stdout (the table goes to stderr)");
  flags.Require("checkpoint");
  flags.ParseOrExit(argc, argv);
  if (opt.repeat < 1) opt.repeat = 1;
  if (opt.warmup < 0) opt.warmup = 0;
  if (opt.gemm_size < 256 || opt.copy_mib < 1) {
    std::fprintf(stderr, "moe-bench-gpu: --gemm-size >= 256 and --copy-mib >= 1\n");
    return 2;
  }
  if (absl::Status s = moe::Run(opt); !s.ok()) {
    std::fprintf(stderr, "moe-bench-gpu: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}
