// Writes the seed corpora of tests/fuzz/corpus/<target>/ with the project's own writers:
//
//   build/bin/fuzz_make_corpus tests/fuzz/corpus
//
// Valid inputs of every kind each parser accepts, plus a few near misses. Regression inputs
// (crashes found by fuzzing) are committed next to them by hand, named regression-*.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "core/npy.h"
#include "core/numerics.h"
#include "inference/grpc_service.pb.h"
#include "model/config.h"
#include "model/safetensors.h"
#include "model/synthetic.h"
#include "moe/v1/internal.pb.h"
#include "moe/v1/moe.pb.h"
#include "proto/tensor_codec.h"
#include "security/rank_handshake.h"
#include "transport/step_codec.h"

namespace moe {
namespace {

std::string g_root;

void Write(const std::string& target, const std::string& name, const std::string& bytes) {
  const std::string dir = g_root + "/" + target;
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/" + name, std::ios::binary) << bytes;
}

void Check(const absl::Status& s) {
  if (!s.ok()) {
    std::fprintf(stderr, "%s\n", s.ToString().c_str());
    std::exit(1);
  }
}

// ---- npy -------------------------------------------------------------------------------------

void NpyCorpus() {
  const float f32[6] = {1.5f, -2.25f, 3.0f, 1e-3f, 7.0f, -0.0f};
  Write("npy", "f4-2x3.npy", EncodeNpy("<f4", {2, 3}, f32, sizeof(f32)));
  Write("npy", "f4-scalar.npy", EncodeNpy("<f4", {}, f32, 4));
  Write("npy", "f4-empty-0x4.npy", EncodeNpy("<f4", {0, 4}, nullptr, 0));
  const uint16_t f16[3] = {0x3c00, 0xc000, 0x7c00};  // 1, -2, +inf
  Write("npy", "f2-3.npy", EncodeNpy("<f2", {3}, f16, sizeof(f16)));
  const double f64[2] = {0.1, -1e300};
  Write("npy", "f8-2.npy", EncodeNpy("<f8", {2}, f64, sizeof(f64)));
  const int32_t i32[3] = {3, -1, 7};
  Write("npy", "i4-3.npy", EncodeNpy("<i4", {3}, i32, sizeof(i32)));
  const int64_t i64[2] = {int64_t{1} << 40, -5};
  Write("npy", "i8-2.npy", EncodeNpy("<i8", {2}, i64, sizeof(i64)));
  const uint8_t u8[4] = {0, 1, 200, 255};
  Write("npy", "u1-2x2.npy", EncodeNpy("|u1", {2, 2}, u8, sizeof(u8)));
  Write("npy", "i1-4.npy", EncodeNpy("|i1", {4}, u8, sizeof(u8)));
  Write("npy", "b1-2.npy", EncodeNpy("|b1", {2}, u8, 2));
  // Version 2.0: a 4-byte header length.
  std::string v2 = EncodeNpy("<f4", {2}, f32, 8);
  const std::string header = v2.substr(10);
  v2 = std::string("\x93NUMPY\x02\x00", 8);
  const uint32_t len = static_cast<uint32_t>(header.size() - 8);
  for (int i = 0; i < 4; ++i) v2.push_back(static_cast<char>(len >> (8 * i)));
  Write("npy", "f4-2-v2.npy", v2 + header);
  // Near misses.
  std::string truncated = EncodeNpy("<f4", {2, 3}, f32, sizeof(f32));
  truncated.pop_back();
  Write("npy", "bad-truncated.npy", truncated);
  Write("npy", "bad-big-endian.npy", EncodeNpy(">f4", {2}, f32, 8));
  std::string fortran = EncodeNpy("<f4", {2}, f32, 8);
  fortran.replace(fortran.find("False"), 5, "True ");
  Write("npy", "bad-fortran.npy", fortran);
}

// ---- safetensors ----------------------------------------------------------------------------

std::string SafetensorsBytes(const std::vector<SafetensorsWriter::PendingTensor>& tensors,
                             const std::map<std::string, std::string>& metadata) {
  const std::string path = g_root + "/.scratch.safetensors";
  auto writer = SafetensorsWriter::Create(path, tensors, metadata);
  Check(writer.status());
  for (const auto& t : tensors) {
    int64_t n = 1;
    for (int64_t d : t.shape) n *= d;
    std::vector<uint8_t> bytes(n * DTypeSize(t.dtype));
    for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<uint8_t>(i * 37 + 11);
    Check((*writer)->Write(bytes));
  }
  Check((*writer)->Finish());
  std::ifstream in(path, std::ios::binary);
  std::string out((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::filesystem::remove(path);
  return out;
}

void SafetensorsCorpus() {
  const std::string two =
      SafetensorsBytes({{"model.layers.1.mlp.gate.weight", DType::kBF16, {2, 3}},
                        {"model.layers.1.mlp.gate.e_score_correction_bias", DType::kF32, {2}}},
                       {{"format", "pt"}});
  Write("safetensors", "bf16-f32.safetensors", two);
  Write("safetensors", "every-dtype.safetensors",
        SafetensorsBytes({{"a", DType::kF8E4M3, {2, 2}},
                          {"b", DType::kU8, {3}},
                          {"c", DType::kF16, {1}},
                          {"d", DType::kF64, {1}},
                          {"e", DType::kI8, {2}},
                          {"f", DType::kI32, {1}},
                          {"g", DType::kI64, {1}},
                          {"h", DType::kBool, {2}},
                          {"i", DType::kBF16, {}}},
                         {}));
  Write("safetensors", "empty-tensor.safetensors",
        SafetensorsBytes({{"z", DType::kF32, {0, 4}}, {"w", DType::kU8, {2}}}, {}));
  Write("safetensors", "no-tensors.safetensors", SafetensorsBytes({}, {{"k", "v"}}));
  // Near misses: data cut short, a header length past the end.
  Write("safetensors", "bad-truncated.safetensors", two.substr(0, two.size() - 3));
  std::string long_header = two;
  long_header[0] = static_cast<char>(0xff);
  Write("safetensors", "bad-header-length.safetensors", long_header);
}

// ---- index ----------------------------------------------------------------------------------

void IndexCorpus() {
  Write("index", "two-shards.json",
        R"({"metadata": {"total_size": 1024}, "weight_map": {
              "model.layers.1.mlp.gate.weight": "model-00001-of-00002.safetensors",
              "model.layers.1.mlp.experts.0.up_proj.weight": "model-00002-of-00002.safetensors"}})");
  Write("index", "empty-map.json", R"({"weight_map": {}})");
  Write("index", "bad-parent-dir.json", R"({"weight_map": {"w": "../model.safetensors"}})");
  Write("index", "bad-dot-dot.json", R"({"weight_map": {"w": ".."}})");
  Write("index", "bad-nul.json", R"({"weight_map": {"w": "a\u0000b"}})");
  Write("index", "bad-not-string.json", R"({"weight_map": {"w": 7}})");
  Write("index", "bad-no-map.json", R"({"metadata": {}})");
}

// ---- config ---------------------------------------------------------------------------------

void ConfigCorpus() {
  for (const std::string& name : SyntheticPresetNames()) {
    const absl::StatusOr<MoeConfig> c = SyntheticPreset(name);
    Check(c.status());
    Write("config", name + ".json", MoeConfigToJson(*c));
  }
  MoeConfig c = *SyntheticPreset("k3-mini");
  c.model_type = "kimi_linear";  // flat K3
  Write("config", "kimi-linear.json", MoeConfigToJson(c));
  MoeConfig k2 = *SyntheticPreset("kimi-k2");
  k2.model_type = "deepseek_v3";
  k2.routing.n_group = 8;
  k2.routing.topk_group = 4;
  Write("config", "deepseek-v3-grouped.json", MoeConfigToJson(k2));
  Write("config", "bad-top-k.json",
        R"({"model_type": "kimi_linear", "hidden_size": 64, "moe_intermediate_size": 32,
            "num_experts": 4, "num_experts_per_token": 5, "num_hidden_layers": 2})");
}

// ---- request --------------------------------------------------------------------------------

std::string Request(int layer, const std::vector<int64_t>& shape, v1::DType dtype,
                    v1::DType output = v1::DTYPE_UNSPECIFIED, float poison = 0.0f) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::vector<float> values(n);
  for (int64_t i = 0; i < n; ++i) values[i] = 0.125f * static_cast<float>(i % 29) - 1.5f;
  if (poison != 0.0f) values[n / 2] = poison;
  v1::ForwardRequest r;
  r.set_layer(layer);
  r.set_output_dtype(output);
  Check(EncodeTensor(values.data(), shape, dtype, r.mutable_hidden_states()));
  return r.SerializeAsString();
}

void RequestCorpus() {
  Write("request", "fp32-2x640.pb", Request(1, {2, 640}, v1::FP32));
  Write("request", "bf16-1x2x640.pb", Request(2, {1, 2, 640}, v1::BF16));
  Write("request", "fp16-1x640-out-bf16.pb", Request(1, {1, 640}, v1::FP16, v1::BF16));
  Write("request", "bad-layer.pb", Request(3, {1, 640}, v1::BF16));
  Write("request", "bad-nan.pb", Request(1, {1, 640}, v1::BF16, v1::DTYPE_UNSPECIFIED, NAN));
  Write("request", "bad-width.pb", Request(1, {2, 64}, v1::BF16));
}

// ---- kserve ---------------------------------------------------------------------------------

// A ModelInferRequest of `tokens` x 640 values, raw (or typed fp32_contents), asking for `outputs`.
std::string Infer(const std::string& model, const std::string& datatype, int64_t tokens,
                  const std::vector<std::string>& outputs, bool typed = false) {
  inference::ModelInferRequest r;
  r.set_model_name(model);
  r.set_id("seed");
  auto* input = r.add_inputs();
  input->set_name("hidden_states");
  input->set_datatype(datatype);
  input->add_shape(tokens);
  input->add_shape(640);
  std::vector<float> values(tokens * 640);
  for (size_t i = 0; i < values.size(); ++i) values[i] = 0.25f * static_cast<float>(i % 13) - 1.5f;
  if (typed) {
    for (float v : values) input->mutable_contents()->add_fp32_contents(v);
  } else {
    v1::Tensor t;
    Check(EncodeTensor(values.data(), {tokens, 640},
                       datatype == "BF16"   ? v1::BF16
                       : datatype == "FP16" ? v1::FP16
                                            : v1::FP32,
                       &t));
    r.add_raw_input_contents(t.data());
  }
  for (const std::string& name : outputs) r.add_outputs()->set_name(name);
  return r.SerializeAsString();
}

void KServeCorpus() {
  Write("kserve", "fp32-2x640.pb", Infer("moe-layer-1", "FP32", 2, {}));
  Write("kserve", "bf16-1x640-routing.pb",
        Infer("moe-layer-2", "BF16", 1, {"output", "expert_ids", "routing_weights"}));
  Write("kserve", "fp16-1x640-ids.pb", Infer("moe-layer-1", "FP16", 1, {"expert_ids"}));
  Write("kserve", "typed-fp32-1x640.pb", Infer("moe-layer-2", "FP32", 1, {"output"}, true));
  Write("kserve", "bad-model.pb", Infer("moe-layer-x", "FP32", 1, {}));
  Write("kserve", "bad-output.pb", Infer("moe-layer-1", "BF16", 1, {"logits"}));
}

// ---- step -----------------------------------------------------------------------------------

std::string Step(int rows, int width, Precision p, bool drop_last_byte = false) {
  std::vector<float> values(static_cast<size_t>(rows) * width);
  for (size_t i = 0; i < values.size(); ++i) values[i] = static_cast<float>(i % 17) - 8.0f;
  v1::internal::GatewayToRank m;
  auto* step = m.mutable_step();
  step->set_step_id(42);
  step->set_layer(1);
  step->set_num_rows(rows);
  step->set_width(width);
  step->set_precision(static_cast<moe::v1::internal::Precision>(WirePrecision(p)));
  const ActivationRows host = ActivationRows::FromFloats(p, values.data(), rows, width);
  EncodeRows(ActivationView(host), step->mutable_rows());
  if (drop_last_byte) step->mutable_rows()->pop_back();
  step->add_row_offsets(0);
  for (int r = 0; r < rows; ++r) {
    for (int k = 0; k < 2; ++k) {
      step->add_local_experts((r + 3 * k) % 8);
      step->add_gates(0.25f + 0.5f * static_cast<float>(k));
    }
    step->add_row_offsets(2 * (r + 1));
  }
  return m.SerializeAsString();
}

void StepCorpus() {
  Write("step", "bf16-3x32.pb", Step(3, 32, Precision::kBF16));
  Write("step", "fp32-2x16.pb", Step(2, 16, Precision::kFP32));
  Write("step", "no-rows.pb", Step(0, 16, Precision::kBF16));
  Write("step", "bad-byte-count.pb", Step(2, 16, Precision::kBF16, /*drop_last_byte=*/true));
  v1::internal::GatewayToRank heartbeat;
  heartbeat.mutable_heartbeat();
  Write("step", "heartbeat.pb", heartbeat.SerializeAsString());
}

// ---- control --------------------------------------------------------------------------------

void ControlCorpus() {
  // A nonce and a session as a gateway makes them, with proofs under another token.
  RankHandshake handshake("seed-token");
  const std::string nonce = handshake.NewNonce(absl::Now());
  const std::string session = handshake.OpenSession(1);
  Write("control", "registration.bin",
        std::string(1, '\0') + nonce + "\n" + RegistrationProof("guess", nonce, 1) + "\n1");
  Write("control", "exchange.bin",
        std::string(1, '\1') + session + "\n" + ExchangeProof("guess", session, 1) + "\n1");
  Write("control", "honest.bin", std::string(1, '\2') + "3\n17");
  v1::internal::RegisterRequest request;
  request.set_requested_rank(-1);
  request.set_hostname("rank-host");
  request.add_transports("grpc");
  request.set_backend("cpu");
  Write("control", "register.pb", std::string(1, '\3') + request.SerializeAsString());
  v1::internal::RankToGateway hello;
  hello.mutable_hello()->set_rank(1);
  hello.mutable_hello()->set_session(session);
  hello.mutable_hello()->set_weight_bytes(1 << 20);
  Write("control", "hello.pb", std::string(1, '\4') + hello.SerializeAsString());
  v1::internal::RankToGateway loaded;
  loaded.mutable_shards_loaded()->set_generation(2);
  loaded.mutable_shards_loaded()->set_error("disk full");
  Write("control", "shards-loaded.pb", std::string(1, '\4') + loaded.SerializeAsString());
}

}  // namespace
}  // namespace moe

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CORPUS_DIR (tests/fuzz/corpus)\n", argv[0]);
    return 2;
  }
  moe::g_root = argv[1];
  moe::NpyCorpus();
  moe::SafetensorsCorpus();
  moe::IndexCorpus();
  moe::ConfigCorpus();
  moe::RequestCorpus();
  moe::KServeCorpus();
  moe::StepCorpus();
  moe::ControlCorpus();
  return 0;
}
