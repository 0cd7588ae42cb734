// The compute backend interface: the only thing model math (model/) calls to do arithmetic.
//
// Activations are fp32 matrices in the backend's memory. In Precision::kBF16 every op rounds
// its result to bf16 at the points docs/DESIGN.md "Numerics" names (values stay in fp32 storage,
// so they are exact bf16 numbers); in kFP32 nothing is rounded. The one exception is the routed
// experts' input (ActivationView): the rows GatherRows gathers for a rank and the rank receives,
// bf16 storage in a bf16 step. GEMMs read bf16 operands (kBF16) or fp32 operands (kFP32) and
// always accumulate in fp32.
//
// Backends: CPU (kernels/cpu) and CUDA (kernels/cuda). Both are tested op by op against the
// plain fp64 reference loops of tests/kernels/test_weights.h.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/activations.h"
#include "core/numerics.h"
#include "kernels/weights.h"

namespace moe {

// Row-major matrix view: element (r, c) at data[r * stride + c]. A View2D<T> converts to
// View2D<const T>.
template <typename T>
struct View2D {
  T* data = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t stride = 0;
  View2D() = default;
  View2D(T* d, int64_t r, int64_t c, int64_t s) : data(d), rows(r), cols(c), stride(s) {}
  template <typename U, typename = std::enable_if_t<std::is_same_v<const U, T>>>
  View2D(const View2D<U>& m)  // NOLINT: a mutable view is readable
      : data(m.data), rows(m.rows), cols(m.cols), stride(m.stride) {}
  T* Row(int64_t r) const { return data + r * stride; }
};

using MatrixView = View2D<float>;  // activations
using ConstMatrixView = View2D<const float>;
// fp64 partial sums of routed experts. NOTES: each term fp32(o) * gate is exact in fp64, so
// fp64 sums make the combine independent of how experts are split over ranks and replicas
// (to 2^-53); it is rounded once, straight to bf16 (or fp32), by RoundPartials.
using PartialView = View2D<double>;
using ConstPartialView = View2D<const double>;

// Activation rows in a backend's memory in their storage dtype: bf16 bits or fp32. The routed
// experts take their input as one, so a bf16 step's rows stay bf16 from the wire into the
// experts' GEMMs (no fp32 copy on the rank). An fp32 view (ConstMatrixView) converts to one.
struct ActivationView {
  const void* data = nullptr;
  Precision dtype = Precision::kFP32;      // the storage: kBF16 = bf16 bits, kFP32 = fp32
  int64_t rows = 0, cols = 0, stride = 0;  // stride in elements
  ActivationView() = default;
  ActivationView(const void* d, Precision t, int64_t r, int64_t c, int64_t s)
      : data(d), dtype(t), rows(r), cols(c), stride(s) {}
  ActivationView(ConstMatrixView m)  // NOLINT: fp32 activations are activation rows
      : ActivationView(m.data, Precision::kFP32, m.rows, m.cols, m.stride) {}
  ActivationView(MatrixView m) : ActivationView(ConstMatrixView(m)) {}  // NOLINT: as above
  // Host rows, in place (their dtype is the storage).
  explicit ActivationView(const ActivationRows& host)
      : ActivationView(host.data(), host.precision(), host.rows(), host.cols(), host.cols()) {}
  size_t element_bytes() const { return ElementBytes(dtype); }
  const uint16_t* Bf16Row(int64_t r) const {
    return static_cast<const uint16_t*>(data) + r * stride;
  }
  const float* Fp32Row(int64_t r) const { return static_cast<const float*>(data) + r * stride; }
};

// Writable activation rows in their storage dtype (GatherRows' output: a bf16 step's dispatch
// rows). An fp32 view (MatrixView) converts to one.
struct MutableActivationView {
  void* data = nullptr;
  Precision dtype = Precision::kFP32;
  int64_t rows = 0, cols = 0, stride = 0;  // stride in elements
  MutableActivationView() = default;
  MutableActivationView(void* d, Precision t, int64_t r, int64_t c, int64_t s)
      : data(d), dtype(t), rows(r), cols(c), stride(s) {}
  MutableActivationView(MatrixView m)  // NOLINT: fp32 activations are activation rows
      : MutableActivationView(m.data, Precision::kFP32, m.rows, m.cols, m.stride) {}
  operator ActivationView() const {  // NOLINT: writable rows are readable
    return ActivationView(data, dtype, rows, cols, stride);
  }
  uint16_t* Bf16Row(int64_t r) const { return static_cast<uint16_t*>(data) + r * stride; }
  float* Fp32Row(int64_t r) const { return static_cast<float*>(data) + r * stride; }
};

// Router hyper-parameters (docs/DESIGN.md "Numerics" step 1).
struct RoutingParams {
  int num_experts = 0;
  int top_k = 0;
  bool renormalize = true;  // w = s / (sum s + 1e-20), when top_k > 1 (as the seed gates)
  float routed_scaling_factor = 1.0f;  // applied after renormalizing
  // DeepSeek-V3 group-limited routing: experts split in n_group groups; a token may only
  // choose experts of its topk_group best groups (group score: sum of its top-2 biased scores).
  int n_group = 1;
  int topk_group = 1;
};

// The rows a rank received, grouped by local expert (CSR). Row `rows[i]` of the rank's input
// goes through local expert e for i in [offsets[e], offsets[e+1]) with weight gates[i].
// Host memory: a small index built per step.
struct ExpertAssignments {
  std::vector<int32_t> offsets;  // [num_local_experts + 1]
  std::vector<int32_t> rows;     // [num_assignments]
  std::vector<float> gates;      // [num_assignments]
  int num_experts() const { return offsets.empty() ? 0 : static_cast<int>(offsets.size()) - 1; }
  int64_t num_assignments() const { return static_cast<int64_t>(rows.size()); }
};

// Owned memory in a backend's space.
class DeviceBuffer {
 public:
  virtual ~DeviceBuffer() = default;
  virtual void* data() = 0;
  virtual size_t size() const = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;
  virtual MemorySpace space() const = 0;

  // --- memory -----------------------------------------------------------------------------
  virtual absl::StatusOr<std::unique_ptr<DeviceBuffer>> Allocate(size_t bytes) = 0;
  virtual absl::Status CopyToBackend(void* dst, const void* host_src, size_t bytes) = 0;
  virtual absl::Status CopyToHost(void* host_dst, const void* src, size_t bytes) = 0;
  // Makes a host weight usable by this backend (device upload, or a kernel-friendly layout).
  // The returned view stays valid as long as the backend lives; host views stay host views
  // on the CPU backend (weights are read in place from the memory-mapped checkpoint). Checked
  // here for every backend: the view's shape, and MXFP4 E8M0 scales in [2, 252] (|w| in the
  // normal range, where the kernels' exponent arithmetic is exact); INVALID_ARGUMENT otherwise.
  absl::StatusOr<WeightMatrix> PrepareWeight(const WeightMatrix& host);
  // INVALID_ARGUMENT for an empty vector.
  absl::StatusOr<WeightVector> PrepareVector(const WeightVector& host);
  // Waits for all queued work.
  virtual absl::Status Synchronize() = 0;

  // --- ops --------------------------------------------------------------------------------
  // Each op checks its arguments here, once for every backend (kernels/backend.cc: shapes,
  // strides, index ranges, routing parameters; INVALID_ARGUMENT "Op: what"), then runs the
  // backend's Do<Op>.
  // y = round(x W^T). x: [M, W.cols], y: [M, W.rows].
  absl::Status Linear(ConstMatrixView x, const WeightMatrix& w, MatrixView y, Precision p);

  // Router from fp32 logits [T, E]: s = sigmoid(logits); choose top_k of s + bias (ties: lower
  // index); weights from s. ids/weights: [T, top_k], in descending order of biased score.
  absl::Status SelectExperts(ConstMatrixView logits, const float* bias, const RoutingParams& params,
                             int32_t* ids, float* weights);

  // out = round(act(g, u)) elementwise. g, u, out: [M, N].
  absl::Status GluActivation(ConstMatrixView g, ConstMatrixView u, const ActivationParams& act,
                             MatrixView out, Precision p);

  // Grouped routed experts: for every assignment i of local expert e,
  //   o_i = round(round(act(round(x[rows[i]] W1_e^T), round(x[rows[i]] W3_e^T))) W2_e^T)
  // and y[r] = sum over the assignments of row r, in ascending expert order, of
  // fp32(o_i) * gate_i, accumulated in fp64. Rows with no assignment get 0. x: [M, in], bf16
  // or fp32 storage (bf16 storage only in a kBF16 step: an fp32 step's rows are not bf16).
  absl::Status ExpertMlp(ActivationView x, const ExpertAssignments& assignments,
                         absl::Span<const MlpWeights> experts, const ActivationParams& act,
                         PartialView y, Precision p);

  // y = round(round(x * rsqrt(mean(x^2) + eps)) * weight), per row.
  absl::Status RmsNorm(ConstMatrixView x, const WeightVector& weight, float eps, MatrixView y,
                       Precision p);

  // y = round(a + b).
  absl::Status Add(ConstMatrixView a, ConstMatrixView b, MatrixView y, Precision p);

  // y = round(y) in place (the layer input in bf16 mode).
  absl::Status Round(MatrixView y, Precision p);

  // out = round(y): fp64 partial sums to bf16 (one rounding) or fp32.
  absl::Status RoundPartials(ConstPartialView y, MatrixView out, Precision p);

  // out[i] = x[rows[i]] (the dispatch gather), in out's storage dtype: bf16 rounds to nearest
  // even (exact for a bf16 step's rows, which hold bf16 values), so a bf16 step's rows leave the
  // gather in the wire's dtype. rows: host array of out.rows indices.
  absl::Status GatherRows(ConstMatrixView x, absl::Span<const int32_t> rows,
                          MutableActivationView out);

  // y[rows[i]] += partial[i] in fp64 (the combine). rows: host array of partial.rows indices.
  absl::Status ScatterAddRows(ConstPartialView partial, absl::Span<const int32_t> rows,
                              PartialView y);

  // y = 0.
  absl::Status Zero(PartialView y);

  // Host activation rows into y ([rows, cols]): bf16 widened to fp32 (exact), fp32 copied. The
  // one place a step's input changes dtype: it stays bf16 on the host, fp32 inside backends.
  absl::Status UploadRows(const ActivationRows& x, MatrixView y);
  // y back to host rows of precision p (bf16: rounded to nearest even, exact for a bf16 step's
  // output, which is rounded already).
  absl::Status DownloadRows(ConstMatrixView y, Precision p, ActivationRows* out);

 private:
  // The implementations, called after the checks above passed (NVI: a backend cannot skip
  // them). Backend-specific conditions (device memory, size limits) stay in the backend.
  virtual absl::StatusOr<WeightMatrix> DoPrepareWeight(const WeightMatrix& host) = 0;
  virtual absl::StatusOr<WeightVector> DoPrepareVector(const WeightVector& host) = 0;
  virtual absl::Status DoLinear(ConstMatrixView x, const WeightMatrix& w, MatrixView y,
                                Precision p) = 0;
  virtual absl::Status DoSelectExperts(ConstMatrixView logits, const float* bias,
                                       const RoutingParams& params, int32_t* ids,
                                       float* weights) = 0;
  virtual absl::Status DoGluActivation(ConstMatrixView g, ConstMatrixView u,
                                       const ActivationParams& act, MatrixView out,
                                       Precision p) = 0;
  virtual absl::Status DoExpertMlp(ActivationView x, const ExpertAssignments& assignments,
                                   absl::Span<const MlpWeights> experts,
                                   const ActivationParams& act, PartialView y, Precision p) = 0;
  virtual absl::Status DoRmsNorm(ConstMatrixView x, const WeightVector& weight, float eps,
                                 MatrixView y, Precision p) = 0;
  virtual absl::Status DoAdd(ConstMatrixView a, ConstMatrixView b, MatrixView y, Precision p) = 0;
  virtual absl::Status DoRound(MatrixView y, Precision p) = 0;
  virtual absl::Status DoRoundPartials(ConstPartialView y, MatrixView out, Precision p) = 0;
  virtual absl::Status DoGatherRows(ConstMatrixView x, absl::Span<const int32_t> rows,
                                    MutableActivationView out) = 0;
  virtual absl::Status DoScatterAddRows(ConstPartialView partial, absl::Span<const int32_t> rows,
                                        PartialView y) = 0;
  virtual absl::Status DoZero(PartialView y) = 0;
  // Through a host fp32 staging copy and CopyToBackend / CopyToHost (device backends; the
  // conversion runs on the host, as one pass, beside the copy). Host backends convert in place.
  virtual absl::Status DoUploadRows(const ActivationRows& x, MatrixView y);
  virtual absl::Status DoDownloadRows(ConstMatrixView y, ActivationRows* out);
};

}  // namespace moe
