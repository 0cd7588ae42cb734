// The argument checks of every backend op, written once (kernels/backend.h: NVI). A backend's
// Do<Op> may assume them; what only one backend cares about (device memory, its size limits)
// it checks itself.
#include "kernels/backend.h"

#include <algorithm>
#include <vector>

#include "core/status.h"
#include "kernels/shape_checks.h"

namespace moe {
namespace {

// A view a kernel can walk: non-negative sizes, rows at least `cols` apart, data when not empty.
template <typename T>
absl::Status CheckView(absl::string_view op, absl::string_view name, const View2D<T>& v) {
  if (v.rows < 0 || v.cols < 0 || (v.rows > 0 && v.stride < v.cols))
    return ShapeError(op, absl::StrCat(name, " has stride ", v.stride, " < cols ", v.cols));
  if (v.rows > 0 && v.cols > 0 && v.data == nullptr)
    return ShapeError(op, absl::StrCat(name, " has no data"));
  return absl::OkStatus();
}

// An activation view's shape, for the checks above (they read the shape, never the data).
View2D<const uint8_t> ShapeOf(ActivationView v) {
  return View2D<const uint8_t>(static_cast<const uint8_t*>(v.data), v.rows, v.cols, v.stride);
}

absl::Status CheckRows(absl::string_view op, absl::Span<const int32_t> rows, int64_t limit) {
  for (int32_t r : rows)
    if (r < 0 || r >= limit) return ShapeError(op, absl::StrCat("row ", r, " out of range"));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<WeightMatrix> Backend::PrepareWeight(const WeightMatrix& host) {
  RETURN_IF_ERROR(host.Validate());
  if (host.format == WeightFormat::kMXFP4 && host.space == MemorySpace::kHost) {
    const auto* s = static_cast<const uint8_t*>(host.scales);
    const auto [lo, hi] = std::minmax_element(s, s + host.ScaleBytes());
    if (host.ScaleBytes() > 0 && (*lo < 2 || *hi > 252))
      return absl::InvalidArgumentError(absl::StrCat("MXFP4 weight [", host.rows, ", ", host.cols,
                                                     "] has E8M0 scales in [", *lo, ", ", *hi,
                                                     "]; supported: [2, 252]"));
  }
  return DoPrepareWeight(host);
}

absl::StatusOr<WeightVector> Backend::PrepareVector(const WeightVector& host) {
  if (host.data == nullptr || host.size <= 0)
    return absl::InvalidArgumentError("empty weight vector");
  return DoPrepareVector(host);
}

absl::Status Backend::Linear(ConstMatrixView x, const WeightMatrix& w, MatrixView y, Precision p) {
  RETURN_IF_ERROR(CheckView("Linear", "x", x));
  RETURN_IF_ERROR(CheckView("Linear", "y", y));
  if (x.cols != w.cols)
    return ShapeError("Linear", absl::StrCat("input width ", x.cols, " != weight cols ", w.cols));
  if (y.rows != x.rows || y.cols != w.rows)
    return ShapeError("Linear", absl::StrCat("output [", y.rows, ", ", y.cols, "] != [", x.rows,
                                             ", ", w.rows, "]"));
  return DoLinear(x, w, y, p);
}

absl::Status Backend::SelectExperts(ConstMatrixView logits, const float* bias,
                                    const RoutingParams& params, int32_t* ids, float* weights) {
  RETURN_IF_ERROR(CheckView("SelectExperts", "logits", logits));
  const int E = params.num_experts, k = params.top_k;
  if (logits.cols != E)
    return ShapeError("SelectExperts",
                      absl::StrCat("logits have ", logits.cols, " experts, expected ", E));
  if (k <= 0 || k > E)
    return ShapeError("SelectExperts", absl::StrCat("top_k ", k, " outside [1, ", E, "]"));
  const int groups = std::max(1, params.n_group);
  if (E % groups != 0 || params.topk_group < 1 || params.topk_group > groups)
    return ShapeError("SelectExperts", "bad expert grouping");
  if (groups > 1 && k > params.topk_group * (E / groups))
    return ShapeError("SelectExperts", absl::StrCat("top_k ", k, " exceeds the experts of the ",
                                                    params.topk_group, " kept groups"));
  if (logits.rows > 0 && (ids == nullptr || weights == nullptr))
    return ShapeError("SelectExperts", "no output arrays");
  return DoSelectExperts(logits, bias, params, ids, weights);
}

absl::Status Backend::GluActivation(ConstMatrixView g, ConstMatrixView u,
                                    const ActivationParams& act, MatrixView out, Precision p) {
  RETURN_IF_ERROR(CheckSameShape("GluActivation", g, u));
  RETURN_IF_ERROR(CheckSameShape("GluActivation", g, out));
  RETURN_IF_ERROR(CheckView("GluActivation", "g", g));
  RETURN_IF_ERROR(CheckView("GluActivation", "u", u));
  RETURN_IF_ERROR(CheckView("GluActivation", "out", out));
  return DoGluActivation(g, u, act, out, p);
}

absl::Status Backend::ExpertMlp(ActivationView x, const ExpertAssignments& asg,
                                absl::Span<const MlpWeights> experts, const ActivationParams& act,
                                PartialView y, Precision p) {
  const View2D<const uint8_t> x_shape = ShapeOf(x);
  RETURN_IF_ERROR(CheckSameShape("ExpertMlp", x_shape, y));
  RETURN_IF_ERROR(CheckView("ExpertMlp", "x", x_shape));
  if (x.dtype == Precision::kBF16 && p != Precision::kBF16)
    return ShapeError("ExpertMlp", "bf16 rows in an fp32 step");
  RETURN_IF_ERROR(CheckView("ExpertMlp", "y", y));
  const int E = asg.num_experts();
  if (static_cast<size_t>(E) != experts.size())
    return ShapeError("ExpertMlp",
                      absl::StrCat(E, " expert groups but ", experts.size(), " experts"));
  if (E == 0 || asg.num_assignments() == 0) return Zero(y);
  const int64_t hidden = experts[0].gate.rows;
  const WeightFormat in_format = experts[0].gate.format, hidden_format = experts[0].down.format;
  for (int e = 0; e < E; ++e) {
    const MlpWeights& w = experts[e];
    if (w.gate.cols != x.cols || w.up.cols != x.cols || w.down.rows != x.cols ||
        w.gate.rows != hidden || w.up.rows != hidden || w.down.cols != hidden)
      return ShapeError("ExpertMlp",
                        absl::StrCat("expert ", e, " shapes do not match input width ", x.cols));
    if (w.gate.format != in_format || w.up.format != in_format || w.down.format != hidden_format)
      return ShapeError("ExpertMlp", "experts of one call must share their weight formats");
    if (asg.offsets[e] > asg.offsets[e + 1])
      return ShapeError("ExpertMlp", "offsets not ascending");
  }
  if (asg.offsets[0] != 0 || asg.offsets[E] != asg.num_assignments() ||
      asg.gates.size() != asg.rows.size())
    return ShapeError("ExpertMlp", "malformed assignments");
  for (int32_t r : asg.rows)
    if (r < 0 || r >= x.rows)
      return ShapeError("ExpertMlp", absl::StrCat("assignment row ", r, " out of range"));
  return DoExpertMlp(x, asg, experts, act, y, p);
}

absl::Status Backend::RmsNorm(ConstMatrixView x, const WeightVector& weight, float eps,
                              MatrixView y, Precision p) {
  RETURN_IF_ERROR(CheckSameShape("RmsNorm", x, y));
  RETURN_IF_ERROR(CheckView("RmsNorm", "x", x));
  RETURN_IF_ERROR(CheckView("RmsNorm", "y", y));
  if (weight.size != x.cols)
    return ShapeError("RmsNorm", absl::StrCat("weight size ", weight.size, " != ", x.cols));
  return DoRmsNorm(x, weight, eps, y, p);
}

absl::Status Backend::Add(ConstMatrixView a, ConstMatrixView b, MatrixView y, Precision p) {
  RETURN_IF_ERROR(CheckSameShape("Add", a, b));
  RETURN_IF_ERROR(CheckSameShape("Add", a, y));
  RETURN_IF_ERROR(CheckView("Add", "a", a));
  RETURN_IF_ERROR(CheckView("Add", "b", b));
  RETURN_IF_ERROR(CheckView("Add", "y", y));
  return DoAdd(a, b, y, p);
}

absl::Status Backend::Round(MatrixView y, Precision p) {
  RETURN_IF_ERROR(CheckView("Round", "y", y));
  return DoRound(y, p);
}

absl::Status Backend::RoundPartials(ConstPartialView y, MatrixView out, Precision p) {
  RETURN_IF_ERROR(CheckSameShape("RoundPartials", y, out));
  RETURN_IF_ERROR(CheckView("RoundPartials", "y", y));
  RETURN_IF_ERROR(CheckView("RoundPartials", "out", out));
  return DoRoundPartials(y, out, p);
}

absl::Status Backend::GatherRows(ConstMatrixView x, absl::Span<const int32_t> rows,
                                 MutableActivationView out) {
  if (static_cast<int64_t>(rows.size()) != out.rows || out.cols != x.cols)
    return ShapeError("GatherRows", "output shape does not match the row list");
  RETURN_IF_ERROR(CheckView("GatherRows", "x", x));
  RETURN_IF_ERROR(CheckView("GatherRows", "out", ShapeOf(out)));
  RETURN_IF_ERROR(CheckRows("GatherRows", rows, x.rows));
  return DoGatherRows(x, rows, out);
}

absl::Status Backend::ScatterAddRows(ConstPartialView partial, absl::Span<const int32_t> rows,
                                     PartialView y) {
  if (static_cast<int64_t>(rows.size()) != partial.rows || partial.cols != y.cols)
    return ShapeError("ScatterAddRows", "partial shape does not match the row list");
  RETURN_IF_ERROR(CheckView("ScatterAddRows", "partial", partial));
  RETURN_IF_ERROR(CheckView("ScatterAddRows", "y", y));
  RETURN_IF_ERROR(CheckRows("ScatterAddRows", rows, y.rows));
  return DoScatterAddRows(partial, rows, y);
}

absl::Status Backend::Zero(PartialView y) {
  RETURN_IF_ERROR(CheckView("Zero", "y", y));
  return DoZero(y);
}

absl::Status Backend::UploadRows(const ActivationRows& x, MatrixView y) {
  RETURN_IF_ERROR(CheckView("UploadRows", "y", y));
  if (x.rows() != y.rows || x.cols() != y.cols)
    return ShapeError("UploadRows", absl::StrCat("rows [", x.rows(), ", ", x.cols(), "] != y [",
                                                 y.rows, ", ", y.cols, "]"));
  return DoUploadRows(x, y);
}

absl::Status Backend::DownloadRows(ConstMatrixView y, Precision p, ActivationRows* out) {
  RETURN_IF_ERROR(CheckView("DownloadRows", "y", y));
  *out = ActivationRows(p, y.rows, y.cols);
  return DoDownloadRows(y, out);
}

absl::Status Backend::DoUploadRows(const ActivationRows& x, MatrixView y) {
  const std::vector<float> staged = x.ToFloats();
  if (y.stride == y.cols)  // one copy for a whole, dense view
    return CopyToBackend(y.data, staged.data(), staged.size() * sizeof(float));
  for (int64_t r = 0; r < y.rows; ++r)
    RETURN_IF_ERROR(CopyToBackend(y.Row(r), staged.data() + r * y.cols, y.cols * sizeof(float)));
  return absl::OkStatus();
}

absl::Status Backend::DoDownloadRows(ConstMatrixView y, ActivationRows* out) {
  std::vector<float> staged(static_cast<size_t>(y.rows * y.cols));
  if (y.stride == y.cols) {
    RETURN_IF_ERROR(CopyToHost(staged.data(), y.data, staged.size() * sizeof(float)));
  } else {
    for (int64_t r = 0; r < y.rows; ++r)
      RETURN_IF_ERROR(CopyToHost(staged.data() + r * y.cols, y.Row(r), y.cols * sizeof(float)));
  }
  *out = ActivationRows::FromFloats(out->precision(), staged.data(), y.rows, y.cols);
  return absl::OkStatus();
}

}  // namespace moe
