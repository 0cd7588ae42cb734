// moe-forward: one MoE layer in-process, the offline way to check a checkpoint and the
// baseline the service is compared with.
//
//   moe-forward --checkpoint DIR --layer L --input x.npy --output y.npy [--dtype bf16|fp32]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>

#include "absl/strings/str_format.h"
#include "core/flags.h"
#include "core/npy.h"
#include "core/progress.h"
#include "core/status.h"
#include "engine/local_layer.h"
#include "kernels/cpu/cpu_backend.h"
#include "model/checkpoint.h"

namespace moe {
namespace {

struct Options {
  std::string checkpoint, input, output, routing_out, weights_out, kernels, placement;
  Precision precision = Precision::kBF16;
  int layer = -1, threads = 0, ranks = 1, repeat = 1;
};

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  std::string text;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) text.append(buf, n);
  std::fclose(f);
  return text;
}

absl::Status Run(const Options& opt) {
  const Precision precision = opt.precision;
  ASSIGN_OR_RETURN(auto checkpoint, Checkpoint::Open(opt.checkpoint));
  const MoeConfig& config = checkpoint->config();
  const int layer = opt.layer >= 0
                        ? opt.layer
                        : (checkpoint->layers().empty() ? 0 : checkpoint->layers().front());

  ASSIGN_OR_RETURN(NpyArray x, ReadNpy(opt.input));
  if (x.data.empty() && !x.ints.empty())
    return absl::InvalidArgumentError(
        absl::StrCat(opt.input, ": input must be float16 or float32"));
  if ((x.shape.size() != 2 && x.shape.size() != 3) || x.shape.back() != config.hidden_size)
    return absl::InvalidArgumentError(absl::StrFormat("%s: shape must be [T, %d] or [B, T, %d]",
                                                      opt.input, config.hidden_size,
                                                      config.hidden_size));
  const int64_t tokens = x.num_elements() / config.hidden_size;
  if (tokens == 0) return absl::InvalidArgumentError(absl::StrCat(opt.input, ": no tokens"));

  ExpertPlacement placement;
  if (!opt.placement.empty()) {
    ASSIGN_OR_RETURN(std::string text, ReadFile(opt.placement));
    ASSIGN_OR_RETURN(placement, ExpertPlacement::Parse(config.routing.num_experts, text));
  } else {
    placement = ExpertPlacement::Contiguous(config.routing.num_experts, opt.ranks);
  }
  ASSIGN_OR_RETURN(std::unique_ptr<CpuBackend> owned_backend,
                   CpuBackend::Create(CpuBackendOptions{opt.threads, opt.kernels}));
  CpuBackend& backend = *owned_backend;
  std::fprintf(stderr, "moe-forward: %s on %s\n", opt.checkpoint.c_str(), backend.name().c_str());
  const auto t_load = std::chrono::steady_clock::now();
  Progress progress("moe-forward: loading", 0);
  ASSIGN_OR_RETURN(auto local,
                   LocalMoeLayer::Load(*checkpoint, layer, placement, &backend, &progress));
  const double load_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t_load).count();

  std::vector<float> out(x.data.size());
  Routing routing;
  std::vector<double> times;
  for (int rep = 0; rep < std::max(1, opt.repeat); ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    RETURN_IF_ERROR(local->Forward(x.data.data(), tokens, precision, out.data(), &routing));
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(times.begin(), times.end());
  RETURN_IF_ERROR(WriteNpyFloat32(opt.output, x.shape, out.data()));
  if (!opt.routing_out.empty())
    RETURN_IF_ERROR(WriteNpyInt32(opt.routing_out, {tokens, routing.top_k}, routing.ids.data()));
  if (!opt.weights_out.empty())
    RETURN_IF_ERROR(
        WriteNpyFloat32(opt.weights_out, {tokens, routing.top_k}, routing.weights.data()));
  std::fprintf(stderr,
               "moe-forward: %s layer %d, %lld tokens, %s, %s: load %.2f s, forward %.2f ms "
               "(median of %zu)\n",
               ModelFamilyName(config.family), layer, static_cast<long long>(tokens),
               PrecisionName(opt.precision), backend.name().c_str(), load_s,
               1e3 * times[times.size() / 2], times.size());
  return absl::OkStatus();
}

}  // namespace
}  // namespace moe

int main(int argc, char** argv) {
  moe::Options opt;
  moe::Flags flags(
      "usage: moe-forward --checkpoint DIR --layer L --input x.npy --output y.npy [--dtype "
      "bf16|fp32]\n\n"
      "Runs one MoE layer in-process on the CPU backend. Input .npy: float32 or float16, [T, H] "
      "or\n"
      "[B, T, H]; output: float32 of the same shape.");
  flags.String("checkpoint", &opt.checkpoint, "checkpoint directory (config.json + safetensors)");
  flags.Int("layer", &opt.layer,
            "MoE layer index, the checkpoint's own numbering (default: first)");
  flags.String("input", &opt.input, "input .npy");
  flags.String("output", &opt.output, "output .npy (float32)");
  flags.Choice("dtype", &opt.precision, moe::PrecisionChoices(),
               "precision: bf16 is the numerics contract, fp32 rounds nothing in between");
  flags.String("routing-out", &opt.routing_out, "write the chosen expert ids [T, k] (int32 .npy)");
  flags.String("weights-out", &opt.weights_out, "write the routing weights [T, k] (float32 .npy)");
  flags.Int("threads", &opt.threads, "CPU threads (0 = all)");
  flags.Range("threads", 0, 4096);
  flags.Int("ranks", &opt.ranks,
            "split the experts over this many in-process shards, as the service does");
  flags.String("placement", &opt.placement,
               "expert placement file (one line of expert ids per rank)");
  flags.String("kernels", &opt.kernels,
               "CPU kernel tier: best, avx512-bf16, avx512, avx2 or portable (default: "
               "MOE_CPU_KERNELS, else the best this CPU runs)");
  flags.Int("repeat", &opt.repeat, "run the forward this many times and report the median time");
  flags.Range("repeat", 1, 1000000);
  flags.Require("checkpoint");
  flags.Require("input");
  flags.Require("output");
  flags.ParseOrExit(argc, argv);
  if (absl::Status s = moe::Run(opt); !s.ok()) {
    std::fprintf(stderr, "moe-forward: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}
