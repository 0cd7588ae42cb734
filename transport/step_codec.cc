#include "transport/step_codec.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "core/numerics.h"
#include "core/status.h"

namespace moe {

// A bf16 step's rows are bf16 from the gateway's gather (Backend::GatherRows) through the
// wire into the rank's GEMMs (DecodeStepRequest keeps the wire's dtype): encoding is a copy.
void EncodeRows(ActivationView rows, std::string* out) {
  const size_t row_bytes = static_cast<size_t>(rows.cols) * rows.element_bytes();
  out->resize(rows.rows * row_bytes);
  const char* src = static_cast<const char*>(rows.data);
  for (int64_t r = 0; r < rows.rows; ++r)
    std::memcpy(out->data() + r * row_bytes, src + r * rows.stride * rows.element_bytes(),
                row_bytes);
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
  if (step.rows().size() != static_cast<size_t>(rows * width) * ElementBytes(out->precision))
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
