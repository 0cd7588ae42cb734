#include "kernels/cpu/cpu_backend.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "core/log.h"
#include "core/status.h"
#include "kernels/cpu/canonical.h"
#include "kernels/cpu/tiers.h"
#include "kernels/router_rule.h"
#include "kernels/shape_checks.h"

namespace moe {
namespace {

class HostBuffer final : public DeviceBuffer {
 public:
  explicit HostBuffer(size_t bytes)
      : bytes_(bytes), data_(std::aligned_alloc(64, (bytes + 63) / 64 * 64 + 64)) {}
  ~HostBuffer() override { std::free(data_); }
  void* data() override { return data_; }
  size_t size() const override { return bytes_; }

 private:
  size_t bytes_;
  void* data_;
};

// Splits [0, n) into `parts` ranges whose boundaries are multiples of `align`.
void SplitAligned(int64_t n, int parts, int64_t align, int part, int64_t* begin, int64_t* end) {
  const int64_t blocks = (n + align - 1) / align;
  *begin = std::min(n, blocks * part / parts * align);
  *end = std::min(n, blocks * (part + 1) / parts * align);
}

// Rows of `row_cost` elements per chunk of a row-parallel op: at least kChunkElements each
// (~10-30 us of work), so a decode-sized op runs on the caller alone instead of paying a
// worker's wake-up (~40-100 us on the VMs we measured) for microseconds of work.
constexpr int64_t kChunkElements = int64_t{1} << 15;
int64_t RowsPerChunk(int64_t row_cost) {
  return std::max<int64_t>(1, kChunkElements / std::max<int64_t>(1, row_cost));
}

// The tier the options ask for.
absl::StatusOr<const cpu::DotKernels*> ResolveKernels(const CpuBackendOptions& options) {
  ASSIGN_OR_RETURN(const cpu::CpuTier* tier, options.kernels.empty()
                                                 ? cpu::DefaultCpuTier()
                                                 : cpu::SelectCpuTier(options.kernels));
  return tier->kernels();
}

}  // namespace

absl::StatusOr<std::unique_ptr<CpuBackend>> CpuBackend::Create(const CpuBackendOptions& options) {
  ASSIGN_OR_RETURN(const cpu::DotKernels* kernels, ResolveKernels(options));
  return std::unique_ptr<CpuBackend>(new CpuBackend(options, kernels));
}

CpuBackend::CpuBackend(const CpuBackendOptions& options)
    : CpuBackend(options, [&] {
        auto kernels = ResolveKernels(options);
        if (!kernels.ok()) {
          LogLine("CpuBackend: %s", kernels.status().ToString());
          std::abort();
        }
        return *kernels;
      }()) {}

CpuBackend::CpuBackend(const CpuBackendOptions& options, const cpu::DotKernels* kernels)
    : kernels_(kernels),
      pool_(options.num_threads),
      scratch_(pool_.num_threads()),
      thread_out_(pool_.num_threads()) {}

std::string CpuBackend::name() const {
  return absl::StrCat("cpu(", kernels_->name, ", ", pool_.num_threads(), " threads)");
}

absl::StatusOr<std::unique_ptr<DeviceBuffer>> CpuBackend::Allocate(size_t bytes) {
  auto buffer = std::make_unique<HostBuffer>(bytes);
  if (buffer->data() == nullptr)
    return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", bytes, " bytes"));
  return std::unique_ptr<DeviceBuffer>(std::move(buffer));
}

absl::Status CpuBackend::CopyToBackend(void* dst, const void* host_src, size_t bytes) {
  if (bytes) std::memcpy(dst, host_src, bytes);
  return absl::OkStatus();
}

absl::Status CpuBackend::CopyToHost(void* host_dst, const void* src, size_t bytes) {
  if (bytes) std::memcpy(host_dst, src, bytes);
  return absl::OkStatus();
}

absl::StatusOr<WeightMatrix> CpuBackend::DoPrepareWeight(const WeightMatrix& host) {
  if (host.space != MemorySpace::kHost)
    return absl::InvalidArgumentError("CPU backend needs host weights");
  return host;  // read in place
}

absl::StatusOr<WeightVector> CpuBackend::DoPrepareVector(const WeightVector& host) { return host; }

int64_t CpuBackend::PackRows(const ActivationView& x, WeightFormat format, Precision p,
                             cpu::AlignedBuffer* buffer) {
  const int64_t stride = cpu::PaddedK(x.cols);
  const size_t elem = ElementBytes(p);
  uint8_t* base = buffer->Reserve(x.rows * stride * elem);
  pool_.ParallelChunks(x.rows, RowsPerChunk(x.cols), [&](int64_t b, int64_t e, int) {
    // bf16 rows are widened one at a time into an L1-sized row (exact) for the tier's pack
    // kernel, which reads fp32: one set of vector pack kernels, and no fp32 copy of the rows.
    std::vector<float> widened(x.dtype == Precision::kBF16 ? x.cols : 0);
    for (int64_t r = b; r < e; ++r) {
      if (x.dtype == Precision::kBF16) {
        const uint16_t* bits = x.Bf16Row(r);
        for (int64_t c = 0; c < x.cols; ++c) widened[c] = Bf16BitsToFloat(bits[c]);
      }
      const float* row = x.dtype == Precision::kBF16 ? widened.data() : x.Fp32Row(r);
      kernels_->pack_row(row, x.cols, format, p, base + r * stride * elem);
    }
  });
  return stride;
}

void CpuBackend::ForRowBlocks(int64_t n, const std::function<void(int64_t, int64_t, int)>& fn) {
  // About eight chunks per thread: a thread that starts late (waking up) leaves its share to
  // the others, at one atomic increment per chunk.
  const int64_t align = kernels_->row_block;
  const int64_t blocks = (n + align - 1) / align;
  const int64_t per_chunk = std::max<int64_t>(1, blocks / (8 * pool_.num_threads()));
  pool_.ParallelChunks(n, per_chunk * align, fn);
}

absl::Status CpuBackend::DoLinear(ConstMatrixView x, const WeightMatrix& w, MatrixView y,
                                  Precision p) {
  if (x.rows == 0) return absl::OkStatus();
  std::lock_guard<std::mutex> lock(mu_);
  cpu::DotOperands op;
  op.x_stride = PackRows(x, w.format, p, &packed_x_);
  op.x = packed_x_.data();
  op.m = x.rows;
  op.w = &w;
  op.precision = p;
  // Blocks of operand rows small enough to stay in L2 (~512 KB) while the weight rows stream
  // past them; the canonical order does not depend on the blocking.
  const size_t row_bytes = op.x_stride * ElementBytes(p);
  const int64_t m_block =
      std::max<int64_t>(6, static_cast<int64_t>((512 << 10) / row_bytes) / 6 * 6);
  ForRowBlocks(w.rows, [&](int64_t n0, int64_t n1, int t) {
    for (int64_t i0 = 0; i0 < op.m; i0 += m_block) {
      cpu::DotOperands block = op;
      block.x = packed_x_.data() + i0 * row_bytes;
      block.m = std::min(m_block, op.m - i0);
      kernels_->dot_rows(block, n0, n1, y.Row(i0) + n0, y.stride, &scratch_[t]);
    }
    if (p == Precision::kBF16)
      for (int64_t i = 0; i < y.rows; ++i)
        for (int64_t n = n0; n < n1; ++n) y.Row(i)[n] = RoundToBf16(y.Row(i)[n]);
  });
  return absl::OkStatus();
}

absl::Status CpuBackend::DoSelectExperts(ConstMatrixView logits, const float* bias,
                                         const RoutingParams& params, int32_t* ids,
                                         float* weights) {
  const int E = params.num_experts, k = params.top_k;
  // As both seed gates do: a single expert keeps its raw score (no renormalization).
  const bool renormalize = params.renormalize && k > 1;
  std::lock_guard<std::mutex> lock(mu_);
  // Per token: E sigmoids and a partial sort, counted as 8 elements' work per expert.
  const int64_t tokens_per_chunk = RowsPerChunk(8 * int64_t{E});
  pool_.ParallelChunks(logits.rows, tokens_per_chunk, [&](int64_t b, int64_t e_end, int) {
    std::vector<float> score(E), biased(E);
    RouterScratch scratch(params);
    for (int64_t t = b; t < e_end; ++t) {
      const float* z = logits.Row(t);
      for (int e = 0; e < E; ++e) {
        score[e] = Sigmoid(z[e]);
        biased[e] = score[e] + (bias ? bias[e] : 0.0f);
      }
      RankExperts(params, biased.data(), scratch);
      const std::vector<int>& order = scratch.order;
      int32_t* out_ids = ids + t * k;
      float* out_w = weights + t * k;
      float sum = 0.0f;
      for (int j = 0; j < k; ++j) {
        out_ids[j] = order[j];
        out_w[j] = score[order[j]];
        sum = sum + out_w[j];
      }
      for (int j = 0; j < k; ++j) {
        if (renormalize) out_w[j] = out_w[j] / (sum + 1e-20f);
        out_w[j] = out_w[j] * params.routed_scaling_factor;
      }
    }
  });
  return absl::OkStatus();
}

absl::Status CpuBackend::DoGluActivation(ConstMatrixView g, ConstMatrixView u,
                                         const ActivationParams& act, MatrixView out, Precision p) {
  std::lock_guard<std::mutex> lock(mu_);
  pool_.ParallelChunks(g.rows, RowsPerChunk(g.cols), [&](int64_t b, int64_t e, int) {
    for (int64_t r = b; r < e; ++r)
      kernels_->glu_row(g.Row(r), u.Row(r), g.cols, act, p, out.Row(r));
  });
  return absl::OkStatus();
}

absl::Status CpuBackend::DoExpertMlp(ActivationView x, const ExpertAssignments& asg,
                                     absl::Span<const MlpWeights> experts,
                                     const ActivationParams& act, PartialView y, Precision p) {
  const int E = asg.num_experts();
  const int64_t hidden = experts[0].gate.rows;
  const WeightFormat in_format = experts[0].gate.format, hidden_format = experts[0].down.format;

  std::lock_guard<std::mutex> lock(mu_);
  const size_t elem = ElementBytes(p);
  const int64_t x_stride = PackRows(x, in_format, p, &packed_x_);
  // Hidden activations of every assignment, packed for the down projection.
  const int64_t h_stride = cpu::PaddedK(hidden);
  const int64_t assignments = asg.num_assignments();
  packed_hidden_.Reserve(assignments * h_stride * elem);
  const int threads = pool_.num_threads();
  const int64_t align = kernels_->row_block;

  // Phase 1: each thread owns a range of hidden units of every expert (disjoint weight rows),
  // in whole 64-element units so it can pack its part of each activation row on its own.
  pool_.RunOnAll([&](int t) {
    int64_t h0, h1;
    SplitAligned(hidden, threads, cpu::kPadK, t, &h0, &h1);
    if (h0 >= h1) return;
    const int64_t width = h1 - h0;
    for (int e = 0; e < E; ++e) {
      const int64_t m = asg.offsets[e + 1] - asg.offsets[e];
      if (m == 0) continue;
      std::vector<float>& out = thread_out_[t];
      if (out.size() < static_cast<size_t>(3 * m * width)) out.resize(3 * m * width);
      cpu::DotOperands op;
      op.x = packed_x_.data();
      op.x_stride = x_stride;
      op.x_rows = asg.rows.data() + asg.offsets[e];
      op.m = m;
      op.precision = p;
      op.w = &experts[e].gate;
      kernels_->dot_rows(op, h0, h1, out.data(), width, &scratch_[t]);
      op.w = &experts[e].up;
      kernels_->dot_rows(op, h0, h1, out.data() + m * width, width, &scratch_[t]);
      float* activated = out.data() + 2 * m * width;
      kernels_->glu_row(out.data(), out.data() + m * width, m * width, act, p, activated);
      // h0 is a multiple of 64, so the segment's canonical order is the row's, shifted by h0;
      // the last segment's zero padding ends exactly at h_stride.
      for (int64_t i = 0; i < m; ++i)
        kernels_->pack_row(activated + i * width, width, hidden_format, p,
                           packed_hidden_.data() + ((asg.offsets[e] + i) * h_stride + h0) * elem);
    }
  });

  // Phase 2: each thread owns a range of output features; experts in ascending order, so
  // every row accumulates its experts in one fixed order.
  pool_.RunOnAll([&](int t) {
    int64_t c0, c1;
    SplitAligned(x.cols, threads, align, t, &c0, &c1);
    if (c0 >= c1) return;
    const int64_t width = c1 - c0;
    for (int64_t r = 0; r < y.rows; ++r) std::fill(y.Row(r) + c0, y.Row(r) + c1, 0.0);
    for (int e = 0; e < E; ++e) {
      const int64_t begin = asg.offsets[e], m = asg.offsets[e + 1] - begin;
      if (m == 0) continue;
      std::vector<float>& out = thread_out_[t];
      if (out.size() < static_cast<size_t>(m * width)) out.resize(m * width);
      cpu::DotOperands op;
      op.x = packed_hidden_.data() + begin * h_stride * elem;
      op.x_stride = h_stride;
      op.m = m;
      op.precision = p;
      op.w = &experts[e].down;
      kernels_->dot_rows(op, c0, c1, out.data(), width, &scratch_[t]);
      for (int64_t i = 0; i < m; ++i) {
        double* yr = y.Row(asg.rows[begin + i]);
        const double gate = asg.gates[begin + i];
        for (int64_t c = c0; c < c1; ++c)
          yr[c] += static_cast<double>(RoundTo(p, out[i * width + (c - c0)])) * gate;
      }
    }
  });
  return absl::OkStatus();
}

absl::Status CpuBackend::DoRmsNorm(ConstMatrixView x, const WeightVector& weight, float eps,
                                   MatrixView y, Precision p) {
  std::lock_guard<std::mutex> lock(mu_);
  pool_.ParallelChunks(x.rows, RowsPerChunk(2 * x.cols), [&](int64_t b, int64_t e, int) {
    for (int64_t r = b; r < e; ++r) {
      const float* xr = x.Row(r);
      // Sum of squares in fp64 (exact enough to be order-independent), then one fp32 rounding.
      double ss = 0;
      for (int64_t c = 0; c < x.cols; ++c) ss += static_cast<double>(xr[c]) * xr[c];
      const float mean = static_cast<float>(ss / static_cast<double>(x.cols));
      const float inv = static_cast<float>(1.0 / std::sqrt(static_cast<double>(mean + eps)));
      float* yr = y.Row(r);
      for (int64_t c = 0; c < x.cols; ++c)
        yr[c] = RoundTo(p, RoundTo(p, xr[c] * inv) * Bf16BitsToFloat(weight.data[c]));
    }
  });
  return absl::OkStatus();
}

absl::Status CpuBackend::DoAdd(ConstMatrixView a, ConstMatrixView b, MatrixView y, Precision p) {
  for (int64_t r = 0; r < a.rows; ++r)
    for (int64_t c = 0; c < a.cols; ++c) y.Row(r)[c] = RoundTo(p, a.Row(r)[c] + b.Row(r)[c]);
  return absl::OkStatus();
}

absl::Status CpuBackend::DoRound(MatrixView y, Precision p) {
  if (p == Precision::kFP32) return absl::OkStatus();
  for (int64_t r = 0; r < y.rows; ++r)
    for (int64_t c = 0; c < y.cols; ++c) y.Row(r)[c] = RoundToBf16(y.Row(r)[c]);
  return absl::OkStatus();
}

absl::Status CpuBackend::DoRoundPartials(ConstPartialView y, MatrixView out, Precision p) {
  for (int64_t r = 0; r < y.rows; ++r)
    for (int64_t c = 0; c < y.cols; ++c) out.Row(r)[c] = RoundDoubleTo(p, y.Row(r)[c]);
  return absl::OkStatus();
}

absl::Status CpuBackend::DoGatherRows(ConstMatrixView x, absl::Span<const int32_t> rows,
                                      MutableActivationView out) {
  for (size_t i = 0; i < rows.size(); ++i) {
    if (out.dtype == Precision::kFP32)
      std::memcpy(out.Fp32Row(i), x.Row(rows[i]), x.cols * sizeof(float));
    else
      FloatsToBf16Bits(x.Row(rows[i]), x.cols, out.Bf16Row(i));
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::DoScatterAddRows(ConstPartialView partial, absl::Span<const int32_t> rows,
                                          PartialView y) {
  for (size_t i = 0; i < rows.size(); ++i) {
    double* yr = y.Row(rows[i]);
    const double* pr = partial.Row(i);
    for (int64_t c = 0; c < y.cols; ++c) yr[c] += pr[c];
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::DoZero(PartialView y) {
  for (int64_t r = 0; r < y.rows; ++r) std::fill(y.Row(r), y.Row(r) + y.cols, 0.0);
  return absl::OkStatus();
}

absl::Status CpuBackend::DoUploadRows(const ActivationRows& x, MatrixView y) {
  for (int64_t r = 0; r < y.rows; ++r)
    for (int64_t c = 0; c < y.cols; ++c) y.Row(r)[c] = x.Value(r * y.cols + c);
  return absl::OkStatus();
}

absl::Status CpuBackend::DoDownloadRows(ConstMatrixView y, ActivationRows* out) {
  for (int64_t r = 0; r < y.rows; ++r) {
    if (out->precision() == Precision::kFP32) {
      std::memcpy(static_cast<float*>(out->data()) + r * y.cols, y.Row(r), y.cols * sizeof(float));
    } else {
      FloatsToBf16Bits(y.Row(r), y.cols, static_cast<uint16_t*>(out->data()) + r * y.cols);
    }
  }
  return absl::OkStatus();
}

}  // namespace moe
