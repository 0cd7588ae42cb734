// CUDA memory that grows on demand: device scratch of the CUDA backend and the NCCL transport's
// device and pinned host buffers. Host-only header (includes the CUDA runtime).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <utility>

#include "absl/status/status.h"
#include "kernels/cuda/cuda_status.h"

namespace moe::cuda {

enum class MemoryKind { kDevice, kPinnedHost };

template <MemoryKind kKind>
class GrowableMemory {
 public:
  GrowableMemory() = default;
  GrowableMemory(const GrowableMemory&) = delete;
  GrowableMemory& operator=(const GrowableMemory&) = delete;
  // Movable (containers of buffers), never copied: a copy would free the memory twice.
  GrowableMemory(GrowableMemory&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}
  GrowableMemory& operator=(GrowableMemory&& other) noexcept {
    if (this != &other) {
      Free();
      data_ = std::exchange(other.data_, nullptr);
      size_ = std::exchange(other.size_, 0);
    }
    return *this;
  }
  ~GrowableMemory() { Free(); }

  bool Fits(size_t bytes) const { return data_ != nullptr && bytes <= size_; }

  // Makes room for `bytes`, losing the contents when it grows: by at least 1.5x, so that a
  // slowly rising batch does not reallocate every step. The caller makes sure that no queued
  // work still uses the old memory.
  absl::Status Ensure(size_t bytes) {
    if (Fits(bytes)) return absl::OkStatus();
    const size_t grown = std::max(AlignUp(std::max<size_t>(bytes, 1)), size_ + size_ / 2);
    CUDA_RETURN_IF_ERROR(Free());
    void* data = nullptr;
    if constexpr (kKind == MemoryKind::kDevice) {
      CUDA_RETURN_IF_ERROR(cudaMalloc(&data, grown));
    } else {
      CUDA_RETURN_IF_ERROR(cudaHostAlloc(&data, grown, cudaHostAllocDefault));
    }
    data_ = data;
    size_ = grown;
    return absl::OkStatus();
  }

  uint8_t* get() const { return static_cast<uint8_t*>(data_); }

 private:
  // Sizes in 256-byte steps, the alignment cudaMalloc gives.
  static size_t AlignUp(size_t v) { return (v + 255) / 256 * 256; }

  cudaError_t Free() {
    void* data = data_;
    data_ = nullptr;
    size_ = 0;
    if (data == nullptr) return cudaSuccess;
    return kKind == MemoryKind::kDevice ? cudaFree(data) : cudaFreeHost(data);
  }

  void* data_ = nullptr;
  size_t size_ = 0;
};

using DeviceMemory = GrowableMemory<MemoryKind::kDevice>;
using PinnedMemory = GrowableMemory<MemoryKind::kPinnedHost>;

}  // namespace moe::cuda
