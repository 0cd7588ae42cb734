// The CPU backend: every op on host memory, parallel over a private thread pool.
//
// Weights are used in place (memory-mapped checkpoint, stored format). All arithmetic goes
// through the batched dot kernels of kernels/cpu/dot.h, so a token's result is bitwise
// independent of its batch and of the kernel variant.
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/thread_pool.h"
#include "kernels/backend.h"
#include "kernels/cpu/dot.h"

namespace moe {

struct CpuBackendOptions {
  int num_threads = 0;  // 0: all hardware threads
  // Kernel tier (kernels/cpu/tiers.h): "" = MOE_CPU_KERNELS if set, else the best the host
  // supports; "best"; or a tier name ("avx2", "portable", ...).
  std::string kernels;
};

class CpuBackend final : public Backend {
 public:
  // Fails when the requested tier is unknown or the host cannot run it.
  static absl::StatusOr<std::unique_ptr<CpuBackend>> Create(const CpuBackendOptions& options = {});
  // For tests and tools that pass a tier the host has: aborts with the message otherwise.
  explicit CpuBackend(const CpuBackendOptions& options = {});
  // With an explicit kernel table (options.kernels is ignored), e.g. a test double.
  CpuBackend(const CpuBackendOptions& options, const cpu::DotKernels* kernels);

  std::string name() const override;
  MemorySpace space() const override { return MemorySpace::kHost; }
  int num_threads() const { return pool_.num_threads(); }
  const cpu::DotKernels& kernels() const { return *kernels_; }

  absl::StatusOr<std::unique_ptr<DeviceBuffer>> Allocate(size_t bytes) override;
  absl::Status CopyToBackend(void* dst, const void* host_src, size_t bytes) override;
  absl::Status CopyToHost(void* host_dst, const void* src, size_t bytes) override;
  absl::Status Synchronize() override { return absl::OkStatus(); }

 private:
  absl::StatusOr<WeightMatrix> DoPrepareWeight(const WeightMatrix& host) override;
  absl::StatusOr<WeightVector> DoPrepareVector(const WeightVector& host) override;
  absl::Status DoLinear(ConstMatrixView x, const WeightMatrix& w, MatrixView y,
                        Precision p) override;
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
  // In place, one pass: bf16 widened into y, y rounded into the host rows.
  absl::Status DoUploadRows(const ActivationRows& x, MatrixView y) override;
  absl::Status DoDownloadRows(ConstMatrixView y, ActivationRows* out) override;

  // Packs rows of x in `format`'s canonical order into `buffer`; returns the row stride.
  int64_t PackRows(const ActivationView& x, WeightFormat format, Precision p,
                   cpu::AlignedBuffer* buffer);
  // Weight rows [0, n) in kernel-friendly blocks, each taken by the first free pool thread.
  void ForRowBlocks(int64_t n, const std::function<void(int64_t, int64_t, int)>& fn);

  const cpu::DotKernels* kernels_;
  ThreadPool pool_;
  std::mutex mu_;  // one op at a time: the pool and the workspaces are shared
  std::vector<cpu::DotScratch> scratch_;        // per pool thread
  cpu::AlignedBuffer packed_x_;                 // packed activations of the current op
  cpu::AlignedBuffer packed_hidden_;            // ExpertMlp: packed activations of the hidden layer
  std::vector<std::vector<float>> thread_out_;  // per-thread dot results
};

}  // namespace moe
