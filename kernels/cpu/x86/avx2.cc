// AVX2 tier (AVX2 + FMA + F16C: Haswell, Zen 1 and later): dot kernels, GLU and packing, bit
// for bit the canonical order of kernels/cpu/canonical.h.
//
// The 16 canonical lanes are two 8-lane halves (lanes 0-7, 8-15), kept in separate registers;
// lanes never mix until the final reduction tree, whose first step adds the two halves.
//
// bf16 mode: VDPBF16PS emulated exactly. A bf16 x bf16 product is exact in fp32, so lane i's
// two steps per 32-element chunk are two FMAs, element 2i+1 first, then 2i. Operands and
// weights are split into fp32 vectors of their odd and even elements (the upper and lower word
// of each dword of bf16 pairs); per 128-element block the split layout is
//     [half h][chunk c][odd | even][8 lanes]      (floats at 64h + 16c + 8 * even + lane)
// and a block is consumed in exactly that order, so every lane sees its chunks in order.
// fp32 mode: chunk c of 16 elements is its two halves at 16c (lanes 0-7) and 16c + 8.
//
// Weights (all decodes exact):
//  - bf16: read in place, split by a mask and a shift.
//  - MXFP4: the four nibbles of each 16-bit word of packed bytes are runs 0..3 of the canonical
//    order (canonical.h); a 128-bit lane of 32 packed bytes holds one scale block, so one
//    vpshufb per lane looks 16 nibbles up in a 16-entry table of that block's scaled bf16 low
//    bytes, one more in its high bytes (tables for all 256 E8M0 scales, built by the scalar
//    decoder once).
//  - FP8 e4m3: each byte moves into the high byte of an fp16 word (a shift; the odd bytes are
//    there already), an arithmetic shift and a mask make it the fp16 of value * 2^-8 (exact,
//    subnormals included), F16C's vcvtph2ps widens it exactly, * 256 is exact; a quadword
//    permute puts the split layout's lanes together. No gathers. The one NaN code (S.1111.111)
//    would widen to 480: decode to scratch fixes it up, the in-register path redoes a row that
//    holds one.
// Kernel shapes: for few operand rows the weights are decoded in registers and consumed at once
// (MXFP4 and bf16: up to 8 operand rows per sweep over the weights, two sweeps for up to 16; FP8
// up to 8), the FMA chains interleaved (ChunkOrder), with K cut into slices whose operand part
// stays in L1; for more, groups of weight rows are decoded into the per-thread scratch and walked
// in L1-sized K slices by 4 x 3 register tiles (3 x 3 with FP8 block partials) over operand rows
// widened once per call.
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <type_traits>

#include "core/numerics.h"
#include "kernels/cpu/canonical.h"
#include "kernels/cpu/dot.h"
#include "kernels/cpu/x86/tile_common.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace moe::cpu {
namespace {

using x86::DispatchTile;
using x86::PrefetchCursor;
using x86::PrefetchStream;
using x86::WithCount;

constexpr int64_t kBlock = 128;  // = kPadK = kFp8Block
static_assert(kBlock == kPadK && kBlock == kFp8Block, "one block size for padding and FP8 scales");

// Floats between rows the kernels write into the scratch (split operand rows, decoded weight
// rows). A padded K is a multiple of 128 floats, so at K = 7168 rows kp floats apart start 28 KB
// = 7 x 4 KB apart and a tile's rows, read at the same offset, all fall into one set of the
// 8-way L1 (its set index is the address mod 4 KB): the 4 x 3 tiles' 7 rows and the fused
// paths' 5-8 operand rows evicted each other. One cache line more per row spreads them (Zen 4,
// 1 thread, 128 x 7168 in L2: 64 operand rows bf16 0.82x, MXFP4 0.85x the time).
inline int64_t ScratchStride(int64_t kp) { return kp + 16; }

#include "kernels/cpu/x86/avx2_decode.inc"
#include "kernels/cpu/x86/avx2_tiles.inc"

// ---- GLU and packing ----------------------------------------------------------------------------

// The vector operations glu_vector.inc is written in, on 8 lanes.
struct Avx2Ops {
  using F = __m256;
  using I = __m256i;
  using M = __m256;  // a compare result: all-ones lanes where true
  static constexpr int kLanes = 8;
  static F Set(float v) { return _mm256_set1_ps(v); }
  static F Fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F Add(F a, F b) { return _mm256_add_ps(a, b); }
  static F Sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F Mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F Div(F a, F b) { return _mm256_div_ps(a, b); }
  static F Min(F a, F b) { return _mm256_min_ps(a, b); }
  static F Max(F a, F b) { return _mm256_max_ps(a, b); }
  static F Nearest(F a) {
    return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  static I ToInt(F a) { return _mm256_cvtps_epi32(a); }
  static F AsFloat(I a) { return _mm256_castsi256_ps(a); }
  static I AsInt(F a) { return _mm256_castps_si256(a); }
  static I AddInt(I a, I b) { return _mm256_add_epi32(a, b); }
  static I SetInt(int32_t v) { return _mm256_set1_epi32(v); }
  static I ShiftLeft(I a, int n) { return _mm256_slli_epi32(a, n); }
  static I ShiftRight(I a, int n) { return _mm256_srli_epi32(a, n); }
  static I AndInt(I a, I b) { return _mm256_and_si256(a, b); }
  static F AndF(F a, F b) { return _mm256_and_ps(a, b); }
  static F OrF(F a, F b) { return _mm256_or_ps(a, b); }
  static F Abs(F a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a); }
  static M Less(F a, F b) { return _mm256_cmp_ps(a, b, _CMP_LT_OQ); }
  static M GreaterEq(F a, F b) { return _mm256_cmp_ps(a, b, _CMP_GE_OQ); }
  static F Select(M m, F where_false, F where_true) {
    return _mm256_blendv_ps(where_false, where_true, m);
  }
  static F LoadN(const float* p, int64_t n) {
    if (n >= kLanes) return _mm256_loadu_ps(p);
    alignas(32) float buf[kLanes] = {};
    std::memcpy(buf, p, static_cast<size_t>(n) * sizeof(float));
    return _mm256_load_ps(buf);
  }
  static void StoreN(float* p, F v, int64_t n) {
    if (n >= kLanes) return _mm256_storeu_ps(p, v);
    alignas(32) float buf[kLanes];
    _mm256_store_ps(buf, v);
    std::memcpy(p, buf, static_cast<size_t>(n) * sizeof(float));
  }
};

#include "kernels/cpu/x86/glu_vector.inc"

// bf16 bits (round to nearest even) of 16 floats, in order.
inline __m256i Bf16Words16(__m256 lo, __m256 hi) {
  const __m256i a = _mm256_srli_epi32(_mm256_castps_si256(RoundBf16V<Avx2Ops>(lo)), 16);
  const __m256i b = _mm256_srli_epi32(_mm256_castps_si256(RoundBf16V<Avx2Ops>(hi)), 16);
  // packus works per 128-bit lane: [a0-3 b0-3 | a4-7 b4-7] -> reorder the quadwords.
  return _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xD8);
}

void PackRowAvx2(const float* x, int64_t k, WeightFormat format, Precision precision, void* out) {
  const int64_t kp = PaddedK(k);
  const int64_t full =
      k & ~(kPadK - 1);  // whole 128-element groups; the tail goes the portable way
  if (precision == Precision::kFP32 && format == WeightFormat::kBF16) {
    std::memcpy(out, x, static_cast<size_t>(k) * sizeof(float));
    std::memset(static_cast<float*>(out) + k, 0, static_cast<size_t>(kp - k) * sizeof(float));
    return;
  }
  if (precision == Precision::kFP32 || full == 0) {
    PackActivationRow(x, k, format, precision, out);
    return;
  }
  auto* o = static_cast<uint16_t*>(out);
  if (format == WeightFormat::kBF16) {
    for (int64_t i = 0; i < full; i += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + i),
                          Bf16Words16(_mm256_loadu_ps(x + i), _mm256_loadu_ps(x + i + 8)));
  } else if (format == WeightFormat::kFP8Block128) {
    // Per 64-element group, run r holds elements 16L + 8r + j: eight-element pieces move whole.
    for (int64_t g = 0; g < full; g += 64)
      for (int piece = 0; piece < 8; ++piece) {  // elements 8 * piece .. + 7
        const int L = piece / 2, r = piece % 2;
        const __m256i v = _mm256_srli_epi32(
            _mm256_castps_si256(RoundBf16V<Avx2Ops>(_mm256_loadu_ps(x + g + 8 * piece))), 16);
        const __m128i words =
            _mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(o + g + 32 * r + 8 * L), words);
      }
  } else {
    // Per 128-element group, run j holds elements 4w + j: 4 x 4 transposes of fp32 quads.
    for (int64_t g = 0; g < full; g += 128)
      for (int64_t w0 = 0; w0 < 32; w0 += 16) {  // words w0 .. w0 + 15 of every run
        __m256 runs[4][2];
        for (int half = 0; half < 2; ++half) {
          // rows: elements 4w .. 4w + 3 for w = w0 + 8 * half + (0..3) and (+4..7) in lane 1
          const float* p = x + g + 4 * (w0 + 8 * half);
          __m256 r0 = _mm256_loadu_ps(p), r1 = _mm256_loadu_ps(p + 8), r2 = _mm256_loadu_ps(p + 16),
                 r3 = _mm256_loadu_ps(p + 24);
          // r0 = [w, w+1], r1 = [w+2, w+3], ... as lanes: regroup so lane 0 holds w..w+3 and
          // lane 1 w+4..w+7.
          const __m256 a = _mm256_permute2f128_ps(r0, r2, 0x20),
                       b = _mm256_permute2f128_ps(r0, r2, 0x31);
          const __m256 c = _mm256_permute2f128_ps(r1, r3, 0x20),
                       d = _mm256_permute2f128_ps(r1, r3, 0x31);
          // a = [w | w+4], b = [w+1 | w+5], c = [w+2 | w+6], d = [w+3 | w+7]
          const __m256 t0 = _mm256_unpacklo_ps(a, b), t1 = _mm256_unpackhi_ps(a, b);
          const __m256 t2 = _mm256_unpacklo_ps(c, d), t3 = _mm256_unpackhi_ps(c, d);
          runs[0][half] = _mm256_shuffle_ps(t0, t2, 0x44);
          runs[1][half] = _mm256_shuffle_ps(t0, t2, 0xEE);
          runs[2][half] = _mm256_shuffle_ps(t1, t3, 0x44);
          runs[3][half] = _mm256_shuffle_ps(t1, t3, 0xEE);
        }
        for (int j = 0; j < 4; ++j)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + g + 32 * j + w0),
                              Bf16Words16(runs[j][0], runs[j][1]));
      }
  }
  if (full < k || full < kp) PackActivationRow(x + full, k - full, format, precision, o + full);
}

}  // namespace
}  // namespace moe::cpu
#pragma GCC pop_options

namespace moe::cpu {

const DotKernels* Avx2DotKernels() {
  static const DotKernels kernels{"avx2", &DotRows, kGroupRows, &GluRowV<Avx2Ops>, &PackRowAvx2};
  return &kernels;
}

}  // namespace moe::cpu
