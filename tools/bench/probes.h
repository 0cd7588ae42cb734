// The instruction-level probes behind the roofline (probes_x86.cc): which streaming-read loop
// this host runs, and the arithmetic loop of each CPU kernel tier.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace moe::bench {

// Sums `bytes` bytes (so the reads cannot be dropped).
using StreamReadFn = uint64_t (*)(const uint8_t* data, size_t bytes);
// The widest loop this host runs; `name` gets its ISA ("avx512", "avx2", "portable").
StreamReadFn StreamReadKernel(std::string* name);

// `iters` steps of independent chains of the tier's multiply-add instruction, in registers.
struct ComputeLoop {
  float (*run)(int64_t iters);
  double flops_per_iter;  // per step (FMA = 2 flops per lane; VDPBF16PS = 4 per lane)
  const char* what;
};
// The loop the kernels of tier `tier` (a kernels/cpu/tiers.h name) multiply-add with in bf16 or
// fp32 mode; call its run() only on a host that runs the tier.
ComputeLoop ComputeLoopFor(const std::string& tier, bool bf16_mode);

}  // namespace moe::bench
