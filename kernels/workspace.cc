#include "kernels/workspace.h"

#include <algorithm>

#include "core/status.h"

namespace moe {

absl::StatusOr<void*> Workspace::Bytes(int slot, size_t bytes) {
  if (static_cast<size_t>(slot) >= buffers_.size()) buffers_.resize(slot + 1);
  auto& buffer = buffers_[slot];
  if (buffer == nullptr || buffer->size() < bytes) {
    // Grow by 1.5x so a slowly rising batch size does not reallocate every step.
    const size_t grown = buffer ? std::max(bytes, buffer->size() + buffer->size() / 2) : bytes;
    ASSIGN_OR_RETURN(buffer, backend_->Allocate(std::max<size_t>(grown, 64)));
  }
  return buffer->data();
}

absl::StatusOr<MatrixView> Workspace::Matrix(int slot, int64_t rows, int64_t cols) {
  ASSIGN_OR_RETURN(void* data, Bytes(slot, static_cast<size_t>(rows * cols) * sizeof(float)));
  return MatrixView(static_cast<float*>(data), rows, cols, cols);
}

absl::StatusOr<MutableActivationView> Workspace::Activations(int slot, Precision dtype,
                                                             int64_t rows, int64_t cols) {
  ASSIGN_OR_RETURN(void* data, Bytes(slot, static_cast<size_t>(rows * cols) * ElementBytes(dtype)));
  return MutableActivationView(data, dtype, rows, cols, cols);
}

absl::StatusOr<PartialView> Workspace::Partial(int slot, int64_t rows, int64_t cols) {
  ASSIGN_OR_RETURN(void* data, Bytes(slot, static_cast<size_t>(rows * cols) * sizeof(double)));
  return PartialView(static_cast<double*>(data), rows, cols, cols);
}

absl::StatusOr<int32_t*> Workspace::Ids(int slot, int64_t count) {
  ASSIGN_OR_RETURN(void* data, Bytes(slot, static_cast<size_t>(count) * sizeof(int32_t)));
  return static_cast<int32_t*>(data);
}

}  // namespace moe
