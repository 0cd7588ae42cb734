#include "kernels/weights.h"

#include "absl/strings/str_cat.h"

namespace moe {

const char* WeightFormatName(WeightFormat f) {
  switch (f) {
    case WeightFormat::kBF16:
      return "bf16";
    case WeightFormat::kMXFP4:
      return "mxfp4";
    case WeightFormat::kFP8Block128:
      return "fp8";
  }
  return "?";
}

int64_t WeightMatrix::DataBytes() const {
  switch (format) {
    case WeightFormat::kBF16:
      return rows * cols * 2;
    case WeightFormat::kMXFP4:
      return rows * cols / 2;
    case WeightFormat::kFP8Block128:
      return rows * cols;
  }
  return 0;
}

int64_t WeightMatrix::ScaleBytes() const {
  switch (format) {
    case WeightFormat::kBF16:
      return 0;
    case WeightFormat::kMXFP4:
      return rows * (cols / 32);
    case WeightFormat::kFP8Block128:
      return ((rows + 127) / 128) * ((cols + 127) / 128) * 4;
  }
  return 0;
}

absl::Status WeightMatrix::Validate() const {
  if (rows <= 0 || cols <= 0)
    return absl::InvalidArgumentError(
        absl::StrCat("weight shape [", rows, ", ", cols, "] is empty"));
  if (data == nullptr) return absl::InvalidArgumentError("weight has no data");
  if (format == WeightFormat::kMXFP4 && cols % 32 != 0)
    return absl::InvalidArgumentError(
        absl::StrCat("MXFP4 weight needs input features divisible by 32, got ", cols));
  if (format != WeightFormat::kBF16 && scales == nullptr)
    return absl::InvalidArgumentError(
        absl::StrCat(WeightFormatName(format), " weight has no scales"));
  return absl::OkStatus();
}

}  // namespace moe
