// Batched dot-product kernels: the one compute primitive of the CPU backend.
//
// y[i][n] = canonical_dot(x_i, W_n) (kernels/cpu/canonical.h) for every operand row i and
// every weight row n of a range. Linear layers, the router and the grouped experts are all
// built from this; each ISA tier (kernels/cpu/tiers.h) has its own table of these functions,
// picked once at start-up, and every tier produces identical bits.
#pragma once

#include <cstdint>
#include <vector>

#include "core/numerics.h"
#include "kernels/weights.h"

namespace moe::cpu {

// A growable byte buffer whose data starts on a 64-byte boundary, so that vector loads of
// packed rows (strides are multiples of 256 bytes) never split cache lines. Reused across
// calls; Reserve does not keep the contents.
class AlignedBuffer {
 public:
  uint8_t* Reserve(size_t n) {
    if (bytes_.size() < n + 64) bytes_.resize(n + 64);
    const auto addr = reinterpret_cast<uintptr_t>(bytes_.data());
    data_ = bytes_.data() + ((64 - addr % 64) % 64);
    return data_;
  }
  uint8_t* data() const { return data_; }

 private:
  std::vector<uint8_t> bytes_;
  uint8_t* data_ = nullptr;
};

// Per-thread scratch a kernel may grow (decoded weight rows).
using DotScratch = AlignedBuffer;

struct DotOperands {
  const void* x = nullptr;  // packed rows: bf16 bits (kBF16) or fp32 (kFP32), canonical order
  int64_t x_stride = 0;     // elements between packed rows (>= PaddedK(w.cols))
  const int32_t* x_rows = nullptr;  // optional: operand row i is packed row x_rows[i]
  int64_t m = 0;                    // operand rows
  const WeightMatrix* w = nullptr;
  Precision precision = Precision::kBF16;
};

// Writes y[i * ldy + (n - n0)] for i < m, n in [n0, n1): raw fp32 results, not rounded.
using DotRowsFn = void (*)(const DotOperands& op, int64_t n0, int64_t n1, float* y, int64_t ldy,
                           DotScratch* scratch);

// out[i] = round(act(round(g[i]), round(u[i]))) for i < n, round = the precision's rounding;
// the activation is core/numerics.h's GluActivate, bit for bit.
using GluRowFn = void (*)(const float* g, const float* u, int64_t n, const ActivationParams& act,
                          Precision precision, float* out);

// Packs one activation row in `format`'s canonical order (PackActivationRow, bit for bit).
using PackRowFn = void (*)(const float* x, int64_t k, WeightFormat format, Precision precision,
                           void* out);

struct DotKernels {
  const char* name;  // the tier's name (kernels/cpu/tiers.h)
  DotRowsFn dot_rows;
  int row_block;  // weight rows a kernel prefers per call (work split granularity)
  GluRowFn glu_row;
  PackRowFn pack_row;
};

// The portable GLU row: the definition the vector ones match.
void PortableGluRow(const float* g, const float* u, int64_t n, const ActivationParams& act,
                    Precision precision, float* out);

// One table per tier (kernels/cpu/tiers.h lists them with their host checks). Calling a tier's
// function is only allowed on a host that passes its check: their code uses its instructions.
const DotKernels* PortableDotKernels();  // any CPU: the definition the others match
#if defined(__x86_64__)
const DotKernels* Avx2DotKernels();        // AVX2 + FMA + F16C (Haswell, Zen 1 and later)
const DotKernels* Avx512DotKernels();      // AVX-512 F/BW/VL/DQ (Skylake-SP to Ice Lake)
const DotKernels* Avx512Bf16DotKernels();  // + AVX-512 BF16 and VBMI (Zen 4, Sapphire Rapids)
#endif

}  // namespace moe::cpu
