// Kernel launchers of the CUDA backend (DeepEP style): raw device pointers, sizes and a
// stream, nothing else. The host code (cuda_backend.cc, transport/nccl_transport.cc)
// validates every shape first; launchers only check what would make a launch invalid and
// return the launch's cudaError_t (cudaGetLastError after the launch).
//
// Matrices are row-major with an explicit row stride in elements. "bf16 operand" means
// uint16_t bf16 bit patterns (what cuBLAS reads as CUDA_R_16BF).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/numerics.h"

namespace moe::cuda {

// The stored weight formats (moe::WeightFormat, kernels/weights.h, same values; that header
// pulls in absl, which device translation units do not include).
enum class StoredFormat : uint8_t { kBF16 = 0, kMXFP4 = 1, kFP8Block128 = 2 };

// ---- elementwise (elementwise.cu) ---------------------------------------------------------
// y = bf16(y) in place.
cudaError_t LaunchRoundBf16(float* y, int64_t rows, int64_t cols, int64_t stride, cudaStream_t s);
// y = round(a + b), round = bf16 or identity.
cudaError_t LaunchAdd(const float* a, int64_t sa, const float* b, int64_t sb, float* y, int64_t sy,
                      int64_t rows, int64_t cols, bool bf16, cudaStream_t s);
// out = round(y): fp64 -> bf16 in one rounding (RoundDoubleToBf16) or fp64 -> fp32.
cudaError_t LaunchRoundPartials(const double* y, int64_t sy, float* out, int64_t so, int64_t rows,
                                int64_t cols, bool bf16, cudaStream_t s);

// ---- operands (operand.cu) ------------------------------------------------------------------
// out[i, :] = convert(x[rows ? rows[i] : i, :]) for i < m: bf16 bits (bf16 = true, round to
// nearest even) or fp32, columns [cols, out_cols) zero-filled. out row stride: out_stride.
cudaError_t LaunchPackOperand(const float* x, int64_t x_stride, const int32_t* rows, int64_t m,
                              int64_t cols, void* out, int64_t out_stride, int64_t out_cols,
                              bool bf16, cudaStream_t s);
// The same from bf16 bits x (a bf16 step's rows as they came off the wire).
cudaError_t LaunchPackBf16Operand(const uint16_t* x, int64_t x_stride, const int32_t* rows,
                                  int64_t m, int64_t cols, void* out, int64_t out_stride,
                                  int64_t out_cols, bool bf16, cudaStream_t s);

// ---- weight decoding (dequantize.cu) --------------------------------------------------------
// Exact values of a stored weight [n, k] into out [n, out_cols] (bf16 bits or fp32),
// columns [k, out_cols) zero-filled. FP8: WITHOUT the block scales (applied per K-block by
// LaunchFp8BlockReduce). MXFP4: with its E8M0 scales (exact in bf16 for scales in [2, 252]).
cudaError_t LaunchDecodeWeight(StoredFormat format, const void* data, const void* scales, int64_t n,
                               int64_t k, void* out, int64_t out_stride, int64_t out_cols,
                               bool bf16, cudaStream_t s);

// y[i, j] = round(sum over b ascending of partials[b, i, j] * scales[j / 128, b]) (fp32 fma),
// partials: nb blocks of [m, n] (row-major, contiguous), scales: [ceil(n/128), nb].
cudaError_t LaunchFp8BlockReduce(const float* partials, int64_t m, int64_t n, int64_t nb,
                                 const float* scales, float* y, int64_t y_stride, bool bf16,
                                 cudaStream_t s);

// ---- fused GEMV for small batches (gemv.cu) -------------------------------------------------
// One matrix of a grouped GEMV: operand rows [x_row, x_row + m) times W^T into output rows
// [y_row, y_row + m) of y.
struct GemvTask {
  const void* data;    // stored weight [n, k]
  const void* scales;  // MXFP4 u8 [n, k/32]; FP8 f32 [ceil(n/128), ceil(k/128)]; else null
  int32_t x_row;
  int32_t m;
  int32_t y_row;
  int32_t y_col;  // first output column (lets gate and up share one launch)
};
// y[y_row + i, y_col + j] = sum_k W[j, k] x[x_row + i, k] (raw fp32, not rounded) for every
// task; all tasks share format, n and k. Tasks: `device_tasks[0 .. num_tasks)` (device
// array) or, when device_tasks is null, the one task `single` (passed by value). x: bf16
// operand (x_bf16) or fp32, row stride x_stride (a multiple of 8), 16-byte aligned; weight
// data 16-byte aligned. max_m: the largest task m (picks the kernel).
cudaError_t LaunchGroupedGemv(StoredFormat format, int64_t n, int64_t k,
                              const GemvTask* device_tasks, int num_tasks, GemvTask single,
                              int max_m, const void* x, int64_t x_stride, bool x_bf16, float* y,
                              int64_t y_stride, cudaStream_t s);

// ---- router (select_experts.cu) -------------------------------------------------------------
cudaError_t LaunchSelectExperts(const float* logits, int64_t stride, int64_t tokens,
                                const float* bias, int num_experts, int top_k, bool renormalize,
                                float scaling, int n_group, int topk_group, int32_t* ids,
                                float* weights, cudaStream_t s);

// ---- GLU (glu_activation.cu) ----------------------------------------------------------------
// out[i, j] = round(act(rin(g[i, j]), rin(u[i, j]))) where rin = round when round_inputs.
// out: fp32 (out_bf16 = false) or bf16 bits, row stride out_stride, columns
// [cols, out_cols) zero-filled.
cudaError_t LaunchGluActivation(const float* g, int64_t sg, const float* u, int64_t su,
                                int64_t rows, int64_t cols, ActivationParams act, bool bf16,
                                bool round_inputs, void* out, int64_t out_stride, int64_t out_cols,
                                bool out_bf16, cudaStream_t s);

// ---- RMSNorm (rms_norm.cu) ------------------------------------------------------------------
cudaError_t LaunchRmsNorm(const float* x, int64_t sx, const uint16_t* weight, float eps, float* y,
                          int64_t sy, int64_t rows, int64_t cols, bool bf16, cudaStream_t s);

// ---- rows (rows.cu) -------------------------------------------------------------------------
// out[i] = x[rows[i]]; out_bf16: out holds bf16 bits (rounded to nearest even), else fp32.
cudaError_t LaunchGatherRows(const float* x, int64_t sx, const int32_t* rows, int64_t n,
                             int64_t cols, void* out, int64_t so, bool out_bf16, cudaStream_t s);
// y[rows[i]] += partial[i] (fp64). unique_rows: rows has no duplicates (parallel over rows);
// otherwise every column is accumulated over i in order by one thread (deterministic).
cudaError_t LaunchScatterAddRows(const double* partial, int64_t sp, const int32_t* rows, int64_t n,
                                 int64_t cols, double* y, int64_t sy, bool unique_rows,
                                 cudaStream_t s);

// ---- expert combine (expert_combine.cu) -----------------------------------------------------
// y[r, c] = sum over j in [row_offsets[r], row_offsets[r+1]) of
//           double(round(o[slots[j], c])) * double(gates[slots[j]]), summed in j order, in fp64.
// Every row r < m is written (0 when it has no slot).
cudaError_t LaunchExpertCombine(const float* o, int64_t so, const float* gates,
                                const int32_t* row_offsets, const int32_t* slots, int64_t m,
                                int64_t cols, bool bf16, double* y, int64_t sy, cudaStream_t s);

}  // namespace moe::cuda
