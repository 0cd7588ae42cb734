// The machine's own limits, measured in the same run as a benchmark: streaming read bandwidth,
// the peak of the multiply-add instruction the CPU kernel tier computes with (in registers, on
// every thread), and for reference the best GEMM library throughput (oneDNN when built with it).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace moe {
class ThreadPool;
}  // namespace moe

namespace moe::bench {

struct Roofline {
  double read_gbps = 0;     // multi-threaded streaming read over a buffer >> caches
  std::string read_kernel;  // the read loop's ISA ("avx512", "avx2", "portable")
  double peak_gflops = 0;   // the tier's multiply-add instruction, all threads
  std::string peak_source;  // "fp32 FMA ymm", "VDPBF16PS zmm", ...
  double bf16_gflops = 0;   // bf16 x bf16 -> fp32 GEMM (oneDNN; 0 without it)
  double fp32_gflops = 0;   // fp32 GEMM (oneDNN; 0 without it)
  std::string gemm_source;  // "oneDNN matmul ...", ...
};

// The host CPU as /proc/cpuinfo names it: its model name, vendor, family and model, and the vector
// extensions the kernel tiers care about (avx2, fma, f16c, avx512*, amx*), so that a committed
// result names its host. Empty fields where the file is absent (not Linux).
struct HostCpu {
  std::string model;
  std::string vendor;  // vendor_id, with "family F model M" (the model name can be as vague as
                       // "AMD EPYC" in a guest)
  std::string flags;   // space separated, sorted
};
HostCpu DescribeHostCpu();

// `threads`: worker threads for the bandwidth run and the compute probe (the GEMM library
// uses its own). `tier`: the CPU kernel tier whose arithmetic sets the compute peak.
// `gemm`: also time the GEMM library, for reference (seconds of large GEMMs).
Roofline MeasureRoofline(int threads, double buffer_gb, const std::string& tier, bool bf16_mode,
                         bool gemm = true);

// The best GFLOP/s of the tier's multiply-add loop run on `threads` threads at once (registers
// only); `what` gets the instruction.
double MeasureComputePeak(int threads, const std::string& tier, bool bf16_mode, std::string* what);

// A streaming-read probe that keeps its buffer, so that a benchmark can measure the bandwidth
// again next to each of its runs (on a shared host it changes from minute to minute).
class ReadProbe {
 public:
  ReadProbe(int threads, size_t bytes);
  ~ReadProbe();
  ReadProbe(const ReadProbe&) = delete;
  ReadProbe& operator=(const ReadProbe&) = delete;
  // The best GB/s of `repeats` passes over the buffer.
  double Measure(int repeats);

 private:
  int threads_;
  size_t bytes_;
  uint8_t* buffer_;
  std::unique_ptr<ThreadPool> pool_;
};

// Streaming read of `bytes` bytes by `threads` threads, the best GB/s of `repeats` passes (a
// roofline is what the machine can do; on a shared host the slower passes measure neighbours).
double MeasureReadBandwidth(int threads, size_t bytes, int repeats);

// Evicts the caches: reads and writes a buffer several times the last-level cache. Benchmarks
// call it before each timed run, as in serving, where a layer's weights never stay cached
// between its steps (every other layer's weights stream through in between).
void FlushCaches();

// Best of a few large square GEMMs; 0 when the library is not available.
double MeasureGemmGflops(bool bf16, std::string* source);

}  // namespace moe::bench
