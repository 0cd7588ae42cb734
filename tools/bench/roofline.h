// The machine's own limits, measured in the same run as a benchmark: streaming read bandwidth
// and the best GEMM throughput available (oneDNN when built with it, else our own kernels).
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
  double bf16_gflops = 0;   // bf16 x bf16 -> fp32 GEMM
  double fp32_gflops = 0;   // fp32 GEMM
  std::string gemm_source;  // "oneDNN 2.6 (avx512_core_bf16)", ...
};

// `threads`: worker threads for the bandwidth run (the GEMM library uses its own).
Roofline MeasureRoofline(int threads, double buffer_gb = 2.0);

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
