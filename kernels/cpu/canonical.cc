#include "kernels/cpu/canonical.h"

#include <cstring>

namespace moe::cpu {

void PackActivationRow(const float* x, int64_t k, WeightFormat f, Precision p, void* out) {
  const int64_t kp = PaddedK(k);
  if (p == Precision::kBF16) {
    auto* o = static_cast<uint16_t*>(out);
    std::memset(o + (k & ~(kPadK - 1)), 0, (kp - (k & ~(kPadK - 1))) * sizeof(uint16_t));
    for (int64_t i = 0; i < k; ++i) o[CanonicalIndex(f, i)] = FloatToBf16Bits(x[i]);
  } else {
    auto* o = static_cast<float*>(out);
    std::memset(o + (k & ~(kPadK - 1)), 0, (kp - (k & ~(kPadK - 1))) * sizeof(float));
    for (int64_t i = 0; i < k; ++i) o[CanonicalIndex(f, i)] = x[i];
  }
}

namespace {

// Exact value of weight (n, k), without the FP8 block scale.
inline float WeightValue(const WeightMatrix& w, int64_t n, int64_t k) {
  switch (w.format) {
    case WeightFormat::kBF16:
      return Bf16BitsToFloat(static_cast<const uint16_t*>(w.data)[n * w.cols + k]);
    case WeightFormat::kMXFP4:
      return Mxfp4Element(static_cast<const uint8_t*>(w.data) + n * (w.cols / 2),
                          static_cast<const uint8_t*>(w.scales) + n * (w.cols / 32), k);
    case WeightFormat::kFP8Block128:
      return Fp8E4m3ToFloat(static_cast<const uint8_t*>(w.data)[n * w.cols + k]);
  }
  return 0.0f;
}

}  // namespace

void DecodeWeightRow(const WeightMatrix& w, int64_t n, Precision p, void* out) {
  const int64_t k = w.cols;
  const int64_t kp = PaddedK(k);
  const int64_t tail = k & ~(kPadK - 1);
  if (p == Precision::kBF16) {
    auto* o = static_cast<uint16_t*>(out);
    std::memset(o + tail, 0, (kp - tail) * sizeof(uint16_t));
    if (w.format == WeightFormat::kBF16) {
      std::memcpy(o, static_cast<const uint16_t*>(w.data) + n * k, k * sizeof(uint16_t));
      return;
    }
    // MXFP4 and FP8 values are exact in bf16 (within the fp32 normal range).
    for (int64_t i = 0; i < k; ++i)
      o[CanonicalIndex(w.format, i)] = FloatToBf16Bits(WeightValue(w, n, i));
  } else {
    auto* o = static_cast<float*>(out);
    std::memset(o + tail, 0, (kp - tail) * sizeof(float));
    for (int64_t i = 0; i < k; ++i) o[CanonicalIndex(w.format, i)] = WeightValue(w, n, i);
  }
}

namespace {

// The lane/block structure shared by both precisions; `chunk(acc, c)` adds the chunk starting
// at element c into the 16 lanes and returns the chunk's length.
template <typename Chunk>
float CanonicalDot(int64_t padded_k, const float* block_scales, Chunk chunk) {
  float lanes[kLanes] = {};
  float part[kLanes];
  const int64_t block = block_scales ? kFp8Block : padded_k;
  for (int64_t b0 = 0; b0 < padded_k; b0 += block) {
    float* acc = lanes;
    if (block_scales) {
      for (float& v : part) v = 0.0f;
      acc = part;
    }
    const int64_t b1 = b0 + block < padded_k ? b0 + block : padded_k;
    for (int64_t c = b0; c < b1;) c += chunk(acc, c);
    if (block_scales) {
      const float s = block_scales[b0 / kFp8Block];
      for (int i = 0; i < kLanes; ++i) lanes[i] = std::fma(part[i], s, lanes[i]);
    }
  }
  return ReduceLanes(lanes);
}

}  // namespace

float CanonicalDotBf16(const uint16_t* x, const uint16_t* w, int64_t padded_k,
                       const float* block_scales) {
  return CanonicalDot(padded_k, block_scales, [&](float* acc, int64_t c) {
    for (int i = 0; i < kLanes; ++i) {  // one VDPBF16PS: element 2i+1, then 2i
      const int64_t e = c + 2 * i;
      acc[i] = std::fma(Bf16BitsToFloat(w[e + 1]), Bf16BitsToFloat(x[e + 1]), acc[i]);
      acc[i] = std::fma(Bf16BitsToFloat(w[e]), Bf16BitsToFloat(x[e]), acc[i]);
    }
    return int64_t{2 * kLanes};
  });
}

float CanonicalDotF32(const float* x, const float* w, int64_t padded_k, const float* block_scales) {
  return CanonicalDot(padded_k, block_scales, [&](float* acc, int64_t c) {
    for (int i = 0; i < kLanes; ++i) acc[i] = std::fma(w[c + i], x[c + i], acc[i]);
    return int64_t{kLanes};
  });
}

}  // namespace moe::cpu
