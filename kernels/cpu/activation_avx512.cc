// AVX-512 GLU activations: the exact operation sequences of core/numerics.h (ExpF, Sigmoid,
// TanhF, GluActivate), 16 lanes at a time, so results match the scalar code bit for bit.
#include <immintrin.h>

#include <array>
#include <cstring>

#include "core/numerics.h"
#include "kernels/cpu/canonical.h"
#include "kernels/cpu/dot.h"

namespace moe::cpu {
namespace {

inline __m512 Fma(__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(a, b, c); }

inline __m512 ExpV(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 minus_n = _mm512_sub_ps(_mm512_setzero_ps(), n);
  __m512 r = Fma(minus_n, _mm512_set1_ps(0.693145751953125f), x);
  r = Fma(minus_n, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(1.9841269841e-4f);
  p = Fma(p, r, _mm512_set1_ps(1.3888888889e-3f));
  p = Fma(p, r, _mm512_set1_ps(8.3333333333e-3f));
  p = Fma(p, r, _mm512_set1_ps(4.1666666667e-2f));
  p = Fma(p, r, _mm512_set1_ps(1.6666666667e-1f));
  p = Fma(p, r, _mm512_set1_ps(0.5f));
  p = Fma(p, r, _mm512_set1_ps(1.0f));
  p = Fma(p, r, _mm512_set1_ps(1.0f));
  const __m512i scale =
      _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(scale));
}

inline __m512 SigmoidV(__m512 z) {
  const __m512 one = _mm512_set1_ps(1.0f);
  return _mm512_div_ps(one, _mm512_add_ps(one, ExpV(_mm512_sub_ps(_mm512_setzero_ps(), z))));
}

inline __m512 TanhV(__m512 x) {
  const __m512 a = _mm512_abs_ps(x);
  // Small-argument polynomial.
  const __m512 x2 = _mm512_mul_ps(x, x);
  __m512 p = _mm512_set1_ps(-8.8632355299e-3f);
  p = Fma(p, x2, _mm512_set1_ps(2.1869488536e-2f));
  p = Fma(p, x2, _mm512_set1_ps(-5.3968253968e-2f));
  p = Fma(p, x2, _mm512_set1_ps(1.3333333333e-1f));
  p = Fma(p, x2, _mm512_set1_ps(-3.3333333333e-1f));
  p = Fma(p, x2, _mm512_set1_ps(1.0f));
  const __m512 small = _mm512_mul_ps(x, p);
  // Large-argument form.
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 e = ExpV(_mm512_mul_ps(_mm512_set1_ps(2.0f), a));
  __m512 t = _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(e, one)));
  t = _mm512_mask_mov_ps(t, _mm512_cmp_ps_mask(a, _mm512_set1_ps(9.0f), _CMP_GE_OQ), one);
  const __m512 sign =
      _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(INT32_MIN)));
  const __m512 large = _mm512_or_ps(t, sign);  // t >= 0: copysign
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, _mm512_set1_ps(0.3f), _CMP_LT_OQ), large,
                              small);
}

// RoundToBf16 on every lane (round to nearest even; inputs are finite).
inline __m512 RoundBf16V(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
  return _mm512_castsi512_ps(
      _mm512_and_si512(r, _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u))));
}

void GluRowAvx512(const float* g, const float* u, int64_t n, const ActivationParams& act,
                  Precision precision, float* out) {
  const bool bf16 = precision == Precision::kBF16;
  const __m512 beta = _mm512_set1_ps(act.situ_beta),
               linear_beta = _mm512_set1_ps(act.situ_linear_beta);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m =
        n - i >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (n - i)) - 1);
    __m512 gv = _mm512_maskz_loadu_ps(m, g + i), uv = _mm512_maskz_loadu_ps(m, u + i);
    if (bf16) {
      gv = RoundBf16V(gv);
      uv = RoundBf16V(uv);
    }
    __m512 a;
    if (act.kind == Activation::kSiLU) {
      a = _mm512_mul_ps(_mm512_mul_ps(gv, SigmoidV(gv)), uv);
    } else {
      const __m512 gate =
          _mm512_mul_ps(_mm512_mul_ps(beta, TanhV(_mm512_div_ps(gv, beta))), SigmoidV(gv));
      const __m512 linear = _mm512_mul_ps(linear_beta, TanhV(_mm512_div_ps(uv, linear_beta)));
      a = _mm512_mul_ps(gate, linear);
    }
    if (bf16) a = RoundBf16V(a);
    _mm512_mask_storeu_ps(out + i, m, a);
  }
}

// bf16 bits of 16 floats (round to nearest even), as 16 words.
inline __m256i Bf16BitsV(__m512 v) {
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(RoundBf16V(v)), 16));
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
  auto words32 = [](const float* p) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(Bf16BitsV(_mm512_loadu_ps(p))),
                              Bf16BitsV(_mm512_loadu_ps(p + 16)), 1);
  };
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
      const __m512i a = words32(x + g), b = words32(x + g + 32);
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
      const __m512i a = words32(x + g), b = words32(x + g + 32), c = words32(x + g + 64),
                    d = words32(x + g + 96);
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

GluRowFn Avx512GluRow() { return &GluRowAvx512; }
PackRowFn Avx512PackRow() { return &PackRowAvx512; }

}  // namespace moe::cpu
