// moe.v1.Tensor <-> fp32 host arrays and activation rows. Shared by the client and the gateway so
// both sides read and write the wire format the same way.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "core/activations.h"
#include "moe/v1/moe.pb.h"

namespace moe {

// Decoded tensor: values widened to fp32 (exact for BF16/FP16).
struct HostTensor {
  std::vector<int64_t> shape;
  std::vector<float> values;
  int64_t num_elements() const;
};

// Checks dtype, shape (no negative dims, no overflow) and that the byte count matches, then
// widens to fp32. Errors are InvalidArgument with a message fit for the caller.
absl::StatusOr<HostTensor> DecodeTensor(const moe::v1::Tensor& tensor, const char* what = "tensor");

// Encodes fp32 values as `dtype` (BF16/FP16 rounded to nearest even).
absl::Status EncodeTensor(const float* values, const std::vector<int64_t>& shape,
                          moe::v1::DType dtype, moe::v1::Tensor* out);

// The same checks, then rows of the last dimension in the dtype of `precision`: a BF16 tensor
// for a bf16 layer (FP32 for fp32) is taken as it is; others are converted once (to bf16 by
// rounding to nearest even).
absl::StatusOr<ActivationRows> DecodeActivations(const moe::v1::Tensor& tensor, Precision precision,
                                                 const char* what = "tensor");

// Element i of a tensor that decoded, as sent, widened to fp32 (exact).
float TensorValue(const moe::v1::Tensor& tensor, int64_t i);

// Encodes rows with `shape` as `dtype`: as they are when it is their own dtype, otherwise
// converted (exactly to FP32, rounded to nearest even to BF16/FP16).
absl::Status EncodeActivations(const ActivationRows& rows, const std::vector<int64_t>& shape,
                               moe::v1::DType dtype, moe::v1::Tensor* out);

const char* DTypeName(moe::v1::DType dtype);
// The enum's name for messages; a value the enum does not define shows as its number.
std::string DTypeForMessage(moe::v1::DType dtype);

}  // namespace moe
