#include "kernels/cpu/tiers.h"

#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/log.h"

namespace moe::cpu {
namespace {

bool Always() { return true; }

#if defined(__x86_64__)
// __builtin_cpu_supports also checks that the OS saves the registers (XCR0) for AVX/AVX-512.
bool HostAvx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
}
bool HostAvx512() {
  return HostAvx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}
bool HostAvx512Bf16() {
  return HostAvx512() && __builtin_cpu_supports("avx512bf16") &&
         __builtin_cpu_supports("avx512vbmi");
}
#endif

// Best first. A new ISA level is one line here plus its file.
const CpuTier kTiers[] = {
#if defined(__x86_64__)
    {"avx512-bf16", "AVX-512 F/BW/VL/DQ + BF16 + VBMI", &HostAvx512Bf16, &Avx512Bf16DotKernels},
    {"avx512", "AVX-512 F/BW/VL/DQ", &HostAvx512, &Avx512DotKernels},
    {"avx2", "AVX2 + FMA + F16C", &HostAvx2, &Avx2DotKernels},
#endif
    {"portable", "any CPU", &Always, &PortableDotKernels},
};

}  // namespace

absl::Span<const CpuTier> CpuTiers() { return kTiers; }

absl::StatusOr<const CpuTier*> SelectCpuTier(absl::string_view request) {
  if (request.empty() || request == "best") {
    for (const CpuTier& tier : kTiers) {
      if (!tier.host_supports()) continue;
      if (&tier == &kTiers[std::size(kTiers) - 1] && std::size(kTiers) > 1) {
        static std::once_flag warned;
        std::call_once(warned, [] {
          LogLine(
              "warning: this CPU has none of the vector kernel tiers (the least is %s, %s); "
              "using the portable kernels, which are 10-100x slower",
              kTiers[std::size(kTiers) - 2].name, kTiers[std::size(kTiers) - 2].features);
        });
      }
      return &tier;
    }
  }
  for (const CpuTier& tier : kTiers) {
    if (request != tier.name) continue;
    if (!tier.host_supports())
      return absl::FailedPreconditionError(absl::StrCat("CPU kernel tier '", tier.name, "' needs ",
                                                        tier.features, ", which this host lacks"));
    return &tier;
  }
  std::vector<std::string> names;
  for (const CpuTier& tier : kTiers) names.push_back(tier.name);
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown CPU kernel tier '", request, "' (known: best, ", absl::StrJoin(names, ", "), ")"));
}

absl::StatusOr<const CpuTier*> DefaultCpuTier() {
  const char* env = std::getenv("MOE_CPU_KERNELS");
  auto tier = SelectCpuTier(env != nullptr ? env : "");
  if (!tier.ok() && env != nullptr)
    return absl::Status(tier.status().code(),
                        absl::StrCat("MOE_CPU_KERNELS: ", tier.status().message()));
  return tier;
}

}  // namespace moe::cpu
