#include "model/checkpoint.h"

#include <algorithm>
#include <cstring>
#include <fstream>
#include <iterator>
#include <set>
#include <sstream>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "core/numerics.h"
#include "core/status.h"
#include "model/weight_values.h"

namespace moe {
namespace {

using Located = SafetensorsCheckpoint::Located;

// Where a family's MoE block tensors live: head + layer + tail + "gate.weight".
struct NamePrefix {
  const char* head;
  const char* tail;
};
constexpr NamePrefix kK3Prefixes[] = {{"language_model.model.layers.", ".block_sparse_moe."},
                                      {"model.layers.", ".block_sparse_moe."}};
constexpr NamePrefix kK2Prefixes[] = {{"model.layers.", ".mlp."}};

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

const uint8_t* DataPtr(const Located& t) { return t.file->Data(*t.info).data(); }

// A tensor a load uses, and how its bytes encode values (for prefetching and the NaN check).
struct UsedTensor {
  Located located;
  StoredValues values;
};

// NOTES: INVALID_ARGUMENT like every other check of what a checkpoint holds (dtype, shape,
// the CPU backend's E8M0 range): the file is well formed, its contents are not servable.
absl::Status CheckFinite(const UsedTensor& t) {
  const absl::Span<const uint8_t> bytes = t.located.file->Data(*t.located.info);
  const int64_t bad = FindNonFinite(t.values, bytes);
  if (bad < 0) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("tensor '", t.located.info->name, "' in ", t.located.file->path(), ": ",
                   DescribeNonFinite(t.values, bytes, bad), " at element ", bad));
}

absl::StatusOr<std::string> ReadTextFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return absl::DataLossError(absl::StrCat("error reading ", path));
  return ss.str();
}

// Layers L with a tensor named exactly head + L + tail + "gate.weight".
std::set<int> LayersWithRouter(const std::vector<std::string>& names, const NamePrefix& prefix) {
  constexpr absl::string_view kRouter = "gate.weight";
  std::set<int> layers;
  for (const std::string& full : names) {
    absl::string_view name = full;
    if (!absl::ConsumePrefix(&name, prefix.head) || !absl::ConsumeSuffix(&name, kRouter) ||
        !absl::ConsumeSuffix(&name, prefix.tail))
      continue;
    int layer;
    if (!name.empty() && absl::ascii_isdigit(name[0]) && absl::SimpleAtoi(name, &layer) &&
        layer >= 0)
      layers.insert(layer);
  }
  return layers;
}

// Finds the matrix `base` ([rows, cols]) in whichever stored format is present, as a view
// into the mapping. Appends the tensors it uses to `touched`.
absl::StatusOr<WeightMatrix> LoadMatrix(const SafetensorsCheckpoint& ckpt, const std::string& base,
                                        int64_t rows, int64_t cols,
                                        std::vector<UsedTensor>* touched) {
  WeightMatrix m;
  m.rows = rows;
  m.cols = cols;
  const std::string packed_name = base + ".weight_packed";
  const std::string weight_name = base + ".weight";
  if (ckpt.Contains(packed_name)) {
    m.format = WeightFormat::kMXFP4;
    ASSIGN_OR_RETURN(const Located packed, ckpt.Find(packed_name));
    if (cols % 32 != 0)
      return absl::InvalidArgumentError(absl::StrCat("tensor '", packed_name, "' in ",
                                                     packed.file->path(), ": MXFP4 needs ", cols,
                                                     " input features to be a multiple of 32"));
    ASSIGN_OR_RETURN(const Located data,
                     ckpt.FindChecked(packed_name, DType::kU8, {rows, cols / 2}));
    const std::string scale_name = base + ".weight_scale";
    if (!ckpt.Contains(scale_name))
      return absl::NotFoundError(absl::StrCat("tensor '", scale_name, "' (the scales of MXFP4 '",
                                              packed_name, "' in ", packed.file->path(),
                                              ") not found in checkpoint ", ckpt.dir()));
    ASSIGN_OR_RETURN(const Located scale,
                     ckpt.FindChecked(scale_name, DType::kU8, {rows, cols / 32}));
    m.data = DataPtr(data);
    m.scales = DataPtr(scale);
    touched->push_back({data, StoredValues::kE2M1});
    touched->push_back({scale, StoredValues::kE8M0});
    return m;
  }
  if (!ckpt.Contains(weight_name))
    return absl::NotFoundError(absl::StrCat("tensor '", weight_name, "' (or '", packed_name,
                                            "') not found in checkpoint ", ckpt.dir()));
  ASSIGN_OR_RETURN(const Located weight, ckpt.Find(weight_name));
  switch (weight.info->dtype) {
    case DType::kBF16: {
      ASSIGN_OR_RETURN(const Located data,
                       ckpt.FindChecked(weight_name, DType::kBF16, {rows, cols}));
      m.format = WeightFormat::kBF16;
      m.data = DataPtr(data);
      touched->push_back({data, StoredValues::kBf16});
      return m;
    }
    case DType::kF8E4M3: {
      ASSIGN_OR_RETURN(const Located data,
                       ckpt.FindChecked(weight_name, DType::kF8E4M3, {rows, cols}));
      const std::string scale_name = base + ".weight_scale_inv";
      if (!ckpt.Contains(scale_name))
        return absl::NotFoundError(
            absl::StrCat("tensor '", scale_name, "' (the block scales of FP8 '", weight_name,
                         "' in ", weight.file->path(), ") not found in checkpoint ", ckpt.dir()));
      ASSIGN_OR_RETURN(
          const Located scale,
          ckpt.FindChecked(scale_name, DType::kF32, {CeilDiv(rows, 128), CeilDiv(cols, 128)}));
      m.format = WeightFormat::kFP8Block128;
      m.data = DataPtr(data);
      m.scales = DataPtr(scale);
      touched->push_back({data, StoredValues::kFp8E4M3});
      touched->push_back({scale, StoredValues::kF32});
      return m;
    }
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor '", weight_name, "' in ", weight.file->path(), ": dtype ",
          DTypeName(weight.info->dtype), ", expected BF16 or F8_E4M3 (or U8 '", packed_name, "')"));
  }
}

// A GLU MLP [hidden, in] x2 + [in, hidden] whose matrices are `base` + names[0..2].
absl::StatusOr<MlpWeights> LoadMlp(const SafetensorsCheckpoint& ckpt, const std::string& base,
                                   const char* const names[3], int64_t hidden, int64_t in,
                                   std::vector<UsedTensor>* touched) {
  MlpWeights mlp;
  ASSIGN_OR_RETURN(mlp.gate, LoadMatrix(ckpt, base + names[0], hidden, in, touched));
  ASSIGN_OR_RETURN(mlp.up, LoadMatrix(ckpt, base + names[1], hidden, in, touched));
  ASSIGN_OR_RETURN(mlp.down, LoadMatrix(ckpt, base + names[2], in, hidden, touched));
  return mlp;
}

constexpr const char* kK3ExpertNames[3] = {"w1", "w3", "w2"};
constexpr const char* kProjNames[3] = {"gate_proj", "up_proj", "down_proj"};

}  // namespace

int64_t GatewayLayerWeights::TotalBytes() const {
  int64_t bytes = router.TotalBytes() + static_cast<int64_t>(router_bias.size() * sizeof(float));
  if (has_latent) bytes += latent_down.TotalBytes() + latent_up.TotalBytes();
  if (has_latent_norm) bytes += latent_norm.size * 2;
  if (has_shared) bytes += shared.TotalBytes();
  return bytes;
}

int64_t ExpertShardWeights::TotalBytes() const {
  int64_t bytes = 0;
  for (const MlpWeights& e : experts) bytes += e.TotalBytes();
  return bytes;
}

absl::StatusOr<std::unique_ptr<Checkpoint>> Checkpoint::Open(const std::string& dir) {
  std::unique_ptr<Checkpoint> ckpt(new Checkpoint());
  ckpt->dir_ = dir;
  const std::string config_path =
      (!dir.empty() && dir.back() == '/') ? dir + "config.json" : dir + "/config.json";
  ASSIGN_OR_RETURN(const std::string config_text, ReadTextFile(config_path));
  absl::StatusOr<MoeConfig> config = ParseMoeConfig(config_text);
  if (!config.ok()) return Annotate(config.status(), config_path);
  ckpt->config_ = *std::move(config);
  RETURN_IF_ERROR_CTX(ckpt->config_.Validate(), config_path);
  ASSIGN_OR_RETURN(ckpt->tensors_, SafetensorsCheckpoint::Open(dir));

  const std::vector<std::string> names = ckpt->tensors_->TensorNames();
  const bool k3 = ckpt->config_.family == ModelFamily::kKimiK3;
  const NamePrefix* prefixes = k3 ? kK3Prefixes : kK2Prefixes;
  const size_t num_prefixes = k3 ? std::size(kK3Prefixes) : std::size(kK2Prefixes);
  std::set<int> found;
  for (size_t i = 0; i < num_prefixes && found.empty(); ++i) {
    found = LayersWithRouter(names, prefixes[i]);
    ckpt->prefix_head_ = prefixes[i].head;
    ckpt->prefix_tail_ = prefixes[i].tail;
  }
  // Only layers the config calls MoE count: a router-like name elsewhere is not a MoE block.
  // (Asked per layer found: listing the config's layers would trust its num_hidden_layers.)
  for (int layer : found)
    if (ckpt->config_.IsMoeLayer(layer)) ckpt->layers_.push_back(layer);
  if (ckpt->layers_.empty()) {
    std::vector<std::string> patterns;
    for (size_t i = 0; i < num_prefixes; ++i)
      patterns.push_back(
          absl::StrCat("'", prefixes[i].head, "{L}", prefixes[i].tail, "gate.weight'"));
    return absl::NotFoundError(absl::StrCat(
        "no MoE layer in checkpoint ", dir, ": no tensor named ", absl::StrJoin(patterns, " or "),
        " for a MoE layer L of ", config_path,
        found.empty()
            ? ""
            : absl::StrCat(" (found routers of layers ", absl::StrJoin(found, ", "), ")")));
  }
  return ckpt;
}

bool Checkpoint::HasLayer(int layer) const {
  return std::binary_search(layers_.begin(), layers_.end(), layer);
}

std::string Checkpoint::LayerPrefix(int layer) const {
  return absl::StrCat(prefix_head_, layer, prefix_tail_);
}

absl::Status Checkpoint::CheckLayer(int layer) const {
  if (HasLayer(layer)) return absl::OkStatus();
  return absl::NotFoundError(absl::StrCat("layer ", layer, " is not in checkpoint ", dir_,
                                          " (MoE layers present: ", absl::StrJoin(layers_, ", "),
                                          ")"));
}

absl::StatusOr<GatewayLayerWeights> Checkpoint::LoadGatewayLayer(int layer) const {
  RETURN_IF_ERROR(CheckLayer(layer));
  const MoeConfig& c = config_;
  const std::string p = LayerPrefix(layer);
  const int64_t experts = c.routing.num_experts;
  // Not prefetched (the gateway reads its tensors right away); all checked for NaN/Inf: they are
  // small next to the experts (router, latent projections, shared experts of one layer).
  std::vector<UsedTensor> touched;

  GatewayLayerWeights w;
  w.layer = layer;
  ASSIGN_OR_RETURN(const Located router, tensors_->FindChecked(p + "gate.weight", DType::kBF16,
                                                               {experts, c.hidden_size}));
  w.router.format = WeightFormat::kBF16;
  w.router.rows = experts;
  w.router.cols = c.hidden_size;
  w.router.data = DataPtr(router);
  touched.push_back({router, StoredValues::kBf16});

  const std::string bias_name = p + "gate.e_score_correction_bias";
  w.router_bias.assign(experts, 0.0f);
  if (tensors_->Contains(bias_name)) {
    ASSIGN_OR_RETURN(const Located bias, tensors_->Find(bias_name));
    if (bias.info->dtype == DType::kBF16) {
      ASSIGN_OR_RETURN(const Located b, tensors_->FindChecked(bias_name, DType::kBF16, {experts}));
      touched.push_back({b, StoredValues::kBf16});
      const uint8_t* src = DataPtr(b);
      for (int64_t e = 0; e < experts; ++e) {
        uint16_t bits;
        std::memcpy(&bits, src + 2 * e, 2);
        w.router_bias[e] = Bf16BitsToFloat(bits);
      }
    } else {
      ASSIGN_OR_RETURN(const Located b, tensors_->FindChecked(bias_name, DType::kF32, {experts}));
      touched.push_back({b, StoredValues::kF32});
      std::memcpy(w.router_bias.data(), DataPtr(b), experts * sizeof(float));
    }
  }

  if (c.has_latent()) {
    w.has_latent = true;
    ASSIGN_OR_RETURN(w.latent_down, LoadMatrix(*tensors_, p + "routed_expert_down_proj",
                                               c.latent_size, c.hidden_size, &touched));
    ASSIGN_OR_RETURN(w.latent_up, LoadMatrix(*tensors_, p + "routed_expert_up_proj", c.hidden_size,
                                             c.latent_size, &touched));
    if (c.latent_norm) {
      ASSIGN_OR_RETURN(const Located norm, tensors_->FindChecked(p + "routed_expert_norm.weight",
                                                                 DType::kBF16, {c.latent_size}));
      touched.push_back({norm, StoredValues::kBf16});
      w.has_latent_norm = true;
      w.latent_norm.data = reinterpret_cast<const uint16_t*>(DataPtr(norm));
      w.latent_norm.size = c.latent_size;
    }
  }
  if (c.num_shared_experts > 0) {
    w.has_shared = true;
    ASSIGN_OR_RETURN(w.shared, LoadMlp(*tensors_, p + "shared_experts.", kProjNames,
                                       c.shared_hidden_size(), c.hidden_size, &touched));
  }
  for (const UsedTensor& t : touched) RETURN_IF_ERROR(CheckFinite(t));
  return w;
}

absl::StatusOr<ExpertShardWeights> Checkpoint::LoadExperts(int layer,
                                                           const std::vector<int>& expert_ids,
                                                           const ExpertLoadOptions& options) const {
  RETURN_IF_ERROR(CheckLayer(layer));
  const MoeConfig& c = config_;
  std::vector<int> ids = expert_ids;
  std::sort(ids.begin(), ids.end());
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= c.routing.num_experts)
      return absl::InvalidArgumentError(absl::StrCat("expert id ", ids[i], " is out of range [0, ",
                                                     c.routing.num_experts, ") for layer ", layer,
                                                     " of checkpoint ", dir_));
    if (i > 0 && ids[i] == ids[i - 1])
      return absl::InvalidArgumentError(absl::StrCat("expert id ", ids[i], " requested twice"));
  }

  const std::string p = LayerPrefix(layer);
  const char* const* names = c.family == ModelFamily::kKimiK3 ? kK3ExpertNames : kProjNames;
  ExpertShardWeights shard;
  shard.layer = layer;
  shard.expert_ids = ids;
  shard.experts.reserve(ids.size());
  std::vector<UsedTensor> touched;
  for (int e : ids) {
    ASSIGN_OR_RETURN(MlpWeights mlp,
                     LoadMlp(*tensors_, absl::StrCat(p, "experts.", e, "."), names,
                             c.expert_hidden_size, c.expert_input_size(), &touched));
    shard.experts.push_back(mlp);
  }
  if (options.prefetch)
    for (const UsedTensor& t : touched) t.located.file->Prefetch(*t.located.info);
  // NOTES: on by default although a rank maps 200+ GB. It reads them all anyway (moe-rank
  // --prefault, or its first steps), and the scan costs memory bandwidth on top of that I/O:
  // 6-7 GB/s on one core here, first-touch page faults included (705 MB of K2 FP8 experts in
  // 110 ms), so ~30 s for a 200 GB FP8 or bf16 rank and ~2 s for an MXFP4 one (scales only).
  // moe-rank --check-weights=false skips it. A NaN not found here serves finite wrong outputs.
  if (options.check_values) {
    int64_t total = 0, done = 0;
    for (const UsedTensor& t : touched) total += static_cast<int64_t>(t.located.info->size_bytes);
    for (const UsedTensor& t : touched) {
      RETURN_IF_ERROR(CheckFinite(t));
      done += static_cast<int64_t>(t.located.info->size_bytes);
      if (options.on_checked) options.on_checked(done, total);
    }
  }
  return shard;
}

}  // namespace moe
