// The Open Inference Protocol's HTTP/REST bodies (KServe v2 JSON, and Triton's binary tensor
// extension) <-> the protocol's protobuf messages, which kserve_codec.h turns into moe.v1. Pure
// functions: the HTTP server (kserve_http.h) reads and writes bytes, these only reshape them, so
// every check of the values stays in one place (ValidateForwardRequest) for all three APIs.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "inference/grpc_service.pb.h"

namespace moe {

// The header of the binary tensor extension: the JSON's length when binary data follows it.
inline constexpr char kInferenceHeaderLength[] = "Inference-Header-Content-Length";

// POST /v2/models/<model>[/versions/<version>]/infer. `body` is JSON, or with `json_length` a
// JSON header of that many bytes followed by the binary inputs (each input's
// parameters.binary_data_size, in order, exactly filling the rest). JSON "data" may be nested;
// BF16/FP16 values must be exactly representable (send FP32 or binary data otherwise).
// INVALID_ARGUMENT for anything malformed, with where.
absl::StatusOr<inference::ModelInferRequest> ParseRestInferRequest(
    absl::string_view model, absl::string_view version, absl::string_view body,
    std::optional<size_t> json_length);

struct RestBody {
  std::string body;
  std::optional<size_t> json_length;  // set when binary data follows the JSON
};
// Each output as JSON numbers, or as binary data after the JSON when the request asked it
// (the output's parameter binary_data, else the request's binary_data_output). The output bytes
// move out of `response`.
RestBody FormatRestInferResponse(const inference::ModelInferRequest& request,
                                 inference::ModelInferResponse& response);

std::string RestServerMetadata(const inference::ServerMetadataResponse& metadata);
std::string RestModelMetadata(const inference::ModelMetadataResponse& metadata);
std::string RestModelConfig(const inference::ModelConfig& config);
std::string RestStatistics(const inference::ModelStatisticsResponse& statistics);
std::string RestRepositoryIndex(const inference::RepositoryIndexResponse& index);
// POST /v2/repository/index: {} or {"ready": bool}; an empty body means {}.
absl::StatusOr<bool> ParseRestRepositoryIndexReadyOnly(absl::string_view body);

// {"error": message}, with the HTTP status the protocol gives `code`.
std::string RestError(absl::string_view message);
int HttpStatusOf(absl::StatusCode code);

}  // namespace moe
