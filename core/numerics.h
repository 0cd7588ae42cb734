// Scalar number formats of the numerics contract (docs/DESIGN.md "Numerics").
//
// Everything here is exact bit manipulation: bf16 rounding is round-to-nearest-even,
// MXFP4 (E2M1 + E8M0 scale) and FP8 E4M3 decode to the exact real value. Usable from
// host code and CUDA device code.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define MOE_HD __host__ __device__ __forceinline__
#else
#define MOE_HD inline
#endif

namespace moe {

// Arithmetic precision of a forward pass.
enum class Precision {
  kBF16,  // default: bf16 operands, fp32 accumulation, bf16 rounding at the contract's points
  kFP32,  // no intermediate rounding; for exactness tests
};
inline const char* PrecisionName(Precision p) { return p == Precision::kBF16 ? "bf16" : "fp32"; }
// Bytes per stored activation element: bf16 bits or fp32.
constexpr size_t ElementBytes(Precision p) { return p == Precision::kBF16 ? 2 : 4; }

MOE_HD uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

MOE_HD float BitsToFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// fp32 -> bf16 bits, round to nearest even; NaN stays a (quiet) NaN.
MOE_HD uint16_t FloatToBf16Bits(float f) {
  uint32_t u = FloatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

MOE_HD float Bf16BitsToFloat(uint16_t b) { return BitsToFloat(static_cast<uint32_t>(b) << 16); }

// n fp32 values to bf16 bits (FloatToBf16Bits each; exact for bf16 values). Host code.
inline void FloatsToBf16Bits(const float* src, int64_t n, uint16_t* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = FloatToBf16Bits(src[i]);
}

// The value of `f` rounded to bf16, kept in an fp32 register.
MOE_HD float RoundToBf16(float f) { return Bf16BitsToFloat(FloatToBf16Bits(f)); }

// fp64 -> nearest bf16 value (ties to even) in one rounding, kept in fp32.
MOE_HD float RoundDoubleToBf16(double d) {
  uint64_t u;
  std::memcpy(&u, &d, sizeof(u));
  if ((u & 0x7fffffffffffffffull) > 0x7ff0000000000000ull) return BitsToFloat(0x7fc00000u);
  // Keep 7 explicit mantissa bits of the 52: round at bit 45, ties to even.
  u += ((uint64_t{1} << 44) - 1) + ((u >> 45) & 1u);
  u &= ~((uint64_t{1} << 45) - 1);
  double r;
  std::memcpy(&r, &u, sizeof(r));
  return static_cast<float>(r);  // exact: 8 significant bits (inf when out of range)
}

// fp64 -> the precision's format in one rounding.
MOE_HD float RoundDoubleTo(Precision p, double d) {
  return p == Precision::kBF16 ? RoundDoubleToBf16(d) : static_cast<float>(d);
}

// Applies the precision's rounding to an fp32 result.
MOE_HD float RoundTo(Precision p, float f) { return p == Precision::kBF16 ? RoundToBf16(f) : f; }

// IEEE binary16 -> fp32 (exact).
MOE_HD float HalfBitsToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  if (exp == 0) {
    // zero or subnormal: man * 2^-24
    const float v = static_cast<float>(man) * 5.9604644775390625e-08f;
    return sign ? -v : v;
  }
  if (exp == 31) return BitsToFloat(sign | 0x7f800000u | (man << 13));
  return BitsToFloat(sign | ((exp + 112u) << 23) | (man << 13));
}

// fp32 -> IEEE binary16 bits, round to nearest even (used to write .npy/fp16 tensors).
MOE_HD uint16_t FloatToHalfBits(float f) {
  const uint32_t u = FloatBits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to inf
  if (abs < 0x38800000u) {
    // subnormal half: scale so the half ulp (2^-24) becomes an integer step, round to even.
    const float a = BitsToFloat(abs) * 16777216.0f;  // exact: power-of-two scaling
    const float r = std::nearbyint(a);               // default rounding mode: to nearest even
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(r));
  }
  uint32_t m = abs - 0x38000000u;  // rebias exponent 127 -> 15 (in the fp32 bit layout)
  m += 0xfffu + ((m >> 13) & 1u);
  return static_cast<uint16_t>(sign | (m >> 13));
}

// FP8 E4M3 ("e4m3fn": no infinities, S.1111.111 is NaN, max 448) -> fp32, exact.
MOE_HD float Fp8E4m3ToFloat(uint8_t v) {
  const uint32_t sign = static_cast<uint32_t>(v & 0x80u) << 24;
  const uint32_t exp = (v >> 3) & 0xfu;
  const uint32_t man = v & 0x7u;
  if (exp == 0xf && man == 0x7) return BitsToFloat(sign | 0x7fc00000u);
  if (exp == 0) {
    const float s = static_cast<float>(man) * 0.001953125f;  // man * 2^-9
    return sign ? -s : s;
  }
  return BitsToFloat(sign | ((exp + 120u) << 23) | (man << 20));
}

// fp32 -> FP8 E4M3 bits, round to nearest even, saturating to +-448 (NaN -> NaN).
MOE_HD uint8_t FloatToFp8E4m3(float f) {
  const uint32_t u = FloatBits(f);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const float a = std::fabs(f);
  if (a != a) return static_cast<uint8_t>(sign | 0x7f);
  if (a >= 464.0f) return static_cast<uint8_t>(sign | 0x7e);  // 448 + half ulp(32): saturate
  if (a < 0.015625f) {
    // subnormal range: multiples of 2^-9
    const float r = std::nearbyint(a * 512.0f);
    return static_cast<uint8_t>(sign | static_cast<uint8_t>(r));  // r == 8 encodes 2^-6 exactly
  }
  uint32_t b = FloatBits(a);
  b += 0x7ffffu + ((b >> 20) & 1u);  // round mantissa to 3 bits
  const uint32_t exp = (b >> 23) - 120u;
  const uint32_t man = (b >> 20) & 0x7u;
  if (exp > 15 || (exp == 15 && man == 7)) return static_cast<uint8_t>(sign | 0x7e);
  return static_cast<uint8_t>(sign | (exp << 3) | man);
}

// MXFP4 element: E2M1 nibble, bit 3 = sign, magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6.
MOE_HD float E2m1ToFloat(uint8_t nibble) {
  const float kMagnitudes[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  const float m = kMagnitudes[nibble & 0x7u];
  return (nibble & 0x8u) ? -m : m;
}

// MXFP4 block scale: E8M0, 2^(u8 - 127). 255 is NaN in the OCP MX spec.
MOE_HD float E8m0ToFloat(uint8_t e) {
  if (e == 0xff) return BitsToFloat(0x7fc00000u);
  if (e == 0) return BitsToFloat(0x00400000u);  // 2^-127 (fp32 subnormal)
  return BitsToFloat(static_cast<uint32_t>(e) << 23);
}

// One MXFP4 weight: element `k` of a row given its packed bytes and its block scales.
MOE_HD float Mxfp4Element(const uint8_t* packed_row, const uint8_t* scale_row, int64_t k) {
  const uint8_t byte = packed_row[k >> 1];
  const uint8_t nibble =
      (k & 1) ? static_cast<uint8_t>(byte >> 4) : static_cast<uint8_t>(byte & 0xf);
  return E2m1ToFloat(nibble) * E8m0ToFloat(scale_row[k >> 5]);
}

// SiTU ("situ"): beta * tanh(g / beta) * sigmoid(g) * linear_beta * tanh(u / linear_beta).
// SiLU-GLU: g * sigmoid(g) * u. Both evaluated in fp32, as the contract says.
enum class Activation { kSiTU, kSiLU };

struct ActivationParams {
  Activation kind = Activation::kSiLU;
  float situ_beta = 4.0f;          // bound of the gate branch
  float situ_linear_beta = 25.0f;  // bound of the linear branch
};

// Deterministic fp32 exp / sigmoid / tanh.
//
// NOTES: libm's expf/tanhf are accurate but not reproducible across implementations, and a
// vector kernel cannot call them. These are one fixed sequence of fp32 operations (range
// reduction, FMA polynomials, correctly rounded division), so this scalar code, the AVX-512
// kernels (kernels/cpu/activation_avx512.cc) and CUDA device code give identical bits.
// Accuracy: within a few ulp of the true value (tests/core), far inside the bf16 rounding that
// follows in bf16 mode.

// exp(x), x clamped to [-87, 88]: x = n ln2 + r, |r| <= ln2/2, degree-7 Taylor polynomial
// (truncation error < 6e-9 relative).
MOE_HD float ExpF(float x) {
  x = fminf(fmaxf(x, -87.0f), 88.0f);
  const float n = nearbyintf(x * 1.44269504088896341f);
  float r = fmaf(-n, 0.693145751953125f, x);  // ln 2, split so n * hi is exact
  r = fmaf(-n, 1.428606765330187045e-06f, r);
  float p = 1.9841269841e-4f;  // 1/7!
  p = fmaf(p, r, 1.3888888889e-3f);
  p = fmaf(p, r, 8.3333333333e-3f);
  p = fmaf(p, r, 4.1666666667e-2f);
  p = fmaf(p, r, 1.6666666667e-1f);
  p = fmaf(p, r, 0.5f);
  p = fmaf(p, r, 1.0f);
  p = fmaf(p, r, 1.0f);
  const uint32_t scale = static_cast<uint32_t>(static_cast<int32_t>(n) + 127)
                         << 23;  // 2^n, n in [-126, 127]
  return p * BitsToFloat(scale);
}

MOE_HD float Sigmoid(float z) { return 1.0f / (1.0f + ExpF(-z)); }

// tanh: odd Taylor polynomial below 0.3 (truncation < 2e-9 relative), 1 - 2 / (exp(2|x|) + 1)
// above, with the sign; exactly 1 from 9 on (fp32 tanh rounds to 1 there).
MOE_HD float TanhF(float x) {
  const float a = fabsf(x);
  if (a < 0.3f) {
    const float x2 = x * x;
    float p = -8.8632355299e-3f;  // -1382/155925
    p = fmaf(p, x2, 2.1869488536e-2f);
    p = fmaf(p, x2, -5.3968253968e-2f);
    p = fmaf(p, x2, 1.3333333333e-1f);
    p = fmaf(p, x2, -3.3333333333e-1f);
    p = fmaf(p, x2, 1.0f);
    return x * p;
  }
  const float t = a >= 9.0f ? 1.0f : 1.0f - 2.0f / (ExpF(2.0f * a) + 1.0f);
  return copysignf(t, x);
}

MOE_HD float GluActivate(const ActivationParams& p, float g, float u) {
  if (p.kind == Activation::kSiLU) return g * Sigmoid(g) * u;
  const float a = p.situ_beta * TanhF(g / p.situ_beta) * Sigmoid(g);
  const float ub = p.situ_linear_beta * TanhF(u / p.situ_linear_beta);
  return a * ub;
}

// Index of the first NaN or Inf among data[0, n), or -1.
template <typename T>
int64_t FirstNonFinite(const T* data, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (!std::isfinite(data[i])) return i;
  return -1;
}

}  // namespace moe
