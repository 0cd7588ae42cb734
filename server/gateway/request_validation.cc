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
  ASSIGN_OR_RETURN(out.input, DecodeTensor(t, "hidden_states"));
  for (size_t i = 0; i < out.input.values.size(); ++i) {
    if (!std::isfinite(out.input.values[i]))
      return absl::InvalidArgumentError(absl::StrCat(
          "hidden_states contains ", std::isnan(out.input.values[i]) ? "NaN" : "Inf", " (token ",
          i / limits.hidden_size, ", feature ", i % limits.hidden_size, ")"));
  }
  out.tokens = tokens;
  out.output_dtype =
      request.output_dtype() == moe::v1::DTYPE_UNSPECIFIED ? t.dtype() : request.output_dtype();
  if (out.output_dtype != moe::v1::BF16 && out.output_dtype != moe::v1::FP16 &&
      out.output_dtype != moe::v1::FP32)
    return absl::InvalidArgumentError(absl::StrCat("output_dtype ",
                                                   moe::v1::DType_Name(out.output_dtype),
                                                   " is not supported (BF16, FP16, FP32)"));
  return out;
}

}  // namespace moe
