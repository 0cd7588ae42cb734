// Grouped GEMV for small batches: y = x W^T reading W in its stored format (MXFP4, FP8
// block-128, bf16), for one or many matrices of the same shape in one launch (the routed
// experts a step touches: gate and up of every expert in one launch, down in another).
//
// NOTES: at decode batch sizes a MoE layer is bound by reading expert weights; decoding to a
// bf16 scratch for cuBLAS reads 4-bit weights once and writes and reads 16 bits per weight
// again (~8x the bytes). Here each weight is read once, 16 bytes per lane per load, decoded
// to its exact fp32 value in registers and multiplied in fp32:
//  * every product w * x is exact (w has <= 4 significant bits for MXFP4/FP8, 8 for bf16;
//    bf16 x has 8) and accumulates in fp32 (fmaf): the contract's arithmetic, in another
//    summation order than the CPU's canonical one;
//  * MXFP4: each 32-element scale block's partial is scaled once (an exact power of two);
//    FP8: each lane's 16-element piece of a 128-block is accumulated unscaled, then
//    acc = fmaf(piece, scale_inv, acc), i.e. sum_b scale_b * partial_b with the block partial
//    split into pieces (same structure as canonical.h, different rounding order).
// A warp computes kRows output features for kM operand rows at a time, so each operand load
// (L1-resident) serves kRows weight rows. Operand rows beyond the task's m are skipped.
#include "kernels/cuda/device_common.cuh"

namespace moe::cuda {
namespace {

constexpr int kWarps = 4;  // per block
constexpr int kRows = 2;   // output features per warp
constexpr int kThreads = 32 * kWarps;

struct Tasks {
  const GemvTask* list;  // device array, or null: `single`
  GemvTask single;
  __device__ GemvTask Get() const { return list != nullptr ? list[blockIdx.y] : single; }
};

// Eight consecutive operand values starting at element `offset` (16-byte aligned).
template <bool kBf16>
__device__ __forceinline__ void LoadX8(const void* x, int64_t offset, float (&v)[8]) {
  if constexpr (kBf16) {
    const uint4 q = __ldg(reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(x) + offset));
    const uint32_t w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[2 * i] = __uint_as_float(w[i] << 16);
      v[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  } else {
    const float4* p = reinterpret_cast<const float4*>(static_cast<const float*>(x) + offset);
    const float4 a = __ldg(p), b = __ldg(p + 1);
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
    v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
  }
}

template <bool kBf16>
__device__ __forceinline__ float LoadX1(const void* x, int64_t offset) {
  if constexpr (kBf16) {
    return Bf16ToFloat(__ldg(static_cast<const uint16_t*>(x) + offset));
  } else {
    return __ldg(static_cast<const float*>(x) + offset);
  }
}

// Eight exact weight values of sub-chunk q (elements 8q .. 8q+7) of a 16-byte chunk.
template <StoredFormat F>
__device__ __forceinline__ void DecodeW8(const uint4& chunk, int q, float (&w)[8]) {
  const uint32_t words[4] = {chunk.x, chunk.y, chunk.z, chunk.w};
  if constexpr (F == StoredFormat::kMXFP4) {
    // 8 nibbles = one 32-bit word; the low nibble of a byte is the even element.
    const uint32_t u = words[q];
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      w[2 * b] = E2m1Value(u >> (8 * b));
      w[2 * b + 1] = E2m1Value(u >> (8 * b + 4));
    }
  } else if constexpr (F == StoredFormat::kFP8Block128) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint32_t u = words[2 * q + h];
#pragma unroll
      for (int b = 0; b < 4; ++b) w[4 * h + b] = Fp8Value((u >> (8 * b)) & 0xffu);
    }
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      w[2 * i] = __uint_as_float(words[i] << 16);
      w[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
    }
  }
}

template <StoredFormat F>
struct Layout;
template <>
struct Layout<StoredFormat::kMXFP4> {
  static constexpr int kElems = 32;  // per 16-byte chunk (= one E8M0 scale block)
  __device__ static int64_t RowBytes(int64_t k) { return k / 2; }
};
template <>
struct Layout<StoredFormat::kFP8Block128> {
  static constexpr int kElems = 16;
  __device__ static int64_t RowBytes(int64_t k) { return k; }
};
template <>
struct Layout<StoredFormat::kBF16> {
  static constexpr int kElems = 8;
  __device__ static int64_t RowBytes(int64_t k) { return 2 * k; }
};

// Vector path: k a multiple of the format's chunk, 16-byte aligned rows and operand.
template <StoredFormat F, bool kXBf16, int kM>
__global__ void __launch_bounds__(kThreads)
    GemvVectorKernel(int64_t n, int64_t k, Tasks tasks, const void* x, int64_t x_stride, float* y,
                     int64_t y_stride) {
  using L = Layout<F>;
  constexpr int kSub = L::kElems / 8;  // 8-element sub-chunks per chunk
  const GemvTask task = tasks.Get();
  const int lane = threadIdx.x & 31;
  const int64_t row0 = (static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5)) * kRows;
  if (row0 >= n) return;
  const auto* data = static_cast<const uint8_t*>(task.data);
  const int64_t row_bytes = L::RowBytes(k);
  const int64_t chunks = k / L::kElems;
  const int64_t fp8_blocks = (k + 127) / 128;

  for (int m0 = 0; m0 < task.m; m0 += kM) {
    const int mm = task.m - m0 < kM ? task.m - m0 : kM;
    const int64_t xr = task.x_row + m0;
    float acc[kRows][kM];
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
      for (int i = 0; i < kM; ++i) acc[r][i] = 0.0f;

    for (int64_t c = lane; c < chunks; c += 32) {
      uint4 chunk[kRows];
      float scale[kRows];
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const int64_t row = row0 + r < n ? row0 + r : n - 1;  // clamp: result discarded
        chunk[r] = __ldcs(reinterpret_cast<const uint4*>(data + row * row_bytes) + c);
        if constexpr (F == StoredFormat::kMXFP4) {
          scale[r] = E8m0Value(static_cast<const uint8_t*>(task.scales)[row * (k / 32) + c]);
        } else if constexpr (F == StoredFormat::kFP8Block128) {
          scale[r] = static_cast<const float*>(task.scales)[(row / 128) * fp8_blocks + c / 8];
        } else {
          scale[r] = 1.0f;
        }
      }
      float part[kRows][kM];
#pragma unroll
      for (int r = 0; r < kRows; ++r)
#pragma unroll
        for (int i = 0; i < kM; ++i) part[r][i] = 0.0f;
#pragma unroll
      for (int q = 0; q < kSub; ++q) {
        float w[kRows][8];
#pragma unroll
        for (int r = 0; r < kRows; ++r) DecodeW8<F>(chunk[r], q, w[r]);
#pragma unroll
        for (int i = 0; i < kM; ++i) {
          if (i < mm) {
            float xv[8];
            LoadX8<kXBf16>(x, (xr + i) * x_stride + c * L::kElems + 8 * q, xv);
#pragma unroll
            for (int r = 0; r < kRows; ++r)
#pragma unroll
              for (int e = 0; e < 8; ++e) part[r][i] = fmaf(w[r][e], xv[e], part[r][i]);
          }
        }
      }
#pragma unroll
      for (int r = 0; r < kRows; ++r)
#pragma unroll
        for (int i = 0; i < kM; ++i) {
          if constexpr (F == StoredFormat::kBF16) {
            acc[r][i] = __fadd_rn(acc[r][i], part[r][i]);
          } else {
            acc[r][i] = fmaf(part[r][i], scale[r], acc[r][i]);
          }
        }
    }

#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
      for (int i = 0; i < kM; ++i) acc[r][i] = WarpSum(acc[r][i]);
    if (lane == 0) {
#pragma unroll
      for (int r = 0; r < kRows; ++r)
#pragma unroll
        for (int i = 0; i < kM; ++i)
          if (i < mm && row0 + r < n)
            y[(task.y_row + m0 + i) * y_stride + task.y_col + row0 + r] = acc[r][i];
    }
  }
}

// Scalar path (any k, any alignment): one element per lane step. FP8 keeps its per-block
// scaling as acc = fmaf(w * x, scale_inv, acc) (w * x exact in bf16 mode).
template <StoredFormat F, bool kXBf16, int kM>
__global__ void __launch_bounds__(kThreads)
    GemvScalarKernel(int64_t n, int64_t k, Tasks tasks, const void* x, int64_t x_stride, float* y,
                     int64_t y_stride) {
  const GemvTask task = tasks.Get();
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (row >= n) return;
  const auto* data = static_cast<const uint8_t*>(task.data);
  const int64_t fp8_blocks = (k + 127) / 128;
  for (int m0 = 0; m0 < task.m; m0 += kM) {
    const int mm = task.m - m0 < kM ? task.m - m0 : kM;
    const int64_t xr = task.x_row + m0;
    float acc[kM];
#pragma unroll
    for (int i = 0; i < kM; ++i) acc[i] = 0.0f;
    for (int64_t kk = lane; kk < k; kk += 32) {
      float w, scale = 1.0f;
      if constexpr (F == StoredFormat::kMXFP4) {
        const uint32_t byte = data[row * (k / 2) + kk / 2];
        w = E2m1Value((kk & 1) ? byte >> 4 : byte) *
            E8m0Value(static_cast<const uint8_t*>(task.scales)[row * (k / 32) + kk / 32]);
      } else if constexpr (F == StoredFormat::kFP8Block128) {
        w = Fp8Value(data[row * k + kk]);
        scale = static_cast<const float*>(task.scales)[(row / 128) * fp8_blocks + kk / 128];
      } else {
        w = Bf16ToFloat(reinterpret_cast<const uint16_t*>(data)[row * k + kk]);
      }
#pragma unroll
      for (int i = 0; i < kM; ++i) {
        if (i < mm) {
          const float xv = LoadX1<kXBf16>(x, (xr + i) * x_stride + kk);
          if constexpr (F == StoredFormat::kFP8Block128) {
            acc[i] = fmaf(__fmul_rn(w, xv), scale, acc[i]);
          } else {
            acc[i] = fmaf(w, xv, acc[i]);
          }
        }
      }
    }
#pragma unroll
    for (int i = 0; i < kM; ++i) acc[i] = WarpSum(acc[i]);
    if (lane == 0) {
#pragma unroll
      for (int i = 0; i < kM; ++i)
        if (i < mm) y[(task.y_row + m0 + i) * y_stride + task.y_col + row] = acc[i];
    }
  }
}

template <StoredFormat F, bool kXBf16, int kM>
cudaError_t Launch(bool vector, int64_t n, int64_t k, Tasks tasks, int num_tasks, const void* x,
                   int64_t x_stride, float* y, int64_t y_stride, cudaStream_t s) {
  if (vector) {
    const int64_t blocks = (n + kWarps * kRows - 1) / (kWarps * kRows);
    GemvVectorKernel<F, kXBf16, kM>
        <<<dim3(static_cast<unsigned>(blocks), num_tasks), kThreads, 0, s>>>(n, k, tasks, x,
                                                                             x_stride, y, y_stride);
  } else {
    const int64_t blocks = (n + kWarps - 1) / kWarps;
    GemvScalarKernel<F, kXBf16, kM>
        <<<dim3(static_cast<unsigned>(blocks), num_tasks), kThreads, 0, s>>>(n, k, tasks, x,
                                                                             x_stride, y, y_stride);
  }
  return cudaGetLastError();
}

template <StoredFormat F, bool kXBf16>
cudaError_t LaunchM(int max_m, bool vector, int64_t n, int64_t k, Tasks tasks, int num_tasks,
                    const void* x, int64_t x_stride, float* y, int64_t y_stride, cudaStream_t s) {
  if (max_m <= 1)
    return Launch<F, kXBf16, 1>(vector, n, k, tasks, num_tasks, x, x_stride, y, y_stride, s);
  if (max_m <= 2)
    return Launch<F, kXBf16, 2>(vector, n, k, tasks, num_tasks, x, x_stride, y, y_stride, s);
  if (max_m <= 4)
    return Launch<F, kXBf16, 4>(vector, n, k, tasks, num_tasks, x, x_stride, y, y_stride, s);
  return Launch<F, kXBf16, 8>(vector, n, k, tasks, num_tasks, x, x_stride, y, y_stride, s);
}

template <StoredFormat F>
cudaError_t LaunchX(bool x_bf16, int max_m, bool vector, int64_t n, int64_t k, Tasks tasks,
                    int num_tasks, const void* x, int64_t x_stride, float* y, int64_t y_stride,
                    cudaStream_t s) {
  return x_bf16
             ? LaunchM<F, true>(max_m, vector, n, k, tasks, num_tasks, x, x_stride, y, y_stride, s)
             : LaunchM<F, false>(max_m, vector, n, k, tasks, num_tasks, x, x_stride, y, y_stride,
                                 s);
}

}  // namespace

cudaError_t LaunchGroupedGemv(StoredFormat format, int64_t n, int64_t k,
                              const GemvTask* device_tasks, int num_tasks, GemvTask single,
                              int max_m, const void* x, int64_t x_stride, bool x_bf16, float* y,
                              int64_t y_stride, cudaStream_t s) {
  if (num_tasks == 0 || n == 0 || max_m == 0) return cudaSuccess;
  if (device_tasks == nullptr && num_tasks != 1) return cudaErrorInvalidValue;
  const Tasks tasks{device_tasks, single};
  if (num_tasks < 0 || num_tasks > kMaxGridY || k <= 0 || x_stride % 8 != 0 ||
      (reinterpret_cast<uintptr_t>(x) & 15) != 0 || n > (int64_t{1} << 36))
    return cudaErrorInvalidValue;
  // The vector path needs whole 16-byte chunks per row; callers guarantee 16-byte aligned
  // weight allocations (PrepareWeight), so rows are aligned when the row size is.
  switch (format) {
    case StoredFormat::kMXFP4:
      if (k % 32 != 0) return cudaErrorInvalidValue;
      return LaunchX<StoredFormat::kMXFP4>(x_bf16, max_m, /*vector=*/true, n, k, tasks, num_tasks,
                                           x, x_stride, y, y_stride, s);
    case StoredFormat::kFP8Block128:
      return LaunchX<StoredFormat::kFP8Block128>(x_bf16, max_m, k % 16 == 0, n, k, tasks, num_tasks,
                                                 x, x_stride, y, y_stride, s);
    case StoredFormat::kBF16:
      return LaunchX<StoredFormat::kBF16>(x_bf16, max_m, k % 8 == 0, n, k, tasks, num_tasks, x,
                                          x_stride, y, y_stride, s);
  }
  return cudaErrorInvalidValue;
}

}  // namespace moe::cuda
