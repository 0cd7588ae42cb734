// CPU kernel tiers: one DotKernels table per instruction-set level, chosen at run time.
//
// Every tier computes the canonical order of kernels/cpu/canonical.h bit for bit; tiers differ
// only in speed. A tier is one file defining its DotKernels (x86 tiers in kernels/cpu/x86/) and
// one line in the table of tiers.cc: its name, the features it needs and the host check. The
// best tier the host supports is used unless MOE_CPU_KERNELS (or a --kernels flag) names one.
#pragma once

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "kernels/cpu/dot.h"

namespace moe::cpu {

struct CpuTier {
  const char* name;                // MOE_CPU_KERNELS value: "avx512-bf16", "avx2", "portable"...
  const char* features;            // what the host needs, for messages ("AVX2 + FMA + F16C")
  bool (*host_supports)();         // cpuid and OS register-state check
  const DotKernels* (*kernels)();  // call only when host_supports()
};

// Every tier built into this binary, best first; the last is always "portable".
absl::Span<const CpuTier> CpuTiers();

// The tier named `request` if this host can run it: INVALID_ARGUMENT for an unknown name (the
// message lists the known ones), FAILED_PRECONDITION for a tier the host lacks. "" or "best":
// the best tier the host supports (a warning on stderr when that is the portable one).
absl::StatusOr<const CpuTier*> SelectCpuTier(absl::string_view request);

// SelectCpuTier(MOE_CPU_KERNELS), "" when the variable is unset.
absl::StatusOr<const CpuTier*> DefaultCpuTier();

}  // namespace moe::cpu
