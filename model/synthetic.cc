#include "model/synthetic.h"

#include <sys/statvfs.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <thread>
#include <utility>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/numerics.h"
#include "core/progress.h"
#include "core/status.h"
#include "model/safetensors.h"

namespace moe {
namespace {

namespace fs = std::filesystem;

// ---- random numbers -----------------------------------------------------------------------

uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

uint64_t Fnv1a(absl::string_view s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (char c : s) h = (h ^ static_cast<uint8_t>(c)) * 0x100000001b3ull;
  return h;
}

// xoshiro256**: fast, and good enough that synthetic weights have no visible structure.
class Xoshiro256 {
 public:
  explicit Xoshiro256(uint64_t seed) {
    for (uint64_t& s : s_) s = seed = SplitMix64(seed);
  }
  uint64_t Next() {
    const uint64_t result = Rotl(s_[1] * 5, 7) * 9;
    const uint64_t t = s_[1] << 17;
    s_[2] ^= s_[0];
    s_[3] ^= s_[1];
    s_[1] ^= s_[2];
    s_[0] ^= s_[3];
    s_[2] ^= t;
    s_[3] = Rotl(s_[3], 45);
    return result;
  }
  // Uniform in [0, 1).
  double Uniform() { return static_cast<double>(Next() >> 11) * 0x1.0p-53; }

 private:
  static uint64_t Rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  uint64_t s_[4];
};

// Inverse of the standard normal CDF (Acklam's rational approximation, |rel. error| < 1.2e-9).
double NormalQuantile(double p) {
  static constexpr double a[] = {-3.969683028665376e+01, 2.209460984245205e+02,
                                 -2.759285104469687e+02, 1.383577518672690e+02,
                                 -3.066479806614716e+01, 2.506628277459239e+00};
  static constexpr double b[] = {-5.447609879822406e+01, 1.615858368580409e+02,
                                 -1.556989798598866e+02, 6.680131188771972e+01,
                                 -1.328068155288572e+01};
  static constexpr double c[] = {-7.784894002430293e-03, -3.223964580411365e-01,
                                 -2.400758277161838e+00, -2.549732539343734e+00,
                                 4.374664141464968e+00,  2.938163982698783e+00};
  static constexpr double d[] = {7.784695709041462e-03, 3.224671290700398e-01,
                                 2.445134137142996e+00, 3.754408661907416e+00};
  constexpr double kLow = 0.02425;
  if (p < kLow || p > 1 - kLow) {
    const double q = std::sqrt(-2 * std::log(p < kLow ? p : 1 - p));
    const double x = (((((c[0] * q + c[1]) * q + c[2]) * q + c[3]) * q + c[4]) * q + c[5]) /
                     ((((d[0] * q + d[1]) * q + d[2]) * q + d[3]) * q + 1);
    return p < kLow ? x : -x;
  }
  const double q = p - 0.5;
  const double r = q * q;
  return (((((a[0] * r + a[1]) * r + a[2]) * r + a[3]) * r + a[4]) * r + a[5]) * q /
         (((((b[0] * r + b[1]) * r + b[2]) * r + b[3]) * r + b[4]) * r + 1);
}

// NOTES: normal samples come from tables of equally likely quantiles indexed by random bits:
// a lookup per value instead of Box-Muller keeps generation disk-bound. 2^16 quantiles are
// finer than bf16 resolution; FP8 has 256 codes anyway.
const std::array<float, 65536>& NormalTable() {
  static const std::array<float, 65536>* table = [] {
    auto* t = new std::array<float, 65536>();
    for (int i = 0; i < 65536; ++i) (*t)[i] = static_cast<float>(NormalQuantile((i + 0.5) / 65536));
    return t;
  }();
  return *table;
}

const std::array<uint8_t, 256>& Fp8NormalTable() {
  static const std::array<uint8_t, 256> table = [] {
    std::array<uint8_t, 256> t;
    for (int i = 0; i < 256; ++i)
      t[i] = FloatToFp8E4m3(static_cast<float>(NormalQuantile((i + 0.5) / 256)));
    return t;
  }();
  return table;
}

// ---- the plan: every tensor, its fill and its shard -----------------------------------------

enum class Fill : uint8_t {
  kNormalBf16,   // bf16 ~ N(mean, stddev^2)
  kNormalF32,    // f32 ~ N(mean, stddev^2), + skew on the first skew_count elements
  kMxfp4Packed,  // uniform random E2M1 codes
  kMxfp4Scale,   // E8M0 exponents giving weight RMS ~ 1/sqrt(in_features)
  kFp8Normal,    // e4m3 ~ N(0, 1)
  kFp8ScaleInv,  // f32 (1/sqrt(in_features)) * U(0.75, 1.25)
};

struct TensorSpec {
  std::string name;
  DType dtype = DType::kBF16;
  std::vector<int64_t> shape;
  Fill fill = Fill::kNormalBf16;
  float mean = 0.0f;
  float stddev = 0.0f;
  int64_t in_features = 0;
  int64_t skew_count = 0;
  float skew = 0.0f;
  uint64_t seed = 0;  // from (options.seed, name)
  uint64_t bytes = 0;
};

// Tensors that must land in the same shard (one expert; one matrix with its scales).
using Unit = std::vector<TensorSpec>;

TensorSpec MakeTensor(std::string name, DType dtype, std::vector<int64_t> shape, Fill fill) {
  TensorSpec t;
  t.name = std::move(name);
  t.dtype = dtype;
  t.shape = std::move(shape);
  t.fill = fill;
  uint64_t n = 1;
  for (int64_t d : t.shape) n *= static_cast<uint64_t>(d);
  t.bytes = n * DTypeSize(dtype);
  return t;
}

void AddMatrix(const std::string& base, WeightFormat format, int64_t rows, int64_t cols,
               Unit* unit) {
  switch (format) {
    case WeightFormat::kBF16: {
      TensorSpec w = MakeTensor(base + ".weight", DType::kBF16, {rows, cols}, Fill::kNormalBf16);
      w.stddev = static_cast<float>(1.0 / std::sqrt(static_cast<double>(cols)));
      unit->push_back(std::move(w));
      return;
    }
    case WeightFormat::kMXFP4: {
      unit->push_back(
          MakeTensor(base + ".weight_packed", DType::kU8, {rows, cols / 2}, Fill::kMxfp4Packed));
      TensorSpec s =
          MakeTensor(base + ".weight_scale", DType::kU8, {rows, cols / 32}, Fill::kMxfp4Scale);
      s.in_features = cols;
      unit->push_back(std::move(s));
      return;
    }
    case WeightFormat::kFP8Block128: {
      unit->push_back(MakeTensor(base + ".weight", DType::kF8E4M3, {rows, cols}, Fill::kFp8Normal));
      TensorSpec s = MakeTensor(base + ".weight_scale_inv", DType::kF32,
                                {(rows + 127) / 128, (cols + 127) / 128}, Fill::kFp8ScaleInv);
      s.in_features = cols;
      unit->push_back(std::move(s));
      return;
    }
  }
}

std::vector<Unit> PlanTensors(const MoeConfig& c, const std::vector<int>& layers,
                              const SyntheticOptions& options) {
  const bool k3 = c.family == ModelFamily::kKimiK3;
  const int64_t experts = c.routing.num_experts;
  std::vector<Unit> units;
  for (int layer : layers) {
    const std::string p = k3 ? absl::StrCat(options.language_model_prefix ? "language_model." : "",
                                            "model.layers.", layer, ".block_sparse_moe.")
                             : absl::StrCat("model.layers.", layer, ".mlp.");
    Unit router;
    TensorSpec gate =
        MakeTensor(p + "gate.weight", DType::kBF16, {experts, c.hidden_size}, Fill::kNormalBf16);
    gate.stddev = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.hidden_size)));
    router.push_back(std::move(gate));
    TensorSpec bias =
        MakeTensor(p + "gate.e_score_correction_bias", DType::kF32, {experts}, Fill::kNormalF32);
    bias.stddev = 0.02f;
    if (options.router_skew != 0.0f) {
      bias.skew = options.router_skew;
      bias.skew_count = (experts + 9) / 10;
    }
    router.push_back(std::move(bias));
    units.push_back(std::move(router));

    if (c.has_latent()) {
      units.emplace_back();
      AddMatrix(p + "routed_expert_down_proj", c.dense_format, c.latent_size, c.hidden_size,
                &units.back());
      if (c.latent_norm) {
        TensorSpec norm = MakeTensor(p + "routed_expert_norm.weight", DType::kBF16, {c.latent_size},
                                     Fill::kNormalBf16);
        norm.mean = 1.0f;
        norm.stddev = 0.05f;
        units.push_back({std::move(norm)});
      }
      units.emplace_back();
      AddMatrix(p + "routed_expert_up_proj", c.dense_format, c.hidden_size, c.latent_size,
                &units.back());
    }
    if (c.num_shared_experts > 0) {
      const int64_t s = c.shared_hidden_size();
      const char* names[3] = {"gate_proj", "up_proj", "down_proj"};
      for (int i = 0; i < 3; ++i) {
        units.emplace_back();
        AddMatrix(absl::StrCat(p, "shared_experts.", names[i]), c.dense_format,
                  i < 2 ? s : c.hidden_size, i < 2 ? c.hidden_size : s, &units.back());
      }
    }
    const int64_t in = c.expert_input_size();
    const int64_t hidden = c.expert_hidden_size;
    const char* k3_names[3] = {"w1", "w3", "w2"};
    const char* k2_names[3] = {"gate_proj", "up_proj", "down_proj"};
    for (int64_t e = 0; e < experts; ++e) {
      Unit unit;
      for (int i = 0; i < 3; ++i)
        AddMatrix(absl::StrCat(p, "experts.", e, ".", k3 ? k3_names[i] : k2_names[i]),
                  c.expert_format, i < 2 ? hidden : in, i < 2 ? in : hidden, &unit);
      units.push_back(std::move(unit));
    }
  }
  for (Unit& unit : units)
    for (TensorSpec& t : unit) t.seed = SplitMix64(options.seed ^ Fnv1a(t.name));
  return units;
}

// ---- generation -----------------------------------------------------------------------------

// Tensors are generated in chunks of this many bytes, each from its own random stream, so
// any thread can produce any chunk and the bytes do not depend on the thread count.
constexpr uint64_t kChunkBytes = 4 << 20;

void FillChunk(const TensorSpec& t, uint64_t offset, uint8_t* out, size_t size) {
  Xoshiro256 rng(t.seed + (offset / kChunkBytes) * 0xd1342543de82ef95ull);
  switch (t.fill) {
    case Fill::kNormalBf16: {
      const auto& table = NormalTable();
      const size_t n = size / 2;
      for (size_t i = 0; i < n; i += 4) {
        uint64_t r = rng.Next();
        for (size_t j = i; j < std::min(n, i + 4); ++j, r >>= 16) {
          const uint16_t bits = FloatToBf16Bits(t.mean + t.stddev * table[r & 0xffff]);
          std::memcpy(out + 2 * j, &bits, 2);
        }
      }
      return;
    }
    case Fill::kNormalF32: {
      const auto& table = NormalTable();
      const int64_t first = static_cast<int64_t>(offset / 4);
      for (size_t j = 0; j < size / 4; ++j) {
        float v = t.mean + t.stddev * table[rng.Next() & 0xffff];
        if (first + static_cast<int64_t>(j) < t.skew_count) v += t.skew;
        std::memcpy(out + 4 * j, &v, 4);
      }
      return;
    }
    case Fill::kMxfp4Packed: {
      size_t i = 0;
      for (; i + 8 <= size; i += 8) {
        const uint64_t r = rng.Next();
        std::memcpy(out + i, &r, 8);
      }
      if (i < size) {
        const uint64_t r = rng.Next();
        std::memcpy(out + i, &r, size - i);
      }
      return;
    }
    case Fill::kMxfp4Scale: {
      // E2M1 codes uniform over all 16 have RMS sqrt(68.5 / 8); pick the exponent 2^s with
      // s in {lo, lo + 1} so that E[4^s] = 4^target, i.e. the weight RMS is 1/sqrt(in).
      const double target =
          -std::log2(std::sqrt(static_cast<double>(t.in_features)) * std::sqrt(68.5 / 8));
      const double lo = std::floor(target);
      const double p_hi = (std::pow(4.0, target - lo) - 1) / 3;
      const uint64_t threshold = static_cast<uint64_t>(p_hi * 65536);
      const int base = static_cast<int>(std::clamp(127 + lo, 1.0, 253.0));
      for (size_t j = 0; j < size; j += 4) {
        uint64_t r = rng.Next();
        for (size_t k = j; k < std::min(size, j + 4); ++k, r >>= 16)
          out[k] = static_cast<uint8_t>(base + ((r & 0xffff) < threshold ? 1 : 0));
      }
      return;
    }
    case Fill::kFp8Normal: {
      const auto& table = Fp8NormalTable();
      size_t i = 0;
      for (; i < size; i += 8) {
        uint64_t r = rng.Next();
        for (size_t k = i; k < std::min(size, i + 8); ++k, r >>= 8) out[k] = table[r & 0xff];
      }
      return;
    }
    case Fill::kFp8ScaleInv: {
      const double base = 1.0 / std::sqrt(static_cast<double>(t.in_features));
      for (size_t j = 0; j < size / 4; ++j) {
        const float v = static_cast<float>(base * (0.75 + 0.5 * rng.Uniform()));
        std::memcpy(out + 4 * j, &v, 4);
      }
      return;
    }
  }
}

struct Shard {
  std::string file_name;
  std::vector<const TensorSpec*> tensors;
  uint64_t bytes = 0;
};

struct Chunk {
  int shard;
  const TensorSpec* tensor;
  uint64_t offset;  // within the tensor
  uint32_t size;
};

// Progress of the writer: cumulative byte counts, as GenerateShards knows them.
class ProgressBar {
 public:
  ProgressBar(bool enabled, uint64_t total)
      : progress_("moe-ckpt: writing", static_cast<int64_t>(total), enabled) {}
  void Update(uint64_t done, bool final = false) {
    progress_.Add(static_cast<int64_t>(done) - progress_.done());
    if (final) progress_.Finish();
  }

 private:
  Progress progress_;
};

// Generates every chunk on `num_threads` workers into a ring of buffers while the calling
// thread streams them, in order, into one SafetensorsWriter per shard.
absl::Status GenerateShards(const std::string& dir, const std::vector<Shard>& shards,
                            int num_threads, ProgressBar* progress) {
  std::vector<Chunk> chunks;
  for (size_t s = 0; s < shards.size(); ++s)
    for (const TensorSpec* t : shards[s].tensors)
      for (uint64_t off = 0; off < t->bytes; off += kChunkBytes)
        chunks.push_back(Chunk{static_cast<int>(s), t, off,
                               static_cast<uint32_t>(std::min(kChunkBytes, t->bytes - off))});

  const size_t num_slots = 2 * static_cast<size_t>(num_threads) + 2;
  std::vector<std::vector<uint8_t>> slots(num_slots, std::vector<uint8_t>(kChunkBytes));
  std::vector<size_t> slot_chunk(num_slots);  // the chunk a slot may hold next
  std::vector<bool> slot_ready(num_slots, false);
  for (size_t i = 0; i < num_slots; ++i) slot_chunk[i] = i;
  std::mutex mu;
  std::condition_variable cv;
  bool abort = false;
  std::atomic<size_t> next{0};

  auto worker = [&] {
    for (;;) {
      const size_t i = next.fetch_add(1);
      if (i >= chunks.size()) return;
      const size_t slot = i % num_slots;
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return abort || slot_chunk[slot] == i; });
        if (abort) return;
      }
      FillChunk(*chunks[i].tensor, chunks[i].offset, slots[slot].data(), chunks[i].size);
      {
        std::lock_guard<std::mutex> lock(mu);
        slot_ready[slot] = true;
      }
      cv.notify_all();
    }
  };
  std::vector<std::thread> workers;
  for (int t = 0; t < num_threads; ++t) workers.emplace_back(worker);

  absl::Status status;
  std::unique_ptr<SafetensorsWriter> writer;
  int current_shard = -1;
  uint64_t done = 0;
  // Finishes the current shard and opens the following ones up to `s` (a shard whose
  // tensors are all empty has no chunks but still gets its file).
  auto advance_to = [&](int s) -> absl::Status {
    while (current_shard < s) {
      if (writer != nullptr) RETURN_IF_ERROR(writer->Finish());
      ++current_shard;
      std::vector<SafetensorsWriter::PendingTensor> declared;
      for (const TensorSpec* t : shards[current_shard].tensors)
        declared.push_back({t->name, t->dtype, t->shape});
      ASSIGN_OR_RETURN(
          writer, SafetensorsWriter::Create(dir + "/" + shards[current_shard].file_name, declared,
                                            {{"format", "pt"}}));
    }
    return absl::OkStatus();
  };
  for (size_t i = 0; i < chunks.size() && status.ok(); ++i) {
    status = advance_to(chunks[i].shard);
    if (!status.ok()) break;
    const size_t slot = i % num_slots;
    {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return slot_ready[slot] && slot_chunk[slot] == i; });
    }
    status = writer->Write(absl::MakeConstSpan(slots[slot].data(), chunks[i].size));
    {
      std::lock_guard<std::mutex> lock(mu);
      slot_ready[slot] = false;
      slot_chunk[slot] = i + num_slots;
    }
    cv.notify_all();
    done += chunks[i].size;
    progress->Update(done);
  }
  if (status.ok()) status = advance_to(static_cast<int>(shards.size()) - 1);
  if (status.ok() && writer != nullptr) status = writer->Finish();
  {
    std::lock_guard<std::mutex> lock(mu);
    abort = true;
  }
  cv.notify_all();
  for (std::thread& t : workers) t.join();
  if (status.ok()) progress->Update(done, /*final=*/true);
  return status;
}

absl::Status WriteTextFile(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << text;
    out.flush();
    if (!out) return absl::InternalError(absl::StrCat("cannot write ", tmp));
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec)
    return absl::InternalError(
        absl::StrCat("cannot rename ", tmp, " to ", path, ": ", ec.message()));
  return absl::OkStatus();
}

}  // namespace

std::vector<std::string> SyntheticPresetNames() { return {"k3-mini", "kimi-k3", "kimi-k2"}; }

void SetNumMoeLayers(int num_moe_layers, MoeConfig* config) {
  config->moe_layer_freq = 1;
  config->num_hidden_layers = config->first_k_dense_replace + num_moe_layers;
}

absl::StatusOr<MoeConfig> SyntheticPreset(absl::string_view name) {
  MoeConfig c;
  if (name == "k3-mini" || name == "kimi-k3") {
    const bool mini = name == "k3-mini";
    c.family = ModelFamily::kKimiK3;
    c.model_type = "kimi_k3";
    c.hidden_size = mini ? 640 : 7168;
    c.latent_size = mini ? 320 : 3584;
    c.expert_hidden_size = mini ? 256 : 3072;
    c.num_shared_experts = 2;
    c.routing.num_experts = mini ? 64 : 896;
    c.routing.top_k = mini ? 2 : 16;
    c.routing.renormalize = true;
    c.routing.routed_scaling_factor = 1.0f;
    c.routing.n_group = 1;
    c.routing.topk_group = 1;
    c.latent_norm = true;
    c.rms_norm_eps = 1e-5f;
    c.activation.kind = Activation::kSiTU;
    c.activation.situ_beta = 4.0f;
    c.activation.situ_linear_beta = 25.0f;
    c.first_k_dense_replace = 1;
    SetNumMoeLayers(mini ? 2 : 1, &c);
    c.expert_format = mini ? WeightFormat::kBF16 : WeightFormat::kMXFP4;
    c.dense_format = WeightFormat::kBF16;
    return c;
  }
  if (name == "kimi-k2") {
    c.family = ModelFamily::kKimiK2;
    c.model_type = "kimi_k2";
    c.hidden_size = 7168;
    c.latent_size = 0;
    c.expert_hidden_size = 2048;
    c.num_shared_experts = 1;
    c.routing.num_experts = 384;
    c.routing.top_k = 8;
    c.routing.renormalize = true;
    c.routing.routed_scaling_factor = 2.827f;
    c.routing.n_group = 1;
    c.routing.topk_group = 1;
    c.latent_norm = false;
    c.rms_norm_eps = 1e-6f;
    c.activation.kind = Activation::kSiLU;
    c.first_k_dense_replace = 1;
    SetNumMoeLayers(1, &c);
    c.expert_format = WeightFormat::kFP8Block128;
    c.dense_format = WeightFormat::kFP8Block128;
    return c;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown preset '", name, "' (known: ", absl::StrJoin(SyntheticPresetNames(), ", "), ")"));
}

absl::Status WriteSyntheticCheckpoint(const std::string& dir, const MoeConfig& config_in,
                                      const SyntheticOptions& options, SyntheticSummary* summary) {
  const auto start = std::chrono::steady_clock::now();
  MoeConfig config = config_in;
  if (options.num_moe_layers < 0)
    return absl::InvalidArgumentError(
        absl::StrCat("num_moe_layers must be >= 0, got ", options.num_moe_layers));
  if (options.num_moe_layers > 0) SetNumMoeLayers(options.num_moe_layers, &config);
  if (options.max_shard_bytes <= 0)
    return absl::InvalidArgumentError(
        absl::StrCat("max_shard_bytes must be positive, got ", options.max_shard_bytes));
  RETURN_IF_ERROR_CTX(config.Validate(), "synthetic checkpoint");
  for (const auto& [format, width] :
       {std::make_pair(config.expert_format, config.expert_input_size()),
        std::make_pair(config.expert_format, config.expert_hidden_size),
        std::make_pair(config.dense_format, config.hidden_size),
        std::make_pair(config.dense_format, config.latent_size),
        std::make_pair(config.dense_format, config.shared_hidden_size())})
    if (format == WeightFormat::kMXFP4 && width % 32 != 0)
      return absl::InvalidArgumentError(
          absl::StrCat("synthetic checkpoint: MXFP4 needs widths divisible by 32, got ", width));
  const std::vector<int> layers = config.MoeLayerIndices();

  // Plan: tensors in order, cut into shards at unit boundaries.
  const std::vector<Unit> units = PlanTensors(config, layers, options);
  std::vector<Shard> shards;
  uint64_t total_bytes = 0;
  for (const Unit& unit : units) {
    uint64_t unit_bytes = 0;
    for (const TensorSpec& t : unit) unit_bytes += t.bytes;
    if (shards.empty() ||
        (!shards.back().tensors.empty() &&
         shards.back().bytes + unit_bytes > static_cast<uint64_t>(options.max_shard_bytes)))
      shards.emplace_back();
    for (const TensorSpec& t : unit) shards.back().tensors.push_back(&t);
    shards.back().bytes += unit_bytes;
    total_bytes += unit_bytes;
  }
  for (size_t s = 0; s < shards.size(); ++s)
    shards[s].file_name = absl::StrFormat("model-%05d-of-%05d.safetensors", s + 1, shards.size());

  // Space: data plus headers (a few hundred bytes per tensor), minus files being replaced.
  // Checked on the nearest existing ancestor so a failed check leaves no directory behind.
  std::error_code ec;
  fs::path probe = fs::absolute(dir, ec);
  while (!fs::exists(probe, ec) && probe.has_parent_path() && probe != probe.parent_path())
    probe = probe.parent_path();
  struct statvfs vfs;
  if (::statvfs(probe.c_str(), &vfs) != 0)
    return absl::InternalError(absl::StrCat("cannot statvfs ", probe.string()));
  // Files being replaced free their space as each new shard is renamed over them, so all
  // but the largest of them count as available.
  uint64_t available = static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
  uint64_t largest_old = 0;
  for (const Shard& shard : shards) {
    const uintmax_t old = fs::file_size(dir + "/" + shard.file_name, ec);
    if (ec) continue;
    available += old;
    largest_old = std::max<uint64_t>(largest_old, old);
  }
  available -= largest_old;
  const uint64_t needed = total_bytes + 512 * units.size() * 6 + (16 << 20);
  if (needed > available)
    return absl::ResourceExhaustedError(absl::StrCat("not enough disk space in ", dir,
                                                     ": the checkpoint needs ", HumanBytes(needed),
                                                     ", ", HumanBytes(available), " available"));

  fs::create_directories(dir, ec);
  if (ec)
    return absl::PermissionDeniedError(
        absl::StrCat("cannot create directory ", dir, ": ", ec.message()));

  SyntheticSummary result;
  result.layers = layers;
  result.num_experts = config.routing.num_experts;
  result.tensor_bytes = static_cast<int64_t>(total_bytes);

  const std::string config_path = dir + "/config.json";
  RETURN_IF_ERROR(WriteTextFile(config_path, MoeConfigToJson(config)));
  result.files.push_back(config_path);

  ProgressBar progress(options.progress, total_bytes);
  RETURN_IF_ERROR(GenerateShards(dir, shards, std::max(1, options.num_threads), &progress));

  // The index last: a directory without one is visibly incomplete.
  nlohmann::json weight_map = nlohmann::json::object();
  for (const Shard& shard : shards) {
    for (const TensorSpec* t : shard.tensors) weight_map[t->name] = shard.file_name;
    result.files.push_back(dir + "/" + shard.file_name);
  }
  nlohmann::json index = {{"metadata", {{"total_size", total_bytes}}},
                          {"weight_map", std::move(weight_map)}};
  const std::string index_path = dir + "/model.safetensors.index.json";
  RETURN_IF_ERROR(WriteTextFile(index_path, index.dump(2) + "\n"));
  result.files.push_back(index_path);

  for (const std::string& file : result.files)
    result.file_bytes += static_cast<int64_t>(fs::file_size(file, ec));
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (summary != nullptr) *summary = std::move(result);
  return absl::OkStatus();
}

}  // namespace moe
