#include <cstdlib>
#include <cstring>

#include "kernels/cpu/dot.h"

namespace moe::cpu {

const DotKernels& BestDotKernels() {
  static const DotKernels* best = [] {
    const char* force = std::getenv("MOE_CPU_KERNELS");
    if (force != nullptr && std::strcmp(force, "portable") == 0) return &PortableDotKernels();
    __builtin_cpu_init();
    const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512vl") &&
                        __builtin_cpu_supports("avx512bf16") &&
                        __builtin_cpu_supports("avx512vbmi");
    if (avx512 && Avx512DotKernels() != nullptr) return Avx512DotKernels();
    return &PortableDotKernels();
  }();
  return *best;
}

}  // namespace moe::cpu
