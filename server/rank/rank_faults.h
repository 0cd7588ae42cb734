// Fault injection for the tests' rank (moe-rank-faults: rank_main.cc built with
// MOE_RANK_FAULTS; moe-rank has neither these flags nor this code): a slow or hung rank, and a
// faulty one whose partial sums are NaN.
#pragma once

#include "core/flags.h"
#include "server/rank/rank_worker.h"

namespace moe {

struct RankFaultFlags {
  int64_t step_delay_ms = 0;  // --debug-step-delay-ms: answer every step this late
  bool nan_partials = false;  // --debug-nan-partials: answer every step with NaN partial sums
};

void AddRankFaultFlags(Flags& flags, RankFaultFlags* faults);
// Installs the faults the flags ask for as `options`' hooks.
void InstallRankFaults(const RankFaultFlags& faults, RankOptions* options);

}  // namespace moe
