// The gateway's public boundary: bytes -> moe.v1.ForwardRequest -> ValidateForwardRequest,
// against the limits the gateway derives from the k3-mini model (hidden 640, MoE layers 1-2)
// and its default --max-request-tokens.
#include <cmath>
#include <cstdint>

#include "server/gateway/request_validation.h"
#include "tests/fuzz/fuzz_check.h"
#include "tests/fuzz/k3_mini_limits.h"
#include "tests/fuzz/quiet_protobuf.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const QuietProtobuf quiet;
  static const moe::RequestLimits limits = K3MiniLimits();
  moe::v1::ForwardRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return 0;
  const absl::StatusOr<moe::ValidatedRequest> v = moe::ValidateForwardRequest(request, limits);
  if (!v.ok()) {
    FUZZ_CHECK_CODE(v.status(), absl::StatusCode::kInvalidArgument, absl::StatusCode::kNotFound,
                    absl::StatusCode::kResourceExhausted);
    return 0;
  }
  // What reaches the batcher: a served layer, 1..limit tokens of finite values.
  FUZZ_CHECK(v->tokens >= 1 && v->tokens <= limits.max_request_tokens);
  FUZZ_CHECK(v->input.rows() == v->tokens && v->input.cols() == limits.hidden_size);
  FUZZ_CHECK(v->input.FirstNonFinite() < 0);
  FUZZ_CHECK(v->output_dtype == moe::v1::BF16 || v->output_dtype == moe::v1::FP16 ||
             v->output_dtype == moe::v1::FP32);
  return 0;
}
