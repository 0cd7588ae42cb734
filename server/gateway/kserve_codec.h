// The Open Inference Protocol (KServe v2) in terms of moe.v1: a ModelInferRequest becomes the
// ForwardRequest it means, and a ForwardResponse the ModelInferResponse. The translation only
// renames and reshapes; every check of the values themselves (shape, byte count, finite values,
// token limits, served layers) stays in ValidateForwardRequest, so both APIs refuse the same
// requests with the same codes.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "inference/grpc_service.pb.h"
#include "moe/v1/moe.pb.h"

namespace moe {

// Model "moe-layer-<L>" <-> MoE layer L (the checkpoint's numbering), version "1".
std::string KServeModelName(int layer);
constexpr char kKServeModelVersion[] = "1";
// The layer a model name names; NOT_FOUND for names not of that form. Whether the layer is
// served is the caller's question.
absl::StatusOr<int> KServeModelLayer(absl::string_view name);
// NOT_FOUND unless `version` is "" (the only one) or "1".
absl::Status CheckKServeModelVersion(absl::string_view name, absl::string_view version);

// The protocol's datatype names are moe.v1's (DTypeName): BF16, FP16, FP32; INVALID_ARGUMENT
// naming `what` for any other.
absl::StatusOr<moe::v1::DType> KServeDType(absl::string_view datatype, absl::string_view what);

// The tensor names of every layer model.
constexpr char kKServeInput[] = "hidden_states";
constexpr char kKServeOutput[] = "output";
constexpr char kKServeExpertIds[] = "expert_ids";
constexpr char kKServeRoutingWeights[] = "routing_weights";

struct KServeCall {
  moe::v1::ForwardRequest forward;
  std::vector<std::string> outputs;  // in the order they are returned
};

// INVALID_ARGUMENT for inputs, datatypes, contents or outputs the model does not have;
// NOT_FOUND for a model or version that does not exist. The request parameter
// "output_datatype" (string BF16/FP16/FP32) sets the output dtype, else the input's.
absl::StatusOr<KServeCall> ToForwardRequest(const inference::ModelInferRequest& request);

// Moves the output bytes of `forward` into `response` (raw_output_contents), in call.outputs'
// order, with the step's timing as the parameters queue_us, step_us and step_tokens.
void ToModelInferResponse(const inference::ModelInferRequest& request, const KServeCall& call,
                          moe::v1::ForwardResponse& forward,
                          inference::ModelInferResponse* response);

// Metadata of a layer model: H = hidden size, k = routed experts per token.
void FillKServeModelMetadata(int layer, int64_t hidden_size, int top_k, absl::string_view platform,
                             inference::ModelMetadataResponse* response);
// The same model as Triton's read-only configuration (the ModelConfig extension): no batch
// dimension of its own (max_batch_size 0), the tensors of the metadata.
void FillKServeModelConfig(int layer, int64_t hidden_size, int top_k,
                           inference::ModelConfigResponse* response);

}  // namespace moe
