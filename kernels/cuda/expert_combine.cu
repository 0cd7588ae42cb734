// The routed experts' combine: y[r] = sum over the row's assignments, in ascending expert
// order, of double(round(o)) * double(gate), in fp64 (CpuBackend::ExpertMlp phase 2).
//
// NOTES: each term is an exact fp64 product (24-bit x 24-bit significands), and the terms
// are added in the CPU's order starting from 0, so y is bitwise the CPU's whenever the o
// values are. The per-row slot lists (CSR, built on the host) replace atomics: one thread
// owns one (row, column) element.
#include "kernels/cuda/device_common.cuh"

namespace moe::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void ExpertCombineKernel(const float* o, int64_t so, const float* gates,
                                    const int32_t* row_offsets, const int32_t* slots, int64_t m,
                                    int64_t cols, bool bf16, double* y, int64_t sy) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  for (int64_t r = blockIdx.y; r < m; r += gridDim.y) {
    double acc = 0.0;
    for (int32_t j = row_offsets[r]; j < row_offsets[r + 1]; ++j) {
      const int64_t slot = slots[j];
      const float v = o[slot * so + c];
      acc = __dadd_rn(acc, __dmul_rn(static_cast<double>(bf16 ? RoundBf16(v) : v),
                                     static_cast<double>(gates[slot])));
    }
    y[r * sy + c] = acc;
  }
}

}  // namespace

cudaError_t LaunchExpertCombine(const float* o, int64_t so, const float* gates,
                                const int32_t* row_offsets, const int32_t* slots, int64_t m,
                                int64_t cols, bool bf16, double* y, int64_t sy, cudaStream_t s) {
  if (m == 0 || cols == 0) return cudaSuccess;
  if (!GridFits(m, cols, kThreads)) return cudaErrorInvalidValue;
  ExpertCombineKernel<<<ElementwiseGrid(m, cols, kThreads), kThreads, 0, s>>>(
      o, so, gates, row_offsets, slots, m, cols, bf16, y, sy);
  return cudaGetLastError();
}

}  // namespace moe::cuda
