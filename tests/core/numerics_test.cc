#include "core/numerics.h"

#include <cmath>
#include <random>

#include "gtest/gtest.h"

namespace moe {
namespace {

// Independent bf16 rounding through double arithmetic: the nearest bf16 value, ties to even.
double RoundBf16Reference(double x) {
  if (x == 0 || std::isinf(x)) return x;
  int exp;
  std::frexp(x, &exp);                          // x = m * 2^exp, 0.5 <= |m| < 1
  const double ulp = std::ldexp(1.0, exp - 8);  // 8 significant bits
  const double q = x / ulp;
  double r = std::floor(q);
  const double frac = q - r;
  if (frac > 0.5 || (frac == 0.5 && std::fmod(r, 2.0) != 0)) r += 1;
  return r * ulp;
}

TEST(NumericsTest, Bf16RoundingMatchesReferenceOnRandomValues) {
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> mant(-2.0f, 2.0f);
  std::uniform_int_distribution<int> ex(-60, 60);
  for (int i = 0; i < 200000; ++i) {
    const float x = std::ldexp(mant(rng), ex(rng));
    ASSERT_EQ(RoundToBf16(x), static_cast<float>(RoundBf16Reference(x))) << x;
  }
}

TEST(NumericsTest, Bf16TiesRoundToEven) {
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to the even mantissa (1).
  EXPECT_EQ(RoundToBf16(1.0f + std::ldexp(1.0f, -8)), 1.0f);
  // 1 + 3 * 2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: rounds to 1 + 2^-6.
  EXPECT_EQ(RoundToBf16(1.0f + 3 * std::ldexp(1.0f, -8)), 1.0f + std::ldexp(1.0f, -6));
  EXPECT_TRUE(std::isnan(RoundToBf16(NAN)));
  EXPECT_EQ(RoundToBf16(INFINITY), INFINITY);
}

TEST(NumericsTest, HalfRoundTripsEveryBitPattern) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = HalfBitsToFloat(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    ASSERT_EQ(FloatToHalfBits(f), h) << std::hex << h;
  }
  EXPECT_EQ(HalfBitsToFloat(0x3c00), 1.0f);
  EXPECT_EQ(HalfBitsToFloat(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(HalfBitsToFloat(0xfbff), -65504.0f);
}

// Exhaustive: all 256 FP8 E4M3 codes against the format's definition.
TEST(NumericsTest, Fp8E4m3DecodesEveryCode) {
  for (int v = 0; v < 256; ++v) {
    const int sign = v >> 7, exp = (v >> 3) & 0xf, man = v & 7;
    const float got = Fp8E4m3ToFloat(static_cast<uint8_t>(v));
    if (exp == 15 && man == 7) {
      EXPECT_TRUE(std::isnan(got)) << v;
      continue;
    }
    const double mag = exp == 0 ? std::ldexp(man / 8.0, -6) : std::ldexp(1.0 + man / 8.0, exp - 7);
    EXPECT_EQ(got, sign ? -mag : mag) << v;
    // Encoding the decoded value gives the code back (negative zero aside).
    if (!(exp == 0 && man == 0)) {
      EXPECT_EQ(FloatToFp8E4m3(got), v) << v;
    }
  }
  EXPECT_EQ(Fp8E4m3ToFloat(0x7e), 448.0f);
  EXPECT_EQ(FloatToFp8E4m3(1e6f), 0x7e);  // saturates
}

// Exhaustive: all 16 E2M1 nibbles and all 256 E8M0 scales.
TEST(NumericsTest, Mxfp4DecodesEveryNibbleAndScale) {
  const float magnitudes[8] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};
  for (int n = 0; n < 16; ++n)
    EXPECT_EQ(E2m1ToFloat(static_cast<uint8_t>(n)), (n & 8 ? -1 : 1) * magnitudes[n & 7]);
  for (int e = 0; e < 255; ++e)
    EXPECT_EQ(E8m0ToFloat(static_cast<uint8_t>(e)), std::ldexp(1.0f, e - 127)) << e;
  EXPECT_TRUE(std::isnan(E8m0ToFloat(255)));
  // Scaled values are exact in bf16 (the contract's "dequantized exactly").
  for (int e = 1; e < 255; ++e)
    for (int n = 0; n < 16; ++n) {
      const float v = E2m1ToFloat(static_cast<uint8_t>(n)) * E8m0ToFloat(static_cast<uint8_t>(e));
      if (std::fabs(v) < std::ldexp(1.0f, -126) || std::isinf(v)) continue;
      ASSERT_EQ(RoundToBf16(v), v);
    }
  // Packing: low nibble is the even element.
  const uint8_t packed[2] = {0x2f, 0x71};  // elements: -6, 1, 0.5, 6
  const uint8_t scale[1] = {128};          // x2
  EXPECT_EQ(Mxfp4Element(packed, scale, 0), -12.0f);
  EXPECT_EQ(Mxfp4Element(packed, scale, 1), 2.0f);
  EXPECT_EQ(Mxfp4Element(packed, scale, 2), 1.0f);
  EXPECT_EQ(Mxfp4Element(packed, scale, 3), 12.0f);
}

TEST(NumericsTest, ActivationsFollowTheirFormulas) {
  ActivationParams situ{Activation::kSiTU, 4.0f, 25.0f};
  ActivationParams silu{Activation::kSiLU, 4.0f, 25.0f};
  for (float g : {-7.0f, -0.3f, 0.0f, 0.9f, 12.0f})
    for (float u : {-40.0f, -1.5f, 0.25f, 30.0f}) {
      const double sg = 1.0 / (1.0 + std::exp(-static_cast<double>(g)));
      const double want_situ = 4.0 * std::tanh(g / 4.0) * sg * 25.0 * std::tanh(u / 25.0);
      const double want_silu = g * sg * u;
      EXPECT_NEAR(GluActivate(situ, g, u), want_situ, 1e-5 * (1 + std::fabs(want_situ)));
      EXPECT_NEAR(GluActivate(silu, g, u), want_silu, 1e-5 * (1 + std::fabs(want_silu)));
    }
}

}  // namespace
}  // namespace moe

namespace moe {
namespace {

double UlpError(float got, double want) {
  if (want == 0) return got == 0 ? 0 : 1e9;
  int e;
  std::frexp(want, &e);
  return std::fabs(got - want) / std::ldexp(1.0, e - 24);
}

// The deterministic fp32 exp / tanh / sigmoid stay within a few ulp of the true values.
TEST(FastMathTest, ExpTanhSigmoidAreAccurate) {
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> wide(-80.0f, 80.0f), narrow(-3.0f, 3.0f);
  double worst_exp = 0, worst_tanh = 0, worst_sigmoid = 0;
  for (int i = 0; i < 200000; ++i) {
    const float x = i % 2 ? wide(rng) : narrow(rng);
    worst_exp = std::max(worst_exp, UlpError(ExpF(x), std::exp(static_cast<double>(x))));
    const float t = narrow(rng) * (i % 3 == 0 ? 0.1f : 1.0f) * (i % 7 == 0 ? 5.0f : 1.0f);
    if (std::fabs(t) > 1e-30f)
      worst_tanh = std::max(worst_tanh, UlpError(TanhF(t), std::tanh(static_cast<double>(t))));
    worst_sigmoid = std::max(worst_sigmoid,
                             UlpError(Sigmoid(x), 1.0 / (1.0 + std::exp(-static_cast<double>(x)))));
  }
  EXPECT_LE(worst_exp, 3.0);
  EXPECT_LE(worst_tanh, 4.0);
  EXPECT_LE(worst_sigmoid, 4.0);
  EXPECT_EQ(TanhF(0.0f), 0.0f);
  EXPECT_EQ(TanhF(20.0f), 1.0f);
  EXPECT_EQ(TanhF(-20.0f), -1.0f);
  EXPECT_EQ(ExpF(0.0f), 1.0f);
  EXPECT_GT(Sigmoid(-200.0f), 0.0f);
  EXPECT_EQ(Sigmoid(200.0f), 1.0f);
  std::printf("worst ulp: exp %.2f tanh %.2f sigmoid %.2f\n", worst_exp, worst_tanh, worst_sigmoid);
}

}  // namespace
}  // namespace moe
