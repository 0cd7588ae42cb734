// moe.v1.Tensor <-> fp32 host arrays. Shared by the client and the gateway so both sides
// read and write the wire format the same way.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
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
absl::Status EncodeTensor(const float* values, const std::vector<int64_t>& shape, moe::v1::DType dtype,
                          moe::v1::Tensor* out);

const char* DTypeName(moe::v1::DType dtype);

}  // namespace moe
