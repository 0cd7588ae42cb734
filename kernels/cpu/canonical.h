// The canonical fp32 operation order of every CPU dot product.
//
// NOTES: a token's result must not depend on which other tokens share its batch, nor on
// which kernel (portable or AVX-512, GEMV or GEMM blocking) computed it. So each output
// element y = x . w is defined as one exact sequence of fp32 operations, which every CPU
// kernel reproduces bit for bit:
//
//  * Both operands are laid out in the weight format's element order and zero-padded to a
//    multiple of 128. bf16: identity. MXFP4: each 128-element group is stored as four runs
//    of 32, run j holding elements 4w + j, so that the four nibbles of one 16-bit word of
//    packed weights decode by shifts, without shuffles. FP8: each 64-element group is stored
//    as two runs of 32, run r holding elements 16L + 8r + j (L = 0..3, j = 0..7), the order
//    in which per-128-bit-lane byte unpacking leaves 64 decoded bytes (no widening shuffle).
//    Permutations stay inside a 64-element group, so FP8 scale blocks keep their elements.
//  * bf16 mode: 16 fp32 lanes; the 32-element chunk c adds to lane i, in this order,
//    w[32c+2i+1]*x[32c+2i+1] then w[32c+2i]*x[32c+2i] (each product exact, each add rounded):
//    the semantics of one AVX-512 VDPBF16PS.
//    fp32 mode: 16 lanes; chunk c of 16 elements adds w[16c+i]*x[16c+i] to lane i (one FMA).
//  * FP8 block-128 weights: each 128-element block accumulates into fresh lanes p; then
//    lane = fma(p, scale_inv[block], lane). (Block partials, as block-scaled GEMMs do; the
//    weights are never rounded.) Other formats accumulate straight into the lanes.
//  * Lanes reduce by a fixed tree: i + (i+8), then i + (i+4), then i + (i+2), then 0 + 1.
//
// Values below 2^-126 (fp32 denormals) are outside the contract: VDPBF16PS flushes them.
#pragma once

#include <cmath>
#include <cstdint>

#include "core/numerics.h"
#include "kernels/weights.h"

namespace moe::cpu {

constexpr int kLanes = 16;
constexpr int64_t kPadK = 128;      // operands are zero-padded to a multiple of this
constexpr int64_t kFp8Block = 128;  // FP8 scale block

inline int64_t PaddedK(int64_t k) { return (k + kPadK - 1) / kPadK * kPadK; }

// Position of logical element k in the format's canonical order.
inline int64_t CanonicalIndex(WeightFormat f, int64_t k) {
  switch (f) {
    case WeightFormat::kBF16:
      return k;
    case WeightFormat::kMXFP4: {
      const int64_t e = k & 127;
      return (k & ~int64_t{127}) + (e & 3) * 32 + (e >> 2);
    }
    case WeightFormat::kFP8Block128: {
      const int64_t e = k & 63;
      return (k & ~int64_t{63}) + ((e & 8) ? 32 : 0) + (e >> 4) * 8 + (e & 7);
    }
  }
  return k;
}

// Writes one activation row in canonical order: bf16 bits (kBF16, rounded to nearest even)
// or fp32 (kFP32), zero-padded to PaddedK(k).
void PackActivationRow(const float* x, int64_t k, WeightFormat f, Precision p, void* out);

// Decodes weight row n to exact values in canonical order, zero-padded: bf16 bits (kBF16)
// or fp32 (kFP32). FP8 rows decode WITHOUT their block scale (see Fp8RowScales).
void DecodeWeightRow(const WeightMatrix& w, int64_t n, Precision p, void* out);

// FP8: the scale_inv of each 128-block of row n (ceil(cols/128) values).
inline const float* Fp8RowScales(const WeightMatrix& w, int64_t n) {
  const int64_t blocks_per_row = (w.cols + kFp8Block - 1) / kFp8Block;
  return static_cast<const float*>(w.scales) + (n / kFp8Block) * blocks_per_row;
}

// The fixed lane reduction tree.
inline float ReduceLanes(const float* lanes) {
  float r8[8], r4[4], r2[2];
  for (int i = 0; i < 8; ++i) r8[i] = lanes[i] + lanes[i + 8];
  for (int i = 0; i < 4; ++i) r4[i] = r8[i] + r8[i + 4];
  for (int i = 0; i < 2; ++i) r2[i] = r4[i] + r4[i + 2];
  return r2[0] + r2[1];
}

// The canonical dot product of packed operands (portable reference implementation; the
// vector kernels must match it bit for bit). `block_scales` is null except for FP8.
float CanonicalDotBf16(const uint16_t* x, const uint16_t* w, int64_t padded_k,
                       const float* block_scales);
float CanonicalDotF32(const float* x, const float* w, int64_t padded_k, const float* block_scales);

}  // namespace moe::cpu
