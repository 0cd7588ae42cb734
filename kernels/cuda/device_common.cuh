// Device helpers shared by the kernels: exact decoders of the stored formats, bf16 bits,
// warp reductions and launch shapes. Included by .cu files only.
//
// NOTES: every kernel file is compiled with --fmad=false (kernels/cuda/CMakeLists.txt), so an
// expression like a * b + c is two roundings, as on the CPU (-ffp-contract=off); fused
// multiply-adds are written as fmaf / fma where the contract's sums use them.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/numerics.h"
#include "kernels/cuda/launchers.h"

namespace moe::cuda {

constexpr int kMaxGridY = 65535;

// Launch shape of a [rows, cols] elementwise kernel: x over columns, y over rows (each
// block loops over rows with stride gridDim.y).
inline dim3 ElementwiseGrid(int64_t rows, int64_t cols, int threads) {
  const int64_t gx = (cols + threads - 1) / threads;
  const int64_t gy = rows < kMaxGridY ? rows : kMaxGridY;
  return dim3(static_cast<unsigned>(gx > 0 ? gx : 1), static_cast<unsigned>(gy > 0 ? gy : 1));
}

inline bool GridFits(int64_t rows, int64_t cols, int threads) {
  return (cols + threads - 1) / threads < (int64_t{1} << 31) && rows >= 0 && cols >= 0;
}

__device__ __forceinline__ float Bf16ToFloat(uint16_t b) {
  return __uint_as_float(static_cast<uint32_t>(b) << 16);
}

// fp32 -> bf16 bits, round to nearest even (core/numerics.h FloatToBf16Bits).
__device__ __forceinline__ uint16_t FloatToBf16(float f) { return FloatToBf16Bits(f); }

__device__ __forceinline__ float RoundBf16(float f) { return RoundToBf16(f); }

// E2M1 code (bit 3 sign, 3 magnitude bits e1 e0 m) -> its exact value. NOTES: the magnitude
// bits placed at fp32 bits 22..24 read as 2^(e-127) * (1 + m/2) for e > 0 and as the
// subnormal m * 2^-127 for e = 0; times 2^126 that is E2M1's 2^(e-1) * (1 + m/2) and m / 2.
// Exact (power-of-two scaling of a value with <= 2 significant bits; no flush-to-zero, the
// kernels are built without fast math). No table: a run-time-indexed local array would live
// in local memory.
__device__ __forceinline__ float E2m1Value(uint32_t code) {
  const uint32_t bits = ((code & 7u) << 22) | ((code & 8u) << 28);
  return __uint_as_float(bits) * 0x1p126f;
}

// E8M0 scale 2^(e - 127) for e in [1, 254] (the backend accepts [2, 252], as the CPU one).
__device__ __forceinline__ float E8m0Value(uint32_t e) { return __uint_as_float(e << 23); }

// FP8 E4M3 (e4m3fn) -> exact fp32. NOTES: same trick, exponent bias 7 instead of 127:
// bits at 20..26 read as 2^(e-127) * (1 + m/8) (or the subnormal m * 2^-130), times 2^120.
// S.1111.111 is NaN as in core/numerics.h Fp8E4m3ToFloat.
__device__ __forceinline__ float Fp8Value(uint32_t v) {
  if ((v & 0x7fu) == 0x7fu) return __uint_as_float(0x7fc00000u | ((v & 0x80u) << 24));
  const uint32_t bits = ((v & 0x7fu) << 20) | ((v & 0x80u) << 24);
  return __uint_as_float(bits) * 0x1p120f;
}

// Sum over the 32 lanes of a warp by a fixed butterfly (deterministic).
__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

__device__ __forceinline__ double WarpSum(double v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

}  // namespace moe::cuda
