// Status propagation for the whole project.
//
// Abseil 20220623 (Debian 12) has no status macros, so they are defined once here.
// Every function below `main` returns absl::Status / absl::StatusOr<T>; the gRPC
// services convert to grpc::Status at one place (server/grpc_status.h).
#pragma once

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

#define MOE_STATUS_CONCAT_INNER(a, b) a##b
#define MOE_STATUS_CONCAT(a, b) MOE_STATUS_CONCAT_INNER(a, b)

// Returns from the enclosing function if `expr` (an absl::Status) is not OK.
#define RETURN_IF_ERROR(expr)                  \
  do {                                         \
    ::absl::Status moe_status_ = (expr);       \
    if (!moe_status_.ok()) return moe_status_; \
  } while (0)

// `lhs = value of expr` when OK, otherwise returns its status.
#define ASSIGN_OR_RETURN(lhs, expr) \
  MOE_ASSIGN_OR_RETURN_IMPL(MOE_STATUS_CONCAT(moe_statusor_, __LINE__), lhs, expr)

#define MOE_ASSIGN_OR_RETURN_IMPL(statusor, lhs, expr) \
  auto statusor = (expr);                              \
  if (!statusor.ok()) return statusor.status();        \
  lhs = std::move(statusor).value()

namespace moe {

// Prefixes a status message with context, keeping the code ("while loading layer 3: ...").
inline absl::Status Annotate(const absl::Status& status, absl::string_view context) {
  if (status.ok()) return status;
  return absl::Status(status.code(), absl::StrCat(context, ": ", status.message()));
}

}  // namespace moe

// Like RETURN_IF_ERROR, adding context to the message on the way out.
#define RETURN_IF_ERROR_CTX(expr, context)                               \
  do {                                                                   \
    ::absl::Status moe_status_ = (expr);                                 \
    if (!moe_status_.ok()) return ::moe::Annotate(moe_status_, context); \
  } while (0)
