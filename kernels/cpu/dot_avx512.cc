// AVX-512 BF16 dot kernels (Zen 4, Sapphire Rapids and later). Compiled with
// -mavx512{f,bw,vl,dq,bf16,vbmi}; selected at run time only on CPUs that have them.
//
// Each output is the canonical dot product of kernels/cpu/canonical.h: one VDPBF16PS (or
// one FMA in fp32 mode) per 32 (16) elements into 16 lanes, FP8 block partials scaled by an
// FMA, then the fixed reduction tree. Tiles of MR operand rows x NR weight rows share every
// load; weight rows are decoded (MXFP4 nibbles, FP8 bytes) to exact bf16 in registers and
// kept in a small per-thread scratch while all operand rows stream past them.
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <type_traits>

#include "kernels/cpu/canonical.h"
#include "kernels/cpu/dot.h"

namespace moe::cpu {
namespace {

constexpr int kMaxRowsPerTile = 4;  // NR: weight rows per tile
// Streamed weight bytes are requested this far ahead, into L2: measured on Zen 4, 4 KB into L1
// left the in-register MXFP4 loop at ~65% of the streaming-read probe, 8 KB into L2 at ~90%
// (L1 prefetches compete with the loop's own loads for the few L1 miss buffers).
constexpr int kPrefetchBytes = 8192;
inline void PrefetchStream(const void* p) {
  _mm_prefetch(static_cast<const char*>(p) + kPrefetchBytes, _MM_HINT_T1);
}

inline float ReduceTree(__m512 v) {
  const __m256 r8 = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  const __m128 r4 = _mm_add_ps(_mm256_castps256_ps128(r8), _mm256_extractf128_ps(r8, 1));
  const __m128 r2 = _mm_add_ps(r4, _mm_movehl_ps(r4, r4));
  return _mm_cvtss_f32(_mm_add_ss(r2, _mm_shuffle_ps(r2, r2, 1)));
}

// ---- weight row decoding (exact) ---------------------------------------------------------

// bf16 bits of the E2M1 values, indexed by nibble; twice, so one 32-word register holds the
// table of two scale blocks.
alignas(64) const uint16_t kE2m1Bf16x2[32] = {
    0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0, 0x8000, 0xBF00, 0xBF80,
    0xBFC0, 0xC000, 0xC040, 0xC080, 0xC0C0, 0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040,
    0x4080, 0x40C0, 0x8000, 0xBF00, 0xBF80, 0xBFC0, 0xC000, 0xC040, 0xC080, 0xC0C0};

// One 128-element MXFP4 group (64 packed bytes, 4 scale blocks) -> 128 bf16 values in
// canonical order (run j holds elements 4w + j, w = 0..31).
//
// Word w of the packed bytes holds the nibbles of elements 4w .. 4w+3 (bits 0-3 .. 12-15), all
// in scale block w / 8. Each run is one vpermt2w into a 64-entry table holding the four
// blocks' scaled values: index = nibble + 16 * (w / 8). The scale 2^(s-127) is exact: it is
// added to the bf16 exponent field of the table's non-zero entries (PrepareWeight checked
// s in [2, 252]).
class Mxfp4GroupDecoder {
 public:
  Mxfp4GroupDecoder()
      : base_(_mm512_load_si512(kE2m1Bf16x2)),
        nibble_(_mm512_set1_epi16(0x000F)),
        block_bits_(_mm512_set_epi16(48, 48, 48, 48, 48, 48, 48, 48, 32, 32, 32, 32, 32, 32, 32, 32,
                                     16, 16, 16, 16, 16, 16, 16, 16, 0, 0, 0, 0, 0, 0, 0, 0)) {}

  // Exponent offsets (s - 127) << 7 of the 32 blocks of 8 groups starting at `scales`
  // (`groups` of them present).
  __m512i Offsets(const uint8_t* scales, int64_t groups) const {
    const __mmask32 mask =
        groups >= 8 ? ~__mmask32{0} : static_cast<__mmask32>((uint64_t{1} << (4 * groups)) - 1);
    return _mm512_slli_epi16(
        _mm512_sub_epi16(_mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(mask, scales)),
                         _mm512_set1_epi16(127)),
        7);
  }
  // The 64-entry table of group g (of the 8 `offsets` covers): blocks 4g, 4g+1 in `lo`,
  // 4g+2, 4g+3 in `hi`.
  void Tables(__m512i offsets, int g, __m512i* lo, __m512i* hi) const {
    const __m512i lo_scale =
        _mm512_permutexvar_epi16(_mm512_load_si512(kScaleIndex()[2 * g].data()), offsets);
    const __m512i hi_scale =
        _mm512_permutexvar_epi16(_mm512_load_si512(kScaleIndex()[2 * g + 1].data()), offsets);
    const __mmask32 nonzero = 0xFEFEFEFEu;  // entries 0 and 8 of each block are +-0
    *lo = _mm512_mask_add_epi16(base_, nonzero, base_, lo_scale);
    *hi = _mm512_mask_add_epi16(base_, nonzero, base_, hi_scale);
  }
  // Table index of run j (0..3) of a group's 64 packed bytes (`words`): nibble j of each word
  // | block bits, one ternary-logic op ((A & B) | C = 0xEA) after the shift.
  __m512i Index(__m512i words, int j) const {
    switch (j) {
      case 0:
        return _mm512_ternarylogic_epi32(words, nibble_, block_bits_, 0xEA);
      case 1:
        return _mm512_ternarylogic_epi32(_mm512_srli_epi16(words, 4), nibble_, block_bits_, 0xEA);
      case 2:
        return _mm512_ternarylogic_epi32(_mm512_srli_epi16(words, 8), nibble_, block_bits_, 0xEA);
      default:
        return _mm512_or_si512(_mm512_srli_epi16(words, 12), block_bits_);
    }
  }
  static __m512i Run(__m512i lo, __m512i idx, __m512i hi) {
    return _mm512_permutex2var_epi16(lo, idx, hi);
  }

  // One group into `out` (128 bf16 values).
  void Decode(const uint8_t* packed, __m512i offsets, int g, uint16_t* out) const {
    __m512i lo, hi;
    Tables(offsets, g, &lo, &hi);
    const __m512i words = _mm512_loadu_si512(packed);
    for (int j = 0; j < 4; ++j) _mm512_storeu_si512(out + 32 * j, Run(lo, Index(words, j), hi));
  }

 private:
  // For group g of 8: [block 4g x16, 4g+1 x16] and [4g+2 x16, 4g+3 x16] as word indices.
  static const std::array<std::array<uint16_t, 32>, 16>& kScaleIndex() {
    alignas(64) static const auto idx = [] {
      std::array<std::array<uint16_t, 32>, 16> v{};
      for (int g = 0; g < 8; ++g)
        for (int w = 0; w < 32; ++w) {
          v[2 * g][w] = static_cast<uint16_t>(4 * g + (w >= 16));
          v[2 * g + 1][w] = static_cast<uint16_t>(4 * g + 2 + (w >= 16));
        }
      return v;
    }();
    return idx;
  }
  __m512i base_, nibble_, block_bits_;
};

// MXFP4 row -> bf16 bits in canonical order, zero-padded to PaddedK(cols).
void DecodeMxfp4RowBf16(const uint8_t* packed, const uint8_t* scales, int64_t cols, uint16_t* out) {
  const Mxfp4GroupDecoder decoder;
  const int64_t full = cols / 128;
  for (int64_t g0 = 0; g0 < full; g0 += 8) {
    const int64_t groups = std::min<int64_t>(8, full - g0);
    const __m512i offsets = decoder.Offsets(scales + 4 * g0, groups);
    for (int64_t g = 0; g < groups; ++g) {
      PrefetchStream(packed + 64 * (g0 + g));
      decoder.Decode(packed + 64 * (g0 + g), offsets, static_cast<int>(g), out + 128 * (g0 + g));
    }
  }
  if (cols % 128) {
    // A partial group (32, 64 or 96 elements): decode it from a zero-padded copy; missing
    // elements are nibble 0, i.e. exactly 0.
    const int64_t blocks = (cols % 128) / 32;
    alignas(64) uint8_t bytes[64] = {};
    std::memcpy(bytes, packed + 64 * full, 16 * blocks);
    alignas(64) uint8_t block_scales[32];
    std::memset(block_scales, 127, sizeof(block_scales));
    std::memcpy(block_scales, scales + 4 * full, blocks);
    decoder.Decode(bytes, decoder.Offsets(block_scales, 8), 0, out + 128 * full);
  }
}

// FP8 E4M3 -> exact bf16 bits, 64 elements at a time, with no widening: the 7-bit magnitude
// indexes two 128-byte tables (the high and the low byte of its bf16 pattern, subnormals and
// NaN included) by one two-source byte permute each; the sign bit is merged into the high
// byte; unpacking interleaves the bytes into words. Unpacking works per 128-bit lane, which
// is what makes FP8's canonical order (canonical.h): the first 32 words are elements
// 16L + j, the second 32 elements 16L + 8 + j (L = 0..3, j = 0..7).
class Fp8Decoder {
 public:
  Fp8Decoder() {
    const uint8_t* t = Tables();
    hi0_ = _mm512_load_si512(t);
    hi1_ = _mm512_load_si512(t + 64);
    lo0_ = _mm512_load_si512(t + 128);
    lo1_ = _mm512_load_si512(t + 192);
  }
  void operator()(__m512i bytes, __m512i* first, __m512i* second) const {
    // vpermt2b reads index bits 0..6 only: the sign bit does not disturb the lookup.
    const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(hi0_, bytes, hi1_), bytes,
                                                 _mm512_set1_epi8(static_cast<char>(0x80)),
                                                 0xF8);  // A | (B & C)
    const __m512i lo = _mm512_permutex2var_epi8(lo0_, bytes, lo1_);
    *first = _mm512_unpacklo_epi8(lo, hi);
    *second = _mm512_unpackhi_epi8(lo, hi);
  }

 private:
  // [high bytes of magnitudes 0..127][low bytes of magnitudes 0..127]
  static const uint8_t* Tables() {
    alignas(64) static uint8_t tables[256];
    static const bool filled = [] {
      for (int m = 0; m < 128; ++m) {
        const uint16_t bits = FloatToBf16Bits(Fp8E4m3ToFloat(static_cast<uint8_t>(m)));
        tables[m] = static_cast<uint8_t>(bits >> 8);
        tables[128 + m] = static_cast<uint8_t>(bits & 0xFF);
      }
      return true;
    }();
    (void)filled;
    return tables;
  }
  __m512i hi0_, hi1_, lo0_, lo1_;
};

// Stored bytes [k, k + 64) of an FP8 row of `cols`; past the end they are 0, which decodes to
// +0 (the zero padding). Streamed rows are prefetched kPrefetchBytes ahead.
inline __m512i LoadFp8Bytes(const uint8_t* row, int64_t cols, int64_t k) {
  if (k + 64 <= cols) {
    PrefetchStream(row + k);
    return _mm512_loadu_si512(row + k);
  }
  if (k < cols) return _mm512_maskz_loadu_epi8((uint64_t{1} << (cols - k)) - 1, row + k);
  return _mm512_setzero_si512();
}

void DecodeFp8RowBf16(const uint8_t* row, int64_t cols, uint16_t* out) {
  const Fp8Decoder Fp8ToBf16;
  const int64_t kp = PaddedK(cols);
  for (int64_t k = 0; k < kp; k += 64) {
    __m512i first, second;
    Fp8ToBf16(LoadFp8Bytes(row, cols, k), &first, &second);
    _mm512_storeu_si512(out + k, first);
    _mm512_storeu_si512(out + k + 32, second);
  }
}

void CopyBf16RowPadded(const uint16_t* row, int64_t cols, uint16_t* out) {
  std::memcpy(out, row, cols * sizeof(uint16_t));
  std::memset(out + cols, 0, (PaddedK(cols) - cols) * sizeof(uint16_t));
}

// Returns the canonical bf16 row n: a pointer into the weights when they are already in
// canonical form (bf16, padded width), otherwise decoded into `buf`.
const uint16_t* WeightRowBf16(const WeightMatrix& w, int64_t n, uint16_t* buf) {
  switch (w.format) {
    case WeightFormat::kBF16: {
      const uint16_t* row = static_cast<const uint16_t*>(w.data) + n * w.cols;
      if (w.cols % kPadK == 0) return row;
      CopyBf16RowPadded(row, w.cols, buf);
      return buf;
    }
    case WeightFormat::kMXFP4:
      DecodeMxfp4RowBf16(static_cast<const uint8_t*>(w.data) + n * (w.cols / 2),
                         static_cast<const uint8_t*>(w.scales) + n * (w.cols / 32), w.cols, buf);
      return buf;
    case WeightFormat::kFP8Block128:
      DecodeFp8RowBf16(static_cast<const uint8_t*>(w.data) + n * w.cols, w.cols, buf);
      return buf;
  }
  return buf;
}

void WidenBf16Row(const uint16_t* in, int64_t kp, float* out) {
  for (int64_t k = 0; k < kp; k += 16) {
    const __m512i v =
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + k)));
    _mm512_storeu_ps(out + k, _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));
  }
}

// ---- tiles ---------------------------------------------------------------------------------

// Pointers to operand rows i0 .. i0 + mr - 1 (through x_rows when the op gathers them).
template <typename T>
void OperandRows(const DotOperands& op, int64_t i0, int64_t mr, const T** xr) {
  for (int64_t i = 0; i < mr; ++i)
    xr[i] = static_cast<const T*>(op.x) + (op.x_rows ? op.x_rows[i0 + i] : i0 + i) * op.x_stride;
}

// Software prefetch spread over the blocks of many tile calls: `per_block` cache lines of
// [next, end) each time a tile starts a 128-element block.
struct PrefetchCursor {
  const char* next = nullptr;
  const char* end = nullptr;
  int64_t per_block = 0;
  void Step() {
    for (int64_t i = 0; i < per_block && next < end; ++i, next += 64)
      _mm_prefetch(next, _MM_HINT_T1);
  }
  // The stored bytes of weight rows [row, row + rows), spread over `blocks` steps.
  static PrefetchCursor Rows(const WeightMatrix& w, int64_t row, int64_t rows, int64_t blocks) {
    PrefetchCursor c;
    if (rows <= 0 || blocks <= 0) return c;
    const int64_t row_bytes = w.DataBytes() / w.rows;
    c.next = static_cast<const char*>(w.data) + row * row_bytes;
    c.end = c.next + rows * row_bytes;
    c.per_block = (rows * row_bytes / 64 + blocks) / blocks;
    return c;
  }
};

static_assert(kFp8Block == kPadK, "an FP8 scale block is one padding block");

// One 128-element block [k0, k0 + 128) of MR operand rows x NR weight rows into acc: four
// VDPBF16PS steps per accumulator (compile-time loops: the accumulators stay in registers).
template <int MR, int NR>
__attribute__((always_inline)) inline void AccumulateBf16Block(const uint16_t* const* x,
                                                               const uint16_t* const* w, int64_t k0,
                                                               __m512 (&acc)[MR][NR]) {
  for (int64_t k = k0; k < k0 + kPadK; k += 32) {
    __m512bh wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(w[j] + k);
    for (int i = 0; i < MR; ++i) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x[i] + k);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
    }
  }
}

// MR operand rows x NR weight rows, bf16 mode, no block scales; `prefetch` steps once per
// 128-element block.
template <int MR, int NR>
void TileBf16(const uint16_t* const* x, const uint16_t* const* w, int64_t kp, float* y, int64_t ldy,
              PrefetchCursor* prefetch) {
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 < kp; k0 += kPadK) {
    prefetch->Step();
    AccumulateBf16Block<MR, NR>(x, w, k0, acc);
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) y[i * ldy + j] = ReduceTree(acc[i][j]);
}

// bf16 mode with FP8 block-128 partials: lanes = fma(partial, scale_inv, lanes), over the K
// slice [k0, k1) (multiples of 128). The lane totals carry over between slices in `carry`
// (MR x NR x 16 floats): `first` starts them at zero, otherwise they are loaded; `last` reduces
// them into y, otherwise they are stored. Storing and reloading fp32 lanes is exact, so slicing
// K does not change a bit of the canonical order.
template <int MR, int NR>
void TileBf16Blocked(const uint16_t* const* x, const uint16_t* const* w, const float* const* scales,
                     int64_t k0, int64_t k1, float* carry, bool first, bool last, float* y,
                     int64_t ldy, PrefetchCursor* prefetch) {
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j)
      acc[i][j] = first ? _mm512_setzero_ps() : _mm512_load_ps(carry + 16 * (i * NR + j));
  for (int64_t b0 = k0; b0 < k1; b0 += kFp8Block) {
    prefetch->Step();
    __m512 part[MR][NR];
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) part[i][j] = _mm512_setzero_ps();
    AccumulateBf16Block<MR, NR>(x, w, b0, part);
    for (int j = 0; j < NR; ++j) {
      const __m512 s = _mm512_set1_ps(scales[j][b0 / kFp8Block]);
      for (int i = 0; i < MR; ++i) acc[i][j] = _mm512_fmadd_ps(part[i][j], s, acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      if (last) {
        y[i * ldy + j] = ReduceTree(acc[i][j]);
      } else {
        _mm512_store_ps(carry + 16 * (i * NR + j), acc[i][j]);
      }
    }
}

// fp32 mode: one FMA per 16 elements per lane; FP8 block partials when kBlocked.
template <int MR, int NR, bool kBlocked>
void TileF32(const float* const* x, const float* const* w, const float* const* scales, int64_t kp,
             float* y, int64_t ldy) {
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  const int64_t block = kBlocked ? kFp8Block : kp;
  for (int64_t b0 = 0; b0 < kp; b0 += block) {
    const int64_t b1 = std::min<int64_t>(b0 + block, kp);
    __m512 part[MR][NR];
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) part[i][j] = kBlocked ? _mm512_setzero_ps() : acc[i][j];
    for (int64_t k = b0; k < b1; k += 16) {
      __m512 wv[NR];
      for (int j = 0; j < NR; ++j) wv[j] = _mm512_loadu_ps(w[j] + k);
      for (int i = 0; i < MR; ++i) {
        const __m512 xv = _mm512_loadu_ps(x[i] + k);
        for (int j = 0; j < NR; ++j) part[i][j] = _mm512_fmadd_ps(wv[j], xv, part[i][j]);
      }
    }
    for (int j = 0; j < NR; ++j) {
      if constexpr (kBlocked) {
        const __m512 s = _mm512_set1_ps(scales[j][b0 / kFp8Block]);
        for (int i = 0; i < MR; ++i) acc[i][j] = _mm512_fmadd_ps(part[i][j], s, acc[i][j]);
      } else {
        for (int i = 0; i < MR; ++i) acc[i][j] = part[i][j];
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) y[i * ldy + j] = ReduceTree(acc[i][j]);
}

// MXFP4 weights decoded in registers and consumed at once, for few operand rows (decode-bound
// shapes): MR operand rows x NR weight rows, cols a multiple of 128. Same canonical order as
// the decode-to-scratch path: one VDPBF16PS per 32-element run, runs in ascending order.
// Run indices are formed just before their lookup, so that four weight rows (four
// accumulator chains, which hide the VDPBF16PS latency) fit the 32 vector registers.
template <int MR, int NR>
void FusedMxfp4Tile(const uint16_t* const* x, const uint8_t* const* packed,
                    const uint8_t* const* scales, int64_t cols, float* y, int64_t ldy) {
  const Mxfp4GroupDecoder decoder;
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < NR; ++r) acc[i][r] = _mm512_setzero_ps();
  const int64_t groups = cols / 128;
  for (int64_t g0 = 0; g0 < groups; g0 += 8) {
    const int64_t count = std::min<int64_t>(8, groups - g0);
    __m512i offsets[NR];
    for (int r = 0; r < NR; ++r) offsets[r] = decoder.Offsets(scales[r] + 4 * g0, count);
    for (int64_t g = 0; g < count; ++g) {
      const int64_t base = 128 * (g0 + g);
      __m512i lo[NR], hi[NR], words[NR];
      for (int r = 0; r < NR; ++r) {
        PrefetchStream(packed[r] + 64 * (g0 + g));
        decoder.Tables(offsets[r], static_cast<int>(g), &lo[r], &hi[r]);
        words[r] = _mm512_loadu_si512(packed[r] + 64 * (g0 + g));
      }
      for (int j = 0; j < 4; ++j) {
        __m512bh xv[MR];
        for (int i = 0; i < MR; ++i) xv[i] = (__m512bh)_mm512_loadu_si512(x[i] + base + 32 * j);
        for (int r = 0; r < NR; ++r) {
          const __m512bh w =
              (__m512bh)Mxfp4GroupDecoder::Run(lo[r], decoder.Index(words[r], j), hi[r]);
          for (int i = 0; i < MR; ++i) acc[i][r] = _mm512_dpbf16_ps(acc[i][r], xv[i], w);
        }
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < NR; ++r) y[i * ldy + r] = ReduceTree(acc[i][r]);
}

// Weight rows per fused MXFP4 tile: four for 1-2 operand rows (measured streamed at the
// bandwidth probe, 1.1x faster than two); two for 3-4, where 4 x MR accumulators would spill.
template <int MR>
constexpr int kFusedMxfp4Rows = MR <= 2 ? 4 : 2;

template <int MR>
void FusedMxfp4Rows(const DotOperands& op, const uint16_t* const* x, int64_t n0, int64_t n1,
                    float* y, int64_t ldy) {
  constexpr int kNr = kFusedMxfp4Rows<MR>;
  const WeightMatrix& w = *op.w;
  const auto* data = static_cast<const uint8_t*>(w.data);
  const auto* scales = static_cast<const uint8_t*>(w.scales);
  for (int64_t n = n0; n < n1; n += kNr) {
    const int nr = static_cast<int>(std::min<int64_t>(kNr, n1 - n));
    const uint8_t* p[kNr];
    const uint8_t* s[kNr];
    for (int r = 0; r < nr; ++r) {
      p[r] = data + (n + r) * (w.cols / 2);
      s[r] = scales + (n + r) * (w.cols / 32);
    }
    float* yt = y + (n - n0);
    if (nr == kNr) {
      FusedMxfp4Tile<MR, kNr>(x, p, s, w.cols, yt, ldy);
    } else if (nr == 1) {
      FusedMxfp4Tile<MR, 1>(x, p, s, w.cols, yt, ldy);
    } else if constexpr (kNr == 4) {  // the 2- or 3-row tail of a 4-row tiling
      if (nr == 2) {
        FusedMxfp4Tile<MR, 2>(x, p, s, w.cols, yt, ldy);
      } else {
        FusedMxfp4Tile<MR, 3>(x, p, s, w.cols, yt, ldy);
      }
    }
  }
}

// Dispatches a runtime nr to the template instance.
template <int MR>
void TileBf16Nr(int nr, const uint16_t* const* x, const uint16_t* const* w, int64_t kp, float* y,
                int64_t ldy, PrefetchCursor* prefetch) {
  switch (nr) {
    case 1:
      return TileBf16<MR, 1>(x, w, kp, y, ldy, prefetch);
    case 2:
      return TileBf16<MR, 2>(x, w, kp, y, ldy, prefetch);
    case 3:
      return TileBf16<MR, 3>(x, w, kp, y, ldy, prefetch);
    default:
      return TileBf16<MR, 4>(x, w, kp, y, ldy, prefetch);
  }
}

template <int MR>
void TileF32Nr(int nr, const float* const* x, const float* const* w, const float* const* scales,
               int64_t kp, float* y, int64_t ldy) {
  // Blocked (FP8) tiles keep two accumulator sets: only up to 3 operand rows.
  switch (nr) {
#define MOE_TILE_F32_CASE(N)                            \
  case N:                                               \
    if constexpr (MR <= 3) {                            \
      if (scales) {                                     \
        TileF32<MR, N, true>(x, w, scales, kp, y, ldy); \
        break;                                          \
      }                                                 \
    }                                                   \
    TileF32<MR, N, false>(x, w, nullptr, kp, y, ldy);   \
    break;
    MOE_TILE_F32_CASE(1)
    MOE_TILE_F32_CASE(2)
    MOE_TILE_F32_CASE(3)
    MOE_TILE_F32_CASE(4)
#undef MOE_TILE_F32_CASE
  }
}

// Calls tile(std::integral_constant<int, mr>, operand row pointers) for a runtime mr in [1, 6].
template <typename T, typename Tile>
void DispatchTile(const DotOperands& op, int64_t i0, int mr, Tile&& tile) {
  const T* xr[6];
  OperandRows(op, i0, mr, xr);
  switch (mr) {
    case 1:
      return tile(std::integral_constant<int, 1>{}, xr);
    case 2:
      return tile(std::integral_constant<int, 2>{}, xr);
    case 3:
      return tile(std::integral_constant<int, 3>{}, xr);
    case 4:
      return tile(std::integral_constant<int, 4>{}, xr);
    case 5:
      return tile(std::integral_constant<int, 5>{}, xr);
    default:
      return tile(std::integral_constant<int, 6>{}, xr);
  }
}

// FP8 weights decoded in registers and consumed at once, for few operand rows (where decoding
// and streaming the weights is the whole cost). One weight row at a time, kFusedFp8Blocks
// 128-blocks in flight: block partials are independent in the canonical order (only their
// scaled sums into the lanes are sequential), so blocks x MR partial chains hide the VDPBF16PS
// latency while a thread's rows stream as one sequential read, the pattern the hardware
// prefetcher follows best (measured: side-by-side rows streamed 1.5x slower at 2-3 operand
// rows). Weights are also prefetched kPrefetchBytes ahead, past a row's end into the next row.
// Every weight row re-reads all MR operand rows, so they must fit L1 together
// (kFusedFp8OperandBytes). Measured against the tiles below: at K = 2048, 4-6 rows (16-24 KB)
// ran 1.3-1.4x faster fused; at K = 7168, 3 rows (42 KB) 1.2x slower. (Walking K in L1-sized
// slices over groups of rows side by side did not help: 1.05-1.35x slower than either.)
constexpr int kFusedFp8MaxRows = 6;
constexpr int64_t kFusedFp8OperandBytes = 32 << 10;
// Blocks in flight: 4 for 1-3 operand rows; 1 for 4-6 (measured fastest: more partials spill).
template <int MR>
constexpr int kFusedFp8Blocks = MR <= 3 ? 4 : 1;

// NB blocks from b0 into the lanes acc (compile-time loops: the partials stay in registers).
template <int MR, int NB>
inline void FusedFp8Blocks(const Fp8Decoder& decoder, const uint16_t* const* x, const uint8_t* row,
                           const float* scales, int64_t cols, int64_t b0, __m512 (&acc)[MR]) {
  __m512 part[NB][MR];
  for (int b = 0; b < NB; ++b)
    for (int i = 0; i < MR; ++i) part[b][i] = _mm512_setzero_ps();
  for (int b = 0; b < NB; ++b) {
    for (int h = 0; h < 2; ++h) {
      const int64_t k = b0 + b * kFp8Block + h * 64;
      __m512i first, second;
      decoder(LoadFp8Bytes(row, cols, k), &first, &second);
      for (int i = 0; i < MR; ++i) {
        part[b][i] =
            _mm512_dpbf16_ps(part[b][i], (__m512bh)_mm512_loadu_si512(x[i] + k), (__m512bh)first);
        part[b][i] = _mm512_dpbf16_ps(part[b][i], (__m512bh)_mm512_loadu_si512(x[i] + k + 32),
                                      (__m512bh)second);
      }
    }
  }
  for (int b = 0; b < NB; ++b) {
    const __m512 s = _mm512_set1_ps(scales[b0 / kFp8Block + b]);
    for (int i = 0; i < MR; ++i) acc[i] = _mm512_fmadd_ps(part[b][i], s, acc[i]);
  }
}

template <int MR>
void FusedFp8Rows(const WeightMatrix& w, const uint16_t* const* xr, int64_t n0, int64_t n1,
                  float* y, int64_t ldy) {
  const Fp8Decoder decoder;
  const int64_t kp = PaddedK(w.cols);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = static_cast<const uint8_t*>(w.data) + n * w.cols;
    const float* scales = Fp8RowScales(w, n);
    __m512 acc[MR];
    for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_ps();
    int64_t b0 = 0;
    constexpr int kNb = kFusedFp8Blocks<MR>;
    for (; b0 + kNb * kFp8Block <= kp; b0 += kNb * kFp8Block)
      FusedFp8Blocks<MR, kNb>(decoder, xr, row, scales, w.cols, b0, acc);
    for (; b0 < kp; b0 += kFp8Block)
      FusedFp8Blocks<MR, 1>(decoder, xr, row, scales, w.cols, b0, acc);
    for (int i = 0; i < MR; ++i) y[i * ldy + (n - n0)] = ReduceTree(acc[i]);
  }
}

// FP8 weights in bf16 mode. Up to kFusedFp8MaxRows operand rows that fit L1 together:
// FusedFp8Rows. Otherwise weight rows are decoded
// to exact bf16 kFp8GroupRows at a time (each row once per call, however many operand rows),
// then K is walked in slices of kFp8SliceK so that an operand tile's slice and the group's slice
// stay in L1 while every tile of the group reuses them (unsliced, the operand rows streamed from
// L2 for every pair of weight rows). Tiles are up to 6 x 2: partial and total accumulators both
// live in registers.
constexpr int kFp8GroupRows = 8;
constexpr int64_t kFp8SliceK = 1024;
constexpr int kFp8TileRows = 6;  // operand rows per tile
constexpr int kFp8TileCols = 2;  // weight rows per tile

void Fp8Bf16Rows(const DotOperands& op, int64_t n0, int64_t n1, float* y, int64_t ldy,
                 DotScratch* scratch) {
  const WeightMatrix& w = *op.w;
  if (op.m == 0) return;
  const int64_t kp = PaddedK(w.cols);
  if (op.m <= kFusedFp8MaxRows &&
      op.m * kp * static_cast<int64_t>(sizeof(uint16_t)) <= kFusedFp8OperandBytes) {
    return DispatchTile<uint16_t>(op, 0, static_cast<int>(op.m),
                                  [&](auto tag, const uint16_t* const* xr) {
                                    FusedFp8Rows<decltype(tag)::value>(w, xr, n0, n1, y, ldy);
                                  });
  }
  const int64_t i_tiles = (op.m + kFp8TileRows - 1) / kFp8TileRows;
  constexpr int64_t carry_per_tile = int64_t{16} * kFp8TileRows * kFp8TileCols;
  constexpr int64_t carry_per_row_tile = carry_per_tile * (kFp8GroupRows / kFp8TileCols);
  auto* base = static_cast<uint8_t*>(scratch->Reserve(
      kFp8GroupRows * kp * sizeof(uint16_t) + i_tiles * carry_per_row_tile * sizeof(float)));
  auto* rows = reinterpret_cast<uint16_t*>(base);
  // kp is a multiple of 128, so the carry area starts 64-byte aligned.
  auto* carry = reinterpret_cast<float*>(base + kFp8GroupRows * kp * sizeof(uint16_t));

  for (int64_t nb = n0; nb < n1; nb += kFp8GroupRows) {
    const int nr = static_cast<int>(std::min<int64_t>(kFp8GroupRows, n1 - nb));
    const uint16_t* wr[kFp8GroupRows];
    const float* sr[kFp8GroupRows];
    for (int j = 0; j < nr; ++j) {
      wr[j] = WeightRowBf16(w, nb + j, rows + j * kp);
      sr[j] = Fp8RowScales(w, nb + j);
    }
    // The next group's stored bytes (contiguous rows) are requested into L2 while this group
    // computes, so that the memory stream overlaps the arithmetic instead of alternating.
    PrefetchCursor prefetch =
        PrefetchCursor::Rows(w, nb + nr, std::min<int64_t>(kFp8GroupRows, n1 - nb - nr),
                             (kp / kFp8Block) * i_tiles * ((nr + kFp8TileCols - 1) / kFp8TileCols));
    for (int64_t k0 = 0; k0 < kp; k0 += kFp8SliceK) {
      const int64_t k1 = std::min(k0 + kFp8SliceK, kp);
      const bool first = k0 == 0, last = k1 == kp;
      for (int64_t it = 0; it < i_tiles; ++it) {
        const int64_t i0 = it * kFp8TileRows;
        const int mr = static_cast<int>(std::min<int64_t>(kFp8TileRows, op.m - i0));
        DispatchTile<uint16_t>(op, i0, mr, [&](auto tag, const uint16_t* const* xr) {
          constexpr int kMr = decltype(tag)::value;
          for (int j0 = 0; j0 < nr; j0 += kFp8TileCols) {
            float* c = carry + it * carry_per_row_tile + (j0 / kFp8TileCols) * carry_per_tile;
            float* yt = y + i0 * ldy + (nb - n0) + j0;
            if (nr - j0 >= kFp8TileCols) {
              TileBf16Blocked<kMr, kFp8TileCols>(xr, wr + j0, sr + j0, k0, k1, c, first, last, yt,
                                                 ldy, &prefetch);
            } else {
              TileBf16Blocked<kMr, 1>(xr, wr + j0, sr + j0, k0, k1, c, first, last, yt, ldy,
                                      &prefetch);
            }
          }
        });
      }
    }
  }
}

void Avx512DotRows(const DotOperands& op, int64_t n0, int64_t n1, float* y, int64_t ldy,
                   DotScratch* scratch) {
  const WeightMatrix& w = *op.w;
  // Few operand rows and MXFP4: decoding dominates, so decode in registers (no scratch).
  if (w.format == WeightFormat::kMXFP4 && op.precision == Precision::kBF16 && op.m <= 4 &&
      w.cols % 128 == 0) {
    return DispatchTile<uint16_t>(op, 0, static_cast<int>(op.m),
                                  [&](auto tag, const uint16_t* const* xr) {
                                    if constexpr (decltype(tag)::value <= 4)
                                      FusedMxfp4Rows<decltype(tag)::value>(op, xr, n0, n1, y, ldy);
                                  });
  }
  const int64_t kp = PaddedK(w.cols);
  const bool bf16 = op.precision == Precision::kBF16;
  const bool fp8 = w.format == WeightFormat::kFP8Block128;
  if (fp8 && bf16) return Fp8Bf16Rows(op, n0, n1, y, ldy, scratch);
  // Operand rows per tile: 6 x 4 accumulators for bf16 tiles; fp32 FP8 tiles keep partial and
  // total accumulators (3 x 4 x 2).
  const int mr_max = fp8 ? 3 : 6;
  auto* decoded =
      static_cast<uint8_t*>(scratch->Reserve(kMaxRowsPerTile * kp * (2 + (bf16 ? 0 : 4))));
  uint16_t* bf16_rows = reinterpret_cast<uint16_t*>(decoded);
  float* f32_rows = reinterpret_cast<float*>(decoded + kMaxRowsPerTile * kp * 2);

  // bf16 weights against 1-2 operand rows are read straight from memory: one row at a time
  // keeps one sequential stream per thread, which streams ~1.2x faster here than 4 rows side
  // by side (the accumulator chain is not the limit at this arithmetic intensity). Measured
  // again with software prefetch (8 KB into L2): neither 1 nor 2 rows gained from it, and 2
  // rows without it streamed 1.2x slower; the hardware prefetcher follows one stream best.
  const int64_t rows_per_tile =
      (bf16 && w.format == WeightFormat::kBF16 && op.m <= 2) ? 1 : kMaxRowsPerTile;
  for (int64_t nb = n0; nb < n1; nb += rows_per_tile) {
    const int nr = static_cast<int>(std::min<int64_t>(rows_per_tile, n1 - nb));
    const uint16_t* wrow16[kMaxRowsPerTile];
    const float* wrow32[kMaxRowsPerTile];
    const float* scale_rows[kMaxRowsPerTile];
    for (int j = 0; j < nr; ++j) {
      wrow16[j] = WeightRowBf16(w, nb + j, bf16_rows + j * kp);
      if (!bf16) {
        WidenBf16Row(wrow16[j], kp, f32_rows + j * kp);
        wrow32[j] = f32_rows + j * kp;
      }
      scale_rows[j] = fp8 ? Fp8RowScales(w, nb + j) : nullptr;
    }
    const float* const* scales = fp8 ? scale_rows : nullptr;
    // The next group's stored bytes are requested into L2 while this group's tiles compute:
    // otherwise the first tile waits on memory and the others on arithmetic, never both.
    PrefetchCursor prefetch;
    if (op.m > mr_max)  // several tiles per group
      prefetch = PrefetchCursor::Rows(w, nb + nr, std::min<int64_t>(rows_per_tile, n1 - nb - nr),
                                      (kp / kPadK) * ((op.m + mr_max - 1) / mr_max));
    for (int64_t i0 = 0; i0 < op.m; i0 += mr_max) {
      const int mr = static_cast<int>(std::min<int64_t>(mr_max, op.m - i0));
      float* yt = y + i0 * ldy + (nb - n0);
      if (bf16) {
        DispatchTile<uint16_t>(op, i0, mr, [&](auto tag, const uint16_t* const* xr) {
          TileBf16Nr<decltype(tag)::value>(nr, xr, wrow16, kp, yt, ldy, &prefetch);
        });
      } else {
        DispatchTile<float>(op, i0, mr, [&](auto tag, const float* const* xr) {
          TileF32Nr<decltype(tag)::value>(nr, xr, wrow32, scales, kp, yt, ldy);
        });
      }
    }
  }
}

}  // namespace

const DotKernels* Avx512DotKernels() {
  static const DotKernels kernels{"avx512-bf16", &Avx512DotRows, kMaxRowsPerTile, Avx512GluRow(),
                                  Avx512PackRow()};
  return &kernels;
}

}  // namespace moe::cpu
