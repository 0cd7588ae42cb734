#include "core/dtype.h"

#include "absl/strings/str_cat.h"

namespace moe {
namespace {
struct DTypeEntry {
  DType type;
  absl::string_view name;
  size_t size;
};
constexpr DTypeEntry kDTypes[] = {
    {DType::kBF16, "BF16", 2}, {DType::kF16, "F16", 2},        {DType::kF32, "F32", 4},
    {DType::kF64, "F64", 8},   {DType::kF8E4M3, "F8_E4M3", 1}, {DType::kU8, "U8", 1},
    {DType::kI8, "I8", 1},     {DType::kI32, "I32", 4},        {DType::kI64, "I64", 8},
    {DType::kBool, "BOOL", 1},
};
}  // namespace

size_t DTypeSize(DType t) {
  for (const auto& e : kDTypes)
    if (e.type == t) return e.size;
  return 0;
}

absl::string_view DTypeName(DType t) {
  for (const auto& e : kDTypes)
    if (e.type == t) return e.name;
  return "?";
}

absl::StatusOr<DType> ParseDTypeName(absl::string_view name) {
  for (const auto& e : kDTypes)
    if (e.name == name) return e.type;
  return absl::InvalidArgumentError(absl::StrCat("unsupported dtype '", name, "'"));
}

}  // namespace moe
