// model/safetensors.cc: the header (JSON) and tensor table of a checkpoint file, which can come
// from anywhere.
#include <cstdint>
#include <string>

#include "core/dtype.h"
#include "model/safetensors.h"
#include "tests/fuzz/fuzz_check.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::StatusOr<moe::SafetensorsHeader> header =
      moe::ParseSafetensorsHeader(absl::MakeConstSpan(data, size), "fuzz.safetensors");
  if (!header.ok()) {
    FUZZ_CHECK_CODE(header.status(), absl::StatusCode::kInvalidArgument);
    return 0;
  }
  // Accepted tensors lie inside the file and hold exactly dtype x shape bytes.
  FUZZ_CHECK(header->data_start >= 8 && header->data_start <= size);
  const uint64_t data_size = size - header->data_start;
  uint64_t total = 0;
  for (const auto& [name, info] : header->tensors) {
    FUZZ_CHECK(name == info.name);
    FUZZ_CHECK(info.data_offset <= data_size && info.size_bytes <= data_size - info.data_offset);
    FUZZ_CHECK(static_cast<uint64_t>(info.num_elements()) * moe::DTypeSize(info.dtype) ==
               info.size_bytes);
    total += info.size_bytes;
    // What a loader would read: the first and last byte of the tensor.
    if (info.size_bytes > 0) {
      volatile uint8_t sink = data[header->data_start + info.data_offset];
      sink = data[header->data_start + info.data_offset + info.size_bytes - 1];
      (void)sink;
    }
  }
  FUZZ_CHECK(total <= data_size);  // no overlaps
  return 0;
}
