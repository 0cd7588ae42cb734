// Host activation rows in their real dtype: bf16 bits in bf16 mode, fp32 in fp32 mode.
//
// NOTES: docs/DESIGN.md's contract rounds every activation between ops to bf16, so in bf16 mode a
// hidden state is a bf16 value from the decoded request to the response: the gateway's service,
// batcher and engine hold them as bf16 (half the bytes of fp32, and no conversion where they only
// move). fp32 appears only in the fp32 exactness mode and inside backends and kernels.
#pragma once

#include <cstdint>
#include <vector>

#include "core/numerics.h"

namespace moe {

class ActivationRows {
 public:
  ActivationRows() = default;
  // Zeroed rows x cols in the dtype of `precision`.
  ActivationRows(Precision precision, int64_t rows, int64_t cols);
  // fp32 values in the dtype of `precision` (bf16: rounded to nearest even).
  static ActivationRows FromFloats(Precision precision, const float* values, int64_t rows,
                                   int64_t cols);

  Precision precision() const { return precision_; }
  int64_t rows() const { return rows_; }
  int64_t cols() const { return cols_; }
  bool empty() const { return rows_ == 0; }
  size_t element_bytes() const { return ElementBytes(precision_); }
  size_t row_bytes() const { return static_cast<size_t>(cols_) * element_bytes(); }
  size_t bytes() const { return static_cast<size_t>(rows_) * row_bytes(); }
  const void* data() const { return storage_.data(); }
  void* data() { return storage_.data(); }
  const uint16_t* bf16() const { return reinterpret_cast<const uint16_t*>(storage_.data()); }
  const float* fp32() const { return reinterpret_cast<const float*>(storage_.data()); }

  // Element i (row-major) as fp32 (exact).
  float Value(int64_t i) const {
    return precision_ == Precision::kBF16 ? Bf16BitsToFloat(bf16()[i]) : fp32()[i];
  }
  // All values as fp32 (exact): for checks and callers that need floats.
  std::vector<float> ToFloats() const;
  // Index of the first NaN or Inf, or -1.
  int64_t FirstNonFinite() const;
  // Copies n rows of `from` (same dtype and width) starting at its row `from_row` to row `row`.
  void CopyRows(int64_t row, const ActivationRows& from, int64_t from_row, int64_t n);
  // Zeroes rows [row, row + n).
  void ZeroRows(int64_t row, int64_t n);
  bool operator==(const ActivationRows& other) const;

 private:
  Precision precision_ = Precision::kBF16;
  int64_t rows_ = 0, cols_ = 0;
  std::vector<uint32_t> storage_;  // 4-byte units: fp32 rows stay aligned
};

}  // namespace moe
