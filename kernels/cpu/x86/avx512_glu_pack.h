// The AVX-512 GLU row and activation packing (activation_avx512.cc, AVX-512 F/BW/VL/DQ), shared
// by both AVX-512 tiers.
#pragma once

#include "kernels/cpu/dot.h"

namespace moe::cpu {

GluRowFn Avx512GluRow();
PackRowFn Avx512PackRow();

}  // namespace moe::cpu
