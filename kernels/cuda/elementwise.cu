// Round, Add, RoundPartials: elementwise with CpuBackend's exact operation sequence.
#include "kernels/cuda/device_common.cuh"

namespace moe::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void RoundBf16Kernel(float* y, int64_t rows, int64_t cols, int64_t stride) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    float* p = y + r * stride + c;
    *p = RoundBf16(*p);
  }
}

__global__ void AddKernel(const float* a, int64_t sa, const float* b, int64_t sb, float* y,
                          int64_t sy, int64_t rows, int64_t cols, bool bf16) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const float v = __fadd_rn(a[r * sa + c], b[r * sb + c]);
    y[r * sy + c] = bf16 ? RoundBf16(v) : v;
  }
}

__global__ void RoundPartialsKernel(const double* y, int64_t sy, float* out, int64_t so,
                                    int64_t rows, int64_t cols, bool bf16) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const double v = y[r * sy + c];
    out[r * so + c] = bf16 ? RoundDoubleToBf16(v) : static_cast<float>(v);
  }
}

}  // namespace

cudaError_t LaunchRoundBf16(float* y, int64_t rows, int64_t cols, int64_t stride, cudaStream_t s) {
  if (rows == 0 || cols == 0) return cudaSuccess;
  if (!GridFits(rows, cols, kThreads)) return cudaErrorInvalidValue;
  RoundBf16Kernel<<<ElementwiseGrid(rows, cols, kThreads), kThreads, 0, s>>>(y, rows, cols, stride);
  return cudaGetLastError();
}

cudaError_t LaunchAdd(const float* a, int64_t sa, const float* b, int64_t sb, float* y, int64_t sy,
                      int64_t rows, int64_t cols, bool bf16, cudaStream_t s) {
  if (rows == 0 || cols == 0) return cudaSuccess;
  if (!GridFits(rows, cols, kThreads)) return cudaErrorInvalidValue;
  AddKernel<<<ElementwiseGrid(rows, cols, kThreads), kThreads, 0, s>>>(a, sa, b, sb, y, sy, rows,
                                                                       cols, bf16);
  return cudaGetLastError();
}

cudaError_t LaunchRoundPartials(const double* y, int64_t sy, float* out, int64_t so, int64_t rows,
                                int64_t cols, bool bf16, cudaStream_t s) {
  if (rows == 0 || cols == 0) return cudaSuccess;
  if (!GridFits(rows, cols, kThreads)) return cudaErrorInvalidValue;
  RoundPartialsKernel<<<ElementwiseGrid(rows, cols, kThreads), kThreads, 0, s>>>(y, sy, out, so,
                                                                                 rows, cols, bf16);
  return cudaGetLastError();
}

}  // namespace moe::cuda
