#include "server/gateway/request_validation.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/status.h"

namespace moe {

absl::StatusOr<ValidatedRequest> ValidateForwardRequest(const moe::v1::ForwardRequest& request,
                                                        const RequestLimits& limits) {
  ValidatedRequest out;
  out.layer = request.layer();
  if (request.request_id().size() > kMaxRequestIdBytes)
    return absl::InvalidArgumentError(absl::StrCat("request_id is ", request.request_id().size(),
                                                   " bytes, more than the ", kMaxRequestIdBytes,
                                                   " echoed back"));
  if (std::find(limits.layers.begin(), limits.layers.end(), request.layer()) == limits.layers.end())
    return absl::NotFoundError(
        absl::StrCat("layer ", request.layer(),
                     " is not served (served layers: ", absl::StrJoin(limits.layers, ", "), ")"));
  if (!request.has_hidden_states()) return absl::InvalidArgumentError("hidden_states is missing");
  const moe::v1::Tensor& t = request.hidden_states();
  const int rank = t.shape_size();
  if (rank != 2 && rank != 3)
    return absl::InvalidArgumentError(
        absl::StrCat("hidden_states must have shape [T, ", limits.hidden_size, "] or [B, T, ",
                     limits.hidden_size, "], got ", rank, " dimensions"));
  if (t.shape(rank - 1) != limits.hidden_size)
    return absl::InvalidArgumentError(
        absl::StrCat("hidden_states last dimension is ", t.shape(rank - 1),
                     ", the model's hidden size is ", limits.hidden_size));
  // Check the token count before decoding, so an oversized request costs nothing.
  int64_t tokens = 1;
  bool over_limit = false;
  for (int i = 0; i + 1 < rank; ++i) {
    const int64_t d = t.shape(i);
    if (d < 0) return absl::InvalidArgumentError("hidden_states has a negative dimension");
    // Stops before the product passes the limit: it could overflow ([16, 2^62, H]).
    if (d > 0 && tokens > limits.max_request_tokens / d) {
      over_limit = true;
      break;
    }
    tokens *= d;
  }
  if (tokens == 0) return absl::InvalidArgumentError("hidden_states has no tokens (empty batch)");
  if (over_limit || tokens > limits.max_request_tokens)
    return absl::ResourceExhaustedError(absl::StrCat("request has more tokens than the limit of ",
                                                     limits.max_request_tokens, " per request"));
  ASSIGN_OR_RETURN(out.input, DecodeActivations(t, limits.precision, "hidden_states"));
  if (const int64_t i = out.input.FirstNonFinite(); i >= 0) {
    const std::string where =
        absl::StrCat(" (token ", i / limits.hidden_size, ", feature ", i % limits.hidden_size, ")");
    // A finite fp32 value can round to Inf in bf16: say so rather than blame the caller's bits.
    const float sent = TensorValue(t, i);
    if (std::isfinite(sent))
      return absl::InvalidArgumentError(
          absl::StrCat("hidden_states value ", sent, where, " is beyond bf16's range"));
    return absl::InvalidArgumentError(
        absl::StrCat("hidden_states contains ", std::isnan(sent) ? "NaN" : "Inf", where));
  }
  for (int i = 0; i < rank; ++i) out.shape.push_back(t.shape(i));
  out.tokens = tokens;
  out.output_dtype =
      request.output_dtype() == moe::v1::DTYPE_UNSPECIFIED ? t.dtype() : request.output_dtype();
  if (out.output_dtype != moe::v1::BF16 && out.output_dtype != moe::v1::FP16 &&
      out.output_dtype != moe::v1::FP32)
    return absl::InvalidArgumentError(absl::StrCat("output_dtype ",
                                                   DTypeForMessage(out.output_dtype),
                                                   " is not supported (BF16, FP16, FP32)"));
  return out;
}

}  // namespace moe
