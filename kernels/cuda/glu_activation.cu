// GLU activation (SiTU / SiLU) with the contract's roundings, as CpuBackend::GluActivation
// and the hidden layer of CpuBackend::ExpertMlp: a = round(act(round(g), round(u))).
//
// NOTES: the fp32 operation sequence is core/numerics.h GluActivate itself, compiled for the
// device without contraction; its exp and tanh (ExpF, TanhF) are fixed sequences of IEEE fp32
// operations (fmaf, nearbyintf, correctly rounded division), not libm / libdevice calls, so
// the result is bitwise the CPU backend's.
#include "kernels/cuda/device_common.cuh"

namespace moe::cuda {
namespace {

constexpr int kThreads = 256;

template <typename T>
__global__ void GluKernel(const float* g, int64_t sg, const float* u, int64_t su, int64_t rows,
                          int64_t cols, ActivationParams act, bool bf16, bool round_inputs, T* out,
                          int64_t out_stride, int64_t out_cols) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= out_cols) return;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    float a = 0.0f;
    if (c < cols) {
      float gv = g[r * sg + c], uv = u[r * su + c];
      if (bf16 && round_inputs) {
        gv = RoundBf16(gv);
        uv = RoundBf16(uv);
      }
      a = GluActivate(act, gv, uv);
      if (bf16) a = RoundBf16(a);
    }
    if constexpr (sizeof(T) == 2) {
      out[r * out_stride + c] = FloatToBf16(a);
    } else {
      out[r * out_stride + c] = a;
    }
  }
}

}  // namespace

cudaError_t LaunchGluActivation(const float* g, int64_t sg, const float* u, int64_t su,
                                int64_t rows, int64_t cols, ActivationParams act, bool bf16,
                                bool round_inputs, void* out, int64_t out_stride, int64_t out_cols,
                                bool out_bf16, cudaStream_t s) {
  if (rows == 0 || out_cols == 0) return cudaSuccess;
  if (out_cols < cols || out_stride < out_cols || !GridFits(rows, out_cols, kThreads))
    return cudaErrorInvalidValue;
  const dim3 grid = ElementwiseGrid(rows, out_cols, kThreads);
  if (out_bf16) {
    GluKernel<uint16_t><<<grid, kThreads, 0, s>>>(g, sg, u, su, rows, cols, act, bf16, round_inputs,
                                                  static_cast<uint16_t*>(out), out_stride,
                                                  out_cols);
  } else {
    GluKernel<float><<<grid, kThreads, 0, s>>>(g, sg, u, su, rows, cols, act, bf16, round_inputs,
                                               static_cast<float*>(out), out_stride, out_cols);
  }
  return cudaGetLastError();
}

}  // namespace moe::cuda
