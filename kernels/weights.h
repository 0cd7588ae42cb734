// Weight matrices as the checkpoint stores them, viewed without copying.
//
// A WeightMatrix is a non-owning view of one linear layer's weight W[rows=out, cols=in]
// in its stored format; y = x W^T. Backends read the stored format directly (MXFP4 and
// FP8 are decoded in registers, never expanded to bf16 for a whole expert set).
#pragma once

#include <cstdint>

#include "absl/status/status.h"

namespace moe {

enum class WeightFormat : uint8_t {
  kBF16,   // data: bf16 [rows, cols]
  kMXFP4,  // data: u8 [rows, cols/2] (low nibble = even column), scales: E8M0 u8 [rows, cols/32]
  kFP8Block128,  // data: e4m3 [rows, cols], scales: f32 [ceil(rows/128), ceil(cols/128)]
                 // (scale_inv)
};

const char* WeightFormatName(WeightFormat f);

// Where the bytes of a view live.
enum class MemorySpace : uint8_t { kHost, kDevice };

struct WeightMatrix {
  WeightFormat format = WeightFormat::kBF16;
  int64_t rows = 0;  // output features
  int64_t cols = 0;  // input features
  const void* data = nullptr;
  const void* scales = nullptr;  // MXFP4 / FP8 only
  MemorySpace space = MemorySpace::kHost;

  // Bytes of `data` and `scales` (what a GEMV must read).
  int64_t DataBytes() const;
  int64_t ScaleBytes() const;
  int64_t TotalBytes() const { return DataBytes() + ScaleBytes(); }
  // Checks the format's shape constraints (MXFP4 needs cols % 32 == 0).
  absl::Status Validate() const;
};

// A learned vector (RMSNorm weight): bf16 [size].
struct WeightVector {
  const uint16_t* data = nullptr;
  int64_t size = 0;
  MemorySpace space = MemorySpace::kHost;
};

// The three matrices of a GLU MLP (a routed expert or the shared experts):
// out = down( act(gate x, up x) ). K3 checkpoint names them w1/w3/w2.
struct MlpWeights {
  WeightMatrix gate;  // [hidden, in]
  WeightMatrix up;    // [hidden, in]
  WeightMatrix down;  // [in, hidden]
  int64_t TotalBytes() const { return gate.TotalBytes() + up.TotalBytes() + down.TotalBytes(); }
};

}  // namespace moe
