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

std::string DTypeForMessage(moe::v1::DType dtype) {
  const std::string& name = moe::v1::DType_Name(dtype);
  return name.empty() ? absl::StrCat(static_cast<int>(dtype), " (not a DType value)") : name;
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

namespace {

// Checks dtype, shape and byte count; `shape` and `n` get the shape and element count.
absl::Status CheckTensor(const moe::v1::Tensor& tensor, const char* what,
                         std::vector<int64_t>* shape, int64_t* n) {
  const int elem = ElementSize(tensor.dtype());
  if (elem == 0)
    return absl::InvalidArgumentError(absl::StrCat(what, ": dtype ",
                                                   DTypeForMessage(tensor.dtype()),
                                                   " is not supported (BF16, FP16, FP32)"));
  *n = 1;
  for (int64_t d : tensor.shape()) {
    if (d < 0)
      return absl::InvalidArgumentError(absl::StrCat(what, ": negative dimension in shape"));
    if (d > 0 && *n > std::numeric_limits<int64_t>::max() / d / elem)
      return absl::InvalidArgumentError(absl::StrCat(what, ": shape too large"));
    *n *= d;
    shape->push_back(d);
  }
  if (tensor.data().size() != static_cast<size_t>(*n) * elem)
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": ", tensor.data().size(), " bytes of data, shape [", absl::StrJoin(*shape, ", "),
        "] of ", DTypeName(tensor.dtype()), " needs ", *n * elem));
  return absl::OkStatus();
}

float WireValue(const char* p, moe::v1::DType dtype, int64_t i) {
  if (dtype == moe::v1::FP32) {
    float v;
    std::memcpy(&v, p + 4 * i, 4);
    return v;
  }
  uint16_t b;
  std::memcpy(&b, p + 2 * i, 2);
  return dtype == moe::v1::BF16 ? Bf16BitsToFloat(b) : HalfBitsToFloat(b);
}

// Whether wire `dtype` holds values of `precision` as they are (no conversion).
bool IsWireDtypeOf(Precision precision, moe::v1::DType dtype) {
  return dtype == (precision == Precision::kBF16 ? moe::v1::BF16 : moe::v1::FP32);
}

}  // namespace

float TensorValue(const moe::v1::Tensor& tensor, int64_t i) {
  return WireValue(tensor.data().data(), tensor.dtype(), i);
}

absl::StatusOr<HostTensor> DecodeTensor(const moe::v1::Tensor& tensor, const char* what) {
  HostTensor out;
  int64_t n = 0;
  if (absl::Status s = CheckTensor(tensor, what, &out.shape, &n); !s.ok()) return s;
  out.values.resize(n);
  const char* p = tensor.data().data();
  if (tensor.dtype() == moe::v1::FP32) {
    if (n > 0) std::memcpy(out.values.data(), p, n * 4);  // empty vectors may have no storage
  } else {
    for (int64_t i = 0; i < n; ++i) out.values[i] = WireValue(p, tensor.dtype(), i);
  }
  return out;
}

absl::StatusOr<ActivationRows> DecodeActivations(const moe::v1::Tensor& tensor, Precision precision,
                                                 const char* what) {
  std::vector<int64_t> shape;
  int64_t n = 0;
  if (absl::Status s = CheckTensor(tensor, what, &shape, &n); !s.ok()) return s;
  const int64_t cols = shape.empty() ? 1 : shape.back();
  ActivationRows out(precision, cols == 0 ? 0 : n / cols, cols);
  const char* p = tensor.data().data();
  if (IsWireDtypeOf(precision, tensor.dtype())) {
    if (n > 0) std::memcpy(out.data(), p, out.bytes());  // the wire holds the real dtype
  } else if (precision == Precision::kBF16) {
    // FP32/FP16 sent to a bf16 layer: rounded to bf16 here, once, as the layer would.
    auto* bits = static_cast<uint16_t*>(out.data());
    for (int64_t i = 0; i < n; ++i) bits[i] = FloatToBf16Bits(WireValue(p, tensor.dtype(), i));
  } else {
    auto* values = static_cast<float*>(out.data());
    for (int64_t i = 0; i < n; ++i) values[i] = WireValue(p, tensor.dtype(), i);
  }
  return out;
}

absl::Status EncodeActivations(const ActivationRows& rows, const std::vector<int64_t>& shape,
                               moe::v1::DType dtype, moe::v1::Tensor* out) {
  if (!IsWireDtypeOf(rows.precision(), dtype)) {
    // Another dtype than the layer's: the values (exact in fp32) are rounded once to it.
    const std::vector<float> values = rows.ToFloats();
    return EncodeTensor(values.data(), shape, dtype, out);
  }
  out->Clear();
  out->set_dtype(dtype);
  for (int64_t d : shape) out->add_shape(d);
  out->mutable_data()->assign(static_cast<const char*>(rows.data()), rows.bytes());
  return absl::OkStatus();
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
