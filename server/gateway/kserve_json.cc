#include "server/gateway/kserve_json.h"

#include <cmath>
#include <cstring>
#include <exception>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "core/numerics.h"
#include "core/status.h"
#include "model/bounded_json.h"
#include "nlohmann/json.hpp"
#include "proto/tensor_codec.h"
#include "server/gateway/kserve_codec.h"

namespace moe {
namespace {

using nlohmann::json;

absl::Status Invalid(absl::string_view where, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(where, ": ", what));
}

// Strings the caller sent (an id) may not be UTF-8: replaced, never a throw.
std::string Dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

absl::StatusOr<json> ParseJson(absl::string_view text, absl::string_view what) {
  absl::StatusOr<json> j = ParseBoundedJson(text);
  if (!j.ok())
    return absl::InvalidArgumentError(absl::StrCat(
        what, " is not JSON: ", absl::CHexEscape(j.status().message().substr(0, 200))));
  return j;
}

// A parameter value of the protocol: string, bool, integer or float.
absl::Status ToParameter(const json& value, absl::string_view where,
                         inference::InferParameter* out) {
  if (value.is_string()) {
    out->set_string_param(value.get<std::string>());
  } else if (value.is_boolean()) {
    out->set_bool_param(value.get<bool>());
  } else if (value.is_number_integer()) {
    out->set_int64_param(value.get<int64_t>());
  } else if (value.is_number_float()) {
    out->set_double_param(value.get<double>());
  } else {
    return Invalid(where, "a parameter is a string, a boolean or a number");
  }
  return absl::OkStatus();
}

absl::Status ToParameters(const json& object, absl::string_view where,
                          google::protobuf::Map<std::string, inference::InferParameter>* out) {
  if (!object.is_object()) return Invalid(where, "\"parameters\" must be an object");
  for (const auto& [key, value] : object.items())
    RETURN_IF_ERROR(
        ToParameter(value, absl::StrCat(where, ".parameters.", absl::CEscape(key)), &(*out)[key]));
  return absl::OkStatus();
}

// The element bytes of JSON numbers (nested arrays flattened, in row-major order) as `datatype`.
class DataWriter {
 public:
  DataWriter(moe::v1::DType dtype, std::string where, std::string* out)
      : dtype_(dtype), where_(std::move(where)), out_(out) {}

  // Recursive: ParseBoundedJson bounded the depth.
  absl::Status Write(const json& data) {
    if (data.is_array()) {
      for (const json& element : data) RETURN_IF_ERROR(Write(element));
      return absl::OkStatus();
    }
    if (!data.is_number())
      return Invalid(where_, absl::StrCat("element ", count_, " of \"data\" is not a number"));
    const double value = data.get<double>();
    const float f = static_cast<float>(value);
    if (dtype_ == moe::v1::FP32) {
      Append(FloatBits(f), 4);
    } else {
      const uint16_t bits = dtype_ == moe::v1::BF16 ? FloatToBf16Bits(f) : FloatToHalfBits(f);
      const float back = dtype_ == moe::v1::BF16 ? Bf16BitsToFloat(bits) : HalfBitsToFloat(bits);
      if (static_cast<double>(back) != value)
        return Invalid(
            where_, absl::StrCat("element ", count_, " (", value, ") is not a ", DTypeName(dtype_),
                                 " number: send FP32 values, or binary data"));
      Append(bits, 2);
    }
    ++count_;
    return absl::OkStatus();
  }

 private:
  void Append(uint32_t bits, size_t width) {
    char bytes[4];
    std::memcpy(bytes, &bits, 4);  // little-endian, as the protocol's raw contents
    out_->append(bytes, width);
  }

  moe::v1::DType dtype_;
  std::string where_;
  std::string* out_;
  int64_t count_ = 0;
};

absl::Status ToInput(const json& input, int index, absl::string_view binary, size_t* binary_used,
                     inference::ModelInferRequest* request) {
  std::string where = absl::StrCat("inputs[", index, "]");
  if (!input.is_object()) return Invalid(where, "an input is an object");
  auto* tensor = request->add_inputs();
  const auto name = input.find("name");
  if (name == input.end() || !name->is_string()) return Invalid(where, "\"name\" (a string)");
  tensor->set_name(name->get<std::string>());
  where = absl::StrCat("input '", absl::CEscape(tensor->name().substr(0, 64)), "'");
  const auto datatype = input.find("datatype");
  if (datatype == input.end() || !datatype->is_string())
    return Invalid(where, "\"datatype\" (a string)");
  tensor->set_datatype(datatype->get<std::string>());
  const auto shape = input.find("shape");
  if (shape == input.end() || !shape->is_array())
    return Invalid(where, "\"shape\" (an array of integers)");
  for (const json& d : *shape) {
    if (!d.is_number_integer()) return Invalid(where, "\"shape\" holds integers only");
    tensor->add_shape(d.get<int64_t>());
  }
  std::optional<uint64_t> binary_size;
  if (const auto parameters = input.find("parameters"); parameters != input.end()) {
    RETURN_IF_ERROR(ToParameters(*parameters, where, tensor->mutable_parameters()));
    if (const auto size = parameters->find("binary_data_size"); size != parameters->end()) {
      if (!size->is_number_unsigned())
        return Invalid(where, "binary_data_size is a non-negative integer");
      binary_size = size->get<uint64_t>();
      tensor->mutable_parameters()->erase("binary_data_size");
    }
  }
  const auto data = input.find("data");
  std::string* raw = request->add_raw_input_contents();
  if (binary_size.has_value()) {
    if (data != input.end()) return Invalid(where, "both \"data\" and binary_data_size");
    if (*binary_size > binary.size() - *binary_used)
      return Invalid(where,
                     absl::StrCat("binary_data_size ", *binary_size, " but only ",
                                  binary.size() - *binary_used, " bytes of binary data are left"));
    raw->assign(binary.data() + *binary_used, *binary_size);
    *binary_used += *binary_size;
    return absl::OkStatus();
  }
  if (data == input.end()) return Invalid(where, "no \"data\" and no binary_data_size");
  ASSIGN_OR_RETURN(const moe::v1::DType dtype, KServeDType(tensor->datatype(), where));
  return DataWriter(dtype, where, raw).Write(*data);
}

bool WantsBinary(const inference::ModelInferRequest& request, const std::string& output) {
  for (const auto& wanted : request.outputs()) {
    if (wanted.name() != output) continue;
    if (auto it = wanted.parameters().find("binary_data"); it != wanted.parameters().end())
      return it->second.bool_param();
  }
  auto it = request.parameters().find("binary_data_output");
  return it != request.parameters().end() && it->second.bool_param();
}

// The little-endian elements of `raw` as JSON numbers (BF16/FP16 widened exactly).
json NumbersOf(const std::string& datatype, const std::string& raw) {
  json values = json::array();
  const size_t width = datatype == "BF16" || datatype == "FP16" ? 2 : 4;
  values.get_ref<json::array_t&>().reserve(raw.size() / width);
  for (size_t at = 0; at + width <= raw.size(); at += width) {
    uint32_t bits = 0;
    std::memcpy(&bits, raw.data() + at, width);
    if (datatype == "INT32") {
      values.push_back(static_cast<int32_t>(bits));
    } else if (datatype == "BF16") {
      values.push_back(static_cast<double>(Bf16BitsToFloat(static_cast<uint16_t>(bits))));
    } else if (datatype == "FP16") {
      values.push_back(static_cast<double>(HalfBitsToFloat(static_cast<uint16_t>(bits))));
    } else {
      values.push_back(static_cast<double>(BitsToFloat(bits)));
    }
  }
  return values;
}

json ParameterJson(const inference::InferParameter& p) {
  switch (p.parameter_choice_case()) {
    case inference::InferParameter::kBoolParam:
      return p.bool_param();
    case inference::InferParameter::kInt64Param:
      return p.int64_param();
    case inference::InferParameter::kDoubleParam:
      return p.double_param();
    case inference::InferParameter::kUint64Param:
      return p.uint64_param();
    default:
      return p.string_param();
  }
}

json TensorMetadata(const inference::ModelMetadataResponse::TensorMetadata& t) {
  return {{"name", t.name()},
          {"datatype", t.datatype()},
          {"shape", std::vector<int64_t>(t.shape().begin(), t.shape().end())}};
}

json Duration(const inference::StatisticDuration& d) {
  return {{"count", d.count()}, {"ns", d.ns()}};
}

}  // namespace

absl::StatusOr<inference::ModelInferRequest> ParseRestInferRequest(
    absl::string_view model, absl::string_view version, absl::string_view body,
    std::optional<size_t> json_length) {
  if (json_length.has_value() && *json_length > body.size())
    return absl::InvalidArgumentError(absl::StrCat(kInferenceHeaderLength, " ", *json_length,
                                                   " is longer than the body (", body.size(),
                                                   " bytes)"));
  const absl::string_view header = json_length.has_value() ? body.substr(0, *json_length) : body;
  const absl::string_view binary =
      json_length.has_value() ? body.substr(*json_length) : absl::string_view();
  ASSIGN_OR_RETURN(const json j,
                   ParseJson(header, json_length.has_value()
                                         ? absl::StrCat("the JSON header (the first ", *json_length,
                                                        " bytes, ", kInferenceHeaderLength, ")")
                                         : std::string("the request")));
  if (!j.is_object()) return absl::InvalidArgumentError("the request is a JSON object");

  inference::ModelInferRequest request;
  request.set_model_name(std::string(model));
  request.set_model_version(std::string(version));
  if (const auto id = j.find("id"); id != j.end()) {
    if (!id->is_string()) return absl::InvalidArgumentError("\"id\" is a string");
    request.set_id(id->get<std::string>());
  }
  if (const auto parameters = j.find("parameters"); parameters != j.end())
    RETURN_IF_ERROR(ToParameters(*parameters, "request", request.mutable_parameters()));
  const auto inputs = j.find("inputs");
  if (inputs == j.end() || !inputs->is_array())
    return absl::InvalidArgumentError("\"inputs\" (an array) is missing");
  size_t binary_used = 0;
  int index = 0;
  for (const json& input : *inputs)
    RETURN_IF_ERROR(ToInput(input, index++, binary, &binary_used, &request));
  if (binary_used != binary.size())
    return absl::InvalidArgumentError(absl::StrCat(
        binary.size(),
        " bytes of binary data follow the JSON; the inputs' binary_data_size add up to ",
        binary_used));
  if (const auto outputs = j.find("outputs"); outputs != j.end()) {
    if (!outputs->is_array()) return absl::InvalidArgumentError("\"outputs\" is an array");
    index = 0;
    for (const json& output : *outputs) {
      const std::string where = absl::StrCat("outputs[", index++, "]");
      const auto name = output.is_object() ? output.find("name") : output.end();
      if (!output.is_object() || name == output.end() || !name->is_string())
        return Invalid(where, "an output is an object with a \"name\" (a string)");
      auto* wanted = request.add_outputs();
      wanted->set_name(name->get<std::string>());
      if (const auto parameters = output.find("parameters"); parameters != output.end())
        RETURN_IF_ERROR(ToParameters(*parameters, where, wanted->mutable_parameters()));
    }
  }
  return request;
}

RestBody FormatRestInferResponse(const inference::ModelInferRequest& request,
                                 inference::ModelInferResponse& response) {
  json j = {{"model_name", response.model_name()}, {"model_version", response.model_version()}};
  if (!response.id().empty()) j["id"] = response.id();
  json parameters = json::object();
  for (const auto& [key, value] : response.parameters()) parameters[key] = ParameterJson(value);
  if (!parameters.empty()) j["parameters"] = std::move(parameters);
  std::string binary;
  json outputs = json::array();
  for (int i = 0; i < response.outputs_size(); ++i) {
    const auto& tensor = response.outputs(i);
    std::string& raw = *response.mutable_raw_output_contents(i);
    json out = {{"name", tensor.name()},
                {"datatype", tensor.datatype()},
                {"shape", std::vector<int64_t>(tensor.shape().begin(), tensor.shape().end())}};
    if (WantsBinary(request, tensor.name())) {
      out["parameters"] = {{"binary_data_size", raw.size()}};
      binary.append(raw);
    } else {
      out["data"] = NumbersOf(tensor.datatype(), raw);
    }
    std::string().swap(raw);
    outputs.push_back(std::move(out));
  }
  j["outputs"] = std::move(outputs);
  RestBody rest{Dump(j), std::nullopt};
  if (!binary.empty()) {
    rest.json_length = rest.body.size();
    rest.body.append(binary);
  }
  return rest;
}

std::string RestServerMetadata(const inference::ServerMetadataResponse& metadata) {
  return Dump(json{{"name", metadata.name()},
                   {"version", metadata.version()},
                   {"extensions", std::vector<std::string>(metadata.extensions().begin(),
                                                           metadata.extensions().end())}});
}

std::string RestModelMetadata(const inference::ModelMetadataResponse& metadata) {
  json inputs = json::array(), outputs = json::array();
  for (const auto& t : metadata.inputs()) inputs.push_back(TensorMetadata(t));
  for (const auto& t : metadata.outputs()) outputs.push_back(TensorMetadata(t));
  return Dump(json{{"name", metadata.name()},
                   {"versions", std::vector<std::string>(metadata.versions().begin(),
                                                         metadata.versions().end())},
                   {"platform", metadata.platform()},
                   {"inputs", std::move(inputs)},
                   {"outputs", std::move(outputs)}});
}

std::string RestModelConfig(const inference::ModelConfig& config) {
  // Triton's JSON for the configuration: the protobuf field names, numbers as numbers.
  auto tensor = [](const std::string& name, inference::DataType type, const auto& dims) {
    return json{{"name", name},
                {"data_type", inference::DataType_Name(type)},
                {"dims", std::vector<int64_t>(dims.begin(), dims.end())}};
  };
  json inputs = json::array(), outputs = json::array();
  for (const auto& t : config.input()) inputs.push_back(tensor(t.name(), t.data_type(), t.dims()));
  for (const auto& t : config.output())
    outputs.push_back(tensor(t.name(), t.data_type(), t.dims()));
  return Dump(json{{"name", config.name()},
                   {"backend", config.backend()},
                   {"max_batch_size", config.max_batch_size()},
                   {"input", std::move(inputs)},
                   {"output", std::move(outputs)}});
}

std::string RestStatistics(const inference::ModelStatisticsResponse& statistics) {
  json models = json::array();
  for (const auto& m : statistics.model_stats()) {
    const auto& s = m.inference_stats();
    models.push_back(json{{"name", m.name()},
                          {"version", m.version()},
                          {"last_inference", m.last_inference()},
                          {"inference_count", m.inference_count()},
                          {"execution_count", m.execution_count()},
                          {"inference_stats",
                           {{"success", Duration(s.success())},
                            {"fail", Duration(s.fail())},
                            {"queue", Duration(s.queue())},
                            {"compute_input", Duration(s.compute_input())},
                            {"compute_infer", Duration(s.compute_infer())},
                            {"compute_output", Duration(s.compute_output())}}},
                          {"batch_stats", json::array()}});
  }
  return Dump(json{{"model_stats", std::move(models)}});
}

std::string RestRepositoryIndex(const inference::RepositoryIndexResponse& index) {
  json models = json::array();
  for (const auto& m : index.models()) {
    json model = {{"name", m.name()}, {"version", m.version()}, {"state", m.state()}};
    if (!m.reason().empty()) model["reason"] = m.reason();
    models.push_back(std::move(model));
  }
  return Dump(models);
}

absl::StatusOr<bool> ParseRestRepositoryIndexReadyOnly(absl::string_view body) {
  if (body.empty()) return false;
  ASSIGN_OR_RETURN(const json j, ParseJson(body, "the request"));
  if (!j.is_object()) return absl::InvalidArgumentError("the request is a JSON object");
  const auto ready = j.find("ready");
  if (ready == j.end()) return false;
  if (!ready->is_boolean()) return absl::InvalidArgumentError("\"ready\" is a boolean");
  return ready->get<bool>();
}

std::string RestError(absl::string_view message) {
  return Dump(json{{"error", std::string(message)}});
}

int HttpStatusOf(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kOk:
      return 200;
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kOutOfRange:
      return 400;
    case absl::StatusCode::kUnauthenticated:
      return 401;
    case absl::StatusCode::kPermissionDenied:
      return 403;
    case absl::StatusCode::kNotFound:
      return 404;
    case absl::StatusCode::kAlreadyExists:
    case absl::StatusCode::kAborted:
      return 409;
    case absl::StatusCode::kResourceExhausted:
      return 429;
    case absl::StatusCode::kCancelled:
      return 499;
    case absl::StatusCode::kUnimplemented:
      return 501;
    case absl::StatusCode::kUnavailable:
      return 503;
    case absl::StatusCode::kDeadlineExceeded:
      return 504;
    default:
      return 500;
  }
}

}  // namespace moe
