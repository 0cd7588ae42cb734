#include "tools/bench/roofline.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "core/thread_pool.h"

#if defined(MOE_HAVE_DNNL)
#include "oneapi/dnnl/dnnl.hpp"
#endif

namespace moe::bench {

// Defined in read_kernel_avx512.cc (512-bit loads) with a portable fallback.
uint64_t StreamRead(const uint8_t* data, size_t bytes);

ReadProbe::ReadProbe(int threads, size_t bytes)
    : threads_(threads),
      bytes_(bytes / 4096 * 4096),
      buffer_(static_cast<uint8_t*>(std::aligned_alloc(4096, bytes_))),
      pool_(std::make_unique<ThreadPool>(threads)) {
  // Touch every page first (first-touch by the threads that will read them).
  pool_->ParallelFor(static_cast<int64_t>(bytes_ / 4096), [&](int64_t b, int64_t e, int) {
    for (int64_t p = b; p < e; ++p)
      std::memset(buffer_ + p * 4096, static_cast<int>(p & 0xff), 4096);
  });
}

ReadProbe::~ReadProbe() { std::free(buffer_); }

double ReadProbe::Measure(int repeats) {
  std::vector<double> gbps;
  std::vector<uint64_t> sums(threads_);
  for (int r = 0; r < repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    pool_->ParallelFor(static_cast<int64_t>(bytes_ / 4096), [&](int64_t b, int64_t e, int t) {
      sums[t] += StreamRead(buffer_ + b * 4096, (e - b) * 4096);
    });
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    gbps.push_back(static_cast<double>(bytes_) / s / 1e9);
  }
  return *std::max_element(gbps.begin(), gbps.end()) + 0 * static_cast<double>(sums[0] & 1);
}

double MeasureReadBandwidth(int threads, size_t bytes, int repeats) {
  return ReadProbe(threads, bytes).Measure(repeats);
}

void FlushCaches() {
  static std::vector<uint8_t> buffer(size_t{256} << 20);  // >> any L3 we run on
  static uint8_t pass = 0;
  ++pass;
  for (size_t i = 0; i < buffer.size(); i += 64) buffer[i] = static_cast<uint8_t>(buffer[i] + pass);
}

double MeasureGemmGflops(bool bf16, std::string* source) {
#if defined(MOE_HAVE_DNNL)
  using dnnl::memory;
  const memory::dim n = 2048;
  dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  dnnl::stream stream(engine);
  const auto dt = bf16 ? memory::data_type::bf16 : memory::data_type::f32;
  memory::desc a_md({n, n}, dt, memory::format_tag::ab);
  memory::desc b_any({n, n}, dt, memory::format_tag::any);
  memory::desc b_md({n, n}, dt, memory::format_tag::ab);
  memory::desc c_md({n, n}, memory::data_type::f32, memory::format_tag::ab);
  dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a_md, b_any, c_md), engine);
  memory a(a_md, engine), b_plain(b_md, engine), b(pd.weights_desc(), engine), c(c_md, engine);
  std::memset(a.get_data_handle(), 0x3c, a_md.get_size());  // small finite values in every dtype
  std::memset(b_plain.get_data_handle(), 0x3c, b_md.get_size());
  dnnl::reorder(b_plain, b).execute(stream, b_plain, b);
  dnnl::matmul gemm(pd);
  double best = 0;
  for (int r = 0; r < 6; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    gemm.execute(stream, {{DNNL_ARG_SRC, a}, {DNNL_ARG_WEIGHTS, b}, {DNNL_ARG_DST, c}});
    stream.wait();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (r > 0) best = std::max(best, 2.0 * n * n * n / s / 1e9);
  }
  if (source != nullptr) *source = std::string("oneDNN matmul ") + pd.impl_info_str();
  return best;
#else
  if (source != nullptr) *source = "none (built without oneDNN)";
  (void)bf16;
  return 0;
#endif
}

Roofline MeasureRoofline(int threads, double buffer_gb) {
  Roofline r;
  r.read_gbps = MeasureReadBandwidth(threads, static_cast<size_t>(buffer_gb * (1 << 30)), 7);
  r.bf16_gflops = MeasureGemmGflops(true, &r.gemm_source);
  r.fp32_gflops = MeasureGemmGflops(false, nullptr);
  return r;
}

}  // namespace moe::bench
