// GEMM operands from fp32 activations: gather (optional), convert to bf16 bits (round to
// nearest even, as CpuBackend's PackActivationRow) or keep fp32, zero-pad to the operand
// width. And the way back for the NCCL transport (bf16 rows -> fp32 storage).
#include "kernels/cuda/device_common.cuh"

namespace moe::cuda {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float LoadValue(const float* x, int64_t i) { return x[i]; }
__device__ __forceinline__ float LoadValue(const uint16_t* x, int64_t i) {
  return Bf16ToFloat(x[i]);
}

// Src: fp32 activations or bf16 bits; T: the operand's bf16 bits or fp32. bf16 into bf16 is a
// copy (the widened value rounds back to itself).
template <typename Src, typename T>
__global__ void PackOperandKernel(const Src* x, int64_t x_stride, const int32_t* rows, int64_t m,
                                  int64_t cols, T* out, int64_t out_stride, int64_t out_cols) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= out_cols) return;
  for (int64_t i = blockIdx.y; i < m; i += gridDim.y) {
    const int64_t src = rows != nullptr ? rows[i] : i;
    const float v = c < cols ? LoadValue(x, src * x_stride + c) : 0.0f;
    if constexpr (sizeof(T) == 2) {
      out[i * out_stride + c] = FloatToBf16(v);
    } else {
      out[i * out_stride + c] = v;
    }
  }
}

template <typename Src>
cudaError_t PackOperand(const Src* x, int64_t x_stride, const int32_t* rows, int64_t m,
                        int64_t cols, void* out, int64_t out_stride, int64_t out_cols, bool bf16,
                        cudaStream_t s) {
  if (m == 0 || out_cols == 0) return cudaSuccess;
  if (out_cols < cols || out_stride < out_cols || !GridFits(m, out_cols, kThreads))
    return cudaErrorInvalidValue;
  const dim3 grid = ElementwiseGrid(m, out_cols, kThreads);
  if (bf16) {
    PackOperandKernel<Src, uint16_t><<<grid, kThreads, 0, s>>>(
        x, x_stride, rows, m, cols, static_cast<uint16_t*>(out), out_stride, out_cols);
  } else {
    PackOperandKernel<Src, float><<<grid, kThreads, 0, s>>>(
        x, x_stride, rows, m, cols, static_cast<float*>(out), out_stride, out_cols);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchPackOperand(const float* x, int64_t x_stride, const int32_t* rows, int64_t m,
                              int64_t cols, void* out, int64_t out_stride, int64_t out_cols,
                              bool bf16, cudaStream_t s) {
  return PackOperand(x, x_stride, rows, m, cols, out, out_stride, out_cols, bf16, s);
}

cudaError_t LaunchPackBf16Operand(const uint16_t* x, int64_t x_stride, const int32_t* rows,
                                  int64_t m, int64_t cols, void* out, int64_t out_stride,
                                  int64_t out_cols, bool bf16, cudaStream_t s) {
  return PackOperand(x, x_stride, rows, m, cols, out, out_stride, out_cols, bf16, s);
}

}  // namespace moe::cuda
