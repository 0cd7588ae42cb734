// The NaN/Inf scan of stored weight formats: every code of the byte formats, every bf16
// pattern, and positions around the scan's block boundaries.
#include "model/weight_values.h"

#include <cmath>
#include <cstring>
#include <vector>

#include "core/numerics.h"
#include "gtest/gtest.h"

namespace moe {
namespace {

std::vector<uint8_t> Bytes(std::initializer_list<uint8_t> b) { return b; }

TEST(WeightValuesTest, EveryFp8AndE8m0Code) {
  for (int code = 0; code < 256; ++code) {
    const std::vector<uint8_t> one = Bytes({static_cast<uint8_t>(code)});
    const bool fp8_nan = std::isnan(Fp8E4m3ToFloat(static_cast<uint8_t>(code)));
    EXPECT_EQ(FindNonFinite(StoredValues::kFp8E4M3, one), fp8_nan ? 0 : -1) << code;
    EXPECT_EQ(FindNonFinite(StoredValues::kE8M0, one), code == 0xff ? 0 : -1) << code;
    EXPECT_EQ(FindNonFinite(StoredValues::kE2M1, one), -1) << code;  // two finite E2M1 codes
  }
  EXPECT_EQ(DescribeNonFinite(StoredValues::kFp8E4M3, Bytes({0xff}), 0), "NaN (E4M3 0xff)");
  EXPECT_EQ(DescribeNonFinite(StoredValues::kE8M0, Bytes({0xff}), 0), "NaN (E8M0 0xff)");
}

TEST(WeightValuesTest, EveryBf16Pattern) {
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    const uint16_t b = static_cast<uint16_t>(bits);
    std::vector<uint8_t> two(2);
    std::memcpy(two.data(), &b, 2);
    const float v = Bf16BitsToFloat(b);
    ASSERT_EQ(FindNonFinite(StoredValues::kBf16, two), std::isfinite(v) ? -1 : 0) << bits;
    if (!std::isfinite(v)) {
      EXPECT_EQ(DescribeNonFinite(StoredValues::kBf16, two, 0),
                std::isnan(v) ? "NaN" : (v < 0 ? "-Inf" : "+Inf"));
    }
  }
}

TEST(WeightValuesTest, F32SpecialValues) {
  const float values[] = {0.0f, -0.0f, 1e-45f, 3.4e38f, -3.4e38f, INFINITY, -INFINITY, NAN};
  for (float v : values) {
    std::vector<uint8_t> four(4);
    std::memcpy(four.data(), &v, 4);
    EXPECT_EQ(FindNonFinite(StoredValues::kF32, four), std::isfinite(v) ? -1 : 0) << v;
  }
}

// The first bad element is found wherever it lies: inside the first block, at a block edge,
// in the tail after the last whole block, and in a span that does not start aligned.
TEST(WeightValuesTest, FirstBadElementAnywhere) {
  constexpr int64_t kElements = 3 * 4096 + 77;
  for (int64_t bad : {int64_t{0}, int64_t{1}, int64_t{4095}, int64_t{4096}, int64_t{8191},
                      int64_t{12287}, int64_t{12288}, kElements - 1}) {
    // Distinct finite values (never zero), a NaN at `bad` and another later.
    std::vector<uint16_t> bf16(kElements);
    std::vector<uint8_t> fp8(kElements);
    for (int64_t i = 0; i < kElements; ++i) {
      bf16[i] = FloatToBf16Bits(0.5f + static_cast<float>(i % 97));
      fp8[i] = static_cast<uint8_t>(1 + i % 0x7e);
    }
    bf16[bad] = 0x7fc1;
    fp8[bad] = 0xff;
    if (bad + 5 < kElements) {
      bf16[bad + 5] = 0xff80;  // -Inf later: the first one counts
      fp8[bad + 5] = 0x7f;
    }
    std::vector<uint8_t> shifted(1 + 2 * kElements);  // odd address
    std::memcpy(shifted.data() + 1, bf16.data(), 2 * kElements);
    const absl::Span<const uint8_t> bf16_bytes(shifted.data() + 1, 2 * kElements);
    EXPECT_EQ(FindNonFinite(StoredValues::kBf16, bf16_bytes), bad);
    EXPECT_EQ(DescribeNonFinite(StoredValues::kBf16, bf16_bytes, bad), "NaN");
    EXPECT_EQ(FindNonFinite(StoredValues::kFp8E4M3, fp8), bad);
    bf16[bad] = FloatToBf16Bits(2.0f);
    std::memcpy(shifted.data() + 1, bf16.data(), 2 * kElements);
    EXPECT_EQ(FindNonFinite(StoredValues::kBf16, bf16_bytes), bad + 5 < kElements ? bad + 5 : -1);
  }
}

}  // namespace
}  // namespace moe
