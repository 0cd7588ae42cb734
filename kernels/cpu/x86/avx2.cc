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

// ---- lanes, layouts, reduction ----------------------------------------------------------------

// The odd (upper word) and even (lower word) elements of 8 dwords of bf16 pairs, as fp32.
inline __m256 OddElements(__m256i pairs) {
  return _mm256_castsi256_ps(
      _mm256_and_si256(pairs, _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
}
inline __m256 EvenElements(__m256i pairs) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
}

// Where vector v (0..7) of half h of a block lives, in floats from the block's start.
struct SplitLayout {  // bf16 mode: v = 2c + (even), the order the lane's FMAs run in
  static constexpr int kHalf = 64, kVector = 8;
};
struct Fp32Layout {  // fp32 mode: v = chunk c
  static constexpr int kHalf = 8, kVector = 16;
};
inline int64_t SplitOffset(int h, int chunk, int even) { return 64 * h + 16 * chunk + 8 * even; }

// The fixed reduction tree of 16 lanes held as two halves.
inline float ReduceHalves(__m256 lo, __m256 hi) {
  const __m256 r8 = _mm256_add_ps(lo, hi);  // i + (i + 8)
  const __m128 r4 = _mm_add_ps(_mm256_castps256_ps128(r8), _mm256_extractf128_ps(r8, 1));
  const __m128 r2 = _mm_add_ps(r4, _mm_movehl_ps(r4, r4));
  return _mm_cvtss_f32(_mm_add_ss(r2, _mm_shuffle_ps(r2, r2, 1)));
}

// A packed bf16 operand row (canonical order) in the split layout.
void SplitOperandRow(const uint16_t* x, int64_t kp, float* out) {
  for (int64_t b = 0; b < kp; b += kBlock)
    for (int c = 0; c < 4; ++c)
      for (int h = 0; h < 2; ++h) {
        const __m256i v =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + b + 32 * c + 16 * h));
        _mm256_store_ps(out + b + SplitOffset(h, c, 0), OddElements(v));
        _mm256_store_ps(out + b + SplitOffset(h, c, 1), EvenElements(v));
      }
}

// The same row times 256, for the fused FP8 path (whose weights then decode as value * 2^-8,
// one multiply fewer per 8 weights: each product, and so every rounded sum, is unchanged).
// Exact unless a finite element reaches 2^120 (bf16 exponent field 247-254), where x * 256
// would overflow: returns false if any does (infinities and NaNs scale to themselves).
bool SplitOperandRowTimes256(const uint16_t* x, int64_t kp, float* out) {
  const __m256 times = _mm256_set1_ps(256.0f);
  const __m256i exponent = _mm256_set1_epi16(0x7F80);
  const __m256i below = _mm256_set1_epi16(246 << 7);  // fields 247 and up ...
  __m256i overflow = _mm256_setzero_si256();
  for (int64_t b = 0; b < kp; b += kBlock)
    for (int c = 0; c < 4; ++c)
      for (int h = 0; h < 2; ++h) {
        const __m256i v =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + b + 32 * c + 16 * h));
        const __m256i field = _mm256_and_si256(v, exponent);  // ... but not 255 (inf, NaN)
        overflow =
            _mm256_or_si256(overflow, _mm256_andnot_si256(_mm256_cmpeq_epi16(field, exponent),
                                                          _mm256_cmpgt_epi16(field, below)));
        _mm256_store_ps(out + b + SplitOffset(h, c, 0), _mm256_mul_ps(OddElements(v), times));
        _mm256_store_ps(out + b + SplitOffset(h, c, 1), _mm256_mul_ps(EvenElements(v), times));
      }
  return _mm256_testz_si256(overflow, overflow);
}

// ---- MXFP4 ------------------------------------------------------------------------------------

// Per E8M0 scale s: [low bytes][high bytes] of the bf16 bits of E2M1 nibble n times 2^(s-127),
// from the scalar decoder, so every scale (255 = NaN included) decodes as the portable kernel.
struct Mxfp4Tables {
  alignas(16) uint8_t bytes[256][2][16];
};
const Mxfp4Tables& Mxfp4ScaleTables() {
  static const Mxfp4Tables* tables = [] {
    auto* t = new Mxfp4Tables;
    for (int s = 0; s < 256; ++s)
      for (int n = 0; n < 16; ++n) {
        const uint16_t bits = FloatToBf16Bits(E2m1ToFloat(static_cast<uint8_t>(n)) *
                                              E8m0ToFloat(static_cast<uint8_t>(s)));
        t->bytes[s][0][n] = static_cast<uint8_t>(bits & 0xFF);
        t->bytes[s][1][n] = static_cast<uint8_t>(bits >> 8);
      }
    return t;
  }();
  return *tables;
}

// Half h of one 128-element group: its 32 packed bytes (16 words, nibbles of elements
// 4w .. 4w+3; words 0-7 in scale block 2h, 8-15 in 2h + 1) -> the bf16 words of chunks 0..3,
// half h (canonical positions 16h .. 16h + 15 of runs 0..3).
class Mxfp4Decoder {
 public:
  Mxfp4Decoder() : tables_(Mxfp4ScaleTables()) {}

  void Half(const uint8_t* bytes, const uint8_t* block_scales, __m256i out[4]) const {
    __m256i t_lo, t_hi;
    Tables(block_scales, &t_lo, &t_hi);
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes));
    const __m256i nib = _mm256_set1_epi8(0x0F);
    const __m256i a = _mm256_and_si256(w, nib);                        // runs 0 | 2 per word
    const __m256i b = _mm256_and_si256(_mm256_srli_epi16(w, 4), nib);  // runs 1 | 3
    const __m256i la = _mm256_shuffle_epi8(t_lo, a), ha = _mm256_shuffle_epi8(t_hi, a);
    const __m256i lb = _mm256_shuffle_epi8(t_lo, b), hb = _mm256_shuffle_epi8(t_hi, b);
    const __m256i low = _mm256_set1_epi16(0x00FF), high = _mm256_set1_epi16(-256);
    out[0] = _mm256_or_si256(_mm256_and_si256(la, low), _mm256_slli_epi16(ha, 8));
    out[1] = _mm256_or_si256(_mm256_and_si256(lb, low), _mm256_slli_epi16(hb, 8));
    out[2] = _mm256_or_si256(_mm256_srli_epi16(la, 8), _mm256_and_si256(ha, high));
    out[3] = _mm256_or_si256(_mm256_srli_epi16(lb, 8), _mm256_and_si256(hb, high));
  }

  // The same half straight into the split layout: odd[c], even[c] of chunks 0..3. Lane j's
  // dword of packed bytes holds [even word: runs 0|1, 2|3][odd word: runs 0|1, 2|3]; one byte
  // shuffle puts every lane's even bytes before its odd ones, so that after the lookups a byte
  // unpack of low and high bf16 bytes leaves, per lane, its even element of run c in the low
  // word and its odd element in the high word: a mask gives odd[c], a shift even[c]. (14 shuffle
  // or shift ops per 64 weights: on Zen 3 those share two pipes.) In two steps, so that a kernel
  // can look up several halves before it consumes their chunks: Lookups, then SplitChunk.
  void HalfSplit(const uint8_t* bytes, const uint8_t* block_scales, __m256 odd[4],
                 __m256 even[4]) const {
    __m256i lookups[4];
    Lookups(bytes, block_scales, lookups);
    for (int c = 0; c < 4; ++c) SplitChunk(lookups, c, &odd[c], &even[c]);
  }
  // The four table lookups of a half: low and high bf16 bytes of runs 0|2, then of runs 1|3.
  void Lookups(const uint8_t* bytes, const uint8_t* block_scales, __m256i out[4]) const {
    __m256i t_lo, t_hi;
    Tables(block_scales, &t_lo, &t_hi);
    const __m256i evens_first =
        _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,  //
                         0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    const __m256i w = _mm256_shuffle_epi8(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes)), evens_first);
    const __m256i nib = _mm256_set1_epi8(0x0F);
    const __m256i a = _mm256_and_si256(w, nib);                        // runs 0 | 2
    const __m256i b = _mm256_and_si256(_mm256_srli_epi16(w, 4), nib);  // runs 1 | 3
    out[0] = _mm256_shuffle_epi8(t_lo, a);
    out[1] = _mm256_shuffle_epi8(t_hi, a);
    out[2] = _mm256_shuffle_epi8(t_lo, b);
    out[3] = _mm256_shuffle_epi8(t_hi, b);
  }
  // Chunk c of a half from its lookups: runs 0 and 1 are the low 8 bytes of each 128-bit lane,
  // runs 2 and 3 the high ones.
  static void SplitChunk(const __m256i lookups[4], int c, __m256* odd, __m256* even) {
    const __m256i lo = lookups[2 * (c & 1)], hi = lookups[2 * (c & 1) + 1];
    const __m256i pairs = c < 2 ? _mm256_unpacklo_epi8(lo, hi) : _mm256_unpackhi_epi8(lo, hi);
    *odd = OddElements(pairs);
    *even = EvenElements(pairs);
  }

 private:
  // The two scale blocks' tables, one per 128-bit lane (broadcast loads and a blend: no
  // shuffle-unit op, unlike an insert).
  void Tables(const uint8_t* block_scales, __m256i* t_lo, __m256i* t_hi) const {
    const auto* lo0 = reinterpret_cast<const __m128i*>(tables_.bytes[block_scales[0]][0]);
    const auto* hi0 = reinterpret_cast<const __m128i*>(tables_.bytes[block_scales[0]][1]);
    const auto* lo1 = reinterpret_cast<const __m128i*>(tables_.bytes[block_scales[1]][0]);
    const auto* hi1 = reinterpret_cast<const __m128i*>(tables_.bytes[block_scales[1]][1]);
    *t_lo = _mm256_blend_epi32(_mm256_broadcastsi128_si256(_mm_load_si128(lo0)),
                               _mm256_broadcastsi128_si256(_mm_load_si128(lo1)), 0xF0);
    *t_hi = _mm256_blend_epi32(_mm256_broadcastsi128_si256(_mm_load_si128(hi0)),
                               _mm256_broadcastsi128_si256(_mm_load_si128(hi1)), 0xF0);
  }
  const Mxfp4Tables& tables_;
};

// ---- FP8 e4m3 ---------------------------------------------------------------------------------

// vpshufb controls (fp32 mode): per 128-bit lane (16 bytes = elements 16L + 0..15 of a
// 64-element group), byte b of run r (elements 16L + 8r + b, b < 8) goes to the high byte of
// word b (low byte 0): canonical position order.
struct Fp8Controls {
  alignas(32) int8_t natural[2][32];
};
const Fp8Controls& Fp8ShuffleControls() {
  static const Fp8Controls controls = [] {
    Fp8Controls c{};
    for (int r = 0; r < 2; ++r)
      for (int lane = 0; lane < 2; ++lane)
        for (int k = 0; k < 8; ++k) {
          c.natural[r][16 * lane + 2 * k] = -128;  // zero
          c.natural[r][16 * lane + 2 * k + 1] = static_cast<int8_t>(8 * r + k);
        }
    return c;
  }();
  return controls;
}

// 16 words, each an FP8 byte in its high byte -> the fp16 bits of the byte's value * 2^-8.
inline __m256i Fp8WordsToHalf(__m256i words) {
  return _mm256_and_si256(_mm256_srai_epi16(words, 1),
                          _mm256_set1_epi16(static_cast<short>(0xBFFF)));
}
// kOver256 (the fused path, whose operand rows carry the * 256): the value * 2^-8.
template <bool kOver256 = false>
inline __m256 HalfToFp8Value(__m128i half) {
  const __m256 over256 = _mm256_cvtph_ps(half);
  return kOver256 ? over256 : _mm256_mul_ps(over256, _mm256_set1_ps(256.0f));
}

// Whether 32 stored bytes hold the NaN code (S.1111.111).
inline bool HasFp8Nan(__m256i bytes) {
  const __m256i mag = _mm256_set1_epi8(0x7F);
  const __m256i nan = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, mag), mag);
  return !_mm256_testz_si256(nan, nan);
}
// The NaN code widens to +-480 (no finite E4M3 value): replace it by the portable decoder's NaN.
inline __m256 FixFp8Nan(__m256 v) {
  const __m256 sign = _mm256_and_ps(v, _mm256_set1_ps(-0.0f));
  const __m256 nan = _mm256_or_ps(sign, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)));
  const __m256 is_nan =
      _mm256_cmp_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), v), _mm256_set1_ps(480.0f), _CMP_EQ_OQ);
  return _mm256_blendv_ps(v, nan, is_nan);
}

// 32 stored bytes of a row from k (zero past `cols`: +0, the padding).
inline __m256i LoadFp8Bytes(const uint8_t* row, int64_t cols, int64_t k) {
  if (k + 32 <= cols) {
    PrefetchStream(row + k);
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + k));
  }
  alignas(32) uint8_t bytes[32] = {};
  if (k < cols) std::memcpy(bytes, row + k, static_cast<size_t>(cols - k));
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(bytes));
}

// Both runs of half h of a group (its 32 bytes `half`: elements 16L + 8r + j of the L = 2h, 2h + 1
// lanes) in the split layout. Word k of each 128-bit lane holds the bytes of run k / 4, elements
// 2(k % 4) and 2(k % 4) + 1: the even byte shifted into the high byte, and the odd one already
// there, become fp16 words by an arithmetic shift and a mask; a quadword permute puts each run's
// lanes 0-3 (L = 2h) beside its lanes 4-7 (L = 2h + 1). The permute moves whole words, which the
// shifts and masks treat alike, so it runs once on the stored bytes rather than on both results.
// kOver256: the values * 2^-8.
template <bool kOver256 = false>
inline void Fp8SplitRuns(__m256i half, __m256 odd[2], __m256 even[2]) {
  const __m256i clear = _mm256_set1_epi16(static_cast<short>(0xBF80));
  const __m256i runs = _mm256_permute4x64_epi64(half, 0xD8);
  const __m256i e = _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(runs, 8), 1), clear);
  const __m256i o = _mm256_and_si256(_mm256_srai_epi16(runs, 1), clear);
  even[0] = HalfToFp8Value<kOver256>(_mm256_castsi256_si128(e));
  even[1] = HalfToFp8Value<kOver256>(_mm256_extracti128_si256(e, 1));
  odd[0] = HalfToFp8Value<kOver256>(_mm256_castsi256_si128(o));
  odd[1] = HalfToFp8Value<kOver256>(_mm256_extracti128_si256(o, 1));
}

// Folds where 32 stored bytes hold the NaN code (S.1111.111) into `acc`: 0x7F is the largest
// signed byte and 0xFF the largest unsigned one, so both maxima reach them exactly when present.
// (An explicit constructor: GCC compiles implicit ones without the region's target.)
struct Fp8NanScan {
  Fp8NanScan() : signed_max(_mm256_set1_epi8(-128)), unsigned_max(_mm256_setzero_si256()) {}
  __m256i signed_max, unsigned_max;
  void Add(__m256i bytes) {
    signed_max = _mm256_max_epi8(signed_max, bytes);
    unsigned_max = _mm256_max_epu8(unsigned_max, bytes);
  }
  bool Found() const {
    const __m256i hit = _mm256_or_si256(_mm256_cmpeq_epi8(signed_max, _mm256_set1_epi8(0x7F)),
                                        _mm256_cmpeq_epi8(unsigned_max, _mm256_set1_epi8(-1)));
    return !_mm256_testz_si256(hit, hit);
  }
};

// Calls half(g, h, bytes, block_scales) for half h of every 128-element group g of MXFP4 row n
// (its 32 packed bytes and 2 E8M0 scales); a partial last group comes from a zero-padded copy
// (missing nibbles are 0, i.e. +0).
template <typename Half>
void ForEachMxfp4Half(const WeightMatrix& w, int64_t n, Half&& half) {
  const auto* packed = static_cast<const uint8_t*>(w.data) + n * (w.cols / 2);
  const auto* scales = static_cast<const uint8_t*>(w.scales) + n * (w.cols / 32);
  for (int64_t g = 0; g * kBlock < w.cols; ++g) {
    alignas(32) uint8_t bytes[64] = {};
    alignas(16) uint8_t block_scales[4] = {127, 127, 127, 127};
    const uint8_t* p = packed + 64 * g;
    const uint8_t* s = scales + 4 * g;
    if ((g + 1) * kBlock > w.cols) {
      const int64_t blocks = (w.cols - g * kBlock) / 32;
      std::memcpy(bytes, p, static_cast<size_t>(16 * blocks));
      std::memcpy(block_scales, s, static_cast<size_t>(blocks));
      p = bytes;
      s = block_scales;
    }
    for (int h = 0; h < 2; ++h) half(g, h, p + 32 * h, s + 2 * h);
  }
}

// ---- weight rows into the scratch (decoded once, reused by every operand tile) ---------------

// Row n in the split layout (bf16 mode), kp floats.
void DecodeRowSplit(const WeightMatrix& w, int64_t n, float* out) {
  const int64_t kp = PaddedK(w.cols);
  switch (w.format) {
    case WeightFormat::kBF16: {
      const uint16_t* row = static_cast<const uint16_t*>(w.data) + n * w.cols;
      const int64_t full = w.cols / kBlock * kBlock;
      SplitOperandRow(row, full, out);
      if (full < kp) {
        alignas(32) uint16_t tail[kBlock] = {};
        std::memcpy(tail, row + full, static_cast<size_t>(w.cols - full) * sizeof(uint16_t));
        SplitOperandRow(tail, kBlock, out + full);
      }
      return;
    }
    case WeightFormat::kMXFP4: {
      const Mxfp4Decoder decoder;
      ForEachMxfp4Half(w, n, [&](int64_t g, int h, const uint8_t* bytes, const uint8_t* scales) {
        __m256 odd[4], even[4];
        decoder.HalfSplit(bytes, scales, odd, even);
        for (int c = 0; c < 4; ++c) {
          _mm256_store_ps(out + kBlock * g + SplitOffset(h, c, 0), odd[c]);
          _mm256_store_ps(out + kBlock * g + SplitOffset(h, c, 1), even[c]);
        }
      });
      return;
    }
    case WeightFormat::kFP8Block128: {
      const auto* row = static_cast<const uint8_t*>(w.data) + n * w.cols;
      for (int64_t k = 0; k < kp; k += 64) {
        float* block = out + (k / kBlock) * kBlock;
        const int chunk0 = static_cast<int>((k % kBlock) / 32);  // runs of this group: 2 chunks
        for (int h = 0; h < 2; ++h) {
          const __m256i bytes = LoadFp8Bytes(row, w.cols, k + 32 * h);
          const bool nan = HasFp8Nan(bytes);
          __m256 odd[2], even[2];
          Fp8SplitRuns(bytes, odd, even);
          for (int r = 0; r < 2; ++r) {
            _mm256_store_ps(block + SplitOffset(h, chunk0 + r, 0),
                            nan ? FixFp8Nan(odd[r]) : odd[r]);
            _mm256_store_ps(block + SplitOffset(h, chunk0 + r, 1),
                            nan ? FixFp8Nan(even[r]) : even[r]);
          }
        }
      }
      return;
    }
  }
}

// Row n as fp32 in canonical order (fp32 mode), kp floats.
void DecodeRowFp32(const WeightMatrix& w, int64_t n, float* out) {
  const int64_t kp = PaddedK(w.cols);
  auto widen16 = [](__m256i words, float* o) {  // 16 bf16 words -> 16 floats, in order
    _mm256_store_ps(o, _mm256_castsi256_ps(_mm256_slli_epi32(
                           _mm256_cvtepu16_epi32(_mm256_castsi256_si128(words)), 16)));
    _mm256_store_ps(o + 8, _mm256_castsi256_ps(_mm256_slli_epi32(
                               _mm256_cvtepu16_epi32(_mm256_extracti128_si256(words, 1)), 16)));
  };
  switch (w.format) {
    case WeightFormat::kBF16: {
      const uint16_t* row = static_cast<const uint16_t*>(w.data) + n * w.cols;
      int64_t k = 0;
      for (; k + 16 <= w.cols; k += 16)
        widen16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + k)), out + k);
      for (; k < w.cols; ++k) out[k] = Bf16BitsToFloat(row[k]);
      std::fill(out + w.cols, out + kp, 0.0f);
      return;
    }
    case WeightFormat::kMXFP4: {  // the words are canonical positions 32c + 16h + (0..15)
      const Mxfp4Decoder decoder;
      ForEachMxfp4Half(w, n, [&](int64_t g, int h, const uint8_t* bytes, const uint8_t* scales) {
        __m256i words[4];
        decoder.Half(bytes, scales, words);
        for (int c = 0; c < 4; ++c) widen16(words[c], out + kBlock * g + 32 * c + 16 * h);
      });
      return;
    }
    case WeightFormat::kFP8Block128: {
      // Canonical positions 32r + 8L .. +7 of a group are its bytes 16L + 8r .. +7.
      const Fp8Controls& controls = Fp8ShuffleControls();
      const __m256i c0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(controls.natural[0]));
      const __m256i c1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(controls.natural[1]));
      const auto* row = static_cast<const uint8_t*>(w.data) + n * w.cols;
      for (int64_t k = 0; k < kp; k += 64)
        for (int h = 0; h < 2; ++h) {
          const __m256i bytes = LoadFp8Bytes(row, w.cols, k + 32 * h);
          const bool nan = HasFp8Nan(bytes);
          for (int r = 0; r < 2; ++r) {
            // lanes: [L = 2h positions 0-7 | L = 2h + 1 positions 0-7] of run r
            const __m256i half = Fp8WordsToHalf(_mm256_shuffle_epi8(bytes, r ? c1 : c0));
            __m256 a = HalfToFp8Value(_mm256_castsi256_si128(half));
            __m256 b = HalfToFp8Value(_mm256_extracti128_si256(half, 1));
            if (nan) {
              a = FixFp8Nan(a);
              b = FixFp8Nan(b);
            }
            _mm256_store_ps(out + k + 32 * r + 8 * (2 * h), a);
            _mm256_store_ps(out + k + 32 * r + 8 * (2 * h + 1), b);
          }
        }
      return;
    }
  }
}

// ---- register tiles over decoded rows ----------------------------------------------------------

// MR operand rows x NR weight rows over the K slice [k0, k1) (multiples of 128), both in layout
// L, as two passes (half 0, then half 1). FP8 (kBlocked): each block accumulates into fresh
// partials, then lanes = fma(partial, scale_inv, lanes). The lane totals of both halves carry
// over between slices in `carry` (2 x MR x NR x 8 floats): `first` starts them at zero,
// otherwise they are loaded; `last` reduces them into y, otherwise they are stored. Storing
// and reloading fp32 lanes is exact, so slicing K does not change a bit. `prefetch` steps once
// per block of the first pass.
template <int MR, int NR, bool kBlocked, typename L>
void Tile(const float* const* x, const float* const* w, const float* const* scales, int64_t k0,
          int64_t k1, float* carry, bool first, bool last, float* y, int64_t ldy,
          PrefetchCursor* prefetch) {
  for (int h = 0; h < 2; ++h) {
    float* c = carry + h * (MR * NR * 8);
    __m256 acc[MR][NR];
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j)
        acc[i][j] = first ? _mm256_setzero_ps() : _mm256_load_ps(c + 8 * (i * NR + j));
    for (int64_t b0 = k0; b0 < k1; b0 += kBlock) {
      if (h == 0) prefetch->Step();
      __m256 part[MR][NR];
      for (int i = 0; i < MR; ++i)
        for (int j = 0; j < NR; ++j) part[i][j] = kBlocked ? _mm256_setzero_ps() : acc[i][j];
      for (int v = 0; v < 8; ++v) {
        const int64_t off = b0 + h * L::kHalf + v * L::kVector;
        __m256 wv[NR];
        for (int j = 0; j < NR; ++j) wv[j] = _mm256_load_ps(w[j] + off);
        for (int i = 0; i < MR; ++i) {
          const __m256 xv = _mm256_loadu_ps(x[i] + off);
          for (int j = 0; j < NR; ++j) part[i][j] = _mm256_fmadd_ps(wv[j], xv, part[i][j]);
        }
      }
      for (int j = 0; j < NR; ++j) {
        if constexpr (kBlocked) {
          const __m256 s = _mm256_set1_ps(scales[j][b0 / kBlock]);
          for (int i = 0; i < MR; ++i) acc[i][j] = _mm256_fmadd_ps(part[i][j], s, acc[i][j]);
        } else {
          for (int i = 0; i < MR; ++i) acc[i][j] = part[i][j];
        }
      }
    }
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) {
        if (last && h == 1) {
          y[i * ldy + j] = ReduceHalves(_mm256_load_ps(carry + 8 * (i * NR + j)), acc[i][j]);
        } else {
          _mm256_store_ps(c + 8 * (i * NR + j), acc[i][j]);
        }
      }
  }
}

// Tile shapes: 4 x 3 (12 accumulators, 3 weight vectors, 1 operand vector of the 16 registers);
// with FP8 block partials 3 x 3 (the totals, touched once per block, live in memory). Measured
// on the bf16 scratch path at 64 operand rows: 4 x 3 ~1.3x faster than 6 x 2, 3 x 4 and 5 x 2;
// FP8 3 x 3 ~1.3x faster than 2 x 3 and 4 x 3.
constexpr int kTileCols = 3;
constexpr int kTileRows = 4;
constexpr int kBlockedTileRows = 3;
constexpr int kGroupRows = 12;  // weight rows decoded into the scratch at a time
// K is walked in slices so that an operand tile's slice (4 rows) and the group's slice (12 rows)
// stay in L1 (4 KB per fp32 row slice: 64 KB, most of it the group's, read by every tile)
// while every tile of the group reuses them; unsliced, every tile streamed its rows from L2.
// Measured: 1024 ~1.4x faster than no slicing and 1.7x faster than 256; with the rows
// ScratchStride apart, 512 no different from 1024 (Zen 4).
constexpr int64_t kSliceK = 1024;
constexpr int64_t kCarryFloats = 2 * kTileRows * kTileCols * 8;  // per tile

// Rows [n0, n1) against all operand rows: weight rows decoded kGroupRows at a time into the
// scratch, operand rows widened into it once (bf16 mode; fp32 operands are used in place).
void ScratchRows(const DotOperands& op, int64_t n0, int64_t n1, float* y, int64_t ldy,
                 DotScratch* scratch) {
  const WeightMatrix& w = *op.w;
  const bool bf16 = op.precision == Precision::kBF16;
  const bool fp8 = w.format == WeightFormat::kFP8Block128;
  const int64_t kp = PaddedK(w.cols);
  const int tile_rows = fp8 ? kBlockedTileRows : kTileRows;
  const int64_t i_tiles = (op.m + tile_rows - 1) / tile_rows;
  constexpr int64_t j_tiles = (kGroupRows + kTileCols - 1) / kTileCols;
  const int64_t ld = ScratchStride(kp);
  const int64_t x_floats = bf16 ? op.m * ld : 0;
  const int64_t carry_floats = i_tiles * j_tiles * kCarryFloats;
  auto* base = reinterpret_cast<float*>(scratch->Reserve(static_cast<size_t>(
      (kGroupRows * ld + x_floats + carry_floats) * 4 + op.m * sizeof(const float*))));
  float* rows = base;
  float* x_split = rows + kGroupRows * ld;
  float* carry = x_split + x_floats;
  auto** xp = reinterpret_cast<const float**>(carry + carry_floats);
  for (int64_t i = 0; i < op.m; ++i) {
    const int64_t r = op.x_rows ? op.x_rows[i] : i;
    if (bf16) {
      SplitOperandRow(static_cast<const uint16_t*>(op.x) + r * op.x_stride, kp, x_split + i * ld);
      xp[i] = x_split + i * ld;
    } else {
      xp[i] = static_cast<const float*>(op.x) + r * op.x_stride;
    }
  }
  for (int64_t nb = n0; nb < n1; nb += kGroupRows) {
    const int nr = static_cast<int>(std::min<int64_t>(kGroupRows, n1 - nb));
    const float* wp[kGroupRows];
    const float* sp[kGroupRows];
    for (int j = 0; j < nr; ++j) {
      float* row = rows + j * ld;
      if (bf16) {
        DecodeRowSplit(w, nb + j, row);
      } else {
        DecodeRowFp32(w, nb + j, row);
      }
      wp[j] = row;
      sp[j] = fp8 ? Fp8RowScales(w, nb + j) : nullptr;
    }
    // The next group's stored bytes are requested into L2 while this group's tiles compute.
    PrefetchCursor prefetch =
        PrefetchCursor::Rows(w, nb + nr, std::min<int64_t>(kGroupRows, n1 - nb - nr),
                             (kp / kBlock) * i_tiles * ((nr + kTileCols - 1) / kTileCols));
    for (int64_t k0 = 0; k0 < kp; k0 += kSliceK) {
      const int64_t k1 = std::min(k0 + kSliceK, kp);
      const bool first = k0 == 0, last = k1 == kp;
      for (int64_t it = 0; it < i_tiles; ++it) {
        const int64_t i0 = it * tile_rows;
        const int mr = static_cast<int>(std::min<int64_t>(tile_rows, op.m - i0));
        for (int j0 = 0; j0 < nr; j0 += kTileCols) {
          const int nc = std::min(kTileCols, nr - j0);
          float* yt = y + i0 * ldy + (nb - n0) + j0;
          float* c = carry + (it * j_tiles + j0 / kTileCols) * kCarryFloats;
          auto run = [&](auto rows_tag, auto cols_tag) {
            constexpr int kMr = decltype(rows_tag)::value, kNr = decltype(cols_tag)::value;
            if (fp8) {
              if constexpr (kMr <= kBlockedTileRows) {
                if (bf16) {
                  Tile<kMr, kNr, true, SplitLayout>(xp + i0, wp + j0, sp + j0, k0, k1, c, first,
                                                    last, yt, ldy, &prefetch);
                } else {
                  Tile<kMr, kNr, true, Fp32Layout>(xp + i0, wp + j0, sp + j0, k0, k1, c, first,
                                                   last, yt, ldy, &prefetch);
                }
              }
            } else if (bf16) {
              Tile<kMr, kNr, false, SplitLayout>(xp + i0, wp + j0, nullptr, k0, k1, c, first, last,
                                                 yt, ldy, &prefetch);
            } else {
              Tile<kMr, kNr, false, Fp32Layout>(xp + i0, wp + j0, nullptr, k0, k1, c, first, last,
                                                yt, ldy, &prefetch);
            }
          };
          WithCount<kTileRows>(mr, [&](auto rows_tag) {
            WithCount<kTileCols>(nc, [&](auto cols_tag) { run(rows_tag, cols_tag); });
          });
        }
      }
    }
  }
}

// ---- weights decoded in registers, for few operand rows -----------------------------------------

// Operand rows in the split layout, in the scratch; returns their pointers' array. `extra`
// (when given) gets `extra_bytes` more of the scratch, 64-byte aligned. `times256` (when given):
// the rows times 256, and *times256 cleared if that would overflow (SplitOperandRowTimes256).
const float* const* SplitOperands(const DotOperands& op, int64_t kp, DotScratch* scratch,
                                  int64_t extra_bytes = 0, uint8_t** extra = nullptr,
                                  bool* times256 = nullptr) {
  const int64_t extra_rounded = (extra_bytes + 63) / 64 * 64, ld = ScratchStride(kp);
  auto* base = scratch->Reserve(
      static_cast<size_t>(op.m * ld * 4 + extra_rounded + op.m * sizeof(const float*)));
  auto* rows = reinterpret_cast<float*>(base);
  if (extra != nullptr) *extra = base + op.m * ld * 4;
  auto** xp = reinterpret_cast<const float**>(base + op.m * ld * 4 + extra_rounded);
  for (int64_t i = 0; i < op.m; ++i) {
    const int64_t r = op.x_rows ? op.x_rows[i] : i;
    const uint16_t* row = static_cast<const uint16_t*>(op.x) + r * op.x_stride;
    if (times256 != nullptr) {
      *times256 = SplitOperandRowTimes256(row, kp, rows + i * ld) && *times256;
    } else {
      SplitOperandRow(row, kp, rows + i * ld);
    }
    xp[i] = rows + i * ld;
  }
  return xp;
}

// ---- K slices for the fused paths ------------------------------------------------------------

// The fused paths stream each weight row once past the operand rows. Unsliced, more than a few
// operand rows of a wide K no longer fit L1 (Zen: 32 KB) and every weight row reads them all from
// L2 again: 4 rows of K = 3584 took 2x the FMA time. So K is cut into slices whose operand part
// (MR rows) fits in kFusedOperandBytes, and a group of weight rows sweeps each slice in turn; the
// lanes carry over between slices through memory (storing and reloading fp32 lanes is exact).
constexpr int64_t kFusedOperandBytes = 16 << 10;
constexpr int kFusedGroupRows = 16;  // weight rows that sweep one slice before the next slice

// Calls tile(row, rows, k0, k1, carry, first, last) for tiles of up to NR weight rows of w over
// [n0, n1) and K slices [k0, k1) (multiples of kBlock); `carry` holds the tile's lanes between its
// slices (kCarryPerRow floats per weight row). With more than one slice a group's rows are read
// in chunks a row apart, which the hardware prefetcher does not follow: the next group's stored
// bytes (rows before `prefetch_end`) are requested into L2 during this group's sweep instead
// (bf16 at 4 operand rows of K = 7168 streamed ~3x slower without).
template <int MR, int NR, typename Tile>
void SlicedRows(const WeightMatrix& w, int64_t n0, int64_t n1, int64_t prefetch_end,
                int64_t carry_per_row, float* carry, Tile&& tile) {
  const int64_t kp = PaddedK(w.cols);
  const int64_t kc = std::max<int64_t>(
      kBlock, std::min<int64_t>(kp, kFusedOperandBytes / (4 * MR) / kBlock * kBlock));
  const int64_t slices = (kp + kc - 1) / kc;
  for (int64_t nb = n0; nb < n1; nb += kFusedGroupRows) {
    const int64_t ne = std::min<int64_t>(n1, nb + kFusedGroupRows);
    PrefetchCursor prefetch;
    if (slices > 1)
      prefetch = PrefetchCursor::Rows(w, ne, std::min<int64_t>(kFusedGroupRows, prefetch_end - ne),
                                      slices * ((ne - nb + NR - 1) / NR));
    for (int64_t k0 = 0; k0 < kp; k0 += kc) {
      const int64_t k1 = std::min(kp, k0 + kc);
      for (int64_t n = nb; n < ne; n += NR) {
        prefetch.Step();
        tile(n, static_cast<int>(std::min<int64_t>(NR, ne - n)), k0, k1,
             carry + (n - nb) * carry_per_row, k0 == 0, k1 == kp);
      }
    }
  }
}
// Floats of carry SlicedRows needs per weight row and in all.
constexpr int64_t CarryPerRow(int mr) { return 2 * mr * 8; }
constexpr int64_t CarryFloats(int mr) { return kFusedGroupRows * CarryPerRow(mr); }

// Lanes in and out of a tile's carry: [half][row][operand row] x 8 floats.
inline __m256 LoadLanes(const float* carry, int mr, int nr, int h, int r, int i) {
  return _mm256_load_ps(carry + 8 * ((h * nr + r) * mr + i));
}
inline void StoreLanes(float* carry, int mr, int nr, int h, int r, int i, __m256 v) {
  _mm256_store_ps(carry + 8 * ((h * nr + r) * mr + i), v);
}

// Weights decoded in registers for a tile of NR weight rows, one chunk (the odd and even
// vectors of the split layout) at a time: Decode(g, r, h, d) prepares half h of row r's block g
// in four registers d, Chunk(g, r, h, c, d) then gives its chunk c. MXFP4 does its table lookups
// in Decode and splits a chunk from them; bf16 rows are read in place, a chunk at a time, and
// split by a mask and a shift.
template <int NR>
struct Mxfp4Chunks {
  const uint8_t* packed[NR];
  const uint8_t* scales[NR];
  Mxfp4Decoder decoder;
  void Decode(int64_t g, int r, int h, __m256i d[4]) const {
    if (h == 0) PrefetchStream(packed[r] + 64 * g);
    decoder.Lookups(packed[r] + 64 * g + 32 * h, scales[r] + 4 * g + 2 * h, d);
  }
  static void Chunk(int64_t, int, int, int c, const __m256i d[4], __m256* odd, __m256* even) {
    Mxfp4Decoder::SplitChunk(d, c, odd, even);
  }
};
template <int NR>
struct Bf16Chunks {
  const uint16_t* rows[NR];
  // The hardware prefetcher: software prefetch of bf16 rows read in place measured ~8% slower.
  void Decode(int64_t, int, int, __m256i*) const {}
  void Chunk(int64_t g, int r, int h, int c, const __m256i*, __m256* odd, __m256* even) const {
    const __m256i words = _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(rows[r] + kBlock * g + 32 * c + 16 * h));
    *odd = OddElements(words);
    *even = EvenElements(words);
  }
};

// The order in which a tile takes its chunks. Each of its 2 x MR x NR accumulator chains takes
// two dependent FMAs per chunk, and the core overlaps chains only as far as its scheduler
// reaches: on Zen 3, 8 chains fed 8 FMAs in a row each ran at half the FMA rate of the same
// chains fed 2 at a time. So the chains' FMAs are interleaved wherever the decoded weights fit
// in registers:
//  - kInterleaved: chunks in canonical order across all the tile's row halves (bf16, read in
//    place; MXFP4 with one weight row: its two halves' lookups);
//  - kRowHalves: one row half after the other (MXFP4 with several weight rows, whose lookups
//    would spill);
//  - kHalfPasses: one weight row, half 0 over the whole K range, then half 1 (read from L1), for
//    5-8 operand rows: MR accumulators in registers, each decode feeding MR chains;
//  - kRowInterleaved: one row after the other, each row's two halves interleaved (MXFP4 with
//    one operand row: 2 chains close together, 8 lookup registers, and the next row's decode
//    for the core to overlap).
enum class ChunkOrder { kInterleaved, kRowHalves, kHalfPasses, kRowInterleaved };

// NR weight rows side by side over the blocks [g0, g1) against MR operand rows.
template <int MR, int NR, ChunkOrder kOrder, typename Chunks>
void FusedTile(const Chunks& chunks, const float* const* x, int64_t g0, int64_t g1, float* carry,
               bool first, bool last, float* y, int64_t ldy) {
  // Chunk c of half h of row r's block g (decoded in d) into the lanes `acc` of MR operand rows.
  auto consume = [&](int64_t g, int r, int h, int c, const __m256i* d, __m256* acc) {
    __m256 odd, even;
    chunks.Chunk(g, r, h, c, d, &odd, &even);
    const int64_t off = kBlock * g + SplitOffset(h, c, 0);
    for (int i = 0; i < MR; ++i) acc[i] = _mm256_fmadd_ps(odd, _mm256_load_ps(x[i] + off), acc[i]);
    for (int i = 0; i < MR; ++i)
      acc[i] = _mm256_fmadd_ps(even, _mm256_load_ps(x[i] + off + 8), acc[i]);
  };
  auto start = [&](int h, int r, __m256* acc) {
    for (int i = 0; i < MR; ++i)
      acc[i] = first ? _mm256_setzero_ps() : LoadLanes(carry, MR, NR, h, r, i);
  };
  auto finish = [&](int r, const __m256* low, const __m256* high) {
    for (int i = 0; i < MR; ++i) {
      if (last) {
        y[i * ldy + r] = ReduceHalves(low[i], high[i]);
      } else {
        StoreLanes(carry, MR, NR, 0, r, i, low[i]);
        StoreLanes(carry, MR, NR, 1, r, i, high[i]);
      }
    }
  };
  // Unrolled, so that the accumulators stay in registers (a runtime row index kept them on the
  // stack: 2x slower).
  if constexpr (kOrder == ChunkOrder::kHalfPasses) {
    static_assert(NR == 1, "half passes take one weight row");
    __m256 acc[2][MR];
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      start(h, 0, acc[h]);
      for (int64_t g = g0; g < g1; ++g) {
        __m256i d[4];
        chunks.Decode(g, 0, h, d);
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) consume(g, 0, h, c, d, acc[h]);
      }
    }
    finish(0, acc[0], acc[1]);
  } else {
    __m256 acc[2][NR][MR];
    for (int h = 0; h < 2; ++h)
      for (int r = 0; r < NR; ++r) start(h, r, acc[h][r]);
    for (int64_t g = g0; g < g1; ++g) {
      if constexpr (kOrder == ChunkOrder::kInterleaved) {
        __m256i d[NR][2][4];
#pragma GCC unroll 4
        for (int r = 0; r < NR; ++r)
          for (int h = 0; h < 2; ++h) chunks.Decode(g, r, h, d[r][h]);
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c)
#pragma GCC unroll 2
          for (int h = 0; h < 2; ++h)
#pragma GCC unroll 4
            for (int r = 0; r < NR; ++r) consume(g, r, h, c, d[r][h], acc[h][r]);
      } else if constexpr (kOrder == ChunkOrder::kRowInterleaved) {
#pragma GCC unroll 4
        for (int r = 0; r < NR; ++r) {
          __m256i d[2][4];
          for (int h = 0; h < 2; ++h) chunks.Decode(g, r, h, d[h]);
#pragma GCC unroll 4
          for (int c = 0; c < 4; ++c)
#pragma GCC unroll 2
            for (int h = 0; h < 2; ++h) consume(g, r, h, c, d[h], acc[h][r]);
        }
      } else {
#pragma GCC unroll 4
        for (int r = 0; r < NR; ++r)
#pragma GCC unroll 2
          for (int h = 0; h < 2; ++h) {
            __m256i d[4];
            chunks.Decode(g, r, h, d);
#pragma GCC unroll 4
            for (int c = 0; c < 4; ++c) consume(g, r, h, c, d, acc[h][r]);
          }
      }
    }
    for (int r = 0; r < NR; ++r) finish(r, acc[0][r], acc[1][r]);
  }
}

// Tile shapes and orders, measured on Zen 3 (weights in L2, K = 3584, 1 thread):
//  - 1 operand row: MXFP4 4 weight rows in row-half order ~1.1x faster than 1 row interleaved;
//    bf16 interleaved 1.2x faster than row halves at 1-2 operand rows;
//  - 2-4 operand rows: one MXFP4 row interleaved ~1.1x faster than row halves, and than half
//    passes (which give fewer chains);
//  - 5-8 operand rows: half passes, one sweep, 1.1-1.3x faster than the two sweeps of 3-4 rows
//    each (MXFP4 5 rows 101 -> 84 us, bf16 88 -> 68 us);
//  - 9-16 operand rows: two sweeps of half passes, MXFP4 1.3-1.5x and bf16 ~1.05x faster than
//    the scratch path (MXFP4 10 rows 242 -> 164 us); from 20 rows on the scratch path wins.
// Revised on Zen 4 (paired rounds, weights in L2, K = 7168, avx2 forced), MXFP4:
//  - 1 operand row: 4 weight rows, each row's halves interleaved, 0.93x the time of row halves
//    (one weight row a tile, interleaved: 1.3x slower);
//  - 4 operand rows: row halves 0.88x the time of interleaved, whose 8 lookups and 8
//    accumulators spill (at 3 rows they fit: row halves 1.1x slower); half passes 1.16x slower.
template <int MR>
constexpr int kFusedBf16Rows = MR == 1 ? 4 : (MR == 2 ? 2 : 1);
template <int MR>
constexpr int kFusedMxfp4Rows = MR == 1 ? 4 : 1;
template <int MR>
constexpr ChunkOrder kBf16Order = MR <= 4 ? ChunkOrder::kInterleaved : ChunkOrder::kHalfPasses;
template <int MR>
constexpr ChunkOrder kMxfp4Order = MR == 1   ? ChunkOrder::kRowInterleaved
                                   : MR <= 3 ? ChunkOrder::kInterleaved
                                   : MR == 4 ? ChunkOrder::kRowHalves
                                             : ChunkOrder::kHalfPasses;
constexpr int kFusedMaxRows = 8;  // operand rows of the MXFP4 and bf16 fused paths per sweep
constexpr int kFusedSweeps = 2;   // sweeps over the weights before the scratch path pays off

// MXFP4 or bf16 weights (cols a multiple of 128) decoded in registers, against MR operand rows.
template <int MR>
void FusedRows(const WeightMatrix& w, const float* const* x, int64_t n0, int64_t n1,
               int64_t prefetch_end, float* y, int64_t ldy, float* carry) {
  // Tiles of up to NR weight rows; chunks_of(n, nr) gives row n's tile source.
  auto sweep = [&](auto rows_tag, auto order_tag, auto&& chunks_of) {
    constexpr int kNr = decltype(rows_tag)::value;
    SlicedRows<MR, kNr>(
        w, n0, n1, prefetch_end, CarryPerRow(MR), carry,
        [&](int64_t n, int nr, int64_t k0, int64_t k1, float* c, bool first, bool last) {
          WithCount<kNr>(nr, [&](auto tile_rows) {
            auto chunks = chunks_of(n, tile_rows);
            FusedTile<MR, decltype(tile_rows)::value, decltype(order_tag)::value>(
                chunks, x, k0 / kBlock, k1 / kBlock, c, first, last, y + (n - n0), ldy);
          });
        });
  };
  if (w.format == WeightFormat::kMXFP4) {
    sweep(std::integral_constant<int, kFusedMxfp4Rows<MR>>(),
          std::integral_constant<ChunkOrder, kMxfp4Order<MR>>(), [&](int64_t n, auto tile_rows) {
            Mxfp4Chunks<decltype(tile_rows)::value> chunks;
            for (int r = 0; r < decltype(tile_rows)::value; ++r) {
              chunks.packed[r] = static_cast<const uint8_t*>(w.data) + (n + r) * (w.cols / 2);
              chunks.scales[r] = static_cast<const uint8_t*>(w.scales) + (n + r) * (w.cols / 32);
            }
            return chunks;
          });
  } else {
    sweep(std::integral_constant<int, kFusedBf16Rows<MR>>(),
          std::integral_constant<ChunkOrder, kBf16Order<MR>>(), [&](int64_t n, auto tile_rows) {
            Bf16Chunks<decltype(tile_rows)::value> chunks;
            for (int r = 0; r < decltype(tile_rows)::value; ++r)
              chunks.rows[r] = static_cast<const uint16_t*>(w.data) + (n + r) * w.cols;
            return chunks;
          });
  }
}

// FP8: one weight row at a time, NB blocks in flight per half (block partials are independent
// in the canonical order; only their scaled sums into the lanes are sequential), each half in
// its own pass over the row (the second pass reads it from L1). The loop assumes no NaN code:
// each pass ORs up where its bytes hold one, and such a row is redone by the scratch path.
template <int MR, int NB>
inline void FusedFp8Blocks(const uint8_t* row, const float* scales, int64_t b0, int h,
                           const float* const* x, __m256 (&lanes)[MR], Fp8NanScan* nan) {
  __m256 part[NB][MR];
  for (int b = 0; b < NB; ++b)
    for (int i = 0; i < MR; ++i) part[b][i] = _mm256_setzero_ps();
  // The 32 bytes g of block b.
  auto step = [&](int b, int g) {
    const uint8_t* p = row + b0 + b * kBlock + 64 * g + 32 * h;
    // The first pass streams the row (16 KB ahead measured 1.2-1.4x faster than 8 KB here,
    // where a row is read twice); the second reads it from L1.
    if (h == 0)
      _mm_prefetch(reinterpret_cast<const char*>(p) + 2 * x86::kPrefetchBytes, _MM_HINT_T1);
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    nan->Add(bytes);
    __m256 odd[2], even[2];
    Fp8SplitRuns</*kOver256=*/true>(bytes, odd, even);
#pragma GCC unroll 2
    for (int r = 0; r < 2; ++r) {
      const int64_t off = b0 + b * kBlock + SplitOffset(h, 2 * g + r, 0);
      for (int i = 0; i < MR; ++i) {
        part[b][i] = _mm256_fmadd_ps(odd[r], _mm256_load_ps(x[i] + off), part[b][i]);
        part[b][i] = _mm256_fmadd_ps(even[r], _mm256_load_ps(x[i] + off + 8), part[b][i]);
      }
    }
  };
  // With up to 4 operand rows the blocks take turns at each 32 bytes, so that the scheduler
  // sees every block's chains close together (Zen 4, weights in L2, medians: K = 3584 1-2 rows
  // 1.02-1.05x faster, 3-4 rows ~1.02x by the min; K = 7168 1-4 rows 1.04-1.08x; 5-6 rows,
  // 10-12 partials, 1.02-1.05x slower so).
  if constexpr (MR <= 4) {
#pragma GCC unroll 2
    for (int g = 0; g < 2; ++g)
#pragma GCC unroll 4
      for (int b = 0; b < NB; ++b) step(b, g);
  } else {
#pragma GCC unroll 4
    for (int b = 0; b < NB; ++b)
#pragma GCC unroll 2
      for (int g = 0; g < 2; ++g) step(b, g);
  }
  for (int b = 0; b < NB; ++b) {
    const __m256 s = _mm256_set1_ps(scales[b0 / kBlock + b]);
    for (int i = 0; i < MR; ++i) lanes[i] = _mm256_fmadd_ps(part[b][i], s, lanes[i]);
  }
}

// Blocks in flight: a block's partials are MR chains of 8 dependent FMAs per half, so fewer
// than 8 chains leave the FMA latency exposed unless a second block runs beside them. Measured
// (Zen 3, weights in L2): 5-6 operand rows 1.25x faster with 2 blocks than 1 (the lane totals
// then live in memory, touched once per block); 7-8 rows and 3-4 rows gain nothing from more.
template <int MR>
constexpr int kFusedFp8Blocks = MR <= 2 ? 4 : (MR <= 6 ? 2 : 1);
// Up to 8 operand rows: at 5 rows ~1.15x faster than the scratch path (K = 7168), at 7-8 rows
// 1.3-1.4x (K = 3584, weights in L2); from 9 rows on the scratch path wins (the partials spill).
constexpr int kFusedFp8MaxRows = 8;

// Row n from scratch: decoded (NaN codes included) into `row`, then one tile. The operand rows
// are the fused path's (times 256), so the decoded values are taken * 2^-8 (exact: the smallest
// E4M3 magnitude, 2^-9, stays far from fp32 subnormals).
template <int MR>
void Fp8RowFromScratch(const WeightMatrix& w, int64_t n, const float* const* x, float* row,
                       float* y, int64_t ldy) {
  const int64_t kp = PaddedK(w.cols);
  DecodeRowSplit(w, n, row);
  const __m256 over256 = _mm256_set1_ps(1.0f / 256.0f);
  for (int64_t k = 0; k < kp; k += 8)
    _mm256_store_ps(row + k, _mm256_mul_ps(_mm256_load_ps(row + k), over256));
  const float* rows[1] = {row};
  const float* scales[1] = {Fp8RowScales(w, n)};
  alignas(32) float carry[2 * MR * 8];
  PrefetchCursor none;
  Tile<MR, 1, true, SplitLayout>(x, rows, scales, 0, kp, carry, true, true, y, ldy, &none);
}

// Rows [n0, n1) in K slices (SlicedRows; one weight row per tile). `rows_buf`: kp bytes, then kp
// floats, for rows whose width is not a multiple of 128 (they are copied zero-padded) and rows
// holding a NaN code (redone from scratch once their last slice is done; the flag rides in the
// row's carry).
template <int MR>
void FusedFp8Rows(const WeightMatrix& w, const float* const* x, int64_t n0, int64_t n1, float* y,
                  int64_t ldy, uint8_t* rows_buf, float* carry) {
  const int64_t kp = PaddedK(w.cols);
  constexpr int kNb = kFusedFp8Blocks<MR>;
  SlicedRows<MR, 1>(w, n0, n1, n1, CarryPerRow(MR) + 8, carry,
                    [&](int64_t n, int, int64_t k0, int64_t k1, float* c, bool first, bool last) {
                      const uint8_t* row = static_cast<const uint8_t*>(w.data) + n * w.cols;
                      if (w.cols != kp) {
                        std::memcpy(rows_buf, row, static_cast<size_t>(w.cols));
                        std::memset(rows_buf + w.cols, 0, static_cast<size_t>(kp - w.cols));
                        row = rows_buf;
                      }
                      const float* scales = Fp8RowScales(w, n);
                      float& nan_flag = c[CarryPerRow(MR)];
                      Fp8NanScan nan;
                      // Set at h = 0 of the last slice, read at h = 1 (zeroed: GCC's -O1
                      // cannot see that and warns).
                      __m256 low_half[MR] = {};
                      for (int h = 0; h < 2; ++h) {
                        __m256 lanes[MR];
                        for (int i = 0; i < MR; ++i)
                          lanes[i] = first ? _mm256_setzero_ps() : LoadLanes(c, MR, 1, h, 0, i);
                        int64_t b0 = k0;
                        for (; b0 + kNb * kBlock <= k1; b0 += kNb * kBlock)
                          FusedFp8Blocks<MR, kNb>(row, scales, b0, h, x, lanes, &nan);
                        for (; b0 < k1; b0 += kBlock)
                          FusedFp8Blocks<MR, 1>(row, scales, b0, h, x, lanes, &nan);
                        for (int i = 0; i < MR; ++i) {
                          if (!last) {
                            StoreLanes(c, MR, 1, h, 0, i, lanes[i]);
                          } else if (h == 0) {
                            low_half[i] = lanes[i];
                          } else {
                            y[i * ldy + (n - n0)] = ReduceHalves(low_half[i], lanes[i]);
                          }
                        }
                      }
                      const bool found = (!first && nan_flag != 0.0f) || nan.Found();
                      nan_flag = found ? 1.0f : 0.0f;
                      if (last && found)
                        Fp8RowFromScratch<MR>(
                            w, n, x, reinterpret_cast<float*>(rows_buf + (kp + 63) / 64 * 64),
                            y + (n - n0), ldy);
                    });
}

void DotRows(const DotOperands& op, int64_t n0, int64_t n1, float* y, int64_t ldy,
             DotScratch* scratch) {
  if (op.m == 0 || n0 >= n1) return;
  const WeightMatrix& w = *op.w;
  const int64_t kp = PaddedK(w.cols);
  if (op.precision == Precision::kBF16) {
    const bool whole_blocks = w.cols % kBlock == 0;
    const int m = static_cast<int>(op.m);
    if ((w.format == WeightFormat::kMXFP4 || w.format == WeightFormat::kBF16) && whole_blocks &&
        op.m <= kFusedSweeps * kFusedMaxRows) {
      // Up to kFusedSweeps sweeps over the weights, each with an even share of the operand rows
      // (9 = 4 + 5): decoding a weight row again in registers costs less than storing it
      // decoded and reading it back (Zen 3, MXFP4: 10 rows 1.5x, 16 rows 1.35x faster). The
      // sweeps take turns per group of weight rows, so that the later ones find the group in L2
      // and the stored weights cross the memory bus once (sweeping the whole range per share of
      // rows read a streamed matrix from DRAM once per sweep).
      uint8_t* carry;
      const float* const* x =
          SplitOperands(op, kp, scratch, CarryFloats(kFusedMaxRows) * 4, &carry);
      const int sweeps = (m + kFusedMaxRows - 1) / kFusedMaxRows;
      const int64_t group = sweeps == 1 ? n1 - n0 : kFusedGroupRows;
      for (int64_t nb = n0; nb < n1; nb += group) {
        const int64_t ne = std::min(n1, nb + group);
        for (int i0 = 0, sweep = 0; sweep < sweeps; ++sweep) {
          const int rows = (m - i0) / (sweeps - sweep);
          WithCount<kFusedMaxRows>(rows, [&](auto tag) {
            // Only the first sweep of a group requests the next group's bytes.
            FusedRows<decltype(tag)::value>(w, x + i0, nb, ne, sweep == 0 ? n1 : ne,
                                            y + i0 * ldy + (nb - n0), ldy,
                                            reinterpret_cast<float*>(carry));
          });
          i0 += rows;
        }
      }
      return;
    }
    if (w.format == WeightFormat::kFP8Block128 && op.m <= kFusedFp8MaxRows) {
      // The rows buffer (kp bytes, then kp floats), then the carry. The decode's * 256 rides on
      // the operand rows (measured on Zen 5, weights in L2: 1 row 1.17x, 2-5 rows 1.09-1.11x
      // faster); operands too large for that (|x| >= 2^120) take the scratch path.
      const int64_t rows_bytes = (kp + 63) / 64 * 64 + kp * 4;
      uint8_t* rows_buf;
      bool times256 = true;
      const float* const* x = SplitOperands(
          op, kp, scratch, rows_bytes + kFusedGroupRows * (CarryPerRow(kFusedFp8MaxRows) + 8) * 4,
          &rows_buf, &times256);
      if (times256) {
        auto* carry = reinterpret_cast<float*>(rows_buf + rows_bytes);
        return WithCount<kFusedFp8MaxRows>(m, [&](auto tag) {
          FusedFp8Rows<decltype(tag)::value>(w, x, n0, n1, y, ldy, rows_buf, carry);
        });
      }
    }
  }
  ScratchRows(op, n0, n1, y, ldy, scratch);
}

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
