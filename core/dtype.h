// Element types of tensors at rest (checkpoints, wire) and their sizes.
#pragma once

#include <cstdint>
#include "absl/strings/string_view.h"

#include "absl/status/statusor.h"

namespace moe {

enum class DType : uint8_t { kBF16, kF16, kF32, kF64, kF8E4M3, kU8, kI8, kI32, kI64, kBool };

// Bytes per element.
size_t DTypeSize(DType t);

// Safetensors spelling: "BF16", "F16", "F32", "F64", "F8_E4M3", "U8", "I8", "I32", "I64", "BOOL".
absl::string_view DTypeName(DType t);
absl::StatusOr<DType> ParseDTypeName(absl::string_view name);

}  // namespace moe
