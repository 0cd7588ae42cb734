// Synthetic checkpoints for tests, written once and cached in the build tree
// (deterministic from their seed; a file lock keeps concurrent test processes apart).
#pragma once

#include <string>

#include "model/config.h"

namespace moe::testing {

// Named test models:
//   "k3-mini"             the embedded default (seed 002), 2 MoE layers
//   "k2-fp8-odd"          Kimi K2 layout in FP8, widths not multiples of 128 (456 / 200),
//                         24 experts, top-8, DeepSeek group-limited routing (4 groups, 2 kept)
//   "k3-mxfp4-full-width" Kimi K3 widths (7168 / 3584 / 3072), 32 MXFP4 experts, top-16
//   "k3-mini-skewed"      k3-mini whose router favours the first 10% of experts
MoeConfig TestConfig(const std::string& name);
std::string TestCheckpoint(const std::string& name);

}  // namespace moe::testing
