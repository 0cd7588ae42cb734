// What the tests of checkpoint files share: tensors to write, a writer of them, and a message
// check without gmock (only gtest is linked).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "model/safetensors.h"

#define EXPECT_CONTAINS(haystack, needle)                          \
  EXPECT_NE(std::string(haystack).find(needle), std::string::npos) \
      << "'" << std::string(haystack) << "' does not contain '" << (needle) << "'"

namespace moe::testing {

struct TestTensor {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};

// `tensors` as one safetensors file at `path`, in order.
inline absl::Status WriteTestTensors(const std::string& path,
                                     const std::vector<TestTensor>& tensors,
                                     const std::map<std::string, std::string>& metadata = {}) {
  std::vector<SafetensorsWriter::PendingTensor> declared;
  for (const TestTensor& t : tensors) declared.push_back({t.name, t.dtype, t.shape});
  auto writer = SafetensorsWriter::Create(path, declared, metadata);
  if (!writer.ok()) return writer.status();
  for (const TestTensor& t : tensors) {
    if (absl::Status s = (*writer)->Write(t.bytes); !s.ok()) return s;
  }
  return (*writer)->Finish();
}

}  // namespace moe::testing
