// The REST bodies of the Open Inference Protocol (server/gateway/kserve_json.h): JSON and the
// binary tensor extension into ModelInferRequest, responses back, bit for bit; malformed bodies
// refused with INVALID_ARGUMENT and a message that says where.
#include "server/gateway/kserve_json.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/numerics.h"
#include "nlohmann/json.hpp"
#include "server/gateway/kserve_codec.h"

namespace moe {
namespace {

using nlohmann::json;

std::vector<float> RandomValues(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, 2.f);
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

std::string Bytes(const void* data, size_t size) {
  return std::string(static_cast<const char*>(data), size);
}

absl::StatusCode CodeOf(absl::string_view body, std::optional<size_t> json_length = std::nullopt) {
  return ParseRestInferRequest("moe-layer-1", "", body, json_length).status().code();
}

TEST(KServeJsonTest, JsonFp32DataNestedOrFlatBecomesTheRawBytes) {
  const std::vector<float> x = RandomValues(6, 1);
  json nested = json::array();
  for (int r = 0; r < 2; ++r) nested.push_back(json::array({x[3 * r], x[3 * r + 1], x[3 * r + 2]}));
  for (const json& data : {json(x), nested}) {
    const json body = {
        {"id", "r1"},
        {"parameters", {{"output_datatype", "FP32"}, {"binary_data_output", true}}},
        {"inputs",
         {{{"name", "hidden_states"}, {"shape", {2, 3}}, {"datatype", "FP32"}, {"data", data}}}}};
    absl::StatusOr<inference::ModelInferRequest> r =
        ParseRestInferRequest("moe-layer-2", "1", body.dump(), std::nullopt);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->model_name(), "moe-layer-2");
    EXPECT_EQ(r->model_version(), "1");
    EXPECT_EQ(r->id(), "r1");
    ASSERT_EQ(r->inputs_size(), 1);
    EXPECT_EQ(r->inputs(0).datatype(), "FP32");
    EXPECT_EQ(std::vector<int64_t>(r->inputs(0).shape().begin(), r->inputs(0).shape().end()),
              (std::vector<int64_t>{2, 3}));
    // json's double -> float is exact for values that were floats: the bytes are the floats'.
    EXPECT_EQ(r->raw_input_contents(0), Bytes(x.data(), x.size() * 4));
    EXPECT_EQ(r->parameters().at("output_datatype").string_param(), "FP32");
    EXPECT_TRUE(r->parameters().at("binary_data_output").bool_param());
    // And the translation to moe.v1 takes it as gRPC's ModelInfer would.
    absl::StatusOr<KServeCall> call = ToForwardRequest(*r);
    ASSERT_TRUE(call.ok()) << call.status();
    EXPECT_EQ(call->forward.layer(), 2);
    EXPECT_EQ(call->forward.hidden_states().data(), r->raw_input_contents(0));
  }
}

TEST(KServeJsonTest, Bf16AndFp16JsonValuesMustBeExact) {
  const float exact = Bf16BitsToFloat(0x3fc1);  // 1.5078125
  json body = {{"inputs",
                {{{"name", "hidden_states"},
                  {"shape", {2}},
                  {"datatype", "BF16"},
                  {"data", {exact, -2.0}}}}}};
  absl::StatusOr<inference::ModelInferRequest> r =
      ParseRestInferRequest("moe-layer-1", "", body.dump(), std::nullopt);
  ASSERT_TRUE(r.ok()) << r.status();
  const uint16_t want[2] = {0x3fc1, FloatToBf16Bits(-2.f)};
  EXPECT_EQ(r->raw_input_contents(0), Bytes(want, 4));
  body["inputs"][0]["data"] = {1.0000001};
  r = ParseRestInferRequest("moe-layer-1", "", body.dump(), std::nullopt);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("is not a BF16 number"), std::string::npos) << r.status();
  body["inputs"][0]["datatype"] = "FP16";
  body["inputs"][0]["data"] = {0.5, 65504.0};
  r = ParseRestInferRequest("moe-layer-1", "", body.dump(), std::nullopt);
  ASSERT_TRUE(r.ok()) << r.status();
  const uint16_t half[2] = {FloatToHalfBits(0.5f), FloatToHalfBits(65504.f)};
  EXPECT_EQ(r->raw_input_contents(0), Bytes(half, 4));
}

TEST(KServeJsonTest, BinaryExtensionTakesTheBytesAfterTheHeader) {
  const std::vector<float> x = RandomValues(8, 2);
  const std::string header =
      json{{"inputs",
            {{{"name", "hidden_states"},
              {"shape", {2, 4}},
              {"datatype", "FP32"},
              {"parameters", {{"binary_data_size", 32}}}}}},
           {"outputs", {{{"name", "output"}, {"parameters", {{"binary_data", true}}}}}}}
          .dump();
  const std::string body = header + Bytes(x.data(), 32);
  absl::StatusOr<inference::ModelInferRequest> r =
      ParseRestInferRequest("moe-layer-1", "", body, header.size());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->raw_input_contents(0), Bytes(x.data(), 32));
  EXPECT_EQ(r->inputs(0).parameters().count("binary_data_size"), 0u);  // consumed here
  ASSERT_EQ(r->outputs_size(), 1);
  EXPECT_TRUE(r->outputs(0).parameters().at("binary_data").bool_param());
  // Bytes left over, too few, a header length past the body, a header that is not the JSON.
  EXPECT_EQ(CodeOf(body + "x", header.size()), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CodeOf(body.substr(0, body.size() - 1), header.size()),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CodeOf(body, body.size() + 1), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CodeOf(body, header.size() - 1), absl::StatusCode::kInvalidArgument);
  // Data and binary_data_size together.
  json both = json::parse(header);
  both["inputs"][0]["data"] = {1.0};
  const std::string both_header = both.dump();
  EXPECT_EQ(CodeOf(both_header + Bytes(x.data(), 32), both_header.size()),
            absl::StatusCode::kInvalidArgument);
}

TEST(KServeJsonTest, MalformedBodiesAreInvalidArgumentsThatSayWhere) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"", "is not JSON"},
      {"{\"inputs\": [", "is not JSON"},
      {"[1]", "JSON object"},
      {"{}", "\"inputs\""},
      {"{\"id\": 3, \"inputs\": []}", "\"id\""},
      {"{\"inputs\": [{\"shape\": [1], \"datatype\": \"FP32\", \"data\": [1]}]}", "\"name\""},
      {"{\"inputs\": [{\"name\": \"hidden_states\", \"shape\": [1], \"datatype\": \"FP32\", "
       "\"data\": [\"1\"]}]}",
       "element 0"},
      {"{\"inputs\": [{\"name\": \"hidden_states\", \"shape\": [1.5], \"datatype\": \"FP32\", "
       "\"data\": [1]}]}",
       "\"shape\""},
      {"{\"inputs\": [{\"name\": \"hidden_states\", \"shape\": [1], \"datatype\": \"INT32\", "
       "\"data\": [1]}]}",
       "datatype 'INT32' is not served"},
      {"{\"inputs\": [{\"name\": \"hidden_states\", \"shape\": [1], \"datatype\": \"FP32\"}]}",
       "no \"data\""},
      {"{\"inputs\": [], \"parameters\": {\"x\": [1]}}", "parameter"},
      {"{\"inputs\": [], \"outputs\": [3]}", "outputs[0]"},
      {std::string(100000, '[') + std::string(100000, ']'), "deeper"},
  };
  for (const auto& [body, says] : cases) {
    absl::StatusOr<inference::ModelInferRequest> r =
        ParseRestInferRequest("moe-layer-1", "", body, std::nullopt);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << body.substr(0, 80);
    EXPECT_NE(r.status().message().find(says), std::string::npos)
        << body.substr(0, 80) << " -> " << r.status();
  }
}

TEST(KServeJsonTest, ResponsesCarryEachOutputAsAskedBitForBit) {
  inference::ModelInferRequest request;
  request.add_outputs()->set_name("output");
  (*request.add_outputs()->mutable_parameters())["binary_data"].set_bool_param(true);
  request.mutable_outputs(1)->set_name("expert_ids");
  inference::ModelInferResponse response;
  response.set_model_name("moe-layer-1");
  response.set_model_version("1");
  response.set_id("\xff-not-utf8");  // replaced in the JSON, never a throw
  (*response.mutable_parameters())["step_us"].set_int64_param(12);
  const uint16_t bf16[3] = {0x3fc1, 0xbf80, 0x0001};  // 1.5078125, -1, the smallest subnormal
  const int32_t ids[2] = {7, 63};
  auto* out = response.add_outputs();
  out->set_name("output");
  out->set_datatype("BF16");
  out->add_shape(3);
  response.add_raw_output_contents(Bytes(bf16, sizeof bf16));
  out = response.add_outputs();
  out->set_name("expert_ids");
  out->set_datatype("INT32");
  out->add_shape(2);
  response.add_raw_output_contents(Bytes(ids, sizeof ids));

  const RestBody rest = FormatRestInferResponse(request, response);
  ASSERT_TRUE(rest.json_length.has_value());
  const json j = json::parse(rest.body.substr(0, *rest.json_length));
  EXPECT_EQ(j["parameters"]["step_us"], 12);
  ASSERT_EQ(j["outputs"].size(), 2u);
  // The JSON output: numbers that read back to the same bf16 bits.
  EXPECT_EQ(j["outputs"][0]["name"], "output");
  std::vector<uint16_t> back;
  for (const json& v : j["outputs"][0]["data"])
    back.push_back(FloatToBf16Bits(static_cast<float>(v.get<double>())));
  EXPECT_EQ(back, std::vector<uint16_t>(bf16, bf16 + 3));
  // The binary one: its bytes after the JSON.
  EXPECT_EQ(j["outputs"][1]["parameters"]["binary_data_size"], 8);
  EXPECT_EQ(rest.body.substr(*rest.json_length), Bytes(ids, sizeof ids));
}

TEST(KServeJsonTest, MetadataConfigStatisticsAndErrors) {
  inference::ModelConfigResponse config;
  FillKServeModelConfig(2, 640, 2, &config);
  const json c = json::parse(RestModelConfig(config.config()));
  EXPECT_EQ(c["name"], "moe-layer-2");
  EXPECT_EQ(c["max_batch_size"], 0);
  EXPECT_EQ(c["input"][0]["data_type"], "TYPE_BF16");
  EXPECT_EQ(c["input"][0]["dims"], json({-1, 640}));  // numbers, as perf_analyzer reads them
  inference::ModelStatisticsResponse stats;
  auto* m = stats.add_model_stats();
  m->set_name("moe-layer-2");
  m->mutable_inference_stats()->mutable_queue()->set_count(3);
  m->mutable_inference_stats()->mutable_queue()->set_ns(4500);
  const json s = json::parse(RestStatistics(stats));
  EXPECT_EQ(s["model_stats"][0]["inference_stats"]["queue"]["ns"], 4500);
  EXPECT_EQ(json::parse(RestError("bad \"x\""))["error"], "bad \"x\"");
  EXPECT_EQ(HttpStatusOf(absl::StatusCode::kInvalidArgument), 400);
  EXPECT_EQ(HttpStatusOf(absl::StatusCode::kUnauthenticated), 401);
  EXPECT_EQ(HttpStatusOf(absl::StatusCode::kNotFound), 404);
  EXPECT_EQ(HttpStatusOf(absl::StatusCode::kResourceExhausted), 429);
  EXPECT_EQ(HttpStatusOf(absl::StatusCode::kUnavailable), 503);
  EXPECT_EQ(*ParseRestRepositoryIndexReadyOnly(""), false);
  EXPECT_EQ(*ParseRestRepositoryIndexReadyOnly("{\"ready\": true}"), true);
  EXPECT_FALSE(ParseRestRepositoryIndexReadyOnly("{\"ready\": 1}").ok());
}

}  // namespace
}  // namespace moe
