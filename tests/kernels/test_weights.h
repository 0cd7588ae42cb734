// Random weights in every stored format, and a plain fp64 reference of the ops, for the
// kernel tests. The reference shares no code with the kernels beyond the scalar decoders
// of core/numerics.h (themselves tested exhaustively in tests/core).
#pragma once

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "core/numerics.h"
#include "kernels/weights.h"

namespace moe::testing {

// Owns the bytes of a random weight matrix in `format`; values ~ N(0, 1/cols).
struct RandomWeight {
  std::vector<uint8_t> data;
  std::vector<uint8_t> scale_bytes;  // MXFP4
  std::vector<float> fp8_scales;     // FP8
  WeightMatrix view;

  RandomWeight(WeightFormat format, int64_t rows, int64_t cols, uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f / std::sqrt(static_cast<float>(cols)));
    view.format = format;
    view.rows = rows;
    view.cols = cols;
    switch (format) {
      case WeightFormat::kBF16: {
        data.resize(rows * cols * 2);
        auto* p = reinterpret_cast<uint16_t*>(data.data());
        for (int64_t i = 0; i < rows * cols; ++i) p[i] = FloatToBf16Bits(normal(rng));
        break;
      }
      case WeightFormat::kMXFP4: {
        data.resize(rows * cols / 2);
        scale_bytes.resize(rows * cols / 32);
        std::uniform_int_distribution<int> byte(0, 255);
        const int base =
            127 -
            static_cast<int>(std::lround(std::log2(3.0 * std::sqrt(static_cast<double>(cols)))));
        std::uniform_int_distribution<int> jitter(-1, 1);
        for (auto& b : data) b = static_cast<uint8_t>(byte(rng));
        for (auto& s : scale_bytes) s = static_cast<uint8_t>(base + jitter(rng));
        view.scales = scale_bytes.data();
        break;
      }
      case WeightFormat::kFP8Block128: {
        data.resize(rows * cols);
        std::normal_distribution<float> unit(0.0f, 1.0f);
        for (auto& b : data) b = FloatToFp8E4m3(unit(rng) * 64.0f);  // spans normals and subnormals
        const int64_t br = (rows + 127) / 128, bc = (cols + 127) / 128;
        std::uniform_real_distribution<float> scale(0.75f, 1.25f);
        fp8_scales.resize(br * bc);
        for (auto& s : fp8_scales) s = scale(rng) / (64.0f * std::sqrt(static_cast<float>(cols)));
        view.scales = fp8_scales.data();
        break;
      }
    }
    view.data = data.data();
  }

  // Exact real value of weight (n, k) including its scale, in fp64.
  double Value(int64_t n, int64_t k) const {
    switch (view.format) {
      case WeightFormat::kBF16:
        return Bf16BitsToFloat(reinterpret_cast<const uint16_t*>(data.data())[n * view.cols + k]);
      case WeightFormat::kMXFP4:
        return Mxfp4Element(data.data() + n * (view.cols / 2),
                            scale_bytes.data() + n * (view.cols / 32), k);
      case WeightFormat::kFP8Block128: {
        const int64_t bc = (view.cols + 127) / 128;
        return static_cast<double>(Fp8E4m3ToFloat(data[n * view.cols + k])) *
               fp8_scales[(n / 128) * bc + k / 128];
      }
    }
    return 0;
  }
};

inline std::vector<float> RandomActivations(int64_t rows, int64_t cols, uint32_t seed,
                                            bool bf16 = true) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(rows * cols);
  for (auto& v : x) v = bf16 ? RoundToBf16(normal(rng)) : normal(rng);
  return x;
}

// fp64 reference of y = x W^T (exact products, fp64 sums).
inline std::vector<double> ReferenceLinear(const std::vector<float>& x, int64_t m,
                                           const RandomWeight& w) {
  std::vector<double> y(m * w.view.rows);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t n = 0; n < w.view.rows; ++n) {
      double acc = 0;
      for (int64_t k = 0; k < w.view.cols; ++k)
        acc += static_cast<double>(x[i * w.view.cols + k]) * w.Value(n, k);
      y[i * w.view.rows + n] = acc;
    }
  return y;
}

// Sum of |x_k w_k|: the scale of a dot product's rounding error.
inline double AbsDot(const std::vector<float>& x, int64_t i, const RandomWeight& w, int64_t n) {
  double acc = 0;
  for (int64_t k = 0; k < w.view.cols; ++k)
    acc += std::fabs(x[i * w.view.cols + k] * w.Value(n, k));
  return acc;
}

}  // namespace moe::testing
