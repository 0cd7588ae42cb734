// model/safetensors.cc: `model.safetensors.index.json`, which maps tensors to shard files and
// comes with the checkpoint from anywhere (ParseSafetensorsIndex).
#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"
#include "model/safetensors.h"
#include "tests/fuzz/fuzz_check.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view text(reinterpret_cast<const char*>(data), size);
  const auto index = moe::ParseSafetensorsIndex(text, "fuzz.index.json");
  if (!index.ok()) {
    FUZZ_CHECK_CODE(index.status(), absl::StatusCode::kInvalidArgument);
    return 0;
  }
  // Every shard an accepted index names is a plain file name inside the checkpoint directory:
  // nothing a loader would join with the directory can leave it.
  for (const auto& [tensor, file] : *index) {
    FUZZ_CHECK(!file.empty() && file != "." && file != "..");
    FUZZ_CHECK(file.find('/') == std::string::npos && file.find('\0') == std::string::npos);
  }
  return 0;
}
