#include "proto/tensor_codec.h"

#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/numerics.h"

namespace moe {

int64_t HostTensor::num_elements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

const char* DTypeName(moe::v1::DType dtype) {
  switch (dtype) {
    case moe::v1::BF16:
      return "BF16";
    case moe::v1::FP16:
      return "FP16";
    case moe::v1::FP32:
      return "FP32";
    default:
      return "DTYPE_UNSPECIFIED";
  }
}

namespace {
int ElementSize(moe::v1::DType dtype) {
  switch (dtype) {
    case moe::v1::BF16:
    case moe::v1::FP16:
      return 2;
    case moe::v1::FP32:
      return 4;
    default:
      return 0;
  }
}
}  // namespace

absl::StatusOr<HostTensor> DecodeTensor(const moe::v1::Tensor& tensor, const char* what) {
  const int elem = ElementSize(tensor.dtype());
  if (elem == 0)
    return absl::InvalidArgumentError(absl::StrCat(what, ": dtype ",
                                                   moe::v1::DType_Name(tensor.dtype()),
                                                   " is not supported (BF16, FP16, FP32)"));
  HostTensor out;
  int64_t n = 1;
  for (int64_t d : tensor.shape()) {
    if (d < 0)
      return absl::InvalidArgumentError(absl::StrCat(what, ": negative dimension in shape"));
    if (d > 0 && n > std::numeric_limits<int64_t>::max() / d / elem)
      return absl::InvalidArgumentError(absl::StrCat(what, ": shape too large"));
    n *= d;
    out.shape.push_back(d);
  }
  if (tensor.data().size() != static_cast<size_t>(n) * elem)
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": ", tensor.data().size(), " bytes of data, shape [", absl::StrJoin(out.shape, ", "),
        "] of ", DTypeName(tensor.dtype()), " needs ", n * elem));
  out.values.resize(n);
  const char* p = tensor.data().data();
  switch (tensor.dtype()) {
    case moe::v1::FP32:
      if (n > 0) std::memcpy(out.values.data(), p, n * 4);  // empty vectors may have no storage
      break;
    case moe::v1::BF16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t b;
        std::memcpy(&b, p + 2 * i, 2);
        out.values[i] = Bf16BitsToFloat(b);
      }
      break;
    case moe::v1::FP16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, p + 2 * i, 2);
        out.values[i] = HalfBitsToFloat(h);
      }
      break;
    default:
      break;
  }
  return out;
}

absl::Status EncodeTensor(const float* values, const std::vector<int64_t>& shape,
                          moe::v1::DType dtype, moe::v1::Tensor* out) {
  const int elem = ElementSize(dtype);
  if (elem == 0)
    return absl::InvalidArgumentError(absl::StrCat("cannot encode dtype ", DTypeName(dtype)));
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  out->Clear();
  out->set_dtype(dtype);
  for (int64_t d : shape) out->add_shape(d);
  std::string* data = out->mutable_data();
  data->resize(n * elem);
  char* p = data->data();
  switch (dtype) {
    case moe::v1::FP32:
      if (n > 0) std::memcpy(p, values, n * 4);  // an empty tensor may come with no values
      break;
    case moe::v1::BF16:
      for (int64_t i = 0; i < n; ++i) {
        const uint16_t b = FloatToBf16Bits(values[i]);
        std::memcpy(p + 2 * i, &b, 2);
      }
      break;
    case moe::v1::FP16:
      for (int64_t i = 0; i < n; ++i) {
        const uint16_t h = FloatToHalfBits(values[i]);
        std::memcpy(p + 2 * i, &h, 2);
      }
      break;
    default:
      break;
  }
  return absl::OkStatus();
}

}  // namespace moe
