// Validation of public Forward requests: every rejection has a precise status and message,
// and nothing invalid reaches the batcher (so one caller cannot corrupt another's step).
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "moe/v1/moe.pb.h"
#include "proto/tensor_codec.h"

namespace moe {

// A request id is echoed in the response: an id, not a payload.
inline constexpr size_t kMaxRequestIdBytes = 256;

struct RequestLimits {
  int64_t hidden_size = 0;
  int64_t max_request_tokens = 0;
  std::vector<int> layers;                 // served layers
  Precision precision = Precision::kBF16;  // the layers' activation dtype
};

struct ValidatedRequest {
  int layer = 0;
  int64_t tokens = 0;
  std::vector<int64_t> shape;  // as sent: [T, H] or [B, T, H]
  ActivationRows input;        // [tokens, H] in the layers' dtype
  moe::v1::DType output_dtype = moe::v1::FP32;
};

// INVALID_ARGUMENT: dtype, shape, byte count, empty batch, NaN/Inf (or, for a bf16 layer, a
// value beyond bf16's range), a request id over kMaxRequestIdBytes.
// NOT_FOUND: layer not served. RESOURCE_EXHAUSTED: more tokens than the limit.
absl::StatusOr<ValidatedRequest> ValidateForwardRequest(const moe::v1::ForwardRequest& request,
                                                        const RequestLimits& limits);

}  // namespace moe
