// moe-ckpt: writes synthetic MoE checkpoints (model/synthetic.h) in the Hugging Face layout.
//
//   moe-ckpt --preset k3-mini --out /tmp/k3-mini
//   moe-ckpt --preset kimi-k2 --experts 16 --out /tmp/k2-small
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "model/synthetic.h"

namespace {

constexpr char kUsage[] =
    R"(usage: moe-ckpt --preset k3-mini|kimi-k3|kimi-k2 --out DIR [options]

Writes a synthetic checkpoint (config.json, model-*.safetensors, model.safetensors.index.json)
with the tensor names, dtypes and shapes of the real model and realistic random values.

options:
  --seed N                 random seed (default 0); same seed, same bytes
  --layers N               number of MoE layers (layers 1..N; default: preset's)
  --hidden N               hidden size
  --latent N               latent size of the routed experts (0 = no latent)
  --expert-hidden N        routed expert hidden size (moe_intermediate_size)
  --experts N              routed experts per layer
  --top-k N                experts per token
  --shared-experts N       shared experts (0 = none)
  --expert-format F        routed experts: bf16 | mxfp4 | fp8
  --dense-format F         shared experts and latent projections: bf16 | fp8 (default: fp8
                           with fp8 experts, else bf16)
  --scaling-factor X       routed_scaling_factor
  --router-skew X          add X to the router bias of the first 10% of experts
  --shard-size-mb N        maximum shard size (default 4096)
  --no-lm-prefix           K3: name tensors model.layers.* instead of language_model.model.layers.*
  --threads N              generator threads (default 2)
  --quiet                  no progress bar (the summary is still printed)
  --help                   this text
)";

[[noreturn]] void UsageError(absl::string_view message) {
  std::fprintf(stderr, "moe-ckpt: %s (see --help)\n", std::string(message).c_str());
  std::exit(2);
}

int64_t ParseInt(absl::string_view flag, absl::string_view value, int64_t min) {
  int64_t v;
  if (!absl::SimpleAtoi(value, &v) || v < min)
    UsageError(absl::StrCat(flag, " needs an integer >= ", min, ", got '", value, "'"));
  return v;
}

float ParseFloat(absl::string_view flag, absl::string_view value) {
  float v;
  if (!absl::SimpleAtof(value, &v) || !std::isfinite(v))
    UsageError(absl::StrCat(flag, " needs a number, got '", value, "'"));
  return v;
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
  // Flags as name -> value; valueless flags map to "".
  static const char* const kValueFlags[] = {
      "--preset",        "--out",           "--seed",           "--layers",      "--hidden",
      "--latent",        "--expert-hidden", "--experts",        "--top-k",       "--shared-experts",
      "--expert-format", "--dense-format",  "--scaling-factor", "--router-skew", "--shard-size-mb",
      "--threads"};
  static const char* const kBoolFlags[] = {"--quiet", "--no-lm-prefix", "--help", "-h"};
  std::map<std::string, std::string> flags;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    std::string value;
    bool has_value = false;
    const size_t eq = arg.find('=');
    if (arg.rfind("--", 0) == 0 && eq != std::string::npos) {
      value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
      has_value = true;
    }
    bool known = false;
    for (const char* f : kBoolFlags) {
      if (arg == f) {
        if (has_value) UsageError(absl::StrCat(arg, " takes no value"));
        known = true;
      }
    }
    for (const char* f : kValueFlags) {
      if (arg == f) {
        if (!has_value) {
          if (i + 1 >= argc) UsageError(absl::StrCat(arg, " needs a value"));
          value = argv[++i];
        }
        known = true;
      }
    }
    if (!known) UsageError(absl::StrCat("unknown argument '", arg, "'"));
    if (flags.count(arg)) UsageError(absl::StrCat(arg, " given twice"));
    flags[arg] = value;
  }
  if (flags.count("--help") || flags.count("-h")) {
    std::fputs(kUsage, stdout);
    return 0;
  }
  if (!flags.count("--preset")) UsageError("--preset is required");
  if (!flags.count("--out") || flags["--out"].empty()) UsageError("--out is required");

  absl::StatusOr<moe::MoeConfig> preset = moe::SyntheticPreset(flags["--preset"]);
  if (!preset.ok()) UsageError(preset.status().message());
  moe::MoeConfig config = *preset;
  moe::SyntheticOptions options;
  const auto has = [&](const char* f) { return flags.count(f) > 0; };
  const auto get = [&](const char* f) -> absl::string_view { return flags[f]; };

  if (has("--seed")) {
    uint64_t seed;
    if (!absl::SimpleAtoi(get("--seed"), &seed))
      UsageError(absl::StrCat("--seed needs a non-negative integer, got '", get("--seed"), "'"));
    options.seed = seed;
  }
  if (has("--layers")) options.num_moe_layers = ParseInt("--layers", get("--layers"), 1);
  if (has("--hidden")) config.hidden_size = ParseInt("--hidden", get("--hidden"), 1);
  if (has("--latent")) {
    config.latent_size = ParseInt("--latent", get("--latent"), 0);
    if (config.latent_size == 0) config.latent_norm = false;
  }
  if (has("--expert-hidden"))
    config.expert_hidden_size = ParseInt("--expert-hidden", get("--expert-hidden"), 1);
  if (has("--experts"))
    config.routing.num_experts = static_cast<int>(ParseInt("--experts", get("--experts"), 1));
  if (has("--top-k"))
    config.routing.top_k = static_cast<int>(ParseInt("--top-k", get("--top-k"), 1));
  if (has("--shared-experts"))
    config.num_shared_experts =
        static_cast<int>(ParseInt("--shared-experts", get("--shared-experts"), 0));
  if (has("--expert-format")) {
    config.expert_format = ParseFormat("--expert-format", get("--expert-format"), true);
    // Unless told otherwise, the dense weights follow: config.json can only say fp8/fp8,
    // mxfp4/bf16 or bf16/bf16.
    config.dense_format = config.expert_format == moe::WeightFormat::kFP8Block128
                              ? moe::WeightFormat::kFP8Block128
                              : moe::WeightFormat::kBF16;
  }
  if (has("--dense-format"))
    config.dense_format = ParseFormat("--dense-format", get("--dense-format"), false);
  if (has("--scaling-factor"))
    config.routing.routed_scaling_factor = ParseFloat("--scaling-factor", get("--scaling-factor"));
  if (has("--router-skew")) options.router_skew = ParseFloat("--router-skew", get("--router-skew"));
  if (has("--shard-size-mb"))
    options.max_shard_bytes = ParseInt("--shard-size-mb", get("--shard-size-mb"), 1) << 20;
  if (has("--threads"))
    options.num_threads = static_cast<int>(ParseInt("--threads", get("--threads"), 1));
  options.language_model_prefix = !has("--no-lm-prefix");
  options.progress = !has("--quiet");

  const std::string out = flags["--out"];
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
