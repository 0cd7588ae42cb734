#include "kernels/cuda/cuda_backend.h"

#include "kernels/shape_checks.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/growable_memory.h"
#include "kernels/cuda/launchers.h"

namespace moe {
namespace {

using cuda::StoredFormat;

static_assert(static_cast<int>(StoredFormat::kBF16) == static_cast<int>(WeightFormat::kBF16));
static_assert(static_cast<int>(StoredFormat::kMXFP4) == static_cast<int>(WeightFormat::kMXFP4));
static_assert(static_cast<int>(StoredFormat::kFP8Block128) ==
              static_cast<int>(WeightFormat::kFP8Block128));

StoredFormat Stored(WeightFormat f) { return static_cast<StoredFormat>(f); }

constexpr int64_t kFp8Block = 128;
constexpr size_t kAlign = 256;

int64_t RoundUp(int64_t v, int64_t m) { return (v + m - 1) / m * m; }
size_t AlignUp(size_t v) { return (v + kAlign - 1) / kAlign * kAlign; }

// Row width of a GEMM operand for input width k: FP8 weights are multiplied per 128-wide
// K-block, so their operands are zero-padded to whole blocks; others to a multiple of 8
// elements (16-byte rows for the vector loads and cuBLAS).
int64_t OperandCols(WeightFormat f, int64_t k) {
  return f == WeightFormat::kFP8Block128 ? RoundUp(k, kFp8Block) : RoundUp(k, 8);
}

absl::Status CheckDeviceWeight(absl::string_view op, const WeightMatrix& w) {
  if (w.space != MemorySpace::kDevice)
    return ShapeError(op, "weight is not in device memory (PrepareWeight it on this backend)");
  return w.Validate();
}

using DeviceGuard = cuda::ScopedDevice;

// Memory from Allocate. Freed only after the backend's queued work (which may still read
// it) has finished; must not outlive the backend.
class CudaDeviceBuffer final : public DeviceBuffer {
 public:
  CudaDeviceBuffer(int device, cudaStream_t stream, void* data, size_t size)
      : device_(device), stream_(stream), data_(data), size_(size) {}
  ~CudaDeviceBuffer() override {
    DeviceGuard guard(device_);
    cudaStreamSynchronize(stream_);
    cudaFree(data_);
  }
  void* data() override { return data_; }
  size_t size() const override { return size_; }

 private:
  int device_;
  cudaStream_t stream_;
  void* data_;
  size_t size_;
};

// Host arrays an op needs on the device, packed into one pinned buffer and sent with one
// asynchronous copy. The pinned buffer is rewritten only after the previous copy from it
// completed (event).
class HostBlob {
 public:
  // Appends `bytes` and returns the offset (kAlign-aligned) of the copy in the blob.
  size_t Add(const void* data, size_t bytes) {
    const size_t offset = AlignUp(bytes_.size());
    bytes_.resize(offset + bytes);
    if (bytes) std::memcpy(bytes_.data() + offset, data, bytes);
    return offset;
  }
  template <typename T>
  size_t Add(const std::vector<T>& v) {
    return Add(v.data(), v.size() * sizeof(T));
  }
  const std::vector<uint8_t>& bytes() const { return bytes_; }

 private:
  std::vector<uint8_t> bytes_;
};

}  // namespace

struct CudaBackend::Impl {
  CudaBackendOptions options;
  std::string description;
  cudaStream_t stream = nullptr;
  cublasHandle_t cublas = nullptr;
  void* cublas_workspace = nullptr;
  cudaEvent_t staging_done = nullptr;
  cuda::PinnedMemory staging;

  std::mutex mu;  // one op at a time: the scratch buffers are shared
  std::vector<void*> weight_allocations;
  int64_t weight_bytes = 0;

  // Scratch buffers (see the ops below), grown through Reserve.
  cuda::DeviceMemory operand;   // packed GEMM operand (Linear) / gathered expert input (ExpertMlp)
  cuda::DeviceMemory decoded;   // decoded weight for the cuBLAS path
  cuda::DeviceMemory partials;  // FP8 per-K-block partials
  cuda::DeviceMemory gate_up;   // ExpertMlp: [A, 2 * hidden] fp32 (gate | up)
  cuda::DeviceMemory hidden;    // ExpertMlp: packed hidden activations
  cuda::DeviceMemory out;       // ExpertMlp: [A, in] fp32 expert outputs
  cuda::DeviceMemory index;     // device copy of the op's host arrays (HostBlob)

  ~Impl() {
    DeviceGuard guard(options.device);
    if (stream != nullptr) cudaStreamSynchronize(stream);
    for (void* p : weight_allocations) cudaFree(p);
    if (cublas != nullptr) cublasDestroy(cublas);
    cudaFree(cublas_workspace);
    if (staging_done != nullptr) cudaEventDestroy(staging_done);
    if (stream != nullptr) cudaStreamDestroy(stream);
  }

  // Scratch `m` with room for `bytes`. Growing waits for the stream first: queued kernels may
  // still read the old buffer.
  absl::StatusOr<void*> Reserve(cuda::DeviceMemory& m, size_t bytes) {
    if (!m.Fits(bytes)) CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
    RETURN_IF_ERROR(m.Ensure(bytes));
    return m.get();
  }

  bool bf16(Precision p) const { return p == Precision::kBF16; }

  // Copies `blob` to device scratch `index` through the pinned staging buffer; returns the
  // device base address (blob offsets apply).
  absl::StatusOr<uint8_t*> Upload(const HostBlob& blob) {
    const size_t bytes = blob.bytes().size();
    if (bytes == 0) return nullptr;
    CUDA_RETURN_IF_ERROR(cudaEventSynchronize(staging_done));  // previous copy done
    RETURN_IF_ERROR(staging.Ensure(bytes));
    std::memcpy(staging.get(), blob.bytes().data(), bytes);
    ASSIGN_OR_RETURN(void* dst, Reserve(index, bytes));
    CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(dst, staging.get(), bytes, cudaMemcpyHostToDevice, stream));
    CUDA_RETURN_IF_ERROR(cudaEventRecord(staging_done, stream));
    return static_cast<uint8_t*>(dst);
  }

  bool GemvEligible(int64_t m, const WeightMatrix& w) const {
    return options.gemv_max_rows > 0 && m <= options.gemv_max_rows &&
           (reinterpret_cast<uintptr_t>(w.data) & 15) == 0;
  }

  // y[m, N] (fp32, row stride ldy) = a[m, K] W^T, raw fp32 sums (not rounded). `a` is a packed
  // operand (bf16 bits in bf16 mode, else fp32) with row stride lda >= OperandCols(format, K),
  // zero-padded up to OperandCols.
  absl::Status MatMul(const void* a, int64_t lda, int64_t m, const WeightMatrix& w, Precision p,
                      float* y, int64_t ldy) {
    if (m == 0) return absl::OkStatus();
    const bool b16 = bf16(p);
    const int64_t N = w.rows, K = w.cols;
    if (GemvEligible(m, w)) {
      cuda::GemvTask task{w.data, w.scales, 0, static_cast<int32_t>(m), 0, 0};
      CUDA_RETURN_IF_ERROR(cuda::LaunchGroupedGemv(Stored(w.format), N, K, nullptr, 1, task,
                                                   static_cast<int>(m), a, lda, b16, y, ldy,
                                                   stream));
      return absl::OkStatus();
    }
    if (N > INT_MAX || K > INT_MAX || m > INT_MAX || lda > INT_MAX || ldy > INT_MAX)
      return absl::InvalidArgumentError(absl::StrCat("GEMM [", m, " x ", K, "] x [", N, " x ", K,
                                                     "]^T exceeds cuBLAS int sizes"));
    const cudaDataType_t type = b16 ? CUDA_R_16BF : CUDA_R_32F;
    const cublasComputeType_t compute = b16 ? CUBLAS_COMPUTE_32F : CUBLAS_COMPUTE_32F_PEDANTIC;
    const size_t esize = b16 ? 2 : 4;
    const float alpha = 1.0f, beta = 0.0f;

    // The weight operand: bf16 weights in place (bf16 mode), everything else decoded to
    // exact values (FP8 without its scales, K zero-padded to whole 128-blocks).
    const void* wdata = w.data;
    int64_t ldw = K;
    const bool fp8 = w.format == WeightFormat::kFP8Block128;
    if (fp8 || w.format == WeightFormat::kMXFP4 || !b16) {
      ldw = fp8 ? RoundUp(K, kFp8Block) : K;
      ASSIGN_OR_RETURN(void* dec, Reserve(decoded, static_cast<size_t>(N * ldw) * esize));
      CUDA_RETURN_IF_ERROR(cuda::LaunchDecodeWeight(Stored(w.format), w.data, w.scales, N, K, dec,
                                                    ldw, ldw, b16, stream));
      wdata = dec;
    }
    if (!fp8) {
      // Column-major view: C[N, m] = W^T-op(A)[N, K] * B[K, m] with A = W (ld K), B = a.
      CUBLAS_RETURN_IF_ERROR(cublasGemmEx(cublas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(N),
                                          static_cast<int>(m), static_cast<int>(K), &alpha, wdata,
                                          type, static_cast<int>(ldw), a, type,
                                          static_cast<int>(lda), &beta, y, CUDA_R_32F,
                                          static_cast<int>(ldy), compute, CUBLAS_GEMM_DEFAULT));
      return absl::OkStatus();
    }
    // FP8: one GEMM per 128-wide K-block (strided batch), then the scaled block sum.
    const int64_t nb = ldw / kFp8Block;
    const int64_t per_row = nb * N * static_cast<int64_t>(sizeof(float));
    const int64_t chunk = std::max<int64_t>(
        1, std::min<int64_t>(m, options.fp8_partials_bytes / std::max<int64_t>(per_row, 1)));
    ASSIGN_OR_RETURN(void* part, Reserve(partials, static_cast<size_t>(chunk * per_row)));
    auto* part_f = static_cast<float*>(part);
    for (int64_t m0 = 0; m0 < m; m0 += chunk) {
      const int64_t mc = std::min(chunk, m - m0);
      const void* a0 = static_cast<const uint8_t*>(a) + static_cast<size_t>(m0 * lda) * esize;
      CUBLAS_RETURN_IF_ERROR(cublasGemmStridedBatchedEx(
          cublas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(N), static_cast<int>(mc),
          static_cast<int>(kFp8Block), &alpha, wdata, type, static_cast<int>(ldw), kFp8Block, a0,
          type, static_cast<int>(lda), kFp8Block, &beta, part_f, CUDA_R_32F, static_cast<int>(N),
          N * mc, static_cast<int>(nb), compute, CUBLAS_GEMM_DEFAULT));
      CUDA_RETURN_IF_ERROR(cuda::LaunchFp8BlockReduce(part_f, mc, N, nb,
                                                      static_cast<const float*>(w.scales),
                                                      y + m0 * ldy, ldy, false, stream));
    }
    return absl::OkStatus();
  }
};

// ---- creation ---------------------------------------------------------------------------------

int CudaDeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear
    return 0;
  }
  return count;
}

std::string CudaUnavailableReason() {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return absl::StrCat("no CUDA device: ", cudaGetErrorName(err), " (", cudaGetErrorString(err),
                        ")");
  }
  if (count == 0) return "no CUDA device: cudaGetDeviceCount reports 0 devices";
  return "";
}

CudaBackend::CudaBackend(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CudaBackend::~CudaBackend() = default;

absl::StatusOr<std::unique_ptr<CudaBackend>> CudaBackend::Create(
    const CudaBackendOptions& options) {
  const std::string reason = CudaUnavailableReason();
  if (!reason.empty()) return absl::UnavailableError(absl::StrCat("CUDA backend: ", reason));
  const int count = CudaDeviceCount();
  if (options.device < 0 || options.device >= count)
    return absl::UnavailableError(absl::StrCat("CUDA backend: device ", options.device,
                                               " not present (", count, " devices)"));
  DeviceGuard guard(options.device);
  CUDA_RETURN_IF_ERROR(guard.status());
  cudaDeviceProp prop;
  CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, options.device));
  if (prop.major < 9)
    return absl::UnavailableError(absl::StrCat("CUDA backend: device ", options.device, " (",
                                               prop.name, ", sm_", prop.major, prop.minor,
                                               ") is older than the sm_90 this build targets"));
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  if (const char* env = std::getenv("MOE_CUDA_GEMV_MAX_ROWS")) {
    int v;
    if (absl::SimpleAtoi(env, &v) && v >= 0) impl->options.gemv_max_rows = v;
  }
  impl->description = absl::StrCat("cuda(", options.device, ": ", prop.name, ", sm_", prop.major,
                                   prop.minor, ", ", prop.totalGlobalMem >> 30, " GiB)");
  CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&impl->stream, cudaStreamNonBlocking));
  CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&impl->staging_done, cudaEventDisableTiming));
  CUBLAS_RETURN_IF_ERROR(cublasCreate(&impl->cublas));
  CUBLAS_RETURN_IF_ERROR(cublasSetStream(impl->cublas, impl->stream));
  CUBLAS_RETURN_IF_ERROR(cublasSetPointerMode(impl->cublas, CUBLAS_POINTER_MODE_HOST));
  // Default math (no TF32 anywhere: fp32 GEMMs also ask for CUBLAS_COMPUTE_32F_PEDANTIC);
  // no reduced-precision split-K reductions.
  CUBLAS_RETURN_IF_ERROR(cublasSetMathMode(
      impl->cublas, static_cast<cublasMath_t>(CUBLAS_DEFAULT_MATH |
                                              CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)));
  if (options.cublas_workspace_bytes > 0) {
    CUDA_RETURN_IF_ERROR(
        cudaMalloc(&impl->cublas_workspace, static_cast<size_t>(options.cublas_workspace_bytes)));
    CUBLAS_RETURN_IF_ERROR(cublasSetWorkspace(impl->cublas, impl->cublas_workspace,
                                              static_cast<size_t>(options.cublas_workspace_bytes)));
  }
  return std::unique_ptr<CudaBackend>(new CudaBackend(std::move(impl)));
}

absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(int device) {
  CudaBackendOptions options;
  options.device = device;
  ASSIGN_OR_RETURN(std::unique_ptr<CudaBackend> backend, CudaBackend::Create(options));
  return std::unique_ptr<Backend>(std::move(backend));
}

std::string CudaBackend::name() const { return impl_->description; }
int CudaBackend::device() const { return impl_->options.device; }
CUstream_st* CudaBackend::stream() const { return impl_->stream; }
const CudaBackendOptions& CudaBackend::options() const { return impl_->options; }
void CudaBackend::set_gemv_max_rows(int rows) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->options.gemv_max_rows = std::max(0, rows);
}
int64_t CudaBackend::weight_bytes() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->weight_bytes;
}

// ---- memory -------------------------------------------------------------------------------

#define MOE_CUDA_OP_PROLOGUE()                 \
  std::lock_guard<std::mutex> lock(impl_->mu); \
  DeviceGuard guard(impl_->options.device);    \
  CUDA_RETURN_IF_ERROR(guard.status())

absl::StatusOr<std::unique_ptr<DeviceBuffer>> CudaBackend::Allocate(size_t bytes) {
  MOE_CUDA_OP_PROLOGUE();
  void* data = nullptr;
  CUDA_RETURN_IF_ERROR(cudaMalloc(&data, std::max<size_t>(bytes, 1)));
  return std::unique_ptr<DeviceBuffer>(
      new CudaDeviceBuffer(impl_->options.device, impl_->stream, data, bytes));
}

absl::Status CudaBackend::CopyToBackend(void* dst, const void* host_src, size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  MOE_CUDA_OP_PROLOGUE();
  CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(dst, host_src, bytes, cudaMemcpyHostToDevice, impl_->stream));
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(impl_->stream));
  return absl::OkStatus();
}

absl::Status CudaBackend::CopyToHost(void* host_dst, const void* src, size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  MOE_CUDA_OP_PROLOGUE();
  CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(host_dst, src, bytes, cudaMemcpyDeviceToHost, impl_->stream));
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(impl_->stream));
  return absl::OkStatus();
}

absl::StatusOr<WeightMatrix> CudaBackend::DoPrepareWeight(const WeightMatrix& host) {
  if (host.space == MemorySpace::kDevice) {
    if ((reinterpret_cast<uintptr_t>(host.data) & 15) != 0)
      return absl::InvalidArgumentError("device weight data must be 16-byte aligned");
    return host;
  }
  MOE_CUDA_OP_PROLOGUE();
  const size_t data_bytes = static_cast<size_t>(host.DataBytes());
  const size_t scale_bytes = static_cast<size_t>(host.ScaleBytes());
  const size_t scale_offset = AlignUp(data_bytes);
  void* mem = nullptr;
  CUDA_RETURN_IF_ERROR(cudaMalloc(&mem, scale_offset + std::max<size_t>(scale_bytes, 1)));
  impl_->weight_allocations.push_back(mem);
  auto* base = static_cast<uint8_t*>(mem);
  CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(base, host.data, data_bytes, cudaMemcpyHostToDevice, impl_->stream));
  if (scale_bytes > 0)
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(base + scale_offset, host.scales, scale_bytes,
                                         cudaMemcpyHostToDevice, impl_->stream));
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(impl_->stream));
  impl_->weight_bytes += static_cast<int64_t>(data_bytes + scale_bytes);
  WeightMatrix out = host;
  out.data = base;
  out.scales = scale_bytes > 0 ? base + scale_offset : nullptr;
  out.space = MemorySpace::kDevice;
  return out;
}

absl::StatusOr<WeightVector> CudaBackend::DoPrepareVector(const WeightVector& host) {
  if (host.space == MemorySpace::kDevice) return host;
  MOE_CUDA_OP_PROLOGUE();
  const size_t bytes = static_cast<size_t>(host.size) * sizeof(uint16_t);
  void* mem = nullptr;
  CUDA_RETURN_IF_ERROR(cudaMalloc(&mem, bytes));
  impl_->weight_allocations.push_back(mem);
  CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(mem, host.data, bytes, cudaMemcpyHostToDevice, impl_->stream));
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(impl_->stream));
  impl_->weight_bytes += static_cast<int64_t>(bytes);
  WeightVector out = host;
  out.data = static_cast<const uint16_t*>(mem);
  out.space = MemorySpace::kDevice;
  return out;
}

absl::Status CudaBackend::Synchronize() {
  MOE_CUDA_OP_PROLOGUE();
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(impl_->stream));
  return absl::OkStatus();
}

// ---- ops ----------------------------------------------------------------------------------

absl::Status CudaBackend::DoLinear(ConstMatrixView x, const WeightMatrix& w, MatrixView y,
                                   Precision p) {
  RETURN_IF_ERROR(CheckDeviceWeight("Linear", w));
  if (x.rows == 0) return absl::OkStatus();
  MOE_CUDA_OP_PROLOGUE();
  Impl& im = *impl_;
  const bool b16 = im.bf16(p);
  const int64_t lda = OperandCols(w.format, x.cols);
  ASSIGN_OR_RETURN(void* a,
                   im.Reserve(im.operand, static_cast<size_t>(x.rows * lda) * (b16 ? 2 : 4)));
  CUDA_RETURN_IF_ERROR(cuda::LaunchPackOperand(x.data, x.stride, nullptr, x.rows, x.cols, a, lda,
                                               lda, b16, im.stream));
  RETURN_IF_ERROR(im.MatMul(a, lda, x.rows, w, p, y.data, y.stride));
  if (b16) CUDA_RETURN_IF_ERROR(cuda::LaunchRoundBf16(y.data, y.rows, y.cols, y.stride, im.stream));
  return absl::OkStatus();
}

absl::Status CudaBackend::DoSelectExperts(ConstMatrixView logits, const float* bias,
                                          const RoutingParams& params, int32_t* ids,
                                          float* weights) {
  const int E = params.num_experts, k = params.top_k;
  const int groups = std::max(1, params.n_group);
  if (E > 4096) return ShapeError("SelectExperts", "more than 4096 experts");
  if (logits.rows == 0) return absl::OkStatus();
  MOE_CUDA_OP_PROLOGUE();
  const bool renormalize = params.renormalize && k > 1;
  CUDA_RETURN_IF_ERROR(cuda::LaunchSelectExperts(
      logits.data, logits.stride, logits.rows, bias, E, k, renormalize,
      params.routed_scaling_factor, groups, params.topk_group, ids, weights, impl_->stream));
  return absl::OkStatus();
}

absl::Status CudaBackend::DoGluActivation(ConstMatrixView g, ConstMatrixView u,
                                          const ActivationParams& act, MatrixView out,
                                          Precision p) {
  MOE_CUDA_OP_PROLOGUE();
  CUDA_RETURN_IF_ERROR(cuda::LaunchGluActivation(
      g.data, g.stride, u.data, u.stride, g.rows, g.cols, act, impl_->bf16(p),
      /*round_inputs=*/true, out.data, out.stride, out.cols, /*out_bf16=*/false, impl_->stream));
  return absl::OkStatus();
}

absl::Status CudaBackend::DoExpertMlp(ActivationView x, const ExpertAssignments& asg,
                                      absl::Span<const MlpWeights> experts,
                                      const ActivationParams& act, PartialView y, Precision p) {
  const int E = asg.num_experts();
  const int64_t in = x.cols, hidden = experts[0].gate.rows;
  const WeightFormat in_format = experts[0].gate.format, hidden_format = experts[0].down.format;
  for (int e = 0; e < E; ++e) {
    const MlpWeights& w = experts[e];
    RETURN_IF_ERROR(CheckDeviceWeight("ExpertMlp", w.gate));
    RETURN_IF_ERROR(CheckDeviceWeight("ExpertMlp", w.up));
    RETURN_IF_ERROR(CheckDeviceWeight("ExpertMlp", w.down));
  }
  const int64_t A = asg.num_assignments(), M = x.rows;
  if (A > INT32_MAX / 2) return ShapeError("ExpertMlp", "too many assignments");

  MOE_CUDA_OP_PROLOGUE();
  Impl& im = *impl_;
  const bool b16 = im.bf16(p);
  const size_t esize = b16 ? 2 : 4;
  const int64_t in_cols = OperandCols(in_format, in);
  const int64_t h_cols = OperandCols(hidden_format, hidden);

  // Host index: per row, its assignment slots in ascending expert order (the combine order).
  std::vector<int32_t> row_offsets(M + 1, 0), slots(A);
  for (int32_t r : asg.rows) ++row_offsets[r + 1];
  for (int64_t r = 0; r < M; ++r) row_offsets[r + 1] += row_offsets[r];
  {
    std::vector<int32_t> fill(row_offsets.begin(), row_offsets.end() - 1);
    for (int64_t i = 0; i < A; ++i) slots[fill[asg.rows[i]]++] = static_cast<int32_t>(i);
  }
  // Small experts go through the grouped GEMV (gate and up in one launch, down in another);
  // the others through MatMul (dequantize + cuBLAS).
  std::vector<cuda::GemvTask> gate_up_tasks, down_tasks;
  std::vector<int> large;
  int max_small_m = 0;
  for (int e = 0; e < E; ++e) {
    const int32_t off = asg.offsets[e], m = asg.offsets[e + 1] - off;
    if (m == 0) continue;
    const MlpWeights& w = experts[e];
    if (im.GemvEligible(m, w.gate) && im.GemvEligible(m, w.up) && im.GemvEligible(m, w.down)) {
      gate_up_tasks.push_back({w.gate.data, w.gate.scales, off, m, off, 0});
      gate_up_tasks.push_back({w.up.data, w.up.scales, off, m, off, static_cast<int32_t>(hidden)});
      down_tasks.push_back({w.down.data, w.down.scales, off, m, off, 0});
      max_small_m = std::max<int>(max_small_m, m);
    } else {
      large.push_back(e);
    }
  }
  HostBlob blob;
  const size_t rows_at = blob.Add(asg.rows), gates_at = blob.Add(asg.gates);
  const size_t offsets_at = blob.Add(row_offsets), slots_at = blob.Add(slots);
  const size_t gu_at = blob.Add(gate_up_tasks), down_at = blob.Add(down_tasks);
  ASSIGN_OR_RETURN(uint8_t * dev, im.Upload(blob));
  const auto* d_rows = reinterpret_cast<const int32_t*>(dev + rows_at);
  const auto* d_gates = reinterpret_cast<const float*>(dev + gates_at);
  const auto* d_offsets = reinterpret_cast<const int32_t*>(dev + offsets_at);
  const auto* d_slots = reinterpret_cast<const int32_t*>(dev + slots_at);
  const auto* d_gu = reinterpret_cast<const cuda::GemvTask*>(dev + gu_at);
  const auto* d_down = reinterpret_cast<const cuda::GemvTask*>(dev + down_at);

  // 1. The gathered operand: row i is x[rows[i]] (expert-grouped order).
  ASSIGN_OR_RETURN(void* xg, im.Reserve(im.operand, static_cast<size_t>(A * in_cols) * esize));
  CUDA_RETURN_IF_ERROR(
      x.dtype == Precision::kBF16
          ? cuda::LaunchPackBf16Operand(static_cast<const uint16_t*>(x.data), x.stride, d_rows, A,
                                        in, xg, in_cols, in_cols, b16, im.stream)
          : cuda::LaunchPackOperand(static_cast<const float*>(x.data), x.stride, d_rows, A, in, xg,
                                    in_cols, in_cols, b16, im.stream));
  // 2. gate | up: [A, 2 * hidden] raw fp32.
  ASSIGN_OR_RETURN(void* gu_raw, im.Reserve(im.gate_up, static_cast<size_t>(A * 2 * hidden) * 4));
  auto* gu = static_cast<float*>(gu_raw);
  if (!gate_up_tasks.empty())
    CUDA_RETURN_IF_ERROR(cuda::LaunchGroupedGemv(
        Stored(in_format), hidden, in, d_gu, static_cast<int>(gate_up_tasks.size()), {},
        max_small_m, xg, in_cols, b16, gu, 2 * hidden, im.stream));
  for (int e : large) {
    const int64_t off = asg.offsets[e], m = asg.offsets[e + 1] - off;
    const void* a = static_cast<const uint8_t*>(xg) + static_cast<size_t>(off * in_cols) * esize;
    RETURN_IF_ERROR(
        im.MatMul(a, in_cols, m, experts[e].gate, p, gu + off * 2 * hidden, 2 * hidden));
    RETURN_IF_ERROR(
        im.MatMul(a, in_cols, m, experts[e].up, p, gu + off * 2 * hidden + hidden, 2 * hidden));
  }
  // 3. a = round(act(round(g), round(u))), packed as the down projection's operand.
  ASSIGN_OR_RETURN(void* h, im.Reserve(im.hidden, static_cast<size_t>(A * h_cols) * esize));
  CUDA_RETURN_IF_ERROR(cuda::LaunchGluActivation(gu, 2 * hidden, gu + hidden, 2 * hidden, A, hidden,
                                                 act, b16, /*round_inputs=*/true, h, h_cols, h_cols,
                                                 /*out_bf16=*/b16, im.stream));
  // 4. o = a W2^T: [A, in] raw fp32.
  ASSIGN_OR_RETURN(void* o_raw, im.Reserve(im.out, static_cast<size_t>(A * in) * 4));
  auto* o = static_cast<float*>(o_raw);
  if (!down_tasks.empty())
    CUDA_RETURN_IF_ERROR(cuda::LaunchGroupedGemv(Stored(hidden_format), in, hidden, d_down,
                                                 static_cast<int>(down_tasks.size()), {},
                                                 max_small_m, h, h_cols, b16, o, in, im.stream));
  for (int e : large) {
    const int64_t off = asg.offsets[e], m = asg.offsets[e + 1] - off;
    const void* a = static_cast<const uint8_t*>(h) + static_cast<size_t>(off * h_cols) * esize;
    RETURN_IF_ERROR(im.MatMul(a, h_cols, m, experts[e].down, p, o + off * in, in));
  }
  // 5. y[r] = sum over r's slots (ascending expert) of double(round(o)) * gate, in fp64.
  CUDA_RETURN_IF_ERROR(cuda::LaunchExpertCombine(o, in, d_gates, d_offsets, d_slots, M, in, b16,
                                                 y.data, y.stride, im.stream));
  return absl::OkStatus();
}

absl::Status CudaBackend::DoRmsNorm(ConstMatrixView x, const WeightVector& weight, float eps,
                                    MatrixView y, Precision p) {
  if (weight.space != MemorySpace::kDevice)
    return ShapeError("RmsNorm", "weight is not in device memory (PrepareVector it first)");
  MOE_CUDA_OP_PROLOGUE();
  CUDA_RETURN_IF_ERROR(cuda::LaunchRmsNorm(x.data, x.stride, weight.data, eps, y.data, y.stride,
                                           x.rows, x.cols, impl_->bf16(p), impl_->stream));
  return absl::OkStatus();
}

absl::Status CudaBackend::DoAdd(ConstMatrixView a, ConstMatrixView b, MatrixView y, Precision p) {
  MOE_CUDA_OP_PROLOGUE();
  CUDA_RETURN_IF_ERROR(cuda::LaunchAdd(a.data, a.stride, b.data, b.stride, y.data, y.stride, a.rows,
                                       a.cols, impl_->bf16(p), impl_->stream));
  return absl::OkStatus();
}

absl::Status CudaBackend::DoRound(MatrixView y, Precision p) {
  if (p == Precision::kFP32) return absl::OkStatus();
  MOE_CUDA_OP_PROLOGUE();
  CUDA_RETURN_IF_ERROR(cuda::LaunchRoundBf16(y.data, y.rows, y.cols, y.stride, impl_->stream));
  return absl::OkStatus();
}

absl::Status CudaBackend::DoRoundPartials(ConstPartialView y, MatrixView out, Precision p) {
  MOE_CUDA_OP_PROLOGUE();
  CUDA_RETURN_IF_ERROR(cuda::LaunchRoundPartials(y.data, y.stride, out.data, out.stride, y.rows,
                                                 y.cols, impl_->bf16(p), impl_->stream));
  return absl::OkStatus();
}

absl::Status CudaBackend::DoGatherRows(ConstMatrixView x, absl::Span<const int32_t> rows,
                                       MutableActivationView out) {
  if (rows.empty()) return absl::OkStatus();
  MOE_CUDA_OP_PROLOGUE();
  HostBlob blob;
  blob.Add(rows.data(), rows.size() * sizeof(int32_t));
  ASSIGN_OR_RETURN(uint8_t * dev, impl_->Upload(blob));
  CUDA_RETURN_IF_ERROR(cuda::LaunchGatherRows(
      x.data, x.stride, reinterpret_cast<const int32_t*>(dev), out.rows, out.cols, out.data,
      out.stride, out.dtype == Precision::kBF16, impl_->stream));
  return absl::OkStatus();
}

absl::Status CudaBackend::DoScatterAddRows(ConstPartialView partial, absl::Span<const int32_t> rows,
                                           PartialView y) {
  std::vector<uint8_t> seen(static_cast<size_t>(y.rows), 0);
  bool unique = true;  // rows in range: checked by Backend::ScatterAddRows
  for (int32_t r : rows) {
    unique = unique && !seen[r];
    seen[r] = 1;
  }
  if (rows.empty()) return absl::OkStatus();
  MOE_CUDA_OP_PROLOGUE();
  HostBlob blob;
  blob.Add(rows.data(), rows.size() * sizeof(int32_t));
  ASSIGN_OR_RETURN(uint8_t * dev, impl_->Upload(blob));
  CUDA_RETURN_IF_ERROR(cuda::LaunchScatterAddRows(
      partial.data, partial.stride, reinterpret_cast<const int32_t*>(dev), partial.rows,
      partial.cols, y.data, y.stride, unique, impl_->stream));
  return absl::OkStatus();
}

absl::Status CudaBackend::DoZero(PartialView y) {
  if (y.rows == 0 || y.cols == 0) return absl::OkStatus();
  MOE_CUDA_OP_PROLOGUE();
  CUDA_RETURN_IF_ERROR(cudaMemset2DAsync(y.data, y.stride * sizeof(double), 0,
                                         y.cols * sizeof(double), y.rows, impl_->stream));
  return absl::OkStatus();
}

}  // namespace moe
