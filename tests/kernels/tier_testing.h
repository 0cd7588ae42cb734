// The CPU kernel tiers as test parameters. Every vector tier is checked bit for bit against the
// portable definition; an instance whose tier this host cannot run skips, naming what it lacks
// (on an AVX2 host the AVX-512 instances skip, on an AVX-512 BF16 host none do).
#pragma once

#include <ostream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/tiers.h"

namespace moe::cpu {
// gtest prints a tier parameter by its name.
inline void PrintTo(const CpuTier* tier, std::ostream* os) { *os << tier->name; }
}  // namespace moe::cpu

namespace moe::testing {

// Every tier but the portable one, best first.
inline std::vector<const cpu::CpuTier*> VectorTiers() {
  std::vector<const cpu::CpuTier*> tiers;
  for (const cpu::CpuTier& tier : cpu::CpuTiers())
    if (std::string(tier.name) != "portable") tiers.push_back(&tier);
  return tiers;
}

inline const cpu::DotKernels& Portable() { return *cpu::PortableDotKernels(); }

// A gtest-safe name for a tier ("avx512-bf16" -> "avx512_bf16").
inline std::string TierTestName(const cpu::CpuTier* tier) {
  std::string name = tier->name;
  for (char& c : name)
    if (c == '-') c = '_';
  return name;
}

// The name generator of suites parameterized by tier alone.
inline std::string TierParamName(const ::testing::TestParamInfo<const cpu::CpuTier*>& p) {
  return TierTestName(p.param);
}

}  // namespace moe::testing

// Skips the current test when the host cannot run `tier` (a const cpu::CpuTier*).
#define MOE_SKIP_UNLESS_HOST_RUNS(tier)                                               \
  if (!(tier)->host_supports())                                                       \
  GTEST_SKIP() << "CPU kernel tier " << (tier)->name << " needs " << (tier)->features \
               << ", which this host lacks"
