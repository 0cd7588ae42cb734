// CUDA and cuBLAS errors as absl::Status, translated where they happen (NCCL style: every
// call checked, one line of context per hop, never abort).
//
//   CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(...));      // INTERNAL / RESOURCE_EXHAUSTED / ...
//   CUBLAS_RETURN_IF_ERROR(cublasGemmEx(...));
//
// Host-only header (includes the CUDA runtime and cuBLAS headers); never part of a public
// interface.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "absl/status/status.h"

namespace moe::cuda {

// "cudaMemcpyAsync(...) failed at file.cc:12: cudaErrorInvalidValue (invalid argument)".
// cudaErrorMemoryAllocation maps to RESOURCE_EXHAUSTED, no device / no driver to
// UNAVAILABLE, everything else to INTERNAL.
absl::Status CudaStatus(cudaError_t err, const char* expr, const char* file, int line);
absl::Status CublasStatus(cublasStatus_t err, const char* expr, const char* file, int line);
const char* CublasStatusName(cublasStatus_t err);

// Makes `device` the calling thread's current device for the scope and restores the previous
// one on exit (ops may be called from threads that work on other devices).
class ScopedDevice {
 public:
  explicit ScopedDevice(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    if (previous_ != device) status_ = cudaSetDevice(device);
  }
  ~ScopedDevice() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;
  cudaError_t status() const { return status_; }

 private:
  int previous_ = -1;
  cudaError_t status_ = cudaSuccess;
};

}  // namespace moe::cuda

#define CUDA_RETURN_IF_ERROR(expr)                                              \
  do {                                                                          \
    const cudaError_t moe_cuda_err_ = (expr);                                   \
    if (moe_cuda_err_ != cudaSuccess)                                           \
      return ::moe::cuda::CudaStatus(moe_cuda_err_, #expr, __FILE__, __LINE__); \
  } while (0)

#define CUBLAS_RETURN_IF_ERROR(expr)                                                \
  do {                                                                              \
    const cublasStatus_t moe_cublas_err_ = (expr);                                  \
    if (moe_cublas_err_ != CUBLAS_STATUS_SUCCESS)                                   \
      return ::moe::cuda::CublasStatus(moe_cublas_err_, #expr, __FILE__, __LINE__); \
  } while (0)
