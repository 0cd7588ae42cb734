// Backend buffers that grow on demand and are reused across steps: no per-step allocation once
// the largest step has been seen. One buffer per slot (a caller's enum), typed by its accessor.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/backend.h"

namespace moe {

class Workspace {
 public:
  explicit Workspace(Backend* backend) : backend_(backend) {}
  // fp32 activations [rows, cols].
  absl::StatusOr<MatrixView> Matrix(int slot, int64_t rows, int64_t cols);
  // Activation rows [rows, cols] stored as `dtype` (bf16 bits or fp32).
  absl::StatusOr<MutableActivationView> Activations(int slot, Precision dtype, int64_t rows,
                                                    int64_t cols);
  // fp64 partial sums [rows, cols].
  absl::StatusOr<PartialView> Partial(int slot, int64_t rows, int64_t cols);
  // int32 expert ids, `count` of them.
  absl::StatusOr<int32_t*> Ids(int slot, int64_t count);

 private:
  absl::StatusOr<void*> Bytes(int slot, size_t bytes);
  Backend* backend_;
  std::vector<std::unique_ptr<DeviceBuffer>> buffers_;
};

}  // namespace moe
