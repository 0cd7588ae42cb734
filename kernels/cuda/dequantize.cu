// Stored weights -> exact values for the cuBLAS path, and the FP8 block-scale reduction.
//
// NOTES: MXFP4 values (E2M1 x E8M0) and unscaled FP8 E4M3 values are exact in bf16, so the
// decoded scratch feeds a bf16 x bf16 -> fp32 GEMM without changing any product. FP8 block
// scales are fp32 and a scaled FP8 weight is NOT exact in bf16, so FP8 is decoded WITHOUT its
// scale and the scale is applied to the GEMM's per-K-block partials by Fp8BlockReduceKernel:
// y = sum_b scale_b * partial_b in fp32, the structure of the CPU contract
// (kernels/cpu/canonical.h).
#include "kernels/cuda/device_common.cuh"

namespace moe::cuda {
namespace {

constexpr int kThreads = 256;

template <StoredFormat F, typename T>
__global__ void DecodeWeightKernel(const uint8_t* data, const uint8_t* scales, int64_t n, int64_t k,
                                   T* out, int64_t out_stride, int64_t out_cols) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= out_cols) return;
  for (int64_t r = blockIdx.y; r < n; r += gridDim.y) {
    float v = 0.0f;
    uint16_t bits = 0;
    if (c < k) {
      if constexpr (F == StoredFormat::kMXFP4) {
        const uint32_t byte = data[r * (k / 2) + c / 2];
        const uint32_t code = (c & 1) ? (byte >> 4) : (byte & 0xfu);
        v = E2m1Value(code) * E8m0Value(scales[r * (k / 32) + c / 32]);
      } else if constexpr (F == StoredFormat::kFP8Block128) {
        v = Fp8Value(data[r * k + c]);
      } else {
        bits = reinterpret_cast<const uint16_t*>(data)[r * k + c];
        v = Bf16ToFloat(bits);
      }
    }
    if constexpr (sizeof(T) == 2) {
      out[r * out_stride + c] = F == StoredFormat::kBF16 ? bits : FloatToBf16(v);
    } else {
      out[r * out_stride + c] = v;
    }
  }
}

template <StoredFormat F>
cudaError_t Decode(const void* data, const void* scales, int64_t n, int64_t k, void* out,
                   int64_t out_stride, int64_t out_cols, bool bf16, cudaStream_t s) {
  const dim3 grid = ElementwiseGrid(n, out_cols, kThreads);
  const auto* d = static_cast<const uint8_t*>(data);
  const auto* sc = static_cast<const uint8_t*>(scales);
  if (bf16) {
    DecodeWeightKernel<F, uint16_t>
        <<<grid, kThreads, 0, s>>>(d, sc, n, k, static_cast<uint16_t*>(out), out_stride, out_cols);
  } else {
    DecodeWeightKernel<F, float>
        <<<grid, kThreads, 0, s>>>(d, sc, n, k, static_cast<float*>(out), out_stride, out_cols);
  }
  return cudaGetLastError();
}

__global__ void Fp8BlockReduceKernel(const float* partials, int64_t m, int64_t n, int64_t nb,
                                     const float* scales, float* y, int64_t y_stride, bool bf16) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= n) return;
  const float* s = scales + (j / 128) * nb;
  const int64_t plane = m * n;
  for (int64_t i = blockIdx.y; i < m; i += gridDim.y) {
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; ++b) acc = fmaf(partials[b * plane + i * n + j], s[b], acc);
    y[i * y_stride + j] = bf16 ? RoundBf16(acc) : acc;
  }
}

}  // namespace

cudaError_t LaunchDecodeWeight(StoredFormat format, const void* data, const void* scales, int64_t n,
                               int64_t k, void* out, int64_t out_stride, int64_t out_cols,
                               bool bf16, cudaStream_t s) {
  if (n == 0 || out_cols == 0) return cudaSuccess;
  if (out_cols < k || out_stride < out_cols || !GridFits(n, out_cols, kThreads))
    return cudaErrorInvalidValue;
  switch (format) {
    case StoredFormat::kMXFP4:
      if (k % 32 != 0 || scales == nullptr) return cudaErrorInvalidValue;
      return Decode<StoredFormat::kMXFP4>(data, scales, n, k, out, out_stride, out_cols, bf16, s);
    case StoredFormat::kFP8Block128:
      return Decode<StoredFormat::kFP8Block128>(data, scales, n, k, out, out_stride, out_cols, bf16,
                                                s);
    case StoredFormat::kBF16:
      return Decode<StoredFormat::kBF16>(data, scales, n, k, out, out_stride, out_cols, bf16, s);
  }
  return cudaErrorInvalidValue;
}

cudaError_t LaunchFp8BlockReduce(const float* partials, int64_t m, int64_t n, int64_t nb,
                                 const float* scales, float* y, int64_t y_stride, bool bf16,
                                 cudaStream_t s) {
  if (m == 0 || n == 0) return cudaSuccess;
  if (nb <= 0 || y_stride < n || !GridFits(m, n, kThreads)) return cudaErrorInvalidValue;
  Fp8BlockReduceKernel<<<ElementwiseGrid(m, n, kThreads), kThreads, 0, s>>>(
      partials, m, n, nb, scales, y, y_stride, bf16);
  return cudaGetLastError();
}

}  // namespace moe::cuda
