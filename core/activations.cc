#include "core/activations.h"

#include <cstring>

namespace moe {

ActivationRows::ActivationRows(Precision precision, int64_t rows, int64_t cols)
    : precision_(precision), rows_(rows), cols_(cols) {
  storage_.assign((bytes() + 3) / 4, 0);
}

ActivationRows ActivationRows::FromFloats(Precision precision, const float* values, int64_t rows,
                                          int64_t cols) {
  ActivationRows out(precision, rows, cols);
  const int64_t n = rows * cols;
  if (n == 0) return out;  // no storage: memcpy's pointers may not be null
  if (precision == Precision::kFP32) {
    std::memcpy(out.data(), values, out.bytes());
  } else {
    FloatsToBf16Bits(values, n, static_cast<uint16_t*>(out.data()));
  }
  return out;
}

std::vector<float> ActivationRows::ToFloats() const {
  std::vector<float> out(static_cast<size_t>(rows_ * cols_));
  for (int64_t i = 0; i < rows_ * cols_; ++i) out[i] = Value(i);
  return out;
}

int64_t ActivationRows::FirstNonFinite() const {
  const int64_t n = rows_ * cols_;
  if (precision_ == Precision::kBF16) {
    // bf16 NaN and Inf: the exponent field all ones.
    for (int64_t i = 0; i < n; ++i)
      if ((bf16()[i] & 0x7F80) == 0x7F80) return i;
    return -1;
  }
  return moe::FirstNonFinite(fp32(), n);
}

void ActivationRows::CopyRows(int64_t row, const ActivationRows& from, int64_t from_row,
                              int64_t n) {
  if (n == 0) return;
  std::memcpy(static_cast<uint8_t*>(data()) + row * row_bytes(),
              static_cast<const uint8_t*>(from.data()) + from_row * from.row_bytes(),
              static_cast<size_t>(n) * row_bytes());
}

void ActivationRows::ZeroRows(int64_t row, int64_t n) {
  if (n == 0) return;
  std::memset(static_cast<uint8_t*>(data()) + row * row_bytes(), 0,
              static_cast<size_t>(n) * row_bytes());
}

bool ActivationRows::operator==(const ActivationRows& other) const {
  return precision_ == other.precision_ && rows_ == other.rows_ && cols_ == other.cols_ &&
         (bytes() == 0 || std::memcmp(data(), other.data(), bytes()) == 0);
}

}  // namespace moe
