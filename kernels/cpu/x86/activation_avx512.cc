// AVX-512 GLU activations: the exact operation sequences of core/numerics.h (ExpF, Sigmoid,
// TanhF, GluActivate), 16 lanes at a time, so results match the scalar code bit for bit; and
// the activation-row packing. AVX-512 F/BW/VL/DQ only: shared by both AVX-512 tiers.
#include <immintrin.h>

#include <array>
#include <cstring>

#include "core/numerics.h"
#include "kernels/cpu/canonical.h"
#include "kernels/cpu/dot.h"
#include "kernels/cpu/x86/avx512_glu_pack.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")
namespace moe::cpu {
namespace {

// The vector operations glu_vector.inc is written in, on 16 lanes.
struct Avx512Ops {
  using F = __m512;
  using I = __m512i;
  using M = __mmask16;
  static constexpr int kLanes = 16;
  static F Set(float v) { return _mm512_set1_ps(v); }
  static F Fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F Add(F a, F b) { return _mm512_add_ps(a, b); }
  static F Sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F Mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F Div(F a, F b) { return _mm512_div_ps(a, b); }
  static F Min(F a, F b) { return _mm512_min_ps(a, b); }
  static F Max(F a, F b) { return _mm512_max_ps(a, b); }
  static F Nearest(F a) {
    return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  static I ToInt(F a) { return _mm512_cvtps_epi32(a); }
  static F AsFloat(I a) { return _mm512_castsi512_ps(a); }
  static I AsInt(F a) { return _mm512_castps_si512(a); }
  static I AddInt(I a, I b) { return _mm512_add_epi32(a, b); }
  static I SetInt(int32_t v) { return _mm512_set1_epi32(v); }
  static I ShiftLeft(I a, int n) { return _mm512_slli_epi32(a, static_cast<unsigned>(n)); }
  static I ShiftRight(I a, int n) { return _mm512_srli_epi32(a, static_cast<unsigned>(n)); }
  static I AndInt(I a, I b) { return _mm512_and_si512(a, b); }
  static F AndF(F a, F b) { return AsFloat(_mm512_and_si512(AsInt(a), AsInt(b))); }
  static F OrF(F a, F b) { return AsFloat(_mm512_or_si512(AsInt(a), AsInt(b))); }
  static F Abs(F a) { return _mm512_abs_ps(a); }
  static M Less(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
  static M GreaterEq(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_GE_OQ); }
  static F Select(M m, F where_false, F where_true) {
    return _mm512_mask_blend_ps(m, where_false, where_true);
  }
  static M FirstLanes(int64_t n) {
    return n >= 16 ? static_cast<M>(0xffff) : static_cast<M>((1u << n) - 1);
  }
  static F LoadN(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(FirstLanes(n), p); }
  static void StoreN(float* p, F v, int64_t n) { _mm512_mask_storeu_ps(p, FirstLanes(n), v); }
};

#include "kernels/cpu/x86/glu_vector.inc"

// bf16 bits of 16 floats (round to nearest even), as 16 words.
inline __m256i Bf16BitsV(__m512 v) {
  return _mm512_cvtepi32_epi16(
      _mm512_srli_epi32(_mm512_castps_si512(RoundBf16V<Avx512Ops>(v)), 16));
}

// bf16 bits of 32 floats, in order.
inline __m512i Bf16Words32(const float* p) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(Bf16BitsV(_mm512_loadu_ps(p))),
                            Bf16BitsV(_mm512_loadu_ps(p + 16)), 1);
}

void PackRowAvx512(const float* x, int64_t k, WeightFormat format, Precision precision, void* out) {
  const int64_t kp = PaddedK(k);
  const int64_t full =
      k & ~(kPadK - 1);  // whole 128-element groups; the tail goes the portable way
  if (precision == Precision::kFP32 && format == WeightFormat::kBF16) {
    std::memcpy(out, x, k * sizeof(float));
    std::memset(static_cast<float*>(out) + k, 0, (kp - k) * sizeof(float));
    return;
  }
  if (precision == Precision::kFP32 || full == 0) {
    PackActivationRow(x, k, format, precision, out);
    return;
  }
  auto* o = static_cast<uint16_t*>(out);
  if (format == WeightFormat::kBF16) {
    for (int64_t i = 0; i < full; i += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + i), Bf16BitsV(_mm512_loadu_ps(x + i)));
  } else if (format == WeightFormat::kFP8Block128) {
    // Per 64-element group, run r (32 words) holds elements 16L + 8r + j: one two-source
    // permute of the group's two natural-order halves per run.
    alignas(64) static const auto kRunIndex = [] {
      std::array<std::array<uint16_t, 32>, 2> idx{};
      for (int r = 0; r < 2; ++r)
        for (int p = 0; p < 32; ++p)
          idx[r][p] = static_cast<uint16_t>(16 * (p / 8) + 8 * r + p % 8);
      return idx;
    }();
    const __m512i run0 = _mm512_load_si512(kRunIndex[0].data());
    const __m512i run1 = _mm512_load_si512(kRunIndex[1].data());
    for (int64_t g = 0; g < full; g += 64) {
      const __m512i a = Bf16Words32(x + g), b = Bf16Words32(x + g + 32);
      _mm512_storeu_si512(o + g, _mm512_permutex2var_epi16(a, run0, b));
      _mm512_storeu_si512(o + g + 32, _mm512_permutex2var_epi16(a, run1, b));
    }
  } else {
    // Per 128-element group, run j (32 words) holds elements 4w + j: words w < 16 come from
    // the group's first 64 elements, w >= 16 from the last 64, each by one two-source permute.
    alignas(64) static const auto kRunIndex = [] {
      std::array<std::array<uint16_t, 32>, 4> idx{};
      for (int j = 0; j < 4; ++j)
        for (int w = 0; w < 32; ++w) idx[j][w] = static_cast<uint16_t>((4 * w + j) & 63);
      return idx;
    }();
    for (int64_t g = 0; g < full; g += 128) {
      const __m512i a = Bf16Words32(x + g), b = Bf16Words32(x + g + 32),
                    c = Bf16Words32(x + g + 64), d = Bf16Words32(x + g + 96);
      for (int j = 0; j < 4; ++j) {
        const __m512i idx = _mm512_load_si512(kRunIndex[j].data());
        const __m512i first = _mm512_permutex2var_epi16(a, idx, b);   // elements 4w + j, w < 16
        const __m512i second = _mm512_permutex2var_epi16(c, idx, d);  // elements 64 + 4w + j
        _mm512_storeu_si512(o + g + 32 * j,
                            _mm512_inserti64x4(first, _mm512_castsi512_si256(second), 1));
      }
    }
  }
  if (full < k || full < kp) PackActivationRow(x + full, k - full, format, precision, o + full);
}

}  // namespace
}  // namespace moe::cpu
#pragma GCC pop_options

namespace moe::cpu {

GluRowFn Avx512GluRow() { return &GluRowV<Avx512Ops>; }
PackRowFn Avx512PackRow() { return &PackRowAvx512; }

}  // namespace moe::cpu
