// moe-ckpt: writes synthetic MoE checkpoints (model/synthetic.h) in the Hugging Face layout.
//
//   moe-ckpt --preset k3-mini --out /tmp/k3-mini
//   moe-ckpt --preset kimi-k2 --experts 16 --out /tmp/k2-small
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "core/flags.h"
#include "model/synthetic.h"

namespace {

constexpr char kUsage[] =
    R"(usage: moe-ckpt --preset k3-mini|kimi-k3|kimi-k2 --out DIR [flags]

Writes a synthetic checkpoint (config.json, model-*.safetensors, model.safetensors.index.json)
with the tensor names, dtypes and shapes of the real model and realistic random values. Flags
left out keep the preset's values; the same seed gives the same bytes.)";

[[noreturn]] void UsageError(absl::string_view message) {
  std::fprintf(stderr, "moe-ckpt: %s (see --help)\n", std::string(message).c_str());
  std::exit(2);
}

moe::WeightFormat ParseFormat(absl::string_view flag, absl::string_view value, bool allow_mxfp4) {
  if (value == "bf16") return moe::WeightFormat::kBF16;
  if (value == "fp8") return moe::WeightFormat::kFP8Block128;
  if (value == "mxfp4" && allow_mxfp4) return moe::WeightFormat::kMXFP4;
  UsageError(absl::StrCat(flag, " must be ", allow_mxfp4 ? "bf16, mxfp4 or fp8" : "bf16 or fp8",
                          ", got '", value, "'"));
}

}  // namespace

int main(int argc, char** argv) {
  std::string preset_name, out, expert_format, dense_format;
  int64_t seed = 0, layers = 0, hidden = 0, latent = 0, expert_hidden = 0, experts = 0, top_k = 0;
  int64_t shared = 0, shard_size_mb = 4096, threads = 2;
  double scaling_factor = 0, router_skew = 0;
  bool quiet = false, no_lm_prefix = false;
  moe::Flags flags(kUsage);
  flags.String("preset", &preset_name, "k3-mini | kimi-k3 | kimi-k2");
  flags.String("out", &out, "output directory");
  flags.Int("seed", &seed, "random seed; same seed, same bytes");
  flags.Range("seed", 0, INT64_MAX);
  flags.Int("layers", &layers, "number of MoE layers (layers 1..N)");
  flags.Range("layers", 1, 1 << 16);
  flags.Int("hidden", &hidden, "hidden size");
  flags.Range("hidden", 1, 1 << 20);
  flags.Int("latent", &latent, "latent size of the routed experts (0 = no latent)");
  flags.Range("latent", 0, 1 << 20);
  flags.Int("expert-hidden", &expert_hidden, "routed expert hidden size (moe_intermediate_size)");
  flags.Range("expert-hidden", 1, 1 << 20);
  flags.Int("experts", &experts, "routed experts per layer");
  flags.Range("experts", 1, 1 << 16);
  flags.Int("top-k", &top_k, "experts per token");
  flags.Range("top-k", 1, 1 << 16);
  flags.Int("shared-experts", &shared, "shared experts (0 = none)");
  flags.Range("shared-experts", 0, 1 << 10);
  flags.String("expert-format", &expert_format, "routed experts: bf16 | mxfp4 | fp8");
  flags.String("dense-format", &dense_format,
               "shared experts and latent projections: bf16 | fp8 (default: fp8 with fp8 "
               "experts, else bf16)");
  flags.Double("scaling-factor", &scaling_factor, "routed_scaling_factor");
  flags.Double("router-skew", &router_skew, "add X to the router bias of the first 10% of experts");
  flags.Int("shard-size-mb", &shard_size_mb, "maximum shard size");
  flags.Range("shard-size-mb", 1, 1 << 30);
  flags.Int("threads", &threads, "generator threads");
  flags.Range("threads", 1, 4096);
  flags.Bool("quiet", &quiet, "no progress bar (the summary is still printed)");
  flags.Bool("no-lm-prefix", &no_lm_prefix,
             "K3: name tensors model.layers.* instead of language_model.model.layers.*");
  flags.Require("preset");
  flags.Require("out");
  flags.ParseOrExit(argc, argv);
  if (out.empty()) UsageError("--out is required");

  absl::StatusOr<moe::MoeConfig> preset = moe::SyntheticPreset(preset_name);
  if (!preset.ok()) UsageError(preset.status().message());
  moe::MoeConfig config = *preset;
  moe::SyntheticOptions options;
  const auto has = [&](const char* f) { return flags.WasSet(f); };
  options.seed = static_cast<uint64_t>(seed);
  if (has("layers")) options.num_moe_layers = static_cast<int>(layers);
  if (has("hidden")) config.hidden_size = hidden;
  if (has("latent")) {
    config.latent_size = latent;
    if (config.latent_size == 0) config.latent_norm = false;
  }
  if (has("expert-hidden")) config.expert_hidden_size = expert_hidden;
  if (has("experts")) config.routing.num_experts = static_cast<int>(experts);
  if (has("top-k")) config.routing.top_k = static_cast<int>(top_k);
  if (has("shared-experts")) config.num_shared_experts = static_cast<int>(shared);
  if (has("expert-format")) {
    config.expert_format = ParseFormat("--expert-format", expert_format, true);
    // Unless told otherwise, the dense weights follow: config.json can only say fp8/fp8,
    // mxfp4/bf16 or bf16/bf16.
    config.dense_format = config.expert_format == moe::WeightFormat::kFP8Block128
                              ? moe::WeightFormat::kFP8Block128
                              : moe::WeightFormat::kBF16;
  }
  if (has("dense-format")) config.dense_format = ParseFormat("--dense-format", dense_format, false);
  if (has("scaling-factor"))
    config.routing.routed_scaling_factor = static_cast<float>(scaling_factor);
  if (has("router-skew")) options.router_skew = static_cast<float>(router_skew);
  options.max_shard_bytes = shard_size_mb << 20;
  options.num_threads = static_cast<int>(threads);
  options.language_model_prefix = !no_lm_prefix;
  options.progress = !quiet;

  moe::SyntheticSummary summary;
  const absl::Status status = moe::WriteSyntheticCheckpoint(out, config, options, &summary);
  if (!status.ok()) {
    std::fprintf(stderr, "moe-ckpt: %s\n", std::string(status.message()).c_str());
    // A bad combination of flags is a usage error; anything else (disk, I/O) a failure.
    return status.code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
  }
  std::printf(
      "wrote %s: %s, MoE layers %s, %d experts/layer (experts %s, dense %s), %.1f MB in %zu "
      "files, %.1f s (%.0f MB/s)\n",
      out.c_str(), moe::ModelFamilyName(config.family), absl::StrJoin(summary.layers, ",").c_str(),
      summary.num_experts, moe::WeightFormatName(config.expert_format),
      moe::WeightFormatName(config.dense_format), summary.file_bytes / 1e6, summary.files.size(),
      summary.seconds, summary.seconds > 0 ? summary.file_bytes / 1e6 / summary.seconds : 0.0);
  return 0;
}
