#include "server/gateway/kserve_codec.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "proto/tensor_codec.h"

namespace moe {
namespace {

constexpr absl::string_view kModelPrefix = "moe-layer-";

// Values in the typed fields other than fp32_contents.
int64_t NonFp32Values(const inference::InferTensorContents& c) {
  return int64_t{c.bool_contents_size()} + c.int_contents_size() + c.int64_contents_size() +
         c.uint_contents_size() + c.uint64_contents_size() + c.fp64_contents_size() +
         c.bytes_contents_size();
}

bool HasTypedValues(const inference::InferTensorContents& c) {
  return NonFp32Values(c) + c.fp32_contents_size() > 0;
}

// The input's bytes, from raw_input_contents or (FP32 only) fp32_contents.
absl::StatusOr<std::string> InputBytes(const inference::ModelInferRequest& request,
                                       moe::v1::DType dtype) {
  const auto& input = request.inputs(0);
  const std::string what = absl::StrCat("input '", kKServeInput, "'");
  if (request.raw_input_contents_size() > 1)
    return absl::InvalidArgumentError(
        absl::StrCat(request.raw_input_contents_size(), " raw_input_contents for 1 input"));
  if (request.raw_input_contents_size() == 1) {
    if (input.has_contents() && HasTypedValues(input.contents()))
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": values in both raw_input_contents and contents"));
    // A copy: the request is const (the synchronous API owns it); one memcpy beside a step.
    return request.raw_input_contents(0);
  }
  const auto& c = input.contents();
  if (dtype != moe::v1::FP32)
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": ", DTypeName(dtype),
        " values travel in raw_input_contents (the protocol has no typed field for them)"));
  if (NonFp32Values(c) > 0)
    return absl::InvalidArgumentError(absl::StrCat(what, ": FP32 values go in fp32_contents"));
  std::string bytes(static_cast<size_t>(c.fp32_contents_size()) * sizeof(float), '\0');
  if (!bytes.empty()) std::memcpy(bytes.data(), c.fp32_contents().data(), bytes.size());
  return bytes;
}

}  // namespace

absl::StatusOr<moe::v1::DType> KServeDType(absl::string_view datatype, absl::string_view what) {
  if (datatype == "BF16") return moe::v1::BF16;
  if (datatype == "FP16") return moe::v1::FP16;
  if (datatype == "FP32") return moe::v1::FP32;
  return absl::InvalidArgumentError(absl::StrCat(what, ": datatype '",
                                                 absl::CEscape(datatype.substr(0, 32)),
                                                 "' is not served (BF16, FP16 or FP32)"));
}

std::string KServeModelName(int layer) { return absl::StrCat(kModelPrefix, layer); }

absl::StatusOr<int> KServeModelLayer(absl::string_view name) {
  int layer = 0;
  const absl::string_view digits = name.substr(std::min(name.size(), kModelPrefix.size()));
  const bool all_digits = !digits.empty() && digits.size() <= 9 &&
                          std::all_of(digits.begin(), digits.end(), absl::ascii_isdigit);
  // One spelling per model: "moe-layer-01" is not "moe-layer-1".
  if (!absl::StartsWith(name, kModelPrefix) || !all_digits || !absl::SimpleAtoi(digits, &layer) ||
      digits != absl::StrCat(layer))
    return absl::NotFoundError(absl::StrCat("unknown model '", absl::CEscape(name.substr(0, 64)),
                                            "' (models are named moe-layer-<L>)"));
  return layer;
}

absl::Status CheckKServeModelVersion(absl::string_view name, absl::string_view version) {
  if (version.empty() || version == kKServeModelVersion) return absl::OkStatus();
  return absl::NotFoundError(
      absl::StrCat("model '", absl::CEscape(name.substr(0, 64)), "' has no version '",
                   absl::CEscape(version.substr(0, 32)), "' (its only version is \"1\")"));
}

absl::StatusOr<KServeCall> ToForwardRequest(const inference::ModelInferRequest& request) {
  KServeCall call;
  moe::v1::ForwardRequest& forward = call.forward;
  ASSIGN_OR_RETURN(const int layer, KServeModelLayer(request.model_name()));
  RETURN_IF_ERROR(CheckKServeModelVersion(request.model_name(), request.model_version()));
  forward.set_layer(layer);
  forward.set_request_id(request.id());

  if (request.inputs_size() != 1 || request.inputs(0).name() != kKServeInput)
    return absl::InvalidArgumentError(absl::StrCat(
        "expected one input named '", kKServeInput, "', got ", request.inputs_size(),
        request.inputs_size() == 1
            ? absl::StrCat(" named '", absl::CEscape(request.inputs(0).name().substr(0, 64)), "'")
            : ""));
  const auto& input = request.inputs(0);
  ASSIGN_OR_RETURN(const moe::v1::DType dtype,
                   KServeDType(input.datatype(), absl::StrCat("input '", kKServeInput, "'")));
  moe::v1::Tensor* hidden = forward.mutable_hidden_states();
  hidden->set_dtype(dtype);
  hidden->mutable_shape()->Add(input.shape().begin(), input.shape().end());
  ASSIGN_OR_RETURN(*hidden->mutable_data(), InputBytes(request, dtype));

  if (auto it = request.parameters().find("output_datatype"); it != request.parameters().end()) {
    if (it->second.parameter_choice_case() != inference::InferParameter::kStringParam)
      return absl::InvalidArgumentError(
          "parameter 'output_datatype' must be a string (BF16, FP16 or FP32)");
    ASSIGN_OR_RETURN(const moe::v1::DType out,
                     KServeDType(it->second.string_param(), "parameter 'output_datatype'"));
    forward.set_output_dtype(out);
  }

  for (const auto& wanted : request.outputs()) {
    const std::string& name = wanted.name();
    if (name != kKServeOutput && name != kKServeExpertIds && name != kKServeRoutingWeights)
      return absl::InvalidArgumentError(absl::StrCat(
          "unknown output '", absl::CEscape(name.substr(0, 64)), "' (the model's outputs are ",
          kKServeOutput, ", ", kKServeExpertIds, " and ", kKServeRoutingWeights, ")"));
    if (std::find(call.outputs.begin(), call.outputs.end(), name) != call.outputs.end())
      return absl::InvalidArgumentError(absl::StrCat("output '", name, "' requested twice"));
    call.outputs.push_back(name);
  }
  if (call.outputs.empty()) call.outputs.push_back(kKServeOutput);
  for (const std::string& name : call.outputs)
    if (name != kKServeOutput) forward.set_return_routing(true);
  return call;
}

void ToModelInferResponse(const inference::ModelInferRequest& request, const KServeCall& call,
                          moe::v1::ForwardResponse& forward,
                          inference::ModelInferResponse* response) {
  response->set_model_name(request.model_name());
  response->set_model_version(kKServeModelVersion);
  response->set_id(request.id());
  moe::v1::Tensor& output = *forward.mutable_output();
  // Routing is [tokens, k] over the flattened batch: shaped as the input's leading dims x k.
  std::vector<int64_t> routing_shape(output.shape().begin(), output.shape().end());
  if (!routing_shape.empty()) routing_shape.back() = forward.routing().top_k();
  for (const std::string& name : call.outputs) {
    auto* tensor = response->add_outputs();
    tensor->set_name(name);
    std::string* raw = response->add_raw_output_contents();
    if (name == kKServeOutput) {
      tensor->set_datatype(DTypeName(output.dtype()));
      tensor->mutable_shape()->CopyFrom(output.shape());
      raw->swap(*output.mutable_data());  // the bytes move; the forward response is done with
    } else if (name == kKServeExpertIds) {
      tensor->set_datatype("INT32");
      tensor->mutable_shape()->Add(routing_shape.begin(), routing_shape.end());
      const auto& ids = forward.routing().expert_ids();
      raw->resize(static_cast<size_t>(ids.size()) * sizeof(int32_t));
      if (!raw->empty()) std::memcpy(raw->data(), ids.data(), raw->size());
    } else {
      tensor->set_datatype("FP32");
      tensor->mutable_shape()->Add(routing_shape.begin(), routing_shape.end());
      const auto& weights = forward.routing().weights();
      raw->resize(static_cast<size_t>(weights.size()) * sizeof(float));
      if (!raw->empty()) std::memcpy(raw->data(), weights.data(), raw->size());
    }
  }
  auto& parameters = *response->mutable_parameters();
  parameters["queue_us"].set_int64_param(forward.timing().queue_us());
  parameters["step_us"].set_int64_param(forward.timing().step_us());
  parameters["step_tokens"].set_int64_param(forward.timing().step_tokens());
}

void FillKServeModelMetadata(int layer, int64_t hidden_size, int top_k, absl::string_view platform,
                             inference::ModelMetadataResponse* response) {
  response->set_name(KServeModelName(layer));
  response->add_versions(kKServeModelVersion);
  response->set_platform(std::string(platform));
  auto add = [](auto* list, const char* name, const char* datatype, int64_t width) {
    auto* t = list->Add();
    t->set_name(name);
    t->set_datatype(datatype);
    t->add_shape(-1);
    t->add_shape(width);
  };
  // The input takes BF16, FP16 or FP32; metadata names one datatype: the model's own, BF16.
  add(response->mutable_inputs(), kKServeInput, "BF16", hidden_size);
  add(response->mutable_outputs(), kKServeOutput, "BF16", hidden_size);
  add(response->mutable_outputs(), kKServeExpertIds, "INT32", top_k);
  add(response->mutable_outputs(), kKServeRoutingWeights, "FP32", top_k);
}

void FillKServeModelConfig(int layer, int64_t hidden_size, int top_k,
                           inference::ModelConfigResponse* response) {
  inference::ModelConfig* config = response->mutable_config();
  config->set_name(KServeModelName(layer));
  config->set_backend("moe-serve");
  config->set_max_batch_size(0);
  inference::ModelInput* input = config->add_input();
  input->set_name(kKServeInput);
  input->set_data_type(inference::TYPE_BF16);  // as the metadata: the model's own dtype
  input->add_dims(-1);
  input->add_dims(hidden_size);
  auto add = [config](const char* name, inference::DataType type, int64_t width) {
    inference::ModelOutput* output = config->add_output();
    output->set_name(name);
    output->set_data_type(type);
    output->add_dims(-1);
    output->add_dims(width);
  };
  add(kKServeOutput, inference::TYPE_BF16, hidden_size);
  add(kKServeExpertIds, inference::TYPE_INT32, top_k);
  add(kKServeRoutingWeights, inference::TYPE_FP32, top_k);
}

}  // namespace moe
