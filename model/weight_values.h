// NaN/Inf in stored weights. A checkpoint with a NaN loads and serves finite, wrong outputs
// (the router's sigmoid, the top-k and the kernels' codes turn it into numbers), so loaders
// refuse one, naming the tensor and the element (model/checkpoint.cc).
#pragma once

#include <cstdint>
#include <string>

#include "absl/types/span.h"

namespace moe {

// How a stored tensor encodes its values, as far as non-finite ones go.
enum class StoredValues : uint8_t {
  kBf16,     // NaN/Inf: exponent bits all ones
  kF32,      // same (FP8 block scale_inv, router bias)
  kFp8E4M3,  // NaN: S.1111.111 (0x7f, 0xff); no Inf
  kE8M0,     // MXFP4 group scale: NaN is 0xff
  kE2M1,     // MXFP4 packed codes: every code is finite (nothing to check)
};

// The first non-finite element of `bytes` read as `values`, or -1. Reads every byte (E2M1:
// none) at close to memory bandwidth: blocks are scanned branch-free and vectorized, and only
// a block with a hit is searched element by element.
int64_t FindNonFinite(StoredValues values, absl::Span<const uint8_t> bytes);

// "NaN", "+Inf" or "-Inf", with the stored code for the byte formats ("NaN (E8M0 0xff)").
std::string DescribeNonFinite(StoredValues values, absl::Span<const uint8_t> bytes, int64_t index);

}  // namespace moe
