#include "kernels/cpu/canonical.h"
#include "kernels/cpu/dot.h"

namespace moe::cpu {
namespace {

void PortableDotRows(const DotOperands& op, int64_t n0, int64_t n1, float* y, int64_t ldy,
                     DotScratch* scratch) {
  const WeightMatrix& w = *op.w;
  const int64_t kp = PaddedK(w.cols);
  const bool bf16 = op.precision == Precision::kBF16;
  const size_t elem = bf16 ? sizeof(uint16_t) : sizeof(float);
  void* row = scratch->Reserve(kp * elem);
  for (int64_t n = n0; n < n1; ++n) {
    DecodeWeightRow(w, n, op.precision, row);
    const float* scales = w.format == WeightFormat::kFP8Block128 ? Fp8RowScales(w, n) : nullptr;
    for (int64_t i = 0; i < op.m; ++i) {
      const int64_t xr = op.x_rows ? op.x_rows[i] : i;
      float v;
      if (bf16) {
        v = CanonicalDotBf16(static_cast<const uint16_t*>(op.x) + xr * op.x_stride,
                             static_cast<const uint16_t*>(row), kp, scales);
      } else {
        v = CanonicalDotF32(static_cast<const float*>(op.x) + xr * op.x_stride,
                            static_cast<const float*>(row), kp, scales);
      }
      y[i * ldy + (n - n0)] = v;
    }
  }
}

}  // namespace

void PortableGluRow(const float* g, const float* u, int64_t n, const ActivationParams& act,
                    Precision precision, float* out) {
  for (int64_t i = 0; i < n; ++i)
    out[i] =
        RoundTo(precision, GluActivate(act, RoundTo(precision, g[i]), RoundTo(precision, u[i])));
}

const DotKernels* PortableDotKernels() {
  static const DotKernels kernels{"portable", &PortableDotRows, 1, &PortableGluRow,
                                  &PackActivationRow};
  return &kernels;
}

}  // namespace moe::cpu
