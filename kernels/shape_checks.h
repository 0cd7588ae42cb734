// Argument checks shared by the backends: one wording for every shape error.
#pragma once

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/backend.h"

namespace moe {

inline absl::Status ShapeError(absl::string_view op, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(op, ": ", what));
}

template <typename A, typename B>
absl::Status CheckSameShape(absl::string_view op, const View2D<A>& a, const View2D<B>& b) {
  if (a.rows != b.rows || a.cols != b.cols)
    return ShapeError(
        op, absl::StrCat("shape [", a.rows, ", ", a.cols, "] vs [", b.rows, ", ", b.cols, "]"));
  return absl::OkStatus();
}

}  // namespace moe
