// Helpers of the CUDA tests: skip without a device, device copies of host arrays, error
// measures.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/cuda_backend.h"

// Every GPU test starts with this: a clear skip (not a failure) on machines without a device.
#define MOE_SKIP_WITHOUT_CUDA()                                             \
  do {                                                                      \
    const std::string moe_reason_ = ::moe::CudaUnavailableReason();         \
    if (!moe_reason_.empty()) GTEST_SKIP() << moe_reason_ << " (GPU test)"; \
  } while (0)

namespace moe::testing {

// A host array mirrored in a backend's memory.
template <typename T>
class DeviceArray {
 public:
  DeviceArray(Backend* backend, const std::vector<T>& host)
      : backend_(backend), size_(host.size()) {
    auto buffer = backend->Allocate(std::max<size_t>(1, host.size()) * sizeof(T));
    EXPECT_TRUE(buffer.ok()) << buffer.status();
    if (!buffer.ok()) return;
    buffer_ = std::move(*buffer);
    const absl::Status s = backend->CopyToBackend(buffer_->data(), host.data(), size_ * sizeof(T));
    EXPECT_TRUE(s.ok()) << s;
  }
  T* data() { return buffer_ ? static_cast<T*>(buffer_->data()) : nullptr; }
  std::vector<T> ToHost() {
    std::vector<T> out(size_);
    const absl::Status s = backend_->CopyToHost(out.data(), data(), size_ * sizeof(T));
    EXPECT_TRUE(s.ok()) << s;
    return out;
  }
  View2D<T> View(int64_t rows, int64_t cols, int64_t stride) {
    return View2D<T>(data(), rows, cols, stride);
  }

 private:
  Backend* backend_;
  size_t size_;
  std::unique_ptr<DeviceBuffer> buffer_;
};

inline std::vector<float> Poison(size_t n) {
  return std::vector<float>(n, std::numeric_limits<float>::quiet_NaN());
}

inline bool SameBits(float a, float b) {
  uint32_t ua, ub;
  std::memcpy(&ua, &a, 4);
  std::memcpy(&ub, &b, 4);
  return ua == ub;
}

inline bool SameBits(double a, double b) {
  uint64_t ua, ub;
  std::memcpy(&ua, &a, 8);
  std::memcpy(&ub, &b, 8);
  return ua == ub;
}

// One bf16 ulp at the magnitude of v.
inline double Bf16Ulp(double v) {
  if (v == 0) return std::ldexp(1.0, -133);
  return std::ldexp(1.0, std::ilogb(v) - 7);
}

// ||a - b|| / ||b|| over all elements (NaN in a makes it NaN, which fails any bound).
template <typename A, typename B>
double RelL2(const std::vector<A>& a, const std::vector<B>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = static_cast<double>(a[i]) - static_cast<double>(b[i]);
    num += d * d;
    den += static_cast<double>(b[i]) * static_cast<double>(b[i]);
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

}  // namespace moe::testing
