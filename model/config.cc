#include "model/config.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>
#include <string>
#include <utility>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "model/bounded_json.h"

namespace moe {
namespace {

using Json = nlohmann::json;

constexpr char kMxfp4Format[] = "mxfp4-pack-quantized";

// ---- field names -------------------------------------------------------------------------

// How a family spells the MoE fields in config.json, and where they sit. Messages name fields
// by their path (`text_config.num_experts_per_token`), so a user finds them in the file.
struct FieldNames {
  std::string prefix;        // "text_config." for the nested K3 layout, else ""
  std::string quantization;  // where quantization_config sits
  const char* num_experts;
  const char* top_k;
  const char* n_group;
  const char* num_shared_experts;

  std::string Path(absl::string_view name) const { return absl::StrCat(prefix, name); }
};

FieldNames NamesFor(ModelFamily family, std::string prefix, std::string quantization) {
  FieldNames n;
  n.prefix = std::move(prefix);
  n.quantization = std::move(quantization);
  if (family == ModelFamily::kKimiK3) {
    n.num_experts = "num_experts";
    n.top_k = "num_experts_per_token";
    n.n_group = "num_expert_group";
    n.num_shared_experts = "num_shared_experts";
  } else {
    n.num_experts = "n_routed_experts";
    n.top_k = "num_experts_per_tok";
    n.n_group = "n_group";
    n.num_shared_experts = "n_shared_experts";
  }
  return n;
}

bool IsModelTypeOf(ModelFamily family, absl::string_view model_type) {
  if (family == ModelFamily::kKimiK3) return model_type == "kimi_k3" || model_type == "kimi_linear";
  return model_type == "kimi_k2" || model_type == "deepseek_v3";
}

// ---- consistency checks (shared by the parser and MoeConfig::Validate) -------------------

absl::Status MustBePositive(const FieldNames& n, absl::string_view name, int64_t value) {
  if (value > 0) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(n.Path(name), " (", value, ") must be positive"));
}

absl::Status MustBeNonNegative(const FieldNames& n, absl::string_view name, int64_t value) {
  if (value >= 0) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(n.Path(name), " (", value, ") must not be negative"));
}

absl::Status MustBePositiveFinite(const FieldNames& n, absl::string_view name, float value) {
  if (std::isfinite(value) && value > 0.0f) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(n.Path(name), " (", value, ") must be a positive finite number"));
}

absl::Status MustDivideBy32ForMxfp4(const FieldNames& n, absl::string_view name, int64_t value) {
  if (value % 32 == 0) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(n.Path(name), " (", value,
                                                 ") is not divisible by 32, which MXFP4 experts "
                                                 "need (",
                                                 n.quantization, ")"));
}

absl::Status CheckConfig(const MoeConfig& c, const FieldNames& n) {
  const bool k3 = c.family == ModelFamily::kKimiK3;
  if (!c.model_type.empty() && !IsModelTypeOf(c.family, c.model_type)) {
    return absl::InvalidArgumentError(
        absl::StrCat("model_type '", c.model_type, "' does not name a ", ModelFamilyName(c.family),
                     " model (", k3 ? "kimi_k3, kimi_linear" : "kimi_k2, deepseek_v3", ")"));
  }

  // Widths.
  RETURN_IF_ERROR(MustBePositive(n, "hidden_size", c.hidden_size));
  if (k3) {
    RETURN_IF_ERROR(MustBeNonNegative(n, "routed_expert_hidden_size", c.latent_size));
    if (c.latent_norm && !c.has_latent()) {
      return absl::InvalidArgumentError(absl::StrCat(n.Path("latent_moe_use_norm"), " needs ",
                                                     n.Path("routed_expert_hidden_size"),
                                                     " (a latent to normalize)"));
    }
  } else {
    if (c.latent_size != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "latent_size (", c.latent_size,
          "): a latent MoE (routed_expert_hidden_size) exists only in kimi_k3 models"));
    }
    if (c.latent_norm) {
      return absl::InvalidArgumentError(
          "latent_norm: latent_moe_use_norm exists only in kimi_k3 models");
    }
  }
  RETURN_IF_ERROR(MustBePositive(n, "moe_intermediate_size", c.expert_hidden_size));
  RETURN_IF_ERROR(MustBeNonNegative(n, n.num_shared_experts, c.num_shared_experts));

  // Routing.
  const RoutingParams& r = c.routing;
  RETURN_IF_ERROR(MustBePositive(n, n.num_experts, r.num_experts));
  RETURN_IF_ERROR(MustBePositive(n, n.top_k, r.top_k));
  if (r.top_k > r.num_experts) {
    return absl::InvalidArgumentError(absl::StrCat(n.Path(n.top_k), " (", r.top_k, ") exceeds ",
                                                   n.num_experts, " (", r.num_experts, ")"));
  }
  RETURN_IF_ERROR(MustBePositive(n, n.n_group, r.n_group));
  if (r.num_experts % r.n_group != 0) {
    return absl::InvalidArgumentError(absl::StrCat(n.Path(n.num_experts), " (", r.num_experts,
                                                   ") is not divisible by ", n.n_group, " (",
                                                   r.n_group, ")"));
  }
  RETURN_IF_ERROR(MustBePositive(n, "topk_group", r.topk_group));
  if (r.topk_group > r.n_group) {
    return absl::InvalidArgumentError(absl::StrCat(n.Path("topk_group"), " (", r.topk_group,
                                                   ") exceeds ", n.n_group, " (", r.n_group, ")"));
  }
  // NOTES: with group-limited routing a token chooses among the experts of its topk_group
  // best groups only; fewer than top_k of those would leave selections empty.
  const int64_t selectable = static_cast<int64_t>(r.topk_group) * (r.num_experts / r.n_group);
  if (r.top_k > selectable) {
    return absl::InvalidArgumentError(absl::StrCat(
        n.Path(n.top_k), " (", r.top_k, ") exceeds the ", selectable, " experts in topk_group (",
        r.topk_group, ") of ", n.n_group, " (", r.n_group, ") groups"));
  }
  RETURN_IF_ERROR(MustBePositiveFinite(n, "routed_scaling_factor", r.routed_scaling_factor));

  // Norm and activation.
  RETURN_IF_ERROR(MustBePositiveFinite(n, "rms_norm_eps", c.rms_norm_eps));
  if (c.activation.kind == Activation::kSiTU) {
    RETURN_IF_ERROR(MustBePositiveFinite(n, "activation_situ_beta", c.activation.situ_beta));
    RETURN_IF_ERROR(
        MustBePositiveFinite(n, "activation_situ_linear_beta", c.activation.situ_linear_beta));
  }

  // Layers.
  RETURN_IF_ERROR(MustBePositive(n, "num_hidden_layers", c.num_hidden_layers));
  RETURN_IF_ERROR(MustBeNonNegative(n, "first_k_dense_replace", c.first_k_dense_replace));
  RETURN_IF_ERROR(MustBePositive(n, "moe_layer_freq", c.moe_layer_freq));
  // NOTES: computed, not listed: a hostile num_hidden_layers must not allocate.
  const int64_t freq = c.moe_layer_freq;
  const int64_t first_moe_layer =
      (static_cast<int64_t>(c.first_k_dense_replace) + freq - 1) / freq * freq;
  if (first_moe_layer >= c.num_hidden_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("no MoE layer: no layer L with ", n.Path("first_k_dense_replace"), " (",
                     c.first_k_dense_replace, ") <= L < ", n.Path("num_hidden_layers"), " (",
                     c.num_hidden_layers, ") has L % ", n.Path("moe_layer_freq"), " (",
                     c.moe_layer_freq, ") == 0"));
  }

  // Formats: the pairs a quantization_config can express.
  const WeightFormat e = c.expert_format;
  const WeightFormat d = c.dense_format;
  const bool expressible = (e == WeightFormat::kBF16 && d == WeightFormat::kBF16) ||
                           (e == WeightFormat::kFP8Block128 && d == WeightFormat::kFP8Block128) ||
                           (e == WeightFormat::kMXFP4 && d == WeightFormat::kBF16);
  if (!expressible) {
    return absl::InvalidArgumentError(absl::StrCat(
        n.quantization, ": routed experts in ", WeightFormatName(e), " with dense weights in ",
        WeightFormatName(d), " is not a supported combination (bf16/bf16, fp8/fp8, mxfp4/bf16)"));
  }
  if (e == WeightFormat::kMXFP4) {
    // w1/w3 read the expert input width, w2 the expert hidden width, in blocks of 32.
    RETURN_IF_ERROR(MustDivideBy32ForMxfp4(
        n, c.has_latent() ? "routed_expert_hidden_size" : "hidden_size", c.expert_input_size()));
    RETURN_IF_ERROR(MustDivideBy32ForMxfp4(n, "moe_intermediate_size", c.expert_hidden_size));
  }
  return absl::OkStatus();
}

// ---- typed JSON field access -------------------------------------------------------------

// A short rendering of a JSON value for messages (never throws on invalid UTF-8).
std::string Describe(const Json& v) {
  std::string text = v.dump(-1, ' ', false, Json::error_handler_t::replace);
  if (text.size() > 60) text = absl::StrCat(text.substr(0, 57), "...");
  return text;
}

absl::Status TypeError(const std::string& path, absl::string_view expected, const Json& v) {
  return absl::InvalidArgumentError(
      absl::StrCat(path, " must be ", expected, ", not ", v.type_name(), " ", Describe(v)));
}

absl::Status ReadValue(const Json& v, const std::string& path, int64_t* out) {
  if (!v.is_number_integer()) return TypeError(path, "an integer", v);
  // NOTES: every integer of a config is a size or a count; 32 bits bound them, so products
  // of two (a weight's element count) cannot overflow int64 downstream.
  constexpr int64_t kMin = std::numeric_limits<int32_t>::min();
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(kMax)) {
      return absl::InvalidArgumentError(absl::StrCat(path, " (", u, ") is out of range"));
    }
    *out = static_cast<int64_t>(u);
    return absl::OkStatus();
  }
  const int64_t i = v.get<int64_t>();
  if (i < kMin || i > kMax) {
    return absl::InvalidArgumentError(absl::StrCat(path, " (", i, ") is out of range"));
  }
  *out = i;
  return absl::OkStatus();
}

absl::Status ReadValue(const Json& v, const std::string& path, int* out) {
  int64_t value = 0;
  RETURN_IF_ERROR(ReadValue(v, path, &value));  // within int32
  *out = static_cast<int>(value);
  return absl::OkStatus();
}

absl::Status ReadValue(const Json& v, const std::string& path, float* out) {
  if (!v.is_number()) return TypeError(path, "a number", v);
  const double d = v.get<double>();
  if (!(std::fabs(d) <= static_cast<double>(std::numeric_limits<float>::max()))) {
    return absl::InvalidArgumentError(absl::StrCat(path, " (", Describe(v), ") is out of range"));
  }
  *out = static_cast<float>(d);
  return absl::OkStatus();
}

absl::Status ReadValue(const Json& v, const std::string& path, bool* out) {
  if (!v.is_boolean()) return TypeError(path, "true or false", v);
  *out = v.get<bool>();
  return absl::OkStatus();
}

absl::Status ReadValue(const Json& v, const std::string& path, std::string* out) {
  if (!v.is_string()) return TypeError(path, "a string", v);
  *out = v.get<std::string>();
  return absl::OkStatus();
}

// Reads typed fields of one JSON object. Absent and null fields are the same (Hugging Face
// writes null for unset optional fields).
class FieldReader {
 public:
  FieldReader(const Json& object, std::string prefix)
      : object_(object), prefix_(std::move(prefix)) {}

  std::string Path(absl::string_view key) const { return absl::StrCat(prefix_, key); }

  // The value of `key`; nullptr when absent or null.
  const Json* Find(const char* key) const {
    const auto it = object_.find(key);
    if (it == object_.end() || it->is_null()) return nullptr;
    return &*it;
  }

  // An error when the field is absent or null.
  template <typename T>
  absl::Status Required(const char* key, T* out) const {
    const Json* v = Find(key);
    if (v == nullptr) return absl::InvalidArgumentError(absl::StrCat(Path(key), " is required"));
    return ReadValue(*v, Path(key), out);
  }

  // `*out` keeps its value (the default) when the field is absent or null.
  template <typename T>
  absl::Status Optional(const char* key, T* out) const {
    const Json* v = Find(key);
    if (v == nullptr) return absl::OkStatus();
    return ReadValue(*v, Path(key), out);
  }

  // The object at `key`; nullptr when absent or null, an error for another type.
  absl::StatusOr<const Json*> FindObject(const char* key) const {
    const Json* v = Find(key);
    if (v != nullptr && !v->is_object()) return TypeError(Path(key), "an object", *v);
    return v;
  }

  // A reader of `object`, the value of this object's `key`.
  FieldReader Child(const Json& object, absl::string_view key) const {
    return FieldReader(object, absl::StrCat(Path(key), "."));
  }

 private:
  const Json& object_;
  std::string prefix_;
};

absl::Status NotSupported(const std::string& path, absl::string_view value,
                          absl::string_view supported) {
  return absl::InvalidArgumentError(
      absl::StrCat(path, " '", value, "' is not supported (", supported, ")"));
}

// `key`, when present, must be "sigmoid": the numerics contract has sigmoid scores only.
absl::Status CheckSigmoid(const FieldReader& f, const char* key) {
  std::string func = "sigmoid";
  RETURN_IF_ERROR(f.Optional(key, &func));
  if (func != "sigmoid") return NotSupported(f.Path(key), func, "only 'sigmoid'");
  return absl::OkStatus();
}

// ---- model fields ------------------------------------------------------------------------

// Fields both families spell the same way.
absl::Status ReadCommonFields(const FieldReader& f, MoeConfig* c) {
  c->routing.routed_scaling_factor = 1.0f;
  RETURN_IF_ERROR(f.Optional("routed_scaling_factor", &c->routing.routed_scaling_factor));
  c->rms_norm_eps = 1e-6f;
  RETURN_IF_ERROR(f.Optional("rms_norm_eps", &c->rms_norm_eps));

  std::string act = "silu";
  RETURN_IF_ERROR(f.Optional("hidden_act", &act));
  c->activation = ActivationParams();
  if (act == "situ") {
    c->activation.kind = Activation::kSiTU;
    c->activation.situ_beta = 4.0f;
    c->activation.situ_linear_beta = 25.0f;
    RETURN_IF_ERROR(f.Optional("activation_situ_beta", &c->activation.situ_beta));
    RETURN_IF_ERROR(f.Optional("activation_situ_linear_beta", &c->activation.situ_linear_beta));
  } else if (act == "silu" || act == "swiglu") {
    c->activation.kind = Activation::kSiLU;
  } else {
    return NotSupported(f.Path("hidden_act"), act, "situ, silu, swiglu");
  }

  RETURN_IF_ERROR(f.Required("num_hidden_layers", &c->num_hidden_layers));
  c->first_k_dense_replace = 0;
  RETURN_IF_ERROR(f.Optional("first_k_dense_replace", &c->first_k_dense_replace));
  c->moe_layer_freq = 1;
  RETURN_IF_ERROR(f.Optional("moe_layer_freq", &c->moe_layer_freq));
  return absl::OkStatus();
}

// Kimi K3 / Kimi Linear (KimiLinearConfig names).
absl::Status ReadK3Fields(const FieldReader& f, MoeConfig* c) {
  c->family = ModelFamily::kKimiK3;
  RETURN_IF_ERROR(f.Required("hidden_size", &c->hidden_size));
  // Present => latent MoE of that width (the reference checks `is not None`).
  if (f.Find("routed_expert_hidden_size") != nullptr) {
    RETURN_IF_ERROR(f.Required("routed_expert_hidden_size", &c->latent_size));
    if (c->latent_size <= 0) {
      return absl::InvalidArgumentError(absl::StrCat(f.Path("routed_expert_hidden_size"), " (",
                                                     c->latent_size, ") must be positive"));
    }
  }
  RETURN_IF_ERROR(f.Required("moe_intermediate_size", &c->expert_hidden_size));
  RETURN_IF_ERROR(f.Optional("num_shared_experts", &c->num_shared_experts));

  RoutingParams& r = c->routing;
  RETURN_IF_ERROR(f.Required("num_experts", &r.num_experts));
  RETURN_IF_ERROR(f.Required("num_experts_per_token", &r.top_k));
  r.renormalize = true;
  RETURN_IF_ERROR(f.Optional("moe_renormalize", &r.renormalize));
  RETURN_IF_ERROR(CheckSigmoid(f, "moe_router_activation_func"));
  RETURN_IF_ERROR(CheckSigmoid(f, "scoring_func"));
  bool grouped = true;
  RETURN_IF_ERROR(f.Optional("use_grouped_topk", &grouped));
  r.n_group = 1;
  r.topk_group = 1;
  RETURN_IF_ERROR(f.Optional("num_expert_group", &r.n_group));
  RETURN_IF_ERROR(f.Optional("topk_group", &r.topk_group));
  if (!grouped) {
    r.n_group = 1;
    r.topk_group = 1;
  }

  // The reference builds the norm only for a latent MoE.
  bool use_norm = false;
  RETURN_IF_ERROR(f.Optional("latent_moe_use_norm", &use_norm));
  c->latent_norm = use_norm && c->has_latent();
  return ReadCommonFields(f, c);
}

// Kimi K2 / DeepSeek-V3 (DeepseekV3Config names).
absl::Status ReadK2Fields(const FieldReader& f, MoeConfig* c) {
  c->family = ModelFamily::kKimiK2;
  RETURN_IF_ERROR(f.Required("hidden_size", &c->hidden_size));
  RETURN_IF_ERROR(f.Required("moe_intermediate_size", &c->expert_hidden_size));
  RETURN_IF_ERROR(f.Optional("n_shared_experts", &c->num_shared_experts));

  RoutingParams& r = c->routing;
  RETURN_IF_ERROR(f.Required("n_routed_experts", &r.num_experts));
  RETURN_IF_ERROR(f.Required("num_experts_per_tok", &r.top_k));
  r.renormalize = true;
  RETURN_IF_ERROR(f.Optional("norm_topk_prob", &r.renormalize));
  RETURN_IF_ERROR(CheckSigmoid(f, "scoring_func"));
  std::string method = "noaux_tc";
  RETURN_IF_ERROR(f.Optional("topk_method", &method));
  r.n_group = 1;
  r.topk_group = 1;
  if (method == "noaux_tc") {
    RETURN_IF_ERROR(f.Optional("n_group", &r.n_group));
    RETURN_IF_ERROR(f.Optional("topk_group", &r.topk_group));
  } else if (method != "greedy") {  // greedy: plain top-k, no group limit
    return NotSupported(f.Path("topk_method"), method, "noaux_tc, greedy");
  }
  return ReadCommonFields(f, c);
}

// ---- quantization_config -----------------------------------------------------------------

// DeepSeek FP8: e4m3 weights with fp32 scale_inv per 128x128 block, dense weights included.
absl::Status ReadFp8(const FieldReader& q, MoeConfig* c) {
  std::string fmt = "e4m3";
  RETURN_IF_ERROR(q.Optional("fmt", &fmt));
  if (fmt != "e4m3") return NotSupported(q.Path("fmt"), fmt, "only 'e4m3'");
  std::string scheme = "dynamic";
  RETURN_IF_ERROR(q.Optional("activation_scheme", &scheme));
  if (scheme != "dynamic")
    return NotSupported(q.Path("activation_scheme"), scheme, "only 'dynamic'");
  const Json* block = q.Find("weight_block_size");
  if (block == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(q.Path("weight_block_size"),
                     " is required (per-tensor FP8 is not supported; only [128, 128])"));
  }
  const bool is_128x128 = block->is_array() && block->size() == 2 &&
                          (*block)[0].is_number_integer() && (*block)[1].is_number_integer() &&
                          (*block)[0].get<int64_t>() == 128 && (*block)[1].get<int64_t>() == 128;
  if (!is_128x128) {
    return absl::InvalidArgumentError(absl::StrCat(
        q.Path("weight_block_size"), " ", Describe(*block), " is not supported (only [128, 128])"));
  }
  c->expert_format = WeightFormat::kFP8Block128;
  c->dense_format = WeightFormat::kFP8Block128;
  return absl::OkStatus();
}

// compressed-tensors with MXFP4 routed experts; everything in `ignore` stays bf16.
absl::Status ReadCompressedTensors(const FieldReader& q, MoeConfig* c) {
  std::string top_format;
  RETURN_IF_ERROR(q.Optional("format", &top_format));
  ASSIGN_OR_RETURN(const Json* groups, q.FindObject("config_groups"));
  if (groups == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(q.Path("config_groups"), " is required"));
  }
  if (groups->empty()) {
    return absl::InvalidArgumentError(absl::StrCat(q.Path("config_groups"), " is empty"));
  }
  const FieldReader groups_reader = q.Child(*groups, "config_groups");
  for (const auto& item : groups->items()) {
    const std::string name = item.key();
    const Json& group = item.value();
    if (!group.is_object()) return TypeError(groups_reader.Path(name), "an object", group);
    const FieldReader g = groups_reader.Child(group, name);

    // A group's own format overrides the top level's (e.g. "mixed-precision").
    std::string format = top_format;
    std::string format_path = q.Path("format");
    if (g.Find("format") != nullptr) {
      RETURN_IF_ERROR(g.Required("format", &format));
      format_path = g.Path("format");
    }
    if (format.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(q.Path("format"), " is required"));
    }
    if (format != kMxfp4Format)
      return NotSupported(format_path, format, "only mxfp4-pack-quantized");

    ASSIGN_OR_RETURN(const Json* weights, g.FindObject("weights"));
    if (weights == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(g.Path("weights"), " is required"));
    }
    const FieldReader w = g.Child(*weights, "weights");
    int64_t num_bits = 0;
    RETURN_IF_ERROR(w.Required("num_bits", &num_bits));
    if (num_bits != 4) {
      return absl::InvalidArgumentError(
          absl::StrCat(w.Path("num_bits"), " (", num_bits, ") must be 4 for ", kMxfp4Format));
    }
    int64_t group_size = 32;
    RETURN_IF_ERROR(w.Optional("group_size", &group_size));
    if (group_size != 32) {
      return absl::InvalidArgumentError(
          absl::StrCat(w.Path("group_size"), " (", group_size, ") must be 32 for ", kMxfp4Format));
    }
    // NOTES: the numerics contract dequantizes weights exactly and keeps activations bf16;
    // a checkpoint trained with quantized activations would be served with the wrong math.
    if (const Json* acts = g.Find("input_activations")) {
      return absl::InvalidArgumentError(
          absl::StrCat(g.Path("input_activations"), " ", Describe(*acts),
                       " is not supported (weight-only quantization; activations stay bf16)"));
    }
  }
  if (const Json* ignore = q.Find("ignore"); ignore != nullptr && !ignore->is_array()) {
    return TypeError(q.Path("ignore"), "an array", *ignore);
  }
  c->expert_format = WeightFormat::kMXFP4;
  c->dense_format = WeightFormat::kBF16;
  return absl::OkStatus();
}

// Reads quantization_config from the top level or, failing that, from text_config.
// `*where` receives its path for later messages.
absl::Status ReadQuantization(const FieldReader& top, const FieldReader* text_config, MoeConfig* c,
                              std::string* where) {
  c->expert_format = WeightFormat::kBF16;
  c->dense_format = WeightFormat::kBF16;
  const FieldReader* holder = &top;
  ASSIGN_OR_RETURN(const Json* q, top.FindObject("quantization_config"));
  if (q == nullptr && text_config != nullptr) {
    holder = text_config;
    ASSIGN_OR_RETURN(q, text_config->FindObject("quantization_config"));
  }
  *where = holder->Path("quantization_config");
  if (q == nullptr) return absl::OkStatus();

  const FieldReader reader = holder->Child(*q, "quantization_config");
  std::string method;
  RETURN_IF_ERROR(reader.Required("quant_method", &method));
  if (method == "fp8") return ReadFp8(reader, c);
  if (method == "compressed-tensors") return ReadCompressedTensors(reader, c);
  return NotSupported(reader.Path("quant_method"), method,
                      "fp8, compressed-tensors mxfp4-pack-quantized");
}

absl::StatusOr<MoeConfig> ParseRoot(const Json& root) {
  if (!root.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the top level must be an object, not ", root.type_name()));
  }
  const FieldReader top(root, "");
  MoeConfig c;
  RETURN_IF_ERROR(top.Required("model_type", &c.model_type));

  std::string prefix;
  const Json* text_config = nullptr;
  if (c.model_type == "kimi_k3") {
    ASSIGN_OR_RETURN(text_config, top.FindObject("text_config"));
    if (text_config == nullptr) {
      return absl::InvalidArgumentError("text_config is required for model_type 'kimi_k3'");
    }
    prefix = "text_config.";
    RETURN_IF_ERROR(ReadK3Fields(FieldReader(*text_config, prefix), &c));
  } else if (c.model_type == "kimi_linear") {
    RETURN_IF_ERROR(ReadK3Fields(top, &c));
  } else if (c.model_type == "kimi_k2" || c.model_type == "deepseek_v3") {
    RETURN_IF_ERROR(ReadK2Fields(top, &c));
  } else {
    return NotSupported("model_type", c.model_type, "kimi_k3, kimi_linear, kimi_k2, deepseek_v3");
  }

  std::string quantization_path;
  if (text_config != nullptr) {
    const FieldReader nested(*text_config, prefix);
    RETURN_IF_ERROR(ReadQuantization(top, &nested, &c, &quantization_path));
  } else {
    RETURN_IF_ERROR(ReadQuantization(top, nullptr, &c, &quantization_path));
  }
  RETURN_IF_ERROR(CheckConfig(c, NamesFor(c.family, prefix, quantization_path)));
  return c;
}

// ---- writing -----------------------------------------------------------------------------

// A float as the JSON number with the shortest decimal that reads back to the same float
// (2.827, not 2.8269999027252197).
Json FloatNumber(float value) {
  char text[64];
  const auto printed = std::to_chars(text, text + sizeof(text), value);
  double d = static_cast<double>(value);
  std::from_chars(text, printed.ptr, d);
  return Json(d);
}

Json CountOrNull(int count) { return count > 0 ? Json(count) : Json(nullptr); }

// Fields both families spell the same way.
void WriteCommonFields(const MoeConfig& c, Json* j) {
  Json& o = *j;
  o["hidden_size"] = c.hidden_size;
  o["moe_intermediate_size"] = c.expert_hidden_size;
  o["routed_scaling_factor"] = FloatNumber(c.routing.routed_scaling_factor);
  o["topk_group"] = c.routing.topk_group;
  o["rms_norm_eps"] = FloatNumber(c.rms_norm_eps);
  if (c.activation.kind == Activation::kSiTU) {
    o["hidden_act"] = "situ";
    o["activation_situ_beta"] = FloatNumber(c.activation.situ_beta);
    o["activation_situ_linear_beta"] = FloatNumber(c.activation.situ_linear_beta);
  } else {
    o["hidden_act"] = "silu";
  }
  o["num_hidden_layers"] = c.num_hidden_layers;
  o["first_k_dense_replace"] = c.first_k_dense_replace;
  o["moe_layer_freq"] = c.moe_layer_freq;
}

Json K3TextFields(const MoeConfig& c) {
  Json o = Json::object();
  WriteCommonFields(c, &o);
  if (c.has_latent()) o["routed_expert_hidden_size"] = c.latent_size;
  o["latent_moe_use_norm"] = c.latent_norm;
  o["num_experts"] = c.routing.num_experts;
  o["num_experts_per_token"] = c.routing.top_k;
  o["num_shared_experts"] = CountOrNull(c.num_shared_experts);
  o["moe_renormalize"] = c.routing.renormalize;
  o["moe_router_activation_func"] = "sigmoid";
  o["use_grouped_topk"] = true;  // num_expert_group == 1 means no group limit
  o["num_expert_group"] = c.routing.n_group;
  o["torch_dtype"] = "bfloat16";
  return o;
}

Json K2Fields(const MoeConfig& c) {
  Json o = Json::object();
  WriteCommonFields(c, &o);
  o["n_routed_experts"] = c.routing.num_experts;
  o["num_experts_per_tok"] = c.routing.top_k;
  o["n_shared_experts"] = CountOrNull(c.num_shared_experts);
  o["norm_topk_prob"] = c.routing.renormalize;
  o["scoring_func"] = "sigmoid";
  o["topk_method"] = "noaux_tc";
  o["n_group"] = c.routing.n_group;
  o["torch_dtype"] = "bfloat16";
  return o;
}

// The quantization_config for the config's formats; null for bf16.
Json QuantizationConfig(const MoeConfig& c, bool multimodal) {
  if (c.expert_format == WeightFormat::kFP8Block128) {
    return Json{{"quant_method", "fp8"},
                {"fmt", "e4m3"},
                {"activation_scheme", "dynamic"},
                {"weight_block_size", Json::array({128, 128})}};
  }
  if (c.expert_format != WeightFormat::kMXFP4) return Json(nullptr);

  // Everything but the routed experts stays bf16 (compressed-tensors matches module names).
  Json ignore = Json::array({"lm_head"});
  if (multimodal) {
    ignore.push_back("re:.*vision_tower.*");
    ignore.push_back("re:.*multi_modal_projector.*");
  }
  ignore.push_back("re:.*self_attn.*");
  ignore.push_back("re:.*mlp\\.(gate|up|down)_proj$");  // dense layers
  ignore.push_back("re:.*gate$");                       // routers
  ignore.push_back("re:.*shared_experts.*");
  if (c.family == ModelFamily::kKimiK3) ignore.push_back("re:.*routed_expert_(down|up)_proj$");

  const Json weights = {{"num_bits", 4},       {"type", "float"},   {"group_size", 32},
                        {"strategy", "group"}, {"symmetric", true}, {"dynamic", false}};
  const Json group = {{"targets", Json::array({"Linear"})},
                      {"weights", weights},
                      {"input_activations", nullptr},
                      {"output_activations", nullptr},
                      {"format", kMxfp4Format}};
  return Json{{"quant_method", "compressed-tensors"},
              {"format", kMxfp4Format},
              {"quantization_status", "compressed"},
              {"config_groups", {{"group_0", group}}},
              {"ignore", ignore},
              {"kv_cache_scheme", nullptr}};
}

}  // namespace

const char* ModelFamilyName(ModelFamily f) {
  switch (f) {
    case ModelFamily::kKimiK3:
      return "kimi_k3";
    case ModelFamily::kKimiK2:
      return "kimi_k2";
  }
  return "?";
}

bool MoeConfig::IsMoeLayer(int layer) const {
  return moe_layer_freq > 0 && layer >= std::max(first_k_dense_replace, 0) &&
         layer < num_hidden_layers && layer % moe_layer_freq == 0;
}

std::vector<int> MoeConfig::MoeLayerIndices() const {
  std::vector<int> layers;
  if (moe_layer_freq <= 0) return layers;
  for (int layer = std::max(first_k_dense_replace, 0); layer < num_hidden_layers; ++layer) {
    if (IsMoeLayer(layer)) layers.push_back(layer);
  }
  return layers;
}

absl::Status MoeConfig::Validate() const {
  const std::string prefix =
      family == ModelFamily::kKimiK3 && model_type != "kimi_linear" ? "text_config." : "";
  return Annotate(CheckConfig(*this, NamesFor(family, prefix, "quantization_config")), "MoeConfig");
}

bool operator==(const MoeConfig& a, const MoeConfig& b) {
  const RoutingParams& ra = a.routing;
  const RoutingParams& rb = b.routing;
  const bool same_activation = a.activation.kind == b.activation.kind &&
                               (a.activation.kind != Activation::kSiTU ||
                                (a.activation.situ_beta == b.activation.situ_beta &&
                                 a.activation.situ_linear_beta == b.activation.situ_linear_beta));
  return a.family == b.family && a.model_type == b.model_type && a.hidden_size == b.hidden_size &&
         a.latent_size == b.latent_size && a.expert_hidden_size == b.expert_hidden_size &&
         a.num_shared_experts == b.num_shared_experts && ra.num_experts == rb.num_experts &&
         ra.top_k == rb.top_k && ra.renormalize == rb.renormalize &&
         ra.routed_scaling_factor == rb.routed_scaling_factor && ra.n_group == rb.n_group &&
         ra.topk_group == rb.topk_group && a.latent_norm == b.latent_norm &&
         a.rms_norm_eps == b.rms_norm_eps && same_activation &&
         a.num_hidden_layers == b.num_hidden_layers &&
         a.first_k_dense_replace == b.first_k_dense_replace &&
         a.moe_layer_freq == b.moe_layer_freq && a.expert_format == b.expert_format &&
         a.dense_format == b.dense_format;
}

absl::StatusOr<MoeConfig> ParseMoeConfig(absl::string_view config_json) {
  absl::StatusOr<Json> root = ParseBoundedJson(config_json);
  if (!root.ok())
    return absl::InvalidArgumentError(
        absl::StrCat("config.json: not valid JSON: ", root.status().message()));
  // NOTES: nlohmann reports errors by exception; they stop here. The field readers check
  // types before every access, so none is expected.
  try {
    absl::StatusOr<MoeConfig> config = ParseRoot(*root);
    if (!config.ok()) return Annotate(config.status(), "config.json");
    return config;
  } catch (const Json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("config.json: ", e.what()));
  }
}

std::string MoeConfigToJson(const MoeConfig& config) {
  Json root = Json::object();
  if (config.family == ModelFamily::kKimiK3) {
    if (config.model_type == "kimi_linear") {
      root = K3TextFields(config);
      root["architectures"] = Json::array({"KimiLinearForCausalLM"});
      root["model_type"] = "kimi_linear";
    } else {
      Json text = K3TextFields(config);
      text["model_type"] = "kimi_linear";
      root["architectures"] = Json::array({"KimiK3ForConditionalGeneration"});
      root["model_type"] = "kimi_k3";
      root["text_config"] = std::move(text);
      root["torch_dtype"] = "bfloat16";
    }
  } else {
    root = K2Fields(config);
    root["architectures"] = Json::array({"DeepseekV3ForCausalLM"});
    root["model_type"] = config.model_type == "deepseek_v3" ? "deepseek_v3" : "kimi_k2";
  }
  const bool multimodal =
      config.family == ModelFamily::kKimiK3 && config.model_type != "kimi_linear";
  Json quantization = QuantizationConfig(config, multimodal);
  if (!quantization.is_null()) root["quantization_config"] = std::move(quantization);
  return root.dump(2) + "\n";
}

}  // namespace moe
