// The Open Inference Protocol's boundary: bytes -> inference.ModelInferRequest ->
// ToForwardRequest -> ValidateForwardRequest, as ModelInfer does, with k3-mini's limits.
#include <cmath>
#include <cstdint>

#include "server/gateway/kserve_codec.h"
#include "server/gateway/request_validation.h"
#include "tests/fuzz/fuzz_check.h"
#include "tests/fuzz/k3_mini_limits.h"
#include "tests/fuzz/quiet_protobuf.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const QuietProtobuf quiet;
  static const moe::RequestLimits limits = K3MiniLimits();
  inference::ModelInferRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return 0;
  const absl::StatusOr<moe::KServeCall> call = moe::ToForwardRequest(request);
  if (!call.ok()) {
    FUZZ_CHECK_CODE(call.status(), absl::StatusCode::kInvalidArgument, absl::StatusCode::kNotFound);
    return 0;
  }
  // A translated request names the model's layer, asks for 1-3 distinct known outputs, and
  // carries the input's bytes unchanged when they came raw.
  FUZZ_CHECK(moe::KServeModelName(call->forward.layer()) == request.model_name());
  FUZZ_CHECK(!call->outputs.empty() && call->outputs.size() <= 3);
  if (request.raw_input_contents_size() == 1)
    FUZZ_CHECK(call->forward.hidden_states().data() == request.raw_input_contents(0));
  const absl::StatusOr<moe::ValidatedRequest> v =
      moe::ValidateForwardRequest(call->forward, limits);
  if (!v.ok()) {
    FUZZ_CHECK_CODE(v.status(), absl::StatusCode::kInvalidArgument, absl::StatusCode::kNotFound,
                    absl::StatusCode::kResourceExhausted);
    return 0;
  }
  FUZZ_CHECK(v->tokens >= 1 && v->tokens <= limits.max_request_tokens);
  FUZZ_CHECK(v->input.FirstNonFinite() < 0);
  // The response side: every requested output comes back, in order, with its bytes.
  moe::v1::ForwardResponse forward;
  forward.mutable_output()->set_dtype(v->output_dtype);
  forward.mutable_output()->mutable_shape()->Add(v->shape.begin(), v->shape.end());
  forward.mutable_output()->set_data(std::string(v->input.rows() * v->input.cols() * 2, '\x01'));
  forward.mutable_routing()->set_top_k(2);
  for (int64_t i = 0; i < 2 * v->tokens; ++i) {
    forward.mutable_routing()->add_expert_ids(static_cast<int32_t>(i % 16));
    forward.mutable_routing()->add_weights(0.5f);
  }
  inference::ModelInferResponse response;
  moe::ToModelInferResponse(request, *call, forward, &response);
  FUZZ_CHECK(response.outputs_size() == static_cast<int>(call->outputs.size()));
  FUZZ_CHECK(response.raw_output_contents_size() == response.outputs_size());
  for (int i = 0; i < response.outputs_size(); ++i) {
    FUZZ_CHECK(response.outputs(i).name() == call->outputs[i]);
    FUZZ_CHECK(!response.raw_output_contents(i).empty());
  }
  return 0;
}
