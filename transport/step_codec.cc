#include "transport/step_codec.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "core/numerics.h"
#include "core/status.h"

namespace moe {

// Rows leave a backend (fp32 views) in the step's dtype: in bf16 mode their values are bf16
// already (the expert input is rounded), so narrowing them is exact and halves the bytes. The
// receiving side widens them back into its backend's view (DecodeRows): fp32 lives only inside
// backends.
void EncodeRows(ConstMatrixView rows, Precision p, std::string* out) {
  const size_t elem = p == Precision::kBF16 ? 2 : 4;
  out->resize(rows.rows * rows.cols * elem);
  char* dst = out->data();
  for (int64_t r = 0; r < rows.rows; ++r) {
    const float* src = rows.Row(r);
    if (p == Precision::kBF16) {
      for (int64_t c = 0; c < rows.cols; ++c) {
        const uint16_t b = FloatToBf16Bits(src[c]);
        std::memcpy(dst + 2 * (r * rows.cols + c), &b, 2);
      }
    } else {
      std::memcpy(dst + 4 * r * rows.cols, src, rows.cols * 4);
    }
  }
}

namespace {
absl::Status CheckRowBytes(const std::string& bytes, int64_t num_rows, int64_t width, Precision p) {
  const size_t elem = p == Precision::kBF16 ? 2 : 4;
  if (bytes.size() != static_cast<size_t>(num_rows * width) * elem)
    return absl::InvalidArgumentError(
        absl::StrCat("step rows: ", bytes.size(), " bytes for [", num_rows, ", ", width, "]"));
  return absl::OkStatus();
}
}  // namespace

absl::Status DecodeRows(const std::string& bytes, int64_t num_rows, int64_t width, Precision p,
                        MatrixView out) {
  RETURN_IF_ERROR(CheckRowBytes(bytes, num_rows, width, p));
  for (int64_t r = 0; r < num_rows; ++r) {
    float* dst = out.Row(r);
    if (p == Precision::kBF16) {
      for (int64_t c = 0; c < width; ++c) {
        uint16_t b;
        std::memcpy(&b, bytes.data() + 2 * (r * width + c), 2);
        dst[c] = Bf16BitsToFloat(b);
      }
    } else {
      std::memcpy(dst, bytes.data() + 4 * r * width, width * 4);
    }
  }
  return absl::OkStatus();
}

absl::Status DecodeStepRequest(const moe::v1::internal::StepRequest& step,
                               std::vector<float>* host_rows, ReceivedStep* out) {
  out->step_id = step.step_id();
  out->layer = step.layer();
  out->placement_generation = step.placement_generation();
  ASSIGN_OR_RETURN(out->precision, PrecisionFromWire(step.precision()));
  const int64_t rows = step.num_rows(), width = step.width();
  if (rows < 0 || width <= 0) return absl::InvalidArgumentError("bad step shape");
  // Before the buffer is sized: the shape (two int32s) could ask for 2^62 floats.
  RETURN_IF_ERROR(CheckRowBytes(step.rows(), rows, width, out->precision));
  host_rows->resize(rows * width);
  MatrixView host(host_rows->data(), rows, width, width);
  RETURN_IF_ERROR(DecodeRows(step.rows(), rows, width, out->precision, host));
  out->rows = host;
  out->assignments.offsets.assign(step.row_offsets().begin(), step.row_offsets().end());
  out->assignments.local_experts.assign(step.local_experts().begin(), step.local_experts().end());
  out->assignments.gates.assign(step.gates().begin(), step.gates().end());
  return absl::OkStatus();
}

}  // namespace moe
