// GatherRows (the dispatch gather) and ScatterAddRows (the fp64 combine of rank partials).
#include "kernels/cuda/device_common.cuh"

namespace moe::cuda {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ void Store(float* out, float v) { *out = v; }
__device__ __forceinline__ void Store(uint16_t* out, float v) { *out = FloatToBf16Bits(v); }

template <typename Out>  // float: a copy; uint16_t: bf16 bits, rounded to nearest even
__global__ void GatherRowsKernel(const float* x, int64_t sx, const int32_t* rows, int64_t n,
                                 int64_t cols, Out* out, int64_t so) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  for (int64_t i = blockIdx.y; i < n; i += gridDim.y) Store(out + i * so + c, x[rows[i] * sx + c]);
}

// Unique destination rows: one thread per (row, column), no two threads share an element.
__global__ void ScatterAddUniqueKernel(const double* partial, int64_t sp, const int32_t* rows,
                                       int64_t n, int64_t cols, double* y, int64_t sy) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  for (int64_t i = blockIdx.y; i < n; i += gridDim.y) {
    double* dst = y + static_cast<int64_t>(rows[i]) * sy + c;
    *dst = __dadd_rn(*dst, partial[i * sp + c]);
  }
}

// Repeated destination rows: each column is owned by one thread that adds the partial rows
// in list order, as the CPU loop does (deterministic, no atomics).
__global__ void ScatterAddOrderedKernel(const double* partial, int64_t sp, const int32_t* rows,
                                        int64_t n, int64_t cols, double* y, int64_t sy) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  for (int64_t i = 0; i < n; ++i) {
    double* dst = y + static_cast<int64_t>(rows[i]) * sy + c;
    *dst = __dadd_rn(*dst, partial[i * sp + c]);
  }
}

}  // namespace

cudaError_t LaunchGatherRows(const float* x, int64_t sx, const int32_t* rows, int64_t n,
                             int64_t cols, void* out, int64_t so, bool out_bf16, cudaStream_t s) {
  if (n == 0 || cols == 0) return cudaSuccess;
  if (!GridFits(n, cols, kThreads)) return cudaErrorInvalidValue;
  const dim3 grid = ElementwiseGrid(n, cols, kThreads);
  if (out_bf16) {
    GatherRowsKernel<<<grid, kThreads, 0, s>>>(x, sx, rows, n, cols, static_cast<uint16_t*>(out),
                                               so);
  } else {
    GatherRowsKernel<<<grid, kThreads, 0, s>>>(x, sx, rows, n, cols, static_cast<float*>(out), so);
  }
  return cudaGetLastError();
}

cudaError_t LaunchScatterAddRows(const double* partial, int64_t sp, const int32_t* rows, int64_t n,
                                 int64_t cols, double* y, int64_t sy, bool unique_rows,
                                 cudaStream_t s) {
  if (n == 0 || cols == 0) return cudaSuccess;
  if (!GridFits(n, cols, kThreads)) return cudaErrorInvalidValue;
  if (unique_rows) {
    ScatterAddUniqueKernel<<<ElementwiseGrid(n, cols, kThreads), kThreads, 0, s>>>(
        partial, sp, rows, n, cols, y, sy);
  } else {
    const unsigned blocks = static_cast<unsigned>((cols + kThreads - 1) / kThreads);
    ScatterAddOrderedKernel<<<blocks, kThreads, 0, s>>>(partial, sp, rows, n, cols, y, sy);
  }
  return cudaGetLastError();
}

}  // namespace moe::cuda
