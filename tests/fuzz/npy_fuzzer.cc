// core/npy.cc: the .npy reader moe-client uses on the user's files.
#include <cstdint>
#include <cstring>
#include <string>

#include "core/npy.h"
#include "tests/fuzz/fuzz_check.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  const absl::StatusOr<moe::NpyArray> array = moe::ParseNpy(bytes, "fuzz.npy");
  if (!array.ok()) {
    FUZZ_CHECK_CODE(array.status(), absl::StatusCode::kInvalidArgument);
    return 0;
  }
  // An accepted array holds exactly its shape's elements, each read from the input.
  const int64_t n = array->num_elements();
  FUZZ_CHECK(n >= 0 && static_cast<uint64_t>(n) <= size);
  const bool is_float = array->descr[1] == 'f';
  FUZZ_CHECK(static_cast<int64_t>(is_float ? array->data.size() : array->ints.size()) == n);
  FUZZ_CHECK((is_float ? array->ints.size() : array->data.size()) == 0);
  // float32 and int32 arrays survive a round trip through the writer bit for bit.
  if (array->descr == "<f4" || array->descr == "<i4") {
    const void* values = is_float ? static_cast<const void*>(array->data.data())
                                  : static_cast<const void*>(array->ints.data());
    const absl::StatusOr<moe::NpyArray> again =
        moe::ParseNpy(moe::EncodeNpy(array->descr, array->shape, values, n * 4), "again.npy");
    FUZZ_CHECK(again.ok());
    FUZZ_CHECK(again->shape == array->shape);
    const void* again_values = is_float ? static_cast<const void*>(again->data.data())
                                        : static_cast<const void*>(again->ints.data());
    FUZZ_CHECK(n == 0 || std::memcmp(values, again_values, n * 4) == 0);
  }
  return 0;
}
