// RMSNorm as CpuBackend::RmsNorm: sum of squares in fp64, mean rounded once to fp32,
// inv = fp32(1 / sqrt(fp64(mean + eps))) (IEEE double sqrt and division on the device too),
// y = round(round(x * inv) * weight).
//
// NOTES: in bf16 mode every square has <= 16 significant bits, so the fp64 sum is exact for
// any order and the result is bitwise the CPU's. In fp32 mode the block's summation order
// differs from the CPU's sequential one at the 2^-53 level, which changes the fp32 mean
// only when it sits on a rounding boundary.
#include "kernels/cuda/device_common.cuh"

namespace moe::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void RmsNormKernel(const float* x, int64_t sx, const uint16_t* weight, float eps,
                              float* y, int64_t sy, int64_t rows, int64_t cols, bool bf16) {
  __shared__ double warp_sums[kThreads / 32];
  __shared__ float inv_shared;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float* xr = x + r * sx;
    double ss = 0.0;
    for (int64_t c = threadIdx.x; c < cols; c += kThreads) {
      const double v = static_cast<double>(xr[c]);
      ss = __dadd_rn(ss, __dmul_rn(v, v));
    }
    ss = WarpSum(ss);
    if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x / 32] = ss;
    __syncthreads();
    if (threadIdx.x == 0) {
      double total = 0.0;
      for (int w = 0; w < kThreads / 32; ++w) total += warp_sums[w];
      const float mean = static_cast<float>(total / static_cast<double>(cols));
      inv_shared = static_cast<float>(1.0 / sqrt(static_cast<double>(__fadd_rn(mean, eps))));
    }
    __syncthreads();
    const float inv = inv_shared;
    float* yr = y + r * sy;
    for (int64_t c = threadIdx.x; c < cols; c += kThreads) {
      float v = __fmul_rn(xr[c], inv);
      if (bf16) v = RoundBf16(v);
      v = __fmul_rn(v, Bf16ToFloat(weight[c]));
      yr[c] = bf16 ? RoundBf16(v) : v;
    }
    __syncthreads();  // warp_sums / inv_shared are reused by the next row
  }
}

}  // namespace

cudaError_t LaunchRmsNorm(const float* x, int64_t sx, const uint16_t* weight, float eps, float* y,
                          int64_t sy, int64_t rows, int64_t cols, bool bf16, cudaStream_t s) {
  if (rows == 0 || cols == 0) return cudaSuccess;
  const int64_t blocks = rows < (int64_t{1} << 20) ? rows : (int64_t{1} << 20);
  RmsNormKernel<<<static_cast<unsigned>(blocks), kThreads, 0, s>>>(x, sx, weight, eps, y, sy, rows,
                                                                   cols, bf16);
  return cudaGetLastError();
}

}  // namespace moe::cuda
