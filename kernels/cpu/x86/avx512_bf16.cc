// AVX-512 BF16 tier (Zen 4, Sapphire Rapids and later): VDPBF16PS and VBMI byte permutes.
// The kernels are dot_avx512.inc, shared with the other AVX-512 tier; every header is included
// before the target region, so only this file's own functions use the instructions.
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <type_traits>

#include "kernels/cpu/canonical.h"
#include "kernels/cpu/dot.h"
#include "kernels/cpu/x86/avx512_glu_pack.h"
#include "kernels/cpu/x86/tile_common.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vbmi,fma,f16c")
#define MOE_AVX512_NATIVE_BF16 1
namespace moe::cpu {
namespace {
using namespace x86;  // NOLINT(build/namespaces): the shared tile helpers
#include "kernels/cpu/x86/dot_avx512.inc"
}  // namespace
}  // namespace moe::cpu
#undef MOE_AVX512_NATIVE_BF16
#pragma GCC pop_options

namespace moe::cpu {

const DotKernels* Avx512Bf16DotKernels() {
  static const DotKernels kernels{"avx512-bf16", &DotRows, kMaxRowsPerTile, Avx512GluRow(),
                                  Avx512PackRow()};
  return &kernels;
}

}  // namespace moe::cpu
