// NumPy .npy files (format 1.0/2.0/3.0, little-endian, C order): the tools' tensor I/O.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace moe {

// A dense array read from / written to .npy. Values are held as float32 (float16 and
// float64 inputs are converted exactly / rounded); integer arrays go through `ints`.
struct NpyArray {
  std::vector<int64_t> shape;
  std::vector<float> data;    // for float arrays
  std::vector<int32_t> ints;  // for int32 arrays (routing ids)
  std::string descr;          // dtype as read: "<f4", "<f2", "<f8", "<i4", ...
  int64_t num_elements() const;
};

// Reads float16/float32/float64 (into data) or int32/int64/int8/uint8/bool/uint16 (into ints)
// arrays; a 2-byte void array ('V2', how numpy saves ml_dtypes.bfloat16) reads as its uint16
// bit patterns.
absl::StatusOr<NpyArray> ReadNpy(const std::string& path);
absl::StatusOr<NpyArray> ParseNpy(const std::string& bytes, const std::string& what);

absl::Status WriteNpyFloat32(const std::string& path, const std::vector<int64_t>& shape,
                             const float* data);
absl::Status WriteNpyInt32(const std::string& path, const std::vector<int64_t>& shape,
                           const int32_t* data);
// The file bytes for an array (header + data).
std::string EncodeNpy(const std::string& descr, const std::vector<int64_t>& shape, const void* data,
                      size_t bytes);

}  // namespace moe
