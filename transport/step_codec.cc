#include "transport/step_codec.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "core/numerics.h"
#include "core/status.h"

namespace moe {

// Rows leave a backend (fp32 views) in the step's dtype: in bf16 mode their values are bf16
// already (the expert input is rounded), so narrowing them is exact and halves the bytes. This
// is the expert leg's one conversion: the gateway's backend holds activations in fp32 storage,
// and the rank keeps the wire's bf16 rows as they are (DecodeStepRequest) into its GEMMs.
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

absl::Status DecodeStepRequest(const moe::v1::internal::StepRequest& step,
                               ActivationRows* host_rows, ReceivedStep* out) {
  out->step_id = step.step_id();
  out->layer = step.layer();
  out->placement_generation = step.placement_generation();
  ASSIGN_OR_RETURN(out->precision, PrecisionFromWire(step.precision()));
  const int64_t rows = step.num_rows(), width = step.width();
  if (rows < 0 || width <= 0) return absl::InvalidArgumentError("bad step shape");
  // Before the buffer is sized: the shape (two int32s) could ask for 2^62 elements.
  const size_t elem = out->precision == Precision::kBF16 ? 2 : 4;
  if (step.rows().size() != static_cast<size_t>(rows * width) * elem)
    return absl::InvalidArgumentError(
        absl::StrCat("step rows: ", step.rows().size(), " bytes for [", rows, ", ", width, "]"));
  if (host_rows->precision() != out->precision || host_rows->rows() != rows ||
      host_rows->cols() != width)
    *host_rows = ActivationRows(out->precision, rows, width);
  if (!step.rows().empty())  // little-endian, as the wire
    std::memcpy(host_rows->data(), step.rows().data(), step.rows().size());
  out->rows = ActivationView(*host_rows);
  out->assignments.offsets.assign(step.row_offsets().begin(), step.row_offsets().end());
  out->assignments.local_experts.assign(step.local_experts().begin(), step.local_experts().end());
  out->assignments.gates.assign(step.gates().begin(), step.gates().end());
  return absl::OkStatus();
}

}  // namespace moe
