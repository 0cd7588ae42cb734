// The CUDA backend: every op of kernels/backend.h on device memory of one GPU, on one stream
// the backend owns, with the CPU backend's numerics contract (docs/DESIGN.md "Numerics").
//
// Usable from plain C++: no CUDA types here beyond the forward-declared stream handle.
//
// How each op meets the contract (details beside each kernel in kernels/cuda/*.cu):
//  * Linear: fp32 accumulation of exact products. bf16 mode: activations converted to a bf16
//    operand; bf16 weights used in place, MXFP4 dequantized exactly to bf16; cuBLAS bf16 x bf16
//    -> fp32 (CUBLAS_COMPUTE_32F), then one rounding to bf16. fp32 mode: fp32 operands,
//    CUBLAS_COMPUTE_32F_PEDANTIC (never TF32). FP8 block-128: the block structure of the CPU
//    contract is kept, y = sum_b scale_b * (partial dot over K-block b): the unscaled FP8
//    values (exact in bf16) go through one strided-batched GEMM over the K-blocks, and a
//    reduction kernel applies the fp32 scales in ascending block order. Small batches
//    (<= options.gemv_max_rows rows) skip cuBLAS: a fused GEMV reads the stored format
//    directly (same per-block scaling). Results equal the CPU's up to fp32 summation order.
//  * SelectExperts: one block per token; sigmoid/bias/group limit/top-k/renormalize exactly as
//    CpuBackend::SelectExperts (same comparisons, same fp32 operation sequence, the
//    deterministic Sigmoid of core/numerics.h): bitwise the CPU's for the same logits.
//  * ExpertMlp: gathered operand, per-expert GEMMs (or one grouped GEMV launch for the small
//    experts), one fused GLU kernel with the contract's roundings, and a combine kernel that
//    sums fp32(round(o)) * gate in fp64 per row in ascending expert order (no atomics): the
//    same fp64 sequence as the CPU, so y is bitwise the CPU's whenever o is.
//  * RmsNorm (fp64 sum of squares), Add, Round, RoundPartials, GatherRows, ScatterAddRows,
//    Zero, GluActivation (round(act(round(g), round(u))), core/numerics.h's deterministic
//    exp/tanh): the CPU's exact operation sequence, compiled with --fmad=false (no
//    contraction), so bitwise the CPU's (RmsNorm in fp32 mode: to the fp64 summation order).
//
// Threading: one op at a time (ops are serialized by a mutex; the stream orders device work).
// Host arrays (ExpertAssignments, GatherRows/ScatterAddRows row lists) are copied to device
// scratch by the op itself. Pointers given to ops must be device memory of this backend
// (Allocate) except where backend.h says host.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "kernels/backend.h"

struct CUstream_st;  // cudaStream_t is CUstream_st*

namespace moe {

struct CudaBackendOptions {
  int device = 0;
  // GEMMs with at most this many operand rows (per expert in ExpertMlp) use the fused
  // GEMV kernels that read MXFP4 / FP8 / bf16 weights in place instead of dequantizing to a
  // scratch and calling cuBLAS. 0 disables the GEMV path. MOE_CUDA_GEMV_MAX_ROWS overrides.
  int gemv_max_rows = 8;
  // Upper bound of the FP8 block-partials scratch (the strided-batched GEMM writes
  // ceil(K/128) fp32 partials per output); larger batches are processed in row chunks.
  int64_t fp8_partials_bytes = int64_t{256} << 20;
  // cuBLAS workspace (Hopper recommends 32 MiB).
  int64_t cublas_workspace_bytes = int64_t{32} << 20;
};

// Number of CUDA devices; 0 when there is no device or no driver (never fails).
int CudaDeviceCount();
// "no CUDA device: <reason>" when CudaDeviceCount() is 0, else "" (for test skips).
std::string CudaUnavailableReason();

class CudaBackend final : public Backend {
 public:
  // UNAVAILABLE when there is no driver or no such device.
  static absl::StatusOr<std::unique_ptr<CudaBackend>> Create(const CudaBackendOptions& options);
  ~CudaBackend() override;
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  std::string name() const override;
  MemorySpace space() const override { return MemorySpace::kDevice; }
  int device() const;
  // The stream every op runs on (a cudaStream_t). The NCCL transport orders its own stream
  // after it with events.
  CUstream_st* stream() const;
  const CudaBackendOptions& options() const;
  // Changes options().gemv_max_rows for the following ops (benchmarks compare both paths on
  // one set of uploaded weights).
  void set_gemv_max_rows(int rows);
  // Bytes of device memory held by prepared weights.
  int64_t weight_bytes() const;

  absl::StatusOr<std::unique_ptr<DeviceBuffer>> Allocate(size_t bytes) override;
  // Both copies are synchronous: they are ordered after the stream's queued work and
  // complete before returning.
  absl::Status CopyToBackend(void* dst, const void* host_src, size_t bytes) override;
  absl::Status CopyToHost(void* host_dst, const void* src, size_t bytes) override;
  // Uploads the stored format as is (weights stay in checkpoint format in GPU memory).
  absl::Status Synchronize() override;

  struct Impl;

 private:
  absl::StatusOr<WeightMatrix> DoPrepareWeight(const WeightMatrix& host) override;
  absl::StatusOr<WeightVector> DoPrepareVector(const WeightVector& host) override;
  absl::Status DoLinear(ConstMatrixView x, const WeightMatrix& w, MatrixView y,
                        Precision p) override;
  // logits, bias, ids and weights are device pointers.
  absl::Status DoSelectExperts(ConstMatrixView logits, const float* bias,
                               const RoutingParams& params, int32_t* ids, float* weights) override;
  absl::Status DoGluActivation(ConstMatrixView g, ConstMatrixView u, const ActivationParams& act,
                               MatrixView out, Precision p) override;
  absl::Status DoExpertMlp(ActivationView x, const ExpertAssignments& assignments,
                           absl::Span<const MlpWeights> experts, const ActivationParams& act,
                           PartialView y, Precision p) override;
  absl::Status DoRmsNorm(ConstMatrixView x, const WeightVector& weight, float eps, MatrixView y,
                         Precision p) override;
  absl::Status DoAdd(ConstMatrixView a, ConstMatrixView b, MatrixView y, Precision p) override;
  absl::Status DoRound(MatrixView y, Precision p) override;
  absl::Status DoRoundPartials(ConstPartialView y, MatrixView out, Precision p) override;
  absl::Status DoGatherRows(ConstMatrixView x, absl::Span<const int32_t> rows,
                            MutableActivationView out) override;
  absl::Status DoScatterAddRows(ConstPartialView partial, absl::Span<const int32_t> rows,
                                PartialView y) override;
  absl::Status DoZero(PartialView y) override;

  explicit CudaBackend(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// The factory the service uses: UNAVAILABLE with a clear message when there is no driver or
// no such device.
absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(int device);

}  // namespace moe
